"""What a path given to ``merge``, ``chat`` and ``eval`` points at, and loading it for inference.

A *source* is one of:

- a **run folder** made by ``finetuner run`` (``recipe.yaml`` + ``adapter/``): the base model is
  the recipe's ``model.name``, loaded as it was trained (quantized for QLoRA);
- a **peft adapter folder** (``adapter_config.json``), e.g. ``runs/x/adapter`` or a checkpoint's
  ``checkpoints/step-N/adapter``: the base is the adapter's ``base_model_name_or_path``;
- a **model folder** (``config.json``), a **GGUF file** (``*.gguf``), a named model
  (``smollm2-135m-instruct``) or a hub id: a plain model with no adapter.

``base_model`` overrides where the base is found (a run copied from another machine).
Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import finetuner.phases as phases
import finetuner.device as dev
from finetuner.config.runtime import TORCH_DTYPES
from finetuner.errors import UserError, first_line
from finetuner.fileio import exists, expand_user
from finetuner.locate import check_hub, locate
from finetuner.model import gguf_base
from finetuner.model.shapes import preset_model
from finetuner.quiet import quieted

Kind = Literal["run", "adapter", "full", "model"]


@dataclass(frozen=True)
class Source:
    """A resolved source: where the base model, the adapter and the run's files are.

    ``kind`` is ``run`` (a LoRA/QLoRA run folder), ``full`` (a full fine-tune run: its
    ``adapter/`` folder is a complete model), ``adapter`` (a peft folder) or ``model``.
    """

    path: Path | str
    kind: Kind
    base_model: str
    adapter_dir: Path | None = None
    run_dir: Path | None = None
    recipe: Any = None  # finetuner.config.recipe.Recipe, when the source has one
    #: the opt-ins given on the command (``--trust-remote-code``, ``--allow-pickle``) or to the Python API
    allow_code: bool = False
    allow_pickle_files: bool = False

    @property
    def trust_remote_code(self) -> bool:
        """Whether loading may run the model's own code: the recipe asks for it (allowed by
        :func:`resolve_source` only with the opt-in), or, with no recipe, the opt-in itself."""
        return bool(self.recipe.model.trust_remote_code) if self.recipe is not None else self.allow_code

    @property
    def allow_pickle(self) -> bool:
        """Whether pickle weight files may be unpickled (as :attr:`trust_remote_code`)."""
        return bool(self.recipe.model.allow_pickle) if self.recipe is not None else self.allow_pickle_files

    @property
    def has_adapter(self) -> bool:
        return self.kind in ("run", "adapter")

    @property
    def tokenizer_dir(self) -> str:
        """The adapter folder when it holds a tokenizer (with the chat template used in training), else the base."""
        if self.adapter_dir is not None and (self.adapter_dir / "tokenizer_config.json").is_file():
            return str(self.adapter_dir)
        return self.base_model

    def describe(self) -> str:
        what = {"run": "run", "full": "full fine-tune run", "adapter": "adapter", "model": "model"}[self.kind]
        return f"{what} {self.path}" + (f" (base {self.base_model})" if self.kind != "model" else "")


def read_recipe(path: Path):
    from pydantic import ValidationError

    from finetuner.config.recipe import Recipe, format_validation_error
    from finetuner.config.recipe_yaml import load_yaml

    try:
        raw = load_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
        # the saved recipe is already resolved (absolute paths); its data files need not exist any more
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise UserError(format_validation_error(e, str(path))) from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the run's recipe ({e}).") from None


def _check_base(base: str, where: str) -> str:
    try:
        found = locate(base, f"The base model named by {where}")
    except UserError as e:
        raise UserError(e.message, hint="Pass the base model's folder or hub id with --base (Python: base_model=...).") from None
    return str(found)


def check_code_optin(recipe, where: Path, trust_remote_code: bool, allow_pickle: bool) -> None:
    """Refuse a recipe from a run folder that asks to run code (``model.trust_remote_code``) or to
    unpickle weights (``model.allow_pickle``) unless the command opted in: a run folder may come
    from someone else, so its own recipe is never taken as the user's consent."""
    for key, on, flag, given in (("model.trust_remote_code", recipe.model.trust_remote_code, "--trust-remote-code", trust_remote_code),
                                 ("model.allow_pickle", recipe.model.allow_pickle, "--allow-pickle", allow_pickle)):
        if on and not given:
            api = flag.removeprefix("--").replace("-", "_")
            raise UserError(
                f"{where}: {key} is true, so loading this run can run code from its folder; add {flag} to allow it.",
                hint=f"Only for a run folder you trust (Python: {api}=True).",
            )


def resolve_source(path: str | Path, base_model: str | None = None, trust_remote_code: bool = False,
                   allow_pickle: bool = False) -> Source:
    """Tell what ``path`` is (run folder, adapter folder, model folder or hub id); clear errors otherwise.

    ``trust_remote_code`` and ``allow_pickle`` are the user's opt-ins: a run whose recipe turns
    either on is refused without them (:func:`check_code_optin`); a source with no recipe gets them as given."""
    optin = dict(allow_code=trust_remote_code, allow_pickle_files=allow_pickle)
    name = str(path)
    if not exists(expand_user(name)) and preset_model(name) is not None:
        name = preset_model(name)  # a named model: the GGUF file a package ships, or its hub id
    if gguf_base.is_gguf_name(name) or exists(expand_user(name), "file"):
        gguf = gguf_base.check_file(expand_user(name), "the model")
        return Source(gguf, "model", str(gguf), **optin)
    try:
        p = locate(name, "The run, adapter or model folder", hub=name.count("/") == 1)
    except UserError as e:
        raise UserError(e.message, hint="Give a run folder (runs/<name>), an adapter folder, a model folder or a "
                                        "hub id (org/name).") from None
    if isinstance(p, str):
        check_hub(p, "The model")
        return Source(p, "model", p, **optin)  # a hub id
    if not p.is_dir():
        raise UserError(f"{p} is a file; expected a run folder, an adapter folder or a model folder.")
    p = p.resolve()
    if (p / "recipe.yaml").is_file() and not (p / "adapter_config.json").is_file():
        recipe = read_recipe(p / "recipe.yaml")
        check_code_optin(recipe, p / "recipe.yaml", trust_remote_code, allow_pickle)
        adapter = p / "adapter"
        if (adapter / "adapter_config.json").is_file():
            kind: Kind = "run"
        elif (adapter / "config.json").is_file():
            kind = "full"
        else:
            from finetuner.checkpoint_layout import latest_checkpoint

            last = latest_checkpoint(p)
            hint = f"Finish the run with `finetuner run {p / 'recipe.yaml'}` (it resumes)"
            if last is not None:
                hint += f", or use its last checkpoint's adapter: {last / 'adapter'}"
            raise UserError(f"The run folder {p} has no adapter/ folder: the run has not finished.", hint=hint + ".")
        base = _check_base(base_model or recipe.model.name, f"{p / 'recipe.yaml'} (model.name)")
        if base != recipe.model.name:
            recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"name": base})})
        run_dir = p if (p / "events.jsonl").is_file() else None  # not a checkpoint folder
        return Source(p, kind, base, adapter_dir=adapter, run_dir=run_dir, recipe=recipe, **optin)
    if (p / "adapter_config.json").is_file():
        try:
            cfg = json.loads((p / "adapter_config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"{p / 'adapter_config.json'}: not readable JSON ({e}).") from None
        if cfg.get("peft_type") not in (None, "LORA"):
            raise UserError(f"{p}: a {cfg.get('peft_type')} adapter; finetuner handles LoRA adapters.")
        named = cfg.get("base_model_name_or_path")
        if not (base_model or named):
            raise UserError(f"{p / 'adapter_config.json'} does not name its base model.", hint="Pass it with --base.")
        base = _check_base(base_model or named, f"{p / 'adapter_config.json'} (base_model_name_or_path)")
        recipe = read_recipe(p.parent / "recipe.yaml") if (p.parent / "recipe.yaml").is_file() else None
        if recipe is not None:
            check_code_optin(recipe, p.parent / "recipe.yaml", trust_remote_code, allow_pickle)
            recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"name": base})})
        run_dir = p.parent if p.name == "adapter" and (p.parent / "events.jsonl").is_file() else None
        return Source(p, "adapter", base, adapter_dir=p, run_dir=run_dir, recipe=recipe, **optin)
    if (p / "config.json").is_file():
        return Source(p, "model", str(p), **optin)
    raise UserError(
        f"{p} is not a run folder (recipe.yaml), a peft adapter folder (adapter_config.json) or a model folder (config.json).",
        hint="Give the folder `finetuner run` wrote (runs/<name>), its adapter/ folder, or a save_pretrained model folder.",
    )


# ---------------------------------------------------------------------------- loading
def load_tokenizer(src: Source):
    from finetuner.model.loading import check_model_folder, open_tokenizer

    trust = src.trust_remote_code
    what = "the model" if src.kind == "model" else "the base model"
    if src.tokenizer_dir == src.base_model:
        check_model_folder(src.base_model, what, trust)
    return open_tokenizer(src.tokenizer_dir, what if src.tokenizer_dir == src.base_model else "the run's adapter",
                          trust_remote_code=trust)


def chat_template(src: Source, tokenizer) -> str:
    """The template the run trained with (the recipe's, or the one saved with the adapter), the tokenizer's, or the
    fallback: the decision training made (:func:`finetuner.data.template_choice.for_tokenizer`)."""
    from finetuner.data.template_choice import for_tokenizer

    return for_tokenizer(src.recipe.data.chat_template if src.recipe is not None else None, tokenizer).template


def system_prompt(src: Source) -> str | None:
    """The system prompt the run trained with: the recipe's ``data.system_prompt`` (training rows without a system
    message got it), else the one every training row carried, as the run's ``metrics.json`` says (``data``)."""
    from finetuner.data.pipeline import run_system_prompt

    if src.recipe is None:
        return None
    return run_system_prompt(src.recipe.data.system_prompt, run_data_stats(src))


def run_data_stats(src: Source) -> dict[str, Any] | None:
    """The run's data statistics as its ``metrics.json`` keeps them (``data``), None without a readable one."""
    metrics = None
    if src.run_dir is not None and (src.run_dir / "metrics.json").is_file():
        try:
            metrics = json.loads((src.run_dir / "metrics.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            metrics = None  # unreadable: the recipe's alone (eval and the probe say what is wrong with the file)
    stats = metrics.get("data") if isinstance(metrics, dict) else None
    return stats if isinstance(stats, dict) else None


def trained_thinking(src: Source) -> dict[str, Any] | None:
    """The thinking forms the run's rows trained in (:func:`finetuner.data.thinking.statement`, as ``metrics.json``
    keeps it), None for a model, an adapter without its run, or a template without the switch."""
    found = (run_data_stats(src) or {}).get("thinking")
    return found if isinstance(found, dict) else None


def trained_tools(src: Source) -> str | None:
    """How the run's rows with tools rendered (``"template"`` or finetuner's fallback ``"hermes"``, as
    ``metrics.json`` keeps it: :func:`finetuner.data.tools.statement`), None when it says nothing of tools."""
    found = (run_data_stats(src) or {}).get("tools")
    return found.get("renders") if isinstance(found, dict) else None


def picture_processor_at(src: Source) -> str | None:
    """Where the processor of a source that reads pictures is, else None, decided from its files without loading
    anything: a run or adapter trained on pictures (its adapter folder keeps the processor), or an image-text-to-text
    model folder or hub id (its own processor). The web UI's Chat tab offers a picture upload only for such a run."""
    from finetuner.model.loading import stored_config
    from finetuner.model.vision import image_text_type

    if gguf_base.is_gguf_name(src.base_model) or not image_text_type(stored_config(src.base_model, None)):
        return None
    if src.kind == "model":
        return src.base_model
    if src.adapter_dir is not None and (Path(src.adapter_dir) / "processor_config.json").is_file():
        return str(src.adapter_dir)
    return None


def picture_processor(src: Source):
    """The processor of a source that reads pictures (:func:`picture_processor_at`), else None."""
    from finetuner.model.vision import load_processor

    where = picture_processor_at(src)
    if where is None:
        return None
    if src.kind == "model":
        try:
            return load_processor(where, trust_remote_code=src.trust_remote_code)
        except UserError:
            return None  # an image-text-to-text checkpoint without its processor: a text model here
    return load_processor(where, trust_remote_code=src.trust_remote_code)


def load_pretrained(name: str, what: str, allow_pickle: bool = False, pictures: bool = False, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` (``AutoModelForImageTextToText`` with ``pictures``) with finetuner's
    weight-format rule (safetensors unless ``allow_pickle``), quietly; a failure is a :class:`UserError` naming
    ``what`` could not be loaded."""
    from transformers import AutoModelForImageTextToText

    from finetuner.model.inventory import causal_lm_auto
    from finetuner.model.loading import model_files_error, stored_config, weight_format_kwargs, weights_load_hint

    from finetuner.model.gguf_base import as_dequantized, load_refused, pretrained_args

    check_hub(name, what)
    try:
        with quieted():
            where, extra = pretrained_args(name, "model", kwargs.get("dtype"))
            model_class = AutoModelForImageTextToText if pictures else \
                causal_lm_auto((stored_config(name, kwargs.get("revision")) or {}).get("model_type"))
            model = model_class.from_pretrained(where, **weight_format_kwargs(allow_pickle, name), **extra, **kwargs)
        return as_dequantized(model, name)
    except Exception as e:  # noqa: BLE001 - OSError, SafetensorError, ValueError, RuntimeError: see model_files_error
        broken = load_refused(e, name, what) or model_files_error(e, name, what)
        if broken is not None:
            raise broken from None
        if not isinstance(e, OSError):
            raise
        raise UserError(f"Could not load {what} '{name}' ({e}).", hint=weights_load_hint(e, allow_pickle) + " Or pass --base.") from None


def inference_device(device: str = "auto") -> str:
    if device == "auto":
        return dev.CUDA if dev.available() else dev.CPU
    if dev.is_cuda(device) and not dev.available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is visible.", hint="Use device 'cpu' or 'auto'.")
    return device


def load_model(src: Source, adapter: bool = True, device: str = "auto", pictures: bool = False):
    """The model for generation or evaluation, on ``device``, in eval mode, with the KV cache on.

    A run's base is loaded as it was trained (its dtype, quantized for QLoRA) and the adapter is
    attached with peft (``model.disable_adapter()`` gives the base back). ``adapter=False`` gives
    the base model alone; ``pictures``: the image-text-to-text model (:func:`picture_processor`). Returns
    ``(model, device)``.
    """
    from finetuner.threads import for_phase

    # torch's CPU threads for the answers to come, from the load now (finetuner.threads); a run's recipe may set them
    for_phase("generate", getattr(getattr(src.recipe, "training", None), "threads", "auto"))
    with phases.phase("load"):  # one blocking call: the command's front hears its heartbeat (finetuner.phases)
        return _load_model(src, adapter, inference_device(device), pictures)


def _load_model(src: Source, adapter: bool, device: str, pictures: bool):
    import torch

    if src.recipe is not None and src.kind in ("run", "adapter"):
        from finetuner.model.loading import load_base_model
        from finetuner.config.runtime import resolve_runtime

        recipe = src.recipe.model_copy(update={"device": dev.platform_of(device).name})
        rt = resolve_runtime(recipe)
        model = load_base_model(recipe, rt, pictures=pictures)
    else:
        dtype = getattr(torch, TORCH_DTYPES[dev.half_precision() if dev.is_cuda(device) else "fp32"])
        trust = src.trust_remote_code
        pickle_ok = src.allow_pickle
        if src.kind == "full" and adapter:
            model = load_pretrained(str(src.adapter_dir), "the fine-tuned model", pickle_ok, pictures, dtype=dtype,
                                    trust_remote_code=trust)
        else:
            model = load_pretrained(src.base_model, "the base model" if src.kind != "model" else "the model", pickle_ok,
                                    pictures, dtype=dtype, trust_remote_code=trust)
        model.to(device)
    if adapter and src.has_adapter:
        model = attach_adapter(model, src)
    model.config.use_cache = True
    model.eval()
    return model, device


def attach_adapter(model, src: Source):
    """``model`` (the base) with ``src``'s LoRA adapter attached, not trainable: chat, eval and merge load it here.

    An adapter file whose header cannot be read (cut short by a copy or a disk that filled, or changed
    afterwards) is a :class:`UserError` naming the file, as is an adapter trained on another base."""
    from peft import PeftModel
    from safetensors import SafetensorError

    try:
        with quieted():
            return PeftModel.from_pretrained(model, str(src.adapter_dir), is_trainable=False)
    except SafetensorError as e:
        weights = Path(str(src.adapter_dir)) / "adapter_model.safetensors"
        raise UserError(f"The adapter file {weights} is truncated or corrupt ({first_line(str(e))}).",
                        hint="Copy the run again from where it was trained, or train it again; a checkpoint's adapter "
                             "(checkpoints/step-N/adapter in the run folder) can be used meanwhile.") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"Could not attach the adapter {src.adapter_dir} to '{src.base_model}' ({e}).",
                        hint="The adapter must have been trained on this base model (pass the right one with --base).") from None


def context_length(model, tokenizer) -> int:
    """The longest sequence the model takes: its position embeddings, else the tokenizer's limit."""
    cfg = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        n = getattr(cfg, key, None) or getattr(getattr(cfg, "text_config", None), key, None)
        if isinstance(n, int) and n > 0:
            return n
    n = getattr(tokenizer, "model_max_length", None)
    return n if isinstance(n, int) and 0 < n < 10**7 else 2048

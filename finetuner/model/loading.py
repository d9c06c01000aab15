"""Loading the base model and tokenizer, quantizing, and attaching the LoRA adapter.

All choices that depend on the device (dtypes, autocast, attention, kernels) are made once, in
:func:`finetuner.config.runtime.resolve`; this module loads what that :class:`~finetuner.config.runtime.Runtime`
says, and the run's ``start`` event records it so a user sees what actually ran.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import finetuner.device as dev
from finetuner.errors import UserError, first_line
from finetuner.locate import check_hub
from finetuner.model import gguf_base
from finetuner.model.layout import all_linear_targets
from finetuner.quiet import quieted

log = logging.getLogger(__name__)


class Recipe(Protocol):
    """What loading reads of a recipe (a :class:`finetuner.config.recipe.Recipe`). Config reads model shapes, so it
    sits above model: the recipe comes in as a value, typed here by what is read of it."""

    model: Any
    method: str
    lora: Any
    quantization: Any
    training: Any
    distributed: Any


class Runtime(Protocol):
    """What loading reads of the resolved runtime (a :class:`finetuner.config.runtime.Runtime`: the one answer to
    dtypes, attention and kernels), passed in as :class:`Recipe` is."""

    device: str
    attention: str
    base_dtype: str
    compute_dtype: str
    kernels: str

    @property
    def is_cuda(self) -> bool: ...

    @property
    def gather_dtype(self) -> str: ...

    def torch_dtype(self, name: str) -> Any: ...


#: Files that hold a tokenizer's vocabulary (one of them must be in a local model folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model*", "vocab.*", "merges.txt", "*.tiktoken", "*spiece*.model",
                   "sentencepiece*.model", "tekken.json")

_WHAT_TO_GIVE = (
    "Give the folder a model was saved to with save_pretrained (config.json, tokenizer files and *.safetensors "
    "weights), e.g. one made by `hf download ORG/NAME --local-dir DIR`, or a hub id such as Qwen/Qwen2.5-7B-Instruct."
)


def check_model_folder(name: str, key: str = "model.name", trust_remote_code: bool = False) -> None:
    """A local ``name`` must be a model folder: say what is missing before transformers tries to load it.

    A folder without ``config.json`` is not a model (``finetuner plan`` says the same); one without
    tokenizer files cannot be trained or chatted with. A hub id (no such folder) is left to the loaders.
    """
    from finetuner.fileio import exists, expand_user

    path = expand_user(name)
    if gguf_base.is_gguf_name(name) or exists(path, "file"):
        gguf_base.check_file(path, key)
        return
    if not exists(path, "dir"):
        return
    if not (path / "config.json").is_file():
        inner = sorted(p.parent for p in [*path.glob("*/config.json"), *path.glob("snapshots/*/config.json")])
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = (f"It looks like the model is in {inner[0]}: give that folder." if inner else
                f"It holds GGUF files: give one as the model, e.g. {path / ggufs[0]} (in a recipe: model.gguf_file: {ggufs[0]})."
                if ggufs else _WHAT_TO_GIVE)
        held = sorted(p.name for p in path.iterdir())[:6]
        holds = f" (it holds: {', '.join(held)}{', ...' if len(held) == 6 else ''})" if held else " (it is empty)"
        raise UserError(f"{key}: {path}: no config.json in this folder, so it is not a model folder{holds}.", hint=hint)
    if not trust_remote_code and not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        raise UserError(
            f"{key}: {path} has a config.json but no tokenizer files (tokenizer.json, tokenizer.model or vocab.json), "
            "so its text cannot be turned into tokens.",
            hint="Copy the tokenizer files from where the model came from into this folder (tokenizer.save_pretrained "
                 "writes them), or give the original model folder or hub id.",
        )


def open_tokenizer(name: str, what: str, revision: str | None = None, trust_remote_code: bool = False):
    """A tokenizer from a folder or hub id, with a pad token (the EOS token when it has none);
    a clear UserError naming ``what`` (``model.name``, ``the base model``, ...) when it cannot load."""
    from transformers import AutoTokenizer

    check_hub(name, what)
    where, extra = gguf_base.pretrained_args(name, "tokenizer")
    try:
        with quieted():
            tok = AutoTokenizer.from_pretrained(where, revision=revision, trust_remote_code=trust_remote_code, **extra)
        if "gguf_file" in extra:  # read from the GGUF file: kept for the next load
            gguf_base.remember_tokenizer(name, tok)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{what}: could not load a tokenizer from '{name}' ({first_line(str(e), 300)}).",
            hint=hub_access_hint(e) or tokenizer_load_hint(e),
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def load_tokenizer(recipe: Recipe):
    m = recipe.model
    check_model_folder(m.name, trust_remote_code=m.trust_remote_code)
    _warn_remote_code(recipe)
    return open_tokenizer(m.name, "model.name", m.revision, m.trust_remote_code)


def tokenizer_load_hint(error: Exception) -> str:
    """What to do when transformers could not build a tokenizer."""
    text = str(error)
    if "sentencepiece" in text or "tiktoken" in text:
        return ("transformers found no tokenizer.json it can read and needs sentencepiece or tiktoken to convert the "
                "files it found: pip install sentencepiece tiktoken, or give a folder with a tokenizer.json.")
    return "Give a local folder with tokenizer files, or a hub id (online)."


def _warn_remote_code(recipe: Recipe) -> None:
    if recipe.model.trust_remote_code:
        log.warning(
            "trust_remote_code is on: code from '%s' will run on this machine. Only do this for repositories you trust.",
            recipe.model.name,
        )


def weight_format_kwargs(allow_pickle: bool, name: str) -> dict[str, Any]:
    """``from_pretrained`` arguments for the weight files finetuner accepts: safetensors only,
    unless ``model.allow_pickle`` says pickle files (``pytorch_model.bin``) may be unpickled too; a GGUF
    file (no code in it, nothing to unpickle): none (:func:`gguf_base.pretrained_args` gives its own)."""
    if gguf_base.is_gguf_name(name):
        return {}
    if not allow_pickle:
        return {"use_safetensors": True}
    log.warning("model.allow_pickle is on: pickle weight files of '%s' may be loaded; unpickling can run code.", name)
    return {"use_safetensors": None}


_GATED = ("gated", "401", "403", "unauthorized", "forbidden", "restricted", "access to model")


def hub_access_hint(error: Exception) -> str | None:
    """The hint for a gated or private hub repository (the hub answered 401/403), else None."""
    text = str(error).lower()
    if any(word in text for word in _GATED):
        return ("The repository is gated or private: accept its licence on the hub, then log in with `hf auth login` "
                "(older huggingface_hub: `huggingface-cli login`) or set HF_TOKEN. finetuner never writes the token "
                "into a run folder.")
    return None


def require_bitsandbytes(what: str):
    """Import bitsandbytes for ``what`` (4/8-bit weights, 8-bit or paged optimizers), or say why it cannot be used."""
    try:
        import bitsandbytes
    except Exception as e:  # noqa: BLE001 - ImportError, or a native library that fails to load (OSError, RuntimeError)
        raise UserError(
            f"{what} needs bitsandbytes, which cannot be imported on this machine ({type(e).__name__}: {e}).",
            hint="Install it (pip install bitsandbytes; it supports Linux and Windows on x86-64 with an NVIDIA GPU or the "
                 "CPU). Without it, use method: lora with optimizer adamw_torch or adafactor (finetuner plan --method lora).",
        ) from None
    return bitsandbytes


def weights_load_hint(error: Exception, allow_pickle: bool) -> str:
    """What to do when loading weights failed: names the pickle opt-in when only pickles were found."""
    gated = hub_access_hint(error)
    if gated:
        return gated
    if not allow_pickle and "safetensors" in str(error):
        return ("finetuner loads safetensors weights only (pickle files can run code when loaded). If this model ships "
                "only pytorch_model.bin and you trust it, set model.allow_pickle: true; else check the folder or hub id.")
    return "Check the folder or hub id (and your connection)."


def _broken_weight_file(folder: Any) -> str | None:
    """The first ``*.safetensors`` file in a local ``folder`` whose header cannot be read, or None."""
    from pathlib import Path

    from safetensors import safe_open

    path = Path(str(folder)).expanduser()
    if not path.is_dir():
        return None
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception:  # noqa: BLE001 - SafetensorError, OSError: this is the broken file
            return f"{f} ({f.stat().st_size} bytes)"
    return None


def model_files_error(error: BaseException, name: str, what: str = "model.name") -> UserError | None:
    """A :class:`UserError` naming the model folder (or hub id) ``name`` when ``error``, raised by
    ``from_pretrained``, says its files are broken or do not fit together: a truncated or empty
    safetensors file, a config.json without ``model_type`` (or with one transformers does not know),
    weights whose shapes differ from config.json. None for anything else (a bug, or out of memory)."""
    from safetensors import SafetensorError

    text = str(error).strip()
    first = first_line(text, 300) if text.strip() else type(error).__name__
    refetch = "Download or copy the model again from where it came from (hf download ORG/NAME --local-dir DIR)."
    if isinstance(error, SafetensorError) or (isinstance(error, OSError) and "safetensors" in text.lower() and "header" in text.lower()):
        where = _broken_weight_file(name) or f"a *.safetensors file in '{name}'"
        return UserError(f"{what}: the weight file {where} is truncated or corrupt ({first}).",
                         hint=refetch + " An interrupted download or copy leaves such a file.")
    architecture = ("model_type", "Unrecognized model", "does not recognize this architecture")
    if isinstance(error, (ValueError, KeyError)) and any(marker in text for marker in architecture):
        return UserError(
            f"{what}: '{name}': config.json names no model_type this transformers knows ({first.rstrip('.')}).",
            hint="Its config.json needs a \"model_type\" transformers knows (e.g. \"llama\", \"qwen2\", \"mistral\"): use the "
                 "config.json that came with the weights, or upgrade transformers for a newer architecture. " + refetch,
        )
    if isinstance(error, RuntimeError) and ("size mismatch" in text or "mismatched_sizes" in text or "mismatched sizes" in text):
        return UserError(
            f"{what}: the weights in '{name}' do not have the shapes its config.json describes (size mismatch).",
            hint="config.json and the *.safetensors files come from different models, or a size in config.json (hidden_size, "
                 "intermediate_size, vocab_size, num_key_value_heads) was edited: put back the config.json that came with "
                 "the weights. " + refetch,
        )
    if isinstance(error, ValueError) and ("config" in text.lower() or "json" in text.lower()):
        return UserError(f"{what}: '{name}': its config.json cannot be used ({first}).", hint=refetch)
    return None


def bnb_config(recipe: Recipe, rt: Runtime):
    """The ``BitsAndBytesConfig`` for the recipe's quantization section (None if unquantized)."""
    q = recipe.quantization
    if q is None:
        return None
    require_bitsandbytes(f"quantization.bits: {q.bits} (method {recipe.method})")
    from transformers import BitsAndBytesConfig

    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=rt.torch_dtype(rt.compute_dtype),
        # FSDP shards a parameter in its own dtype and all-gathers it in the mixed-precision one: the packed
        # 4-bit bytes are kept in that one so that both are the same and no cast touches them
        **({"bnb_4bit_quant_storage": rt.torch_dtype(rt.gather_dtype)} if recipe.distributed.strategy == "fsdp" else {}),
    )


def load_base_model(recipe: Recipe, rt: Runtime, place: str | None = None, pictures: bool = False):
    """The frozen base model on the device, quantized if the recipe says so; ``pictures``: an image-text-to-text
    model for a run whose data has pictures (:mod:`finetuner.model.vision`), loaded whole, its vision tower too.

    ``place`` (a multi-process strategy that loads the model once,
    :mod:`finetuner.training.strategies.rank0_loading`): ``"cpu"`` keeps the model in CPU memory
    (QLoRA: quantized there), ``"meta"`` builds its modules without weights (nothing is read into
    memory). A GGUF base is dequantized as it loads, so it is loaded whole whatever ``place`` says."""
    import torch
    from transformers import AutoModelForImageTextToText

    from finetuner.model.inventory import causal_lm_auto

    m = recipe.model
    _warn_remote_code(recipe)
    stored = stored_config(m.name, m.revision)  # read once for the checks below
    model_class = AutoModelForImageTextToText if pictures else causal_lm_auto((stored or {}).get("model_type"))
    kwargs: dict[str, Any] = dict(
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        dtype=rt.torch_dtype(rt.base_dtype),
        **weight_format_kwargs(m.allow_pickle, m.name),
    )
    if rt.attention != "auto":
        kwargs["attn_implementation"] = rt.attention
    quant = bnb_config(recipe, rt)
    if place is not None and gguf_base.is_gguf_name(m.name):
        place = None
    if place is not None:
        kwargs["device_map"] = {"": place}
    experts_cpu: dict[str, str] = {}
    if quant is None and _stored_method(stored) == "mxfp4":
        # gpt-oss's published experts: dequantized as they load (to the recipe's dtype), as a GGUF base is; kept
        # in MXFP4 the triton kernels transformers would pick train nothing through them
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    if quant is not None:
        _refuse_prequantized(stored, m.name)
        if pictures and recipe.lora.train_projector and stored:  # its trained copy cannot be 4-bit: kept whole
            from finetuner.model.vision_parts import not_quantized

            quant.llm_int8_skip_modules = not_quantized(stored, m.trust_remote_code)
        kwargs["quantization_config"] = quant
        # bitsandbytes quantizes onto the device the map names: this process's GPU (the current one, which
        # a rank of a multi-process run has set to its LOCAL_RANK's), not always GPU 0
        index = torch.device(rt.device).index
        kwargs.setdefault("device_map", {"": index if index is not None else dev.current_index()} if rt.is_cuda else {"": "cpu"})
        if rt.is_cuda and recipe.quantization.bits == 4 and "" in kwargs["device_map"] and not gguf_base.is_gguf_name(m.name):
            # a mixture of experts' 16-bit experts would fill the GPU before they are quantized: they load into
            # CPU memory and are quantized onto the GPU one expert at a time (finetuner.model.experts4bit)
            experts_cpu = experts_in_cpu_memory(stored) if stored else {}
            if experts_cpu:
                kwargs["device_map"] = {**kwargs["device_map"], **experts_cpu}
                quant.llm_int8_enable_fp32_cpu_offload = True
    if m.max_memory:
        # layers split over several GPUs (accelerate's device map; autograd follows the tensors)
        if not rt.is_cuda or dev.count() < len(m.max_memory):
            raise UserError(
                f"model.max_memory names {len(m.max_memory)} GPU(s) but {dev.count()} are visible.",
                hint="Remove model.max_memory to train on one device.",
            )
        kwargs["device_map"] = "auto"
        kwargs["max_memory"] = {int(k): v.replace(" ", "") for k, v in m.max_memory.items()}
    check_hub(m.name, "model.name")
    try:
        with quieted():
            if quant is not None:  # a 4-bit load reads a GGUF base's dequantized folder (the conversion cache)
                gguf_base.dequantize_first(m.name, model_class, kwargs["dtype"], trust_remote_code=m.trust_remote_code)
            where, extra = gguf_base.pretrained_args(m.name, "model", kwargs["dtype"])
            model = model_class.from_pretrained(where, **kwargs, **extra)
    except Exception as e:  # noqa: BLE001 - OSError, SafetensorError, ValueError, RuntimeError: see model_files_error
        broken = gguf_base.load_refused(e, m.name) or model_files_error(e, m.name)
        if broken is None and not isinstance(e, OSError):
            raise
        raise broken or UserError(
            f"model.name: could not load '{m.name}' ({e}).",
            hint=weights_load_hint(e, m.allow_pickle),
        ) from None
    model = gguf_base.as_dequantized(model, m.name)
    if quant is not None and recipe.quantization.bits == 4:
        from finetuner.model.experts4bit import quantize_experts

        gpu = torch.device(rt.device) if rt.is_cuda else None
        if experts_cpu:
            from accelerate.hooks import remove_hook_from_module

            for name in experts_cpu:
                remove_hook_from_module(model.get_submodule(name))
        quantize_experts(model, recipe.quantization.quant_type, recipe.quantization.double_quant,
                         device=gpu if experts_cpu else None)
    if quant is None and not m.max_memory and place is None:
        model.to(rt.device)
    model.config.use_cache = False
    if rt.kernels == "liger":
        from finetuner.model.kernels import apply_liger

        apply_liger(model)
    return model


def check_vision_training(recipe: Recipe, pictures: bool) -> None:
    """``lora.train_projector`` / ``lora.train_vision_tower`` on a run that reads no pictures: one line."""
    lc = recipe.lora
    if recipe.method != "full" and (lc.train_projector or lc.train_vision_tower) and not pictures:
        key = "lora.train_projector" if lc.train_projector else "lora.train_vision_tower"
        raise UserError(f"{key}: this run reads no pictures (a text model, or data without pictures); the vision "
                        "tower and projector take part only in a picture run.", hint=f"Remove {key}.")


def prepare_for_training(model, recipe: Recipe, tiled_mlp: int = 0, pictures: bool = False):
    """Freeze/quantize-prepare the base, enable checkpointing, and attach LoRA (or unfreeze all);
    ``tiled_mlp`` (the runtime's :attr:`~finetuner.config.runtime.Runtime.tiled_mlp`): tokens per MLP
    chunk, 0 for the plain MLP (:mod:`finetuner.model.tiled_mlp`); ``pictures``: an image-text model on pictures,
    whose projector (``lora.train_projector``) and vision tower (``lora.train_vision_tower``) may train too."""
    # Freeze the base ourselves instead of peft's prepare_model_for_kbit_training: that helper
    # casts every non-4-bit parameter (embeddings, LM head, norms) to fp32, which for a 128k
    # vocabulary costs 2 GB more than the 4-bit layers save on an 8B model. Norms compute in
    # fp32 internally and everything runs under autocast, so bf16 storage is enough.
    if recipe.method != "full":
        for p in model.parameters():
            p.requires_grad_(False)
    if recipe.training.gradient_checkpointing:
        # non-reentrant checkpointing needs no input-grad hook and works with frozen embeddings
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    if recipe.method == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return _training_mode(_tile_mlp(_offload_checkpoints(model, recipe), tiled_mlp))

    from peft import LoraConfig, get_peft_model

    lc = recipe.lora
    target = all_linear_targets(model) if lc.target_modules == "all-linear" else lc.target_modules
    projectors = None
    if lc.train_projector or lc.train_vision_tower:
        check_vision_training(recipe, pictures)
        from finetuner.model.vision_parts import lora_targets_with_tower, vision_parts

        tower, parts = vision_parts(model)
        if lc.train_vision_tower:
            target = lora_targets_with_tower(target, model, tower, parts)
        projectors = parts if lc.train_projector else None
    config = LoraConfig(
        r=lc.r,
        lora_alpha=lc.alpha,
        lora_dropout=lc.dropout,
        target_modules=target,
        bias=lc.bias,
        task_type="CAUSAL_LM",
        modules_to_save=projectors,
    )
    try:
        with quieted():
            model = get_peft_model(model, config)
    except ValueError as e:
        raise UserError(
            f"lora.target_modules: {e}",
            hint="Use 'all-linear' or names of Linear modules in the model (e.g. q_proj, v_proj).",
        ) from None
    if projectors:  # peft's copy of the projector has the base's dtype: trained in fp32, as the LoRA matrices are
        import torch

        for p in model.parameters():
            if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
                p.data = p.data.float()
    return _training_mode(_tile_mlp(_offload_checkpoints(model, recipe), tiled_mlp))


def stored_config(name: str, revision: str | None) -> dict[str, Any] | None:
    """The ``config.json`` of the checkpoint to load (a preset's, a folder's, the hub's); None for a GGUF base or
    a config that cannot be read here (``from_pretrained`` then says what is wrong with it)."""
    from finetuner.model.shapes import is_sixteen_bit_copy, load_config

    if gguf_base.is_gguf_name(name):
        return None
    try:
        cfg = load_config(name, revision)[0]
    except UserError:
        return None
    if is_sixteen_bit_copy(name):  # a preset's bf16 copy (unsloth/gpt-oss-20b-BF16): its weights are not quantized
        cfg.pop("quantization_config", None)
    return cfg


def _stored_method(cfg: dict[str, Any] | None) -> str | None:
    """How a checkpoint's weights are stored quantized (``quantization_config.quant_method``), None in 16 bits."""
    return ((cfg or {}).get("quantization_config") or {}).get("quant_method")


def _refuse_prequantized(cfg: dict[str, Any] | None, name: str) -> None:
    """A checkpoint stored quantized by another method (gpt-oss's MXFP4) cannot be loaded into bitsandbytes'
    4-bit: say so before any weight is read."""
    method = _stored_method(cfg)
    if method and method != "bitsandbytes":
        raise UserError(
            f"model.name: '{name}' is stored quantized ({method}); QLoRA quantizes a 16-bit checkpoint with "
            "bitsandbytes and cannot load this one.",
            hint="Train with method: lora on it (an MXFP4 checkpoint is dequantized as it loads), or give a bf16 copy of "
                 "it (for MXFP4: load it with transformers' Mxfp4Config(dequantize=True) and save_pretrained).")


def experts_in_cpu_memory(cfg: dict[str, Any]) -> dict[str, str]:
    """``{experts module path: "cpu"}`` for a mixture of experts (``cfg``: its ``config.json``; the model built
    on meta, :mod:`finetuner.model.inventory`); empty for a dense model or an image-text-to-text one."""
    from finetuner.model.inventory import language_config
    from finetuner.model.reading import read_inventory

    try:
        if language_config(cfg)[1]:
            return {}
        inv = read_inventory(cfg)
    except UserError:
        return {}
    return {f"{inv.layers_path}.{i}.{path.rsplit('.', 1)[0]}": "cpu"
            for kind in inv.kinds for i in kind.indices for path in dict(kind.experts) if path.endswith("down_proj")}


def _training_mode(model):
    """Every module in training mode, and 4-bit layers kept in their trained-on layout.

    ``from_pretrained`` returns the model in eval mode and peft's wrapper starts in training mode,
    so without this the base model's modules stayed in eval mode while training: transformers'
    gradient checkpointing, which runs only in training mode, was silently off. And on CPUs with
    AVX512-BF16 a bitsandbytes 4-bit layer in eval mode (or evaluated without gradients) repacks its
    weight in place into an inference layout with bf16 block scales: the training's numbers would
    change after the first evaluation, and under FSDP the repacked copy is a gathered one that is
    thrown away while the shared quantization state says it was repacked.
    """
    model.train()
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def _tile_mlp(model, chunk: int):
    """Run the MLPs in chunks of ``chunk`` tokens (0: unchanged)."""
    if chunk:
        from finetuner.model.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, chunk)
    return model


def _offload_checkpoints(model, recipe: Recipe):
    """With checkpointing and activation offload, keep each layer's saved input on the CPU."""
    t = recipe.training
    if t.offload_activations and t.gradient_checkpointing:
        from finetuner.model.offload import enable_offloaded_checkpointing

        enable_offloaded_checkpointing(model)
        # the first layer's input (a frozen embedding's output) must require grad, or the
        # custom autograd function would not run backward for it and its LoRA weights
        model.enable_input_require_grads()
    elif recipe.method != "full" and has_reversible_layers(model):
        model.enable_input_require_grads()  # the same for the layers' own autograd function
    return model


def has_reversible_layers(model) -> bool:
    """Decoder layers with a backward of their own (Reformer's reversible residual layers, ``backward_pass``: one
    autograd function over every layer recomputes each layer's input from its output). The function's output needs
    grad only when its input does: with a frozen embedding, no LoRA weight in it would get a gradient."""
    return any(callable(getattr(m, "backward_pass", None)) for m in model.modules())


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit packed params count as their real element count."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()
        if getattr(p, "quant_state", None) is not None or p.__class__.__name__ == "Params4bit":
            n *= 2  # two 4-bit values per stored byte
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total

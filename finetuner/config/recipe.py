"""The recipe: a typed, validated description of one fine-tune.

A recipe is a YAML file with the sections of :mod:`finetuner.config.sections`. Loading it reads the
YAML safely (:mod:`finetuner.config.recipe_yaml`), applies ``--set key.path=value`` overrides
(:mod:`finetuner.config.overrides`), applies defaults, resolves relative paths against the recipe's
folder, and checks every field and every combination of fields (the combinations here). Every problem
becomes a :class:`~finetuner.errors.UserError` that names the file and the key and, for a misspelt key
or value, the closest valid one (:mod:`finetuner.config.recipe_errors`).

The fully resolved recipe is saved as ``recipe.yaml`` in the run folder, so a run can be
reproduced and resumed from that folder alone.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import Field, PrivateAttr, ValidationError, create_model, field_validator, model_validator

from finetuner.config.overrides import apply_override, drop_stale_val_path
from finetuner.objectives.specs import DEFAULT as DEFAULT_OBJECTIVE
from finetuner.objectives.specs import described, in_words, names_where, sections, spec_of
from finetuner.config.recipe_errors import model_keys, render_validation_error, values_accepted
from finetuner.config.recipe_yaml import parse_yaml
from finetuner.config.sections import (
    DATA_AUTO_KEYS,
    REFERENCE_OBJECTIVES,
    Auto,
    CheckpointSection,
    DataSection,
    DistributedSection,
    LoggingSection,
    LoraSection,
    Method,
    ModelSection,
    Objective,
    QuantizationSection,
    SamplesSection,
    Section,
    TrainingSection,
)
from finetuner.device import CPU, CUDA
from finetuner.errors import UserError
from finetuner.fileio import expand_user, exists
from finetuner.locate import find_local, locate
from finetuner.model import gguf_base
from finetuner.strategy_table import FSDP_ENGINE
from finetuner.model.shapes import preset_model
from finetuner.run_marker import is_run_folder

log = logging.getLogger(__name__)


class RecipeHead(Section):
    """The first keys of a recipe: its name, the model, the method and the objective. The objectives' own
    sections follow (:func:`objective_section_fields`), then the rest (:class:`Recipe`)."""

    name: str = Field("run", description="Run name; the default output folder is runs/<name>.")
    model: ModelSection
    method: Method | Auto = "lora"
    objective: Objective = Field(DEFAULT_OBJECTIVE, description=f"What training optimises: {described()}.")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", v):
            raise ValueError("use letters, digits, '.', '_' and '-' only (it names a folder)")
        return v


def objective_section_fields() -> dict[str, Any]:
    """One recipe field per section the objectives' descriptions name (:func:`finetuner.objectives.specs.sections`),
    of the schema the description holds: with its defaults in every recipe (``preference``), or None outside a
    recipe of its objective (``grpo``, ``neftune``)."""
    return {name: (spec.section_schema, Field(default_factory=spec.section_schema, description=spec.section_help))
            if spec.section_always else
            (spec.section_schema | None, Field(None, description=spec.section_help))
            for name, spec in sections().items()}


#: the recipe's first keys and the objectives' sections, as one model the recipe extends
RecipeWithObjectives = create_model("RecipeWithObjectives", __base__=RecipeHead, __module__=__name__,
                                    **objective_section_fields())


class Recipe(RecipeWithObjectives):
    """A complete fine-tuning recipe."""

    _dropped: tuple[str, str] | None = PrivateAttr(None)  # :attr:`dropped_val_path`
    lora: LoraSection = Field(default_factory=LoraSection)
    quantization: QuantizationSection | None = None
    data: DataSection
    training: TrainingSection = Field(default_factory=TrainingSection)
    checkpointing: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    samples: SamplesSection = Field(default_factory=SamplesSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    output_dir: str | None = None
    device: Literal["auto", CPU, CUDA] = "auto"  # the platforms of finetuner.device

    #: The keys that may be ``auto`` (resolved by the planner when the run starts).
    AUTO_KEYS: ClassVar[tuple[str, ...]] = (
        "method",
        "training.micro_batch_size",
        "training.gradient_accumulation",
        "training.optimizer",
        "training.gradient_checkpointing",
        "training.offload_activations",
        *DATA_AUTO_KEYS,
    )

    def auto_keys(self) -> list[str]:
        """The keys whose value is ``auto`` (empty when the recipe is fully resolved)."""
        out = []
        for key in self.AUTO_KEYS:
            node: Any = self
            for part in key.split("."):
                node = getattr(node, part)
            if node == "auto":
                out.append(key)
        return out

    @model_validator(mode="after")
    def _combinations(self) -> Recipe:
        t = self.training
        if t.micro_batch_size != "auto" and t.gradient_accumulation != "auto":
            if t.effective_batch is not None and t.effective_batch != t.micro_batch_size * t.gradient_accumulation:
                raise ValueError(
                    f"training.effective_batch: {t.effective_batch} is not micro_batch_size x gradient_accumulation "
                    f"({t.micro_batch_size} x {t.gradient_accumulation}); set one of them to auto or drop effective_batch"
                )
        elif t.micro_batch_size != "auto" and t.effective_batch is not None and t.effective_batch < t.micro_batch_size:
            raise ValueError(
                f"training.effective_batch: {t.effective_batch} is smaller than micro_batch_size {t.micro_batch_size}"
            )
        quant_given = "quantization" in self.model_fields_set
        if self.method == "qlora":
            if self.quantization is None:
                if quant_given:
                    raise ValueError(
                        "quantization: method 'qlora' needs a quantized base: set quantization.bits to 4 "
                        "(or 8), or use method 'lora'"
                    )
                object.__setattr__(self, "quantization", QuantizationSection())
        elif self.quantization is not None and self.method == "lora":
            raise ValueError(
                "quantization: set, but method is 'lora': use method 'qlora' to train "
                "LoRA on a quantized base, or remove the quantization section"
            )
        elif self.quantization is not None and self.method == "full":
            raise ValueError(
                "quantization: method 'full' cannot train quantized weights: remove the quantization section "
                "or use method 'qlora'"
            )
        # method auto with a quantization section: the planner decides; the section says how to quantize if it picks qlora
        t = self.training
        if t.warmup_steps is not None and t.warmup_ratio is not None:
            raise ValueError("training.warmup_steps: set warmup_steps or warmup_ratio, not both")
        _check_distributed(self)
        _check_preference(self)
        _check_objective_sections(self)
        _check_grpo(self)
        if self.data.replay not in (0, "auto") and (not spec_of(self.objective).replay or self.distributed.world_size > 1):
            raise ValueError(f"data.replay: mixes the base model's answers into SFT rows on one process; this recipe "
                             f"trains {self.objective} on {self.distributed.world_size} process(es): set replay: 0")
        return self

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> Recipe:
        """Load, override, validate and resolve a recipe file. A run folder's own ``recipe.yaml`` (a folder
        finetuner made for a run) trains in that folder: its ``output_dir`` is the folder it was read from, not
        the path saved in it (``--set output_dir=...`` still wins)."""
        path = expand_user(path)
        if not exists(path, "file"):
            raise UserError(
                f"Recipe file not found: {path}",
                hint="Give the path of a YAML recipe, e.g. recipes/demo_cpu.yaml.",
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            line = e.object[: e.start].count(b"\n") + 1
            raise UserError(f"{path}: line {line}: not a UTF-8 text file ({e.reason} at byte {e.start}).") from None
        recipe = cls.from_dict(parse_yaml(text, str(path)), overrides=overrides, base_dir=path.parent, source=str(path))
        if path.name == "recipe.yaml" and is_run_folder(path.parent) and not any(
                o.split("=", 1)[0].strip() == "output_dir" for o in overrides or []):
            # a run folder's own recipe trains in the folder it was read from, whatever output_dir it names: a copy
            # resumes as the copy, and a received run never writes where the giver's path points on this machine
            recipe = recipe.model_copy(update={"output_dir": str(path.parent.resolve())})
        return recipe

    @classmethod
    def from_yaml_text(
        cls,
        text: str,
        source: str = "recipe",
        base_dir: str | Path | None = None,
        overrides: list[str] | None = None,
    ) -> Recipe:
        """A recipe from YAML text (an editor, a request): parsed, validated and resolved as
        :meth:`from_yaml` does a file; ``source`` names it in the messages, relative paths are
        resolved against ``base_dir`` (default: the working directory)."""
        return cls.from_dict(parse_yaml(text, source), overrides=overrides, base_dir=base_dir, source=source)

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        overrides: list[str] | None = None,
        base_dir: str | Path | None = None,
        source: str = "recipe",
    ) -> Recipe:
        """Override, validate and resolve a raw recipe. An override that points ``data.path`` at other data, with no
        ``data.val_path`` on the same command, drops the recipe's held-out file (:func:`drop_stale_val_path`;
        :attr:`dropped_val_path` says it)."""
        raw = copy.deepcopy(raw)
        given = copy.deepcopy(raw)
        for item in overrides or []:
            apply_override(raw, item)
        dropped = drop_stale_val_path(given, raw, overrides or [])
        try:
            recipe = cls.model_validate(raw)
        except ValidationError as e:
            raise UserError(format_validation_error(e, source)) from None
        recipe = recipe.resolve_paths(Path(base_dir) if base_dir else Path.cwd(), source)
        recipe._dropped = None if dropped is None else (dropped, source)
        return recipe

    @property
    def dropped_val_path(self) -> tuple[str, str] | None:
        """``(data.val_path, the recipe's name)`` when an override to other data dropped the held-out file
        (:func:`drop_stale_val_path`), else None. Which rows of the new data to hold out instead is the data's
        question (counting its rows): :func:`finetuner.data.follow.load_recipe` answers it."""
        return self._dropped

    def resolve_paths(self, base_dir: Path, source: str = "recipe") -> Recipe:
        """Make local model and data paths absolute (relative to the recipe, then the cwd)."""
        r = self.model_copy(deep=True)
        model_path = find_local(r.model.name, [base_dir])
        hub_id = preset_model(r.model.name) if model_path is None else None
        if model_path is not None:
            if model_path.is_file() or gguf_base.is_gguf_name(model_path):
                gguf_base.check_file(model_path, f"{source}: model.name")
            elif not (model_path / "config.json").is_file() and next(model_path.glob("*.gguf"), None) is not None:
                files = sorted(p.name for p in model_path.glob("*.gguf"))
                raise UserError(
                    f"{source}: model.name: {model_path} holds GGUF files ({', '.join(files[:6])}) but no config.json: "
                    "name the file to load.",
                    hint=f"Set model.gguf_file: {files[0]} (or give the file's path as model.name).",
                )
            r.model.name = str(model_path)
        elif hub_id is not None:
            if gguf_base.is_gguf_name(hub_id):
                log.info("%s: model.name '%s' loads the GGUF file %s.", source, r.model.name, hub_id)
            else:
                log.warning("%s: model.name '%s' is a finetuner preset (a shape for planning); loading its hub id %s.",
                            source, r.model.name, hub_id)
            r.model.name = hub_id
        elif gguf_base.is_gguf_name(r.model.name):  # a missing GGUF file, with the files beside it
            gguf_base.check_file(base_dir / expand_user(r.model.name), f"{source}: model.name")
        else:  # a hub id, or a missing folder said at once (with near matches)
            locate(r.model.name, f"{source}: model.name", [base_dir])
        paths = r.data.path if isinstance(r.data.path, list) else [r.data.path]
        resolved = [_resolve_data_path(p, base_dir, source, "data.path") for p in paths]
        r.data.path = resolved if isinstance(r.data.path, list) else resolved[0]
        if r.data.val_path:
            r.data.val_path = _resolve_data_path(r.data.val_path, base_dir, source, "data.val_path")
        if r.preference.start_from:
            r.preference.start_from = _resolve_run_path(r.preference.start_from, base_dir, source)
        for i, reward in enumerate(r.grpo.rewards if r.grpo else []):
            if reward.file is not None:
                found = locate(reward.file, f"{source}: grpo.rewards[{i}].file", [base_dir], hub=False)
                if not found.is_file():
                    raise UserError(f"{source}: grpo.rewards[{i}].file: {found} is a folder; name the Python file that "
                                    f"defines {reward.function}.")
                reward.file = str(found)
        return r

    # ------------------------------------------------------------------ saving
    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump(mode="json")
        for section in OPTIONAL_SECTIONS:  # only a recipe of their objective has these: other recipes read as before
            if out.get(section) is None:
                out.pop(section, None)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def save(self, path: str | Path) -> None:
        """Write the resolved recipe atomically."""
        from finetuner.fileio import atomic_write_text

        atomic_write_text(Path(path), self.to_yaml())

    def output_path(self) -> Path:
        return Path(self.output_dir).expanduser().resolve() if self.output_dir else (Path.cwd() / "runs" / self.name).resolve()


#: The objectives' own sections (each description's ``section``), in the recipe's order.
OBJECTIVE_SECTIONS = tuple(sections())
#: The sections of one objective's settings that a recipe has only for that objective (``grpo``, ``neftune``:
#: absent from the recipes of the others, and from what they save), as the objectives' descriptions name them.
OPTIONAL_SECTIONS = tuple(name for name in OBJECTIVE_SECTIONS if Recipe.model_fields[name].default is None)


# ---------------------------------------------------------------------- YAML in and out
#: The order of a recipe's keys in the YAML finetuner writes for people to read (``finetuner plan
#: -o``, the web UI's editor): every top-level field of :class:`Recipe`, each once.
KEY_ORDER = ("name", "model", "method", "objective", *OBJECTIVE_SECTIONS, "quantization", "lora", "data", "training", "distributed",
             "checkpointing", "logging", "samples", "output_dir", "device")


#: The most nodes (mappings, lists, scalars) a recipe's YAML may stand for once its aliases are
#: expanded. A recipe has a few hundred; an alias bomb ("billion laughs") stands for billions in a


def readable_dict(recipe: Recipe, keep: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """What a person reads of a recipe: the values that differ from the defaults and the method,
    plus ``keep`` (section → key → value: written even where it is the default), in
    :data:`KEY_ORDER`. :meth:`Recipe.from_dict` of it gives the recipe back."""
    raw = recipe.model_dump(mode="json", exclude_defaults=True)
    raw["method"] = recipe.method
    for section, values in (keep or {}).items():
        raw.setdefault(section, {}).update(values)
    return {k: _whole_numbers_as_int(raw[k]) for k in sorted(raw, key=KEY_ORDER.index)}


def _whole_numbers_as_int(value: Any) -> Any:
    """``value`` with every whole float written as an int (``epochs: 8``, ``val_size: 6``, not ``8.0``,
    ``6.0``): the schema reads them back as the same floats."""
    if isinstance(value, dict):
        return {k: _whole_numbers_as_int(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers_as_int(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def readable_yaml(recipe: Recipe, header: str = "", keep: dict[str, dict[str, Any]] | None = None) -> str:
    """:func:`readable_dict` as YAML after ``header`` (comment lines, each ending in a newline)."""
    return header + yaml.safe_dump(readable_dict(recipe, keep), sort_keys=False, allow_unicode=True)


# ---------------------------------------------------------------------- helpers
def _check_distributed(r: Recipe) -> None:
    """Combinations of ``distributed`` with the rest of the recipe that cannot run."""
    d = r.distributed
    if d.node_rank >= d.nodes:
        raise ValueError(f"distributed.node_rank: {d.node_rank} must be below distributed.nodes ({d.nodes})")
    if d.offload != "none" and not d.deepspeed:
        also = "; with fsdp, set distributed.fsdp_offload: true instead" if d.row.engine == FSDP_ENGINE else ""
        raise ValueError(
            f"distributed.offload: '{d.offload}' needs a DeepSpeed strategy: set distributed.strategy to zero2 "
            f"(optimizer states in CPU memory) or zero3{also}"
        )
    if d.offload not in d.row.offloads:
        raise ValueError(
            f"distributed.offload: parameter offload needs strategy zero3 (got {d.strategy}): ZeRO stages 1-2 keep the "
            "parameters on every GPU; use offload 'optimizer' or strategy zero3"
        )
    if "optimizer" in d.row.shards and r.training.optimizer not in ("adamw_torch", "sgd", "auto"):
        engine = "DeepSpeed ZeRO" if d.deepspeed else "fsdp (measured: bitsandbytes' and Adafactor's updates fail on its sharded parameters)"
        raise ValueError(
            f"training.optimizer: '{r.training.optimizer}' cannot be sharded by {engine} (bitsandbytes and "
            "factored optimizers keep their own state layout): use adamw_torch, or strategy ddp"
        )
    if d.offload != "none" and r.training.optimizer == "sgd":
        raise ValueError("training.optimizer: ZeRO-Offload runs an Adam optimizer on the CPU: use adamw_torch")
    if d.fsdp_offload and d.row.engine != FSDP_ENGINE:
        raise ValueError(
            f"distributed.fsdp_offload: applies to strategy fsdp (got {d.strategy}): set strategy fsdp, or use "
            "distributed.offload with a ZeRO strategy"
        )
    if r.method == "qlora" and d.row.engine == FSDP_ENGINE and r.quantization is not None and r.quantization.bits == 8:
        raise ValueError(
            "quantization.bits: 8-bit bitsandbytes weights cannot be sharded by fsdp (their scales live on the parameter "
            "object, which FSDP replaces with its shard): use bits 4 with fsdp, or strategy ddp or zero2 for 8-bit QLoRA"
        )
    if r.method == "qlora" and d.deepspeed and "parameters" in d.row.shards:
        raise ValueError(
            "distributed.strategy: 'zero3' would shard the 4-bit base weights, which DeepSpeed does not support for "
            "bitsandbytes-quantized models: use fsdp (shards the 4-bit weights), zero2 or ddp with qlora, or method lora with zero3"
        )
    if r.model.max_memory and d.world_size > 1:
        raise ValueError(
            "model.max_memory: splitting the model by layers over GPUs cannot be combined with several processes: "
            "remove model.max_memory, or use distributed.strategy zero3/fsdp to shard it instead"
        )


def _check_preference(r: Recipe) -> None:
    """Combinations of ``objective`` and ``preference`` with the rest of the recipe that cannot run."""
    p, obj = r.preference, r.objective
    # keys whose value is not the default (a saved recipe holds every key, so being present says nothing)
    given = [k for k, f in type(p).model_fields.items() if getattr(p, k) != f.default]
    if spec_of(obj).section != "preference":
        if given:
            raise ValueError(
                f"preference.{given[0]}: set, but objective is '{obj}': set objective to "
                f"{in_words(names_where(section='preference'))}, or remove the preference section"
            )
        return
    for key in given:
        if obj not in p.APPLIES_TO[key]:
            users = ", ".join(p.APPLIES_TO[key])
            raise ValueError(f"preference.{key}: applies to {users}, not to objective '{obj}': remove it, or change the objective")
    if p.loss_type == "ipo" and p.label_smoothing:
        raise ValueError("preference.label_smoothing: applies to loss_type sigmoid (IPO has no label smoothing): remove it")
    if obj in REFERENCE_OBJECTIVES and p.reference == "adapter_off":
        why = None
        if p.start_from:
            why = ("switching the adapter off would give the base model, not the SFT model of preference.start_from; "
                   "precomputed scores that SFT model once before the first step")
        elif r.method == "full":
            why = "method 'full' trains the whole model, so there is no adapter to switch off"
        if why:
            if "reference" in p.model_fields_set:
                raise ValueError(f"preference.reference: 'adapter_off' cannot be used here: {why}; set reference: precomputed")
            object.__setattr__(p, "reference", "precomputed")
    if p.start_from and r.method == "full":
        raise ValueError("preference.start_from: starts from a LoRA run's adapter, so it needs method lora or qlora")
    if r.data.packing is True:
        raise ValueError(
            f"data.packing: objective '{obj}' scores each response as a whole sequence, so examples cannot be packed: "
            "set packing: false"
        )
    if r.data.train_on_prompt:
        raise ValueError(f"data.train_on_prompt: objective '{obj}' scores only the responses: remove train_on_prompt")


def _check_objective_sections(r: Recipe) -> None:
    """An objective's own section (:data:`OPTIONAL_SECTIONS`) set in a recipe of another objective would do nothing."""
    for section in OPTIONAL_SECTIONS:
        if getattr(r, section) is not None and spec_of(r.objective).section != section:
            raise ValueError(f"{section}: set, but objective is '{r.objective}': set objective to "
                             f"{' or '.join(names_where(section=section))}, or remove the {section} section")


def _check_grpo(r: Recipe) -> None:
    """Combinations of ``objective: grpo`` and its ``grpo`` section with the rest of the recipe that cannot run."""
    g = r.grpo
    if not spec_of(r.objective).generates:
        return
    if g is None or not g.rewards:
        raise ValueError("grpo.rewards: objective grpo trains on rewards: name at least one reward function, e.g. "
                         "grpo: {rewards: [{function: my_reward, file: rewards.py}]} (a file of functions with TRL's signature)")
    if g.beta and r.method == "full":
        raise ValueError("grpo.beta: the reference is the base with the adapter off, and method 'full' has no adapter: "
                         "set beta: 0, or use method lora or qlora")
    if r.data.packing is True:
        raise ValueError("data.packing: objective 'grpo' generates a group of completions per prompt, so prompts cannot be "
                         "packed: set packing: false")
    if r.data.train_on_prompt:
        raise ValueError("data.train_on_prompt: objective 'grpo' trains only on the generated completions: remove train_on_prompt")
    if g.max_new_tokens >= r.data.max_seq_len:
        raise ValueError(f"grpo.max_new_tokens: {g.max_new_tokens} leaves no room for the prompt in data.max_seq_len "
                         f"{r.data.max_seq_len} (prompt + completion): lower it, or raise data.max_seq_len")
    problem = vllm_refusal(r)
    if problem:
        raise ValueError(problem)


#: the LoRA ranks vLLM's engine takes (``vllm/config/lora.py`` ``MaxLoRARanks``, vLLM 0.30); a rank in
#: between is served in the next one up
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_refusal(r: Recipe) -> str | None:
    """Why ``grpo.use_vllm`` cannot run with the rest of ``r`` (None: it can, as far as the recipe
    says; whether vLLM and a GPU are there is checked when the objective is built,
    :func:`finetuner.objectives.rollout_vllm.check_vllm`). vLLM samples from the base it loads itself
    plus the adapter, saved at each rollout: a recipe whose policy is not that cannot use it."""
    g = r.grpo
    if g is None or not g.use_vllm:
        return None
    off = "or set grpo.use_vllm: false (transformers' generate)"
    if r.device == "cpu":
        return f"grpo.use_vllm: vLLM runs on a CUDA GPU, and device is cpu: set device: auto (or cuda), {off}"
    if r.method == "full":
        return ("grpo.use_vllm: with method 'full' vLLM would need the whole model's weights copied into it at every "
                "rollout, which finetuner does not do (it hands vLLM the LoRA adapter): use method lora or qlora, " + off)
    if r.distributed.world_size > 1:
        return f"grpo.use_vllm: vLLM runs in a single training process here; set distributed.num_processes and nodes to 1, {off}"
    if gguf_base.is_gguf_name(r.model.name):
        return f"grpo.use_vllm: model.name is a GGUF file, which finetuner trains dequantized; vLLM would not load that base: {off}"
    if r.lora.r > VLLM_LORA_RANKS[-1]:
        return f"grpo.use_vllm: lora.r {r.lora.r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}: lower it, {off}"
    if r.lora.bias != "none":
        return f"grpo.use_vllm: vLLM serves LoRA adapters without biases: set lora.bias: none, {off}"
    q = r.quantization
    if r.method == "qlora" and q is not None and (q.bits != 4 or q.quant_type != "nf4" or not q.double_quant):
        return ("grpo.use_vllm: vLLM quantizes the base itself as it loads it, to 4-bit NF4 with double quantization only, "
                "so the policy it samples would not be the one trained: set quantization bits: 4, quant_type: nf4, "
                f"double_quant: true, {off}")
    return None


def _resolve_run_path(p: str, base_dir: Path, source: str) -> str:
    """``preference.start_from``: a finished run's folder (one with ``adapter/``), made absolute."""
    found = locate(p, f"{source}: preference.start_from", [base_dir], hub=False)
    if not found.is_dir():
        raise UserError(f"{source}: preference.start_from: {found} is a file; give the folder of a finished SFT run, "
                        "e.g. runs/demo_cpu.")
    if not (found / "adapter").is_dir():
        raise UserError(
            f"{source}: preference.start_from: {found} holds no adapter/ folder: that run has not finished.",
            hint="Let the SFT run finish (finetuner run RECIPE resumes it), or start from another run.",
        )
    return str(found)


def _resolve_data_path(p: str, base_dir: Path, source: str, key: str) -> str:
    found = locate(p, f"{source}: {key}", [base_dir])
    if isinstance(found, Path) and found.is_dir():  # the data reader takes files only
        raise UserError(
            f"{source}: {key}: '{p}' is a folder ({found}); name a data file (.json, .jsonl, .csv, .parquet).",
        )
    return str(found)  # a local file, or a hub data set id

# ---------------------------------------------------------------------- error messages
def format_validation_error(e: ValidationError, source: str) -> str:
    """Turn pydantic's errors about a recipe into lines that name the key, say what it must be and suggest a fix
    (:func:`finetuner.config.recipe_errors.render_validation_error` on the :class:`Recipe` schema)."""
    return render_validation_error(e, source, Recipe)


def recipe_keys() -> list[str]:
    """Every key of a recipe that holds a value, dotted (``training.lr``, ``method``)."""
    return model_keys(Recipe)


def accepted_values(key: str) -> tuple[list[str], list[Any]]:
    """What a dotted ``key`` accepts, as the error messages say it: the kinds of value in words
    (``a whole number ≥ 1``) and the named choices (``auto``)."""
    return values_accepted(Recipe, key)

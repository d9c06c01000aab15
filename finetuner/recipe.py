"""The recipe: a typed, validated description of one fine-tune.

A recipe is a YAML file with the sections below. Loading it applies defaults, resolves
relative paths against the recipe's folder, applies ``--set key.path=value`` overrides, and
checks every field and every combination of fields. Every problem becomes a
:class:`~finetuner.errors.UserError` that names the file and the key and, for a misspelt key
or value, the closest valid one.

The fully resolved recipe is saved as ``recipe.yaml`` in the run folder, so a run can be
reproduced and resumed from that folder alone.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from finetuner.errors import UserError, did_you_mean
from finetuner.fileio import expand_user, exists
from finetuner.shapes import preset_hub_id

Dtype = Literal["auto", "bf16", "fp16", "fp32"]
Method = Literal["lora", "qlora", "full"]
#: ``auto`` asks the planner (:mod:`finetuner.planner`) to choose for the device the run is on.
Auto = Literal["auto"]
PositiveInt = Annotated[int, Field(gt=0)]
Optimizer = Literal[
    "adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd"
]
Scheduler = Literal["cosine", "linear", "constant", "constant_with_warmup"]
DataFormat = Literal["auto", "alpaca", "chat", "text", "completion"]

DATA_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet")

log = logging.getLogger(__name__)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    """Which base model to fine-tune and how to load it."""

    name: str = Field(description="Hub id (org/name) or a local folder with config.json.")
    revision: str | None = Field(None, description="Hub branch, tag or commit.")
    dtype: Dtype = Field("auto", description="Storage dtype of the frozen base weights.")
    trust_remote_code: bool = Field(
        False, description="Run code shipped with the model. Off unless you trust the repository."
    )
    allow_pickle: bool = Field(
        False,
        description=(
            "Also load pickle weights (pytorch_model.bin) when the model has no safetensors. Off: unpickling "
            "can run code, so only turn it on for files you trust."
        ),
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    max_memory: dict[str, str] | None = Field(
        None,
        description=(
            "Split the frozen base across several GPUs by layers (accelerate device map), e.g. "
            "{'0': '20GiB', '1': '24GiB'}. CPU or disk entries are refused: see the error for why."
        ),
    )

    @field_validator("max_memory")
    @classmethod
    def _gpus_only(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if not v:
            return None
        for key, size in v.items():
            if key in ("cpu", "disk"):
                raise ValueError(
                    f"'{key}': base-weight offload to {key} is not supported for training: accelerate's offload hooks "
                    "replace the offloaded weights at every forward, so the LoRA layers on them would not train and "
                    "the weights saved for backward stay on the GPU anyway. Use method qlora (a 4-bit base is ~3.5x "
                    "smaller), `finetuner plan` to see what fits, or distributed.strategy zero3 with parameter offload"
                )
            if not key.isdigit():
                raise ValueError(f"'{key}': keys are GPU indices such as '0' and '1'")
            if not re.fullmatch(r"\s*\d+(\.\d+)?\s*(GiB|GB|MiB|MB)\s*", str(size)):
                raise ValueError(f"'{key}': size {size!r} must look like '20GiB'")
        return v


class LoraSection(_Section):
    """LoRA adapter hyper-parameters (peft ``LoraConfig``)."""

    r: int = Field(16, gt=0, le=1024)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: str | list[str] = Field(
        "all-linear", description="'all-linear' or a list of module names such as q_proj."
    )
    bias: Literal["none", "all", "lora_only"] = "none"

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("needs at least one module name, or 'all-linear'")
        return v


class QuantizationSection(_Section):
    """bitsandbytes quantization of the frozen base weights."""

    bits: Literal[4, 8] = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Dtype = "auto"


class DataSection(_Section):
    """Training data and how it becomes token sequences."""

    path: str | list[str] = Field(description="JSON/JSONL/CSV/Parquet file(s) or a hub data set id.")
    format: DataFormat = "auto"
    columns: dict[str, str] | None = Field(
        None,
        description=(
            "Which column holds what, as role: column, e.g. {prompt: question, response: answer}. Roles: prompt, "
            "input, response, system (instruction data), messages (chat), text. Implies the format unless format is set."
        ),
    )
    split: str = Field("train", description="Split to use for hub data sets.")
    max_seq_len: int = Field(1024, ge=16)
    train_on_prompt: bool = Field(False, description="Also compute the loss on prompt tokens.")
    packing: bool | Auto = Field(
        False, description="Pack short examples into full sequences; auto packs when they average under half of max_seq_len."
    )
    val_size: float = Field(0.0, ge=0, description="Fraction (<1) or number (>=1) of rows held out.")
    val_path: str | None = None
    on_bad_row: Literal["error", "skip"] = "error"
    chat_template: str | None = Field(None, description="Jinja chat template overriding the tokenizer's.")
    system_prompt: str | None = None
    max_examples: int | None = Field(None, gt=0)
    num_proc: int | None = Field(None, gt=0, description="Worker processes for tokenization (default: up to 8 from 20k rows).")
    cache: bool = Field(True, description="Keep tokenized data on disk for the next run with the same files, tokenizer and settings.")

    @field_validator("columns", mode="before")
    @classmethod
    def _numbers_are_names(cls, v: Any) -> Any:
        """Roles in any case; a column named ``2024`` (YAML and ``--set`` read it as a number) is a name;
        an empty value is left for the check below to explain."""
        if isinstance(v, dict):
            return {
                (k.strip().lower() if isinstance(k, str) else k): "" if c is None else str(c) if isinstance(c, int) and not isinstance(c, bool) else c
                for k, c in v.items()
            }
        return v

    @field_validator("columns")
    @classmethod
    def _known_roles(cls, v: dict[str, str] | None, info: ValidationInfo) -> dict[str, str] | None:
        if not v:
            return None
        from finetuner.data_formats import check_columns

        check_columns(v, info.data.get("format", "auto"))
        return v


class TrainingSection(_Section):
    """Optimisation settings."""

    epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps; overrides epochs.")
    lr: float = Field(2e-4, gt=0)
    scheduler: Scheduler = "cosine"
    warmup_steps: int | None = Field(None, ge=0)
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="Warm-up as a fraction of steps (0.03 if neither is set).")
    micro_batch_size: PositiveInt | Auto = 1
    gradient_accumulation: PositiveInt | Auto = 1
    effective_batch: PositiveInt | None = Field(
        None, description="Examples per optimizer step when micro_batch_size or gradient_accumulation is auto (default 16)."
    )
    optimizer: Optimizer | Auto = "adamw_torch"
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    gradient_checkpointing: bool | Auto = False
    offload_activations: bool | Auto = Field(
        False, description="Keep saved activations in CPU memory (with checkpointing: each layer's input)."
    )
    loss_chunk_size: int = Field(
        1024, ge=0, description="Tokens per cross-entropy chunk (full logits are never held); 0 computes full logits."
    )
    precision: Dtype = Field("auto", description="Autocast dtype for compute.")
    kernels: Literal["auto", "liger", "none"] = Field(
        "auto", description="Fused Liger kernels (CUDA, finetuner[speed]); auto uses them when installed on a CUDA GPU."
    )
    compile: bool = Field(False, description="torch.compile each decoder layer (slower start, faster steps).")
    seed: int = 42
    eval_every: int | None = Field(None, gt=0, description="Evaluate every N steps (and at the end).")

    @property
    def effective_batch_size(self) -> int:
        """Examples per optimizer step (the planner resolves ``auto`` values first)."""
        if self.micro_batch_size == "auto" or self.gradient_accumulation == "auto":
            return self.effective_batch or 16
        return self.micro_batch_size * self.gradient_accumulation


class CheckpointSection(_Section):
    save_every: int | None = Field(100, gt=0, description="Save a resumable checkpoint every N steps.")
    keep_last: int = Field(2, ge=1, description="Keep only the last K checkpoints.")


class LoggingSection(_Section):
    every: int = Field(1, gt=0, description="Write a step event every N optimizer steps.")
    tensorboard: bool = True


class SamplesSection(_Section):
    """Generations shown after training: base model vs fine-tuned, same prompt."""

    prompts: list[str] = Field(default_factory=list)
    max_new_tokens: int = Field(64, gt=0)


Strategy = Literal["ddp", "fsdp", "zero1", "zero2", "zero3"]
Offload = Literal["none", "optimizer", "optimizer+params"]


class DistributedSection(_Section):
    """Several processes (GPUs, or CPU processes on gloo) training one model: :mod:`finetuner.launch`.

    The effective batch stays ``micro_batch_size x gradient_accumulation`` whatever the number of
    processes: each optimizer step's micro-batches are split across them, so N processes follow
    the loss curve of one.
    """

    strategy: Strategy = Field(
        "ddp",
        description="ddp (replicated), zero1/zero2/zero3 (DeepSpeed ZeRO stages); fsdp: config only, refused by run (use zero3).",
    )
    num_processes: int = Field(1, ge=1, description="Processes per node (one per GPU); `finetuner run --gpus N` sets it.")
    offload: Offload = Field(
        "none", description="ZeRO-Offload: optimizer states (zero1-3) or also parameters (zero3) in CPU memory."
    )
    cpu_adam: bool = Field(
        True,
        description="With offload: DeepSpeedCPUAdam (a C++ extension built on first use, ~1-3 min) instead of torch AdamW on the CPU states.",
    )
    nodes: int = Field(1, ge=1, description="Machines taking part; run the same command on each with its node_rank.")
    node_rank: int = Field(0, ge=0)
    master_addr: str = Field("127.0.0.1", description="Address of node 0 (rendezvous).")
    master_port: int = Field(29500, ge=1, le=65535)

    @property
    def world_size(self) -> int:
        return self.num_processes * self.nodes

    @property
    def deepspeed(self) -> bool:
        return self.strategy.startswith("zero")


class Recipe(_Section):
    """A complete fine-tuning recipe."""

    name: str = Field("run", description="Run name; the default output folder is runs/<name>.")
    model: ModelSection
    method: Method | Auto = "lora"
    lora: LoraSection = Field(default_factory=LoraSection)
    quantization: QuantizationSection | None = None
    data: DataSection
    training: TrainingSection = Field(default_factory=TrainingSection)
    checkpointing: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    samples: SamplesSection = Field(default_factory=SamplesSection)
    distributed: DistributedSection = Field(default_factory=DistributedSection)
    output_dir: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", v):
            raise ValueError("use letters, digits, '.', '_' and '-' only (it names a folder)")
        return v

    #: The keys that may be ``auto`` (resolved by the planner when the run starts).
    AUTO_KEYS: ClassVar[tuple[str, ...]] = (
        "method",
        "training.micro_batch_size",
        "training.gradient_accumulation",
        "training.optimizer",
        "training.gradient_checkpointing",
        "training.offload_activations",
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
        return self

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> Recipe:
        """Load, override, validate and resolve a recipe file."""
        path = expand_user(path)
        if not exists(path, "file"):
            raise UserError(
                f"Recipe file not found: {path}",
                hint="Give the path of a YAML recipe, e.g. recipes/demo_cpu.yaml.",
            )
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            line = e.object[: e.start].count(b"\n") + 1
            raise UserError(f"{path}: line {line}: not a UTF-8 text file ({e.reason} at byte {e.start}).") from None
        except RecursionError:
            raise UserError(f"{path}: invalid YAML: lists or mappings nested too deeply.") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e)
            raise UserError(f"{path}:{where}: invalid YAML: {problem}.") from None
        if raw is None:
            raise UserError(f"{path}: the recipe is empty.", hint="See recipes/demo_cpu.yaml for an example.")
        if not isinstance(raw, dict):
            raise UserError(f"{path}: a recipe must be a mapping of sections (model:, data:, ...).")
        return cls.from_dict(raw, overrides=overrides, base_dir=path.parent, source=str(path))

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        overrides: list[str] | None = None,
        base_dir: str | Path | None = None,
        source: str = "recipe",
    ) -> Recipe:
        raw = copy.deepcopy(raw)
        for item in overrides or []:
            apply_override(raw, item)
        try:
            recipe = cls.model_validate(raw)
        except ValidationError as e:
            raise UserError(format_validation_error(e, source)) from None
        return recipe.resolve_paths(Path(base_dir) if base_dir else Path.cwd(), source)

    def resolve_paths(self, base_dir: Path, source: str = "recipe") -> Recipe:
        """Make local model and data paths absolute (relative to the recipe, then the cwd)."""
        r = self.model_copy(deep=True)
        model_path = _find_local(r.model.name, base_dir)
        hub_id = preset_hub_id(r.model.name) if model_path is None else None
        if model_path is not None:
            r.model.name = str(model_path)
        elif hub_id is not None:
            log.warning("%s: model.name '%s' is a finetuner preset (a shape for planning); loading its hub id %s.",
                        source, r.model.name, hub_id)
            r.model.name = hub_id
        elif _looks_like_path(r.model.name):
            raise UserError(
                f"{source}: model.name: no folder '{r.model.name}' (looked in {base_dir} and {Path.cwd()}).",
                hint="Give an existing folder with config.json, or a hub id like org/name.",
            )
        paths = r.data.path if isinstance(r.data.path, list) else [r.data.path]
        resolved = [_resolve_data_path(p, base_dir, source, "data.path") for p in paths]
        r.data.path = resolved if isinstance(r.data.path, list) else resolved[0]
        if r.data.val_path:
            r.data.val_path = _resolve_data_path(r.data.val_path, base_dir, source, "data.val_path")
        return r

    # ------------------------------------------------------------------ saving
    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def save(self, path: str | Path) -> None:
        """Write the resolved recipe atomically."""
        from finetuner.fileio import atomic_write_text

        atomic_write_text(Path(path), self.to_yaml())

    def output_path(self) -> Path:
        return Path(self.output_dir).expanduser().resolve() if self.output_dir else (Path.cwd() / "runs" / self.name).resolve()


# ---------------------------------------------------------------------- helpers
def _check_distributed(r: Recipe) -> None:
    """Combinations of ``distributed`` with the rest of the recipe that cannot run."""
    d = r.distributed
    if d.node_rank >= d.nodes:
        raise ValueError(f"distributed.node_rank: {d.node_rank} must be below distributed.nodes ({d.nodes})")
    if d.offload != "none" and not d.deepspeed:
        raise ValueError(
            f"distributed.offload: '{d.offload}' needs a DeepSpeed strategy: set distributed.strategy to zero2 "
            "(optimizer states in CPU memory) or zero3"
        )
    if d.offload == "optimizer+params" and d.strategy != "zero3":
        raise ValueError(
            f"distributed.offload: parameter offload needs strategy zero3 (got {d.strategy}): ZeRO stages 1-2 keep the "
            "parameters on every GPU; use offload 'optimizer' or strategy zero3"
        )
    if d.deepspeed and r.training.optimizer not in ("adamw_torch", "sgd", "auto"):
        raise ValueError(
            f"training.optimizer: '{r.training.optimizer}' cannot be sharded by DeepSpeed ZeRO (bitsandbytes and "
            "factored optimizers keep their own state layout): use adamw_torch, or strategy ddp"
        )
    if d.offload != "none" and r.training.optimizer == "sgd":
        raise ValueError("training.optimizer: ZeRO-Offload runs an Adam optimizer on the CPU: use adamw_torch")
    if r.method == "qlora" and d.strategy in ("fsdp", "zero3"):
        raise ValueError(
            f"distributed.strategy: '{d.strategy}' would shard the 4-bit base weights, which finetuner does not support "
            "for bitsandbytes-quantized models: use zero2 (shards optimizer states and gradients) or ddp with qlora, "
            "or method lora with fsdp/zero3"
        )
    if r.model.max_memory and d.world_size > 1:
        raise ValueError(
            "model.max_memory: splitting the model by layers over GPUs cannot be combined with several processes: "
            "remove model.max_memory, or use distributed.strategy zero3/fsdp to shard it instead"
        )


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith(DATA_EXTENSIONS)


def _find_local(name: str, base_dir: Path) -> Path | None:
    p = expand_user(name)
    for candidate in ([p] if p.is_absolute() else [base_dir / p, Path.cwd() / p]):
        if exists(candidate):
            return candidate.resolve()
    return None


def _resolve_data_path(p: str, base_dir: Path, source: str, key: str) -> str:
    found = _find_local(p, base_dir)
    if found is not None and found.is_dir():  # the data reader takes files only
        raise UserError(
            f"{source}: {key}: '{p}' is a folder ({found}); name a data file (.json, .jsonl, .csv, .parquet).",
        )
    if found is not None:
        return str(found)
    if _looks_like_path(p):
        raise UserError(
            f"{source}: {key}: file not found: '{p}' (looked in {base_dir} and {Path.cwd()}).",
            hint="Relative paths are taken from the recipe's folder, then the current folder.",
        )
    return p  # a hub data set id


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``key.path=value`` override to a raw recipe dict; the value is parsed as YAML."""
    if "=" not in item:
        raise UserError(f"--set {item!r}: expected key.path=value, e.g. training.lr=1e-4.")
    key, _, value_text = item.partition("=")
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise UserError(f"--set {item!r}: the key is empty.")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except yaml.YAMLError:
        value = value_text
    node = raw
    for i, k in enumerate(keys[:-1]):
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise UserError(f"--set {item!r}: '{'.'.join(keys[: i + 1])}' is not a section.")
        node = nxt
    node[keys[-1]] = value


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Recipe
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return model


def format_validation_error(e: ValidationError, source: str) -> str:
    """Turn pydantic's errors into lines that name the key and suggest a fix."""
    lines = [f"{source}: the recipe is not valid:"]
    for err in e.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-after", "literal["))))
        # pydantic adds union-member tags to the location; keep only real keys and indexes
        loc = tuple(p for p in loc if isinstance(p, int) or not re.match(r"^(str|list\[str\]|int|float|bool|QuantizationSection)$", str(p)))
        key = ".".join(str(p) for p in loc)
        etype = err["type"]
        if not key:  # a cross-field check: its message starts with the key it is about
            key, _, rest = err["msg"].removeprefix("Value error, ").partition(": ")
            err = {**err, "msg": rest, "input": {}}
        if etype == "extra_forbidden":
            parent = _model_at(loc[:-1])
            choices = list(parent.model_fields) if parent else []
            msg = f"unknown key.{did_you_mean(str(loc[-1]), choices)}" if choices else "unknown key."
        elif etype == "literal_error":
            expected = err.get("ctx", {}).get("expected", "")
            choices = re.findall(r"'([^']*)'", expected) or re.findall(r"(\d+)", expected)
            got = err.get("input")
            msg = f"invalid value {got!r}.{did_you_mean(str(got), choices)}"
        elif etype == "missing":
            msg = "required key is missing."
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            msg = err["msg"].removeprefix("Value error, ") + shown + "."
        lines.append(f"  - {key}: {msg}")
    return "\n".join(dict.fromkeys(lines))

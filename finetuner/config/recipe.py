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

from finetuner.errors import UserError, closest, did_you_mean
from finetuner.fileio import expand_user, exists
from finetuner.locate import find_local, locate
from finetuner.model import gguf_base
from finetuner.model.shapes import preset_model
from finetuner.runs.marker import is_run_folder

Dtype = Literal["auto", "bf16", "fp16", "fp32"]
Method = Literal["lora", "qlora", "full"]
#: The data keys that may be ``auto``: resolved from the recipe's own data when the run starts
#: (:func:`finetuner.planning.data_auto.resolve_data`), by the rules ``finetuner plan`` sizes a run with.
DATA_AUTO_KEYS = ("data.max_seq_len", "data.packing", "data.replay")
#: ``auto`` asks the planner (:mod:`finetuner.planning.planner`) to choose for the device the run is on.
Auto = Literal["auto"]
PositiveInt = Annotated[int, Field(gt=0)]
Optimizer = Literal[
    "adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd"
]
Scheduler = Literal["cosine", "linear", "constant", "constant_with_warmup"]
DataFormat = Literal["auto", "alpaca", "chat", "text", "completion"]
#: What training optimises (:mod:`finetuner.objectives`): supervised fine-tuning, a preference objective
#: (:mod:`finetuner.objectives.preference`), or reinforcement learning from rewards (:mod:`finetuner.objectives.grpo`).
Objective = Literal["sft", "dpo", "orpo", "simpo", "kto", "grpo"]
#: The preference objectives (the ``preference`` section's).
PREFERENCE_OBJECTIVES = ("dpo", "orpo", "simpo", "kto")
#: The objectives trained on pairs of a chosen and a rejected response (KTO takes single rated responses).
PAIRED_OBJECTIVES = ("dpo", "orpo", "simpo")
#: The objectives that compare the model with a reference model (ORPO and SimPO need none).
REFERENCE_OBJECTIVES = ("dpo", "kto")

DATA_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet")

log = logging.getLogger(__name__)

#: one module name (``q_proj``, ``self_attn.q_proj``), and names separated by commas or spaces
_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
_NAMES = re.compile(r"\s*[A-Za-z0-9_.]+(\s*[,\s]\s*[A-Za-z0-9_.]+)*\s*,?\s*")


#: the seeds torch, numpy and ``random`` all accept (numpy's ``SeedSequence`` takes 0 to 2**32 - 1)
MAX_SEED = 2**32 - 1
#: the largest whole number a recipe key takes: 2**53, the largest up to which a float holds every whole number
#: exactly. YAML reads ``1e16`` (and the web UI's JSON any number) as a float, so a larger value is not the one
#: written; no count in a recipe comes near it (what a run can finish: :mod:`finetuner.planning.bounds`).
MAX_WHOLE = 2**53


#: a number in exponent notation without a dot (``1e12``, ``-2E-4``): text to YAML 1.1, a number to YAML 1.2
EXPONENT_NUMBER = re.compile(r"[+-]?\d+[eE][+-]?\d+")


def _numeric_kinds(annotation: Any) -> set[type]:
    """``int`` and ``float`` among the kinds of value a field's annotation accepts (unions and
    ``Annotated`` looked into); ``bool`` too where the field takes true/false."""
    import typing

    if typing.get_origin(annotation) is typing.Annotated:
        return _numeric_kinds(typing.get_args(annotation)[0])
    members = _union_members(annotation)
    if members is not None:
        return set().union(*(_numeric_kinds(m) for m in members))
    return {annotation} & {int, float, bool}


def _has_upper_bound(field: Any) -> bool:
    """Whether a field states its own largest value (``le``/``lt``, e.g. ``training.seed``): its message says it."""
    return any(getattr(c, "le", None) is not None or getattr(c, "lt", None) is not None for c in field.metadata)


class _Section(BaseModel):
    # inf and nan are never a sensible setting (``training.lr: .inf`` trained a model of NaNs)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_as_written(cls, v: Any, info: ValidationInfo) -> Any:
        """``true``/``false`` where a number belongs is a mistake (pydantic would read it as 1/0:
        ``lora.r: true`` trained with r=1); so is a whole number above :data:`MAX_WHOLE` (pydantic takes the
        float ``1e20`` as the int 100000000000000000000, not a value anyone wrote). A number written with an
        exponent and no dot (``1e12``, ``2e-4``) is text to YAML 1.1, which PyYAML reads; where a number belongs it
        is read as the number it is (YAML 1.2 and JSON read it so), and then checked as any other."""
        field = cls.model_fields.get(info.field_name or "")
        kinds = _numeric_kinds(field.annotation) if field else set()
        if isinstance(v, str) and kinds - {bool} and EXPONENT_NUMBER.fullmatch(v.strip()):
            v = float(v)
        if not isinstance(v, int | float):
            return v
        if isinstance(v, bool):
            if kinds and bool not in kinds:
                raise ValueError(f"must be a number, not {str(v).lower()}")
        elif abs(v) > MAX_WHOLE and int in kinds and float not in kinds and not _has_upper_bound(field):
            raise ValueError(f"must be a whole number of at most {MAX_WHOLE:,} (2**53: a larger one is not exact once "
                             f"YAML or JSON reads it); got {shown(v)}")
        return v


class ModelSection(_Section):
    """Which base model to fine-tune and how to load it."""

    name: str = Field(description=(
        "Hub id (org/name), a local folder with config.json, a preset name (smollm2-135m-instruct), or a GGUF file "
        "(*.gguf, e.g. from Ollama or LM Studio: its weights are dequantized and trained in full precision)."))
    gguf_file: str | None = Field(None, description=(
        "A GGUF file inside the folder model.name names (transformers' gguf_file); the resolved recipe names the "
        "file itself in model.name."))
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

    @model_validator(mode="before")
    @classmethod
    def _gguf_file_in_folder(cls, raw: Any) -> Any:
        """``name`` + ``gguf_file`` become one path to the file (every loader takes a ``.gguf`` model.name)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("gguf_file"), str) or not isinstance(raw.get("name"), str):
            return raw  # a gguf_file of the wrong kind is said by its field's own check
        name, file = raw["name"], raw["gguf_file"]
        if gguf_base.is_gguf_name(name):
            raise ValueError(f"model.name '{name}' is already a GGUF file; model.gguf_file "
                             f"('{file}') names a file inside a folder: give one or the other")
        if not gguf_base.is_gguf_name(file):
            raise ValueError(f"gguf_file '{file}' does not end with .gguf: name the GGUF file in the folder model.name")
        return {**raw, "name": str(Path(name) / file), "gguf_file": None}

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
        "all-linear",
        description=(
            "'all-linear', module names as a list ([q_proj, v_proj]) or one comma-separated string "
            "('q_proj,v_proj'), or a regular expression matched against whole module paths (peft's rule)."
        ),
    )
    bias: Literal["none", "all", "lora_only"] = "none"
    train_projector: bool = Field(
        False,
        description=("An image-text model on pictures: train the projector between the vision tower and the language "
                     "model in full (saved with the adapter, peft's modules_to_save); off: frozen."),
    )
    train_vision_tower: bool = Field(
        False,
        description=("An image-text model on pictures: LoRA (the same r and alpha) on the vision tower's linear layers "
                     "too; off: the tower is frozen."),
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names(cls, v: Any) -> Any:
        """A string of names (``q_proj,v_proj``, ``q_proj v_proj``, ``q_proj``) becomes their list."""
        if isinstance(v, str) and v.strip() != "all-linear" and _NAMES.fullmatch(v):
            return [n for n in re.split(r"[\s,]+", v) if n]
        return v

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            names = [n.strip() for n in v]
            if not names:
                raise ValueError("needs at least one module name, or 'all-linear'")
            bad = next((n for n in names if not _NAME.fullmatch(n)), None)
            if bad is not None:
                raise ValueError(
                    f"{bad!r} is not a module name (letters, digits, '_' and '.'): list names such as "
                    "[q_proj, v_proj], or give one regular expression as a string"
                )
            return names
        v = v.strip()
        if v != "all-linear":
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"{v!r} is neither 'all-linear', module names nor a valid regular expression ({e})") from None
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
    max_seq_len: Annotated[int, Field(ge=16)] | Auto = Field(
        1024, description="Tokens a row keeps; auto: what the data need, as finetuner plan sizes it (a few outlier rows cut).")
    train_on_prompt: bool = Field(False, description="Also compute the loss on prompt tokens.")
    packing: bool | Auto = Field(
        False, description="Pack short examples into full sequences; auto: as finetuner plan decides it from the data."
    )
    val_size: float = Field(0.0, ge=0, description="Fraction (<1) or number (>=1) of rows held out.")
    val_path: str | None = None
    on_bad_row: Literal["error", "skip"] = "error"
    chat_template: str | None = Field(None, description="Jinja chat template overriding the tokenizer's.")
    system_prompt: str | None = None
    thinking: Literal["auto", "on", "off"] = Field(
        "auto",
        description=("A thinking chat template's form (one that takes enable_thinking: Qwen3, Qwen3.5): auto renders "
                     "a row with reasoning (reasoning_content, or <think>...</think>) in its thinking form and a row "
                     "without in its non-thinking form (enable_thinking=False); on or off: every row in that form "
                     "(off drops the reasoning). No effect on other templates."),
    )
    max_examples: int | None = Field(None, gt=0)
    num_proc: int | None = Field(None, gt=0, description="Worker processes for tokenization (default: up to 8 from 20k rows).")
    cache: bool = Field(True, description="Keep tokenized data on disk for the next run with the same files, tokenizer and settings.")
    max_pixels: int | None = Field(
        None, gt=0,
        description=("Pictures (an image-text-to-text model whose processor sizes them by pixel count: Qwen2-VL, "
                     "Qwen2.5-VL, Qwen3-VL): the most pixels a picture keeps; larger ones are scaled down. finetuner "
                     "plan chooses the largest that fits the card."),
    )
    replay: Annotated[float, Field(ge=0, le=1)] | Auto = Field(
        0.0,
        description=(
            "A guard against forgetting (SFT on one process): this share of the training rows again as the base "
            "model's own answers to general prompts (data/replay_prompts.jsonl), generated before training, cached, "
            "never with data.system_prompt; 0.25 adds one for every four rows. auto: as finetuner plan sets it (0.25 "
            "for a small file whose rows carry a system prompt, else 0)."
        ),
    )

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
        from finetuner.data.formats import check_columns

        check_columns(v, info.data.get("format", "auto"))
        return v


class TrainingSection(_Section):
    """Optimisation settings."""

    epochs: float = Field(1.0, gt=0, le=MAX_WHOLE)  # more cannot be counted in steps (1e308 overflowed)
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
    tiled_mlp: bool | Auto = Field(
        "auto",
        description=(
            "Run each layer's MLP over 2048-token chunks, each recomputed in backward, so only one chunk's MLP "
            "tensors exist at a time (one more MLP forward per step). auto: on with gradient checkpointing from "
            "max_seq_len 16384, where the MLP's tensors are most of a recomputed layer's backward."
        ),
    )
    seed: int = Field(42, ge=0, le=MAX_SEED, description="Seeds the data order, the LoRA initialisation and dropout.")
    eval_every: int | None = Field(None, gt=0, description="Evaluate every N steps (and at the end).")
    keep_best: bool = Field(
        True,
        description=(
            "SFT with LoRA or QLoRA on one process or DDP: the run's adapter is the one of the evaluation with the "
            "lowest held-out loss; when the last is not it, the last is kept beside it as adapter-last/ (a resumed run: "
            "the lowest since it resumed)."
        ),
    )
    early_stopping_patience: int | None = Field(
        None, gt=0,
        description="Stop after this many evaluations in a row without a lower held-out loss (needs eval_every and held-out data).",
    )
    general_probe: int | None = Field(
        None, ge=0,
        description=(
            "At the end of a LoRA or QLoRA run on one process, the base and the fine-tune answer this many questions "
            "of data/general_probe.jsonl (facts, arithmetic, instructions; scored without a judge): 'kept N of M' in "
            "the summary and metrics.json. 0: none. Default: 40 on a GPU, 16 on the CPU (the FINETUNER_GENERAL_PROBE "
            "environment variable sets another default)."
        ),
    )

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


class PreferenceSection(_Section):
    """Settings of the preference objectives (``objective: dpo | orpo | simpo | kto``).

    Each key applies to the objectives its description names; setting one the recipe's objective
    does not use is an error (it would silently do nothing).
    """

    #: the objectives each key applies to (the check in :meth:`Recipe._combinations`)
    APPLIES_TO: ClassVar[dict[str, tuple[str, ...]]] = {
        "beta": ("dpo", "simpo", "kto"),
        "loss_type": ("dpo",),
        "label_smoothing": ("dpo",),
        "gamma": ("simpo",),
        "orpo_weight": ("orpo",),
        "desirable_weight": ("kto",),
        "undesirable_weight": ("kto",),
        "reference": REFERENCE_OBJECTIVES,
        "start_from": ("dpo", "orpo", "simpo", "kto"),
    }
    #: ``beta`` when the recipe leaves it out
    DEFAULT_BETA: ClassVar[dict[str, float]] = {"dpo": 0.1, "kto": 0.1, "simpo": 2.0}

    beta: float | None = Field(
        None, gt=0, description="dpo, kto: strength of the pull towards the reference (default 0.1); simpo: reward scale (default 2.0)."
    )
    loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid", description="dpo: sigmoid (the DPO paper) or ipo (squared loss, IPO paper).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo sigmoid: assumed fraction of pairs whose labels are flipped (cDPO).")
    gamma: float = Field(1.0, ge=0, description="simpo: target reward margin.")
    orpo_weight: float = Field(0.1, gt=0, description="orpo: weight (lambda) of the odds-ratio term added to the SFT loss of the chosen response.")
    desirable_weight: float = Field(1.0, gt=0, description="kto: weight of desirable (label true) examples.")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: weight of undesirable (label false) examples.")
    reference: Literal["adapter_off", "precomputed"] = Field(
        "adapter_off",
        description=(
            "dpo, kto: the reference model. adapter_off: the same base with the adapter switched off, each step; "
            "precomputed: the model as training starts, scored once before the first step (required with start_from "
            "and method full)."
        ),
    )
    start_from: str | None = Field(
        None, description="A finished SFT run folder: its adapter is where training starts, and the reference is that SFT model."
    )

    def beta_for(self, objective: str) -> float:
        """``beta``, or the objective's default."""
        return self.beta if self.beta is not None else self.DEFAULT_BETA.get(objective, 0.1)


class RewardSection(_Section):
    """One reward function of ``objective: grpo``: a function of a Python file with TRL's signature
    ``fn(prompts, completions, **columns) -> list[float]``, or a built-in
    (:mod:`finetuner.rewards`) with its keyword arguments."""

    function: str = Field(description="The function's name in file, or the name of a built-in reward when file is not set.")
    file: str | None = Field(None, description="A Python file defining function (relative to the recipe).")
    weight: float = Field(1.0, description="The reward's weight in the sum the advantages are computed from.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of a built-in reward (e.g. column, pattern, max_words).")

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, raw: Any) -> Any:
        """``- exact_match`` (a name alone) is a built-in with no arguments."""
        return {"function": raw} if isinstance(raw, str) else raw

    @model_validator(mode="after")
    def _args_for_builtins(self) -> RewardSection:
        if self.file is not None and self.args:
            raise ValueError(f"args: set for '{self.function}' from {self.file}; args are the keyword arguments of a "
                             "built-in reward: remove them (a function of your file takes the data's columns)")
        return self


class GRPOSection(_Section):
    """Settings of ``objective: grpo``: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath)
    with Dr. GRPO's and DAPO's variants (:mod:`finetuner.losses.grpo` writes out the formulas).

    Each step takes the prompts of ``training.micro_batch_size × gradient_accumulation`` examples of
    the data (the prompt side of any supported format, or a file of prompts), generates
    ``num_generations`` completions of each with the adapter in the loop, scores them with the reward
    functions, and trains on the completions with their group-relative advantages. TRL's
    ``GRPOConfig`` names are accepted where they mean the same (:attr:`TRL_NAMES`).
    """

    #: TRL ``GRPOConfig`` names → this section's key (the same meaning)
    TRL_NAMES: ClassVar[dict[str, str]] = {"max_completion_length": "max_new_tokens", "reward_funcs": "rewards",
                                           "num_completions_to_print": "logged_completions"}

    num_generations: int = Field(4, ge=2, description="Completions generated per prompt (the group whose rewards are compared).")
    max_new_tokens: int = Field(64, ge=1, description="The longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the completions.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p.")
    rewards: list[RewardSection] = Field(default_factory=list, description="The reward functions, summed with their weights.")
    beta: float = Field(0.0, ge=0, description="Weight of the KL divergence to the reference (the base with the adapter off); 0: no reference pass.")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clipping of the importance ratio to [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = Field(None, gt=0, description="DAPO's upper clip bound (default: epsilon).")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="grpo: mean per sequence (DeepSeekMath); dr_grpo: sum over tokens / (sequences x max_new_tokens) "
        "(Dr. GRPO); dapo: mean over all tokens (DAPO).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide the advantages by the group's reward std (group), the batch's (batch), or not (none, Dr. GRPO).")
    num_iterations: int = Field(1, ge=1, description="Optimizer steps on each rollout (mu): the prompts of one step are generated once and trained on this many times.")
    use_bias_correction_kl: bool = Field(False, description="Weight each token's KL term by its importance ratio (DeepSeek-V3.2's unbiased reverse-KL gradient; TRL's default is true); false: DeepSeekMath's beta x KL. Matters only with beta > 0.")
    logged_completions: int = Field(2, ge=0, description="Completions (with their rewards) written to the events at each logging step.")
    reward_timeout_s: float = Field(600.0, gt=0, description="The longest one call of a reward function may take, in seconds; "
                                    "past it the run stops with a message naming the function, after a checkpoint of its last step.")
    use_vllm: bool = Field(False, description="Generate the completions with vLLM (pip install 'finetuner[vllm]', a CUDA GPU), "
                           "colocated in the training process, the adapter as it is at each rollout; false: transformers' generate.")
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, lt=1, description="With use_vllm: the share of the GPU's memory vLLM reserves for its copy of the weights "
        "and its KV cache, for the whole run, on top of the training's (TRL's name and default).")

    #: TRL's ``vllm_mode`` values: only ``colocate`` is finetuner's (the key is accepted, and not kept)
    VLLM_MODES: ClassVar[tuple[str, ...]] = ("colocate",)

    @model_validator(mode="before")
    @classmethod
    def _trl_names(cls, raw: Any) -> Any:
        """TRL's names for the same settings; ``scale_rewards`` true/false as TRL takes it; TRL's
        ``vllm_mode: colocate`` (the only mode finetuner runs vLLM in), ``server`` refused."""
        if not isinstance(raw, dict):
            return raw
        out = dict(raw)
        if "vllm_mode" in out:
            mode = out.pop("vllm_mode")
            if mode == "server":
                raise ValueError("vllm_mode: server is not supported: finetuner runs vLLM in its own process, colocated with "
                                 "the training (vllm_mode: colocate): remove vllm_mode, or set it to colocate")
            if mode not in cls.VLLM_MODES:
                raise ValueError(f"vllm_mode: '{mode}' is not a mode; finetuner runs vLLM colocated (vllm_mode: colocate)")
        for theirs, ours in cls.TRL_NAMES.items():
            if theirs in out:
                if ours in out:
                    raise ValueError(f"{theirs} and {ours} are the same setting (TRL's name and finetuner's): give one")
                out[ours] = out.pop(theirs)
        if isinstance(out.get("scale_rewards"), bool):
            out["scale_rewards"] = "group" if out["scale_rewards"] else "none"
        return out

    @model_validator(mode="after")
    def _bounds(self) -> GRPOSection:
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(f"epsilon_high: {self.epsilon_high} is below epsilon {self.epsilon}; DAPO's upper bound is the "
                             "larger one: raise it, or remove it")
        return self


Strategy = Literal["ddp", "fsdp", "zero1", "zero2", "zero3"]
Offload = Literal["none", "optimizer", "optimizer+params"]


class DistributedSection(_Section):
    """Several processes (GPUs, or CPU processes on gloo) training one model: :mod:`finetuner.training.launch`.

    The effective batch stays ``micro_batch_size x gradient_accumulation`` whatever the number of
    processes: each optimizer step's micro-batches are split across them, so N processes follow
    the loss curve of one.
    """

    strategy: Strategy = Field(
        "ddp",
        description="ddp (replicated), zero1/zero2/zero3 (DeepSpeed ZeRO stages), fsdp (torch FSDP2: parameters, gradients "
        "and optimizer states sharded per decoder layer; with LoRA, QLoRA or full fine-tuning).",
    )
    num_processes: int = Field(1, ge=1, description="Processes per node (one per GPU); `finetuner run --gpus N` sets it.")
    offload: Offload = Field(
        "none", description="ZeRO-Offload: optimizer states (zero1-3) or also parameters (zero3) in CPU memory."
    )
    fsdp_offload: bool = Field(
        False,
        description="fsdp only: keep the parameter shards, their gradients and the optimizer states in CPU memory "
        "(less GPU memory, slower steps; the optimizer steps on the CPU).",
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
    objective: Objective = Field("sft", description="sft (supervised), a preference objective on pairs (dpo, orpo, simpo) or rated "
                                 "responses (kto), or grpo (reinforcement learning from reward functions on prompts).")
    preference: PreferenceSection = Field(default_factory=PreferenceSection)
    grpo: GRPOSection | None = Field(None, description="Settings of objective grpo (its reward functions, group size, generation).")
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
        _check_grpo(self)
        if self.data.replay not in (0, "auto") and (self.objective != "sft" or self.distributed.world_size > 1):
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
        ``data.val_path`` on the same command, drops the recipe's held-out file (:func:`drop_stale_val_path`)."""
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
        return recipe if dropped is None else recipe.held_out_from_data(dropped, source)

    def held_out_from_data(self, dropped: str, source: str = "recipe") -> Recipe:
        """This recipe, whose ``data.val_path`` ``dropped`` was dropped (:func:`drop_stale_val_path`), holding out
        rows of its own data instead: its ``data.val_size`` when it names one, else the size a plan takes for
        that many rows (:func:`finetuner.data.split.held_out_size`; a hub data set, not counted here, holds out
        nothing). Said in one warning line before anything runs, with the way to keep the file."""
        from finetuner.data.formats import read_rows
        from finetuner.data.split import held_out_rows, held_out_size

        d = self.data
        paths = d.path if isinstance(d.path, list) else [d.path]
        rows = None
        if d.val_size == 0 and all(Path(p).is_file() for p in paths):
            rows = sum(sum(1 for _ in read_rows(p, d.split, [])) for p in paths)
            d = d.model_copy(update={"val_size": held_out_size(rows)})
        new = ", ".join(paths)
        if d.val_size > 0:
            part = f"{held_out_rows(d.val_size, rows)} of its {rows} rows" if rows is not None else "part of it"
            held = f"holds out {part} (data.val_size: {d.val_size:g}) instead"
        else:
            held = ("holds nothing out" + (f" ({rows} rows: too few to spare)" if rows is not None else "")
                    + ": no held-out loss, no best adapter by it")
        log.warning("%s: data.path is now %s, but data.val_path %s holds out rows of the data the recipe was written for: "
                    "dropped; the run %s. To evaluate on that file anyway, add --set data.val_path=%s",
                    source, new, dropped, held, dropped)
        return self.model_copy(update={"data": d})

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
        if out.get("grpo") is None:  # only a GRPO recipe has the section: other recipes read as before
            out.pop("grpo", None)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)

    def save(self, path: str | Path) -> None:
        """Write the resolved recipe atomically."""
        from finetuner.fileio import atomic_write_text

        atomic_write_text(Path(path), self.to_yaml())

    def output_path(self) -> Path:
        return Path(self.output_dir).expanduser().resolve() if self.output_dir else (Path.cwd() / "runs" / self.name).resolve()


# ---------------------------------------------------------------------- YAML in and out
#: The order of a recipe's keys in the YAML finetuner writes for people to read (``finetuner plan
#: -o``, the web UI's editor): every top-level field of :class:`Recipe`, each once.
KEY_ORDER = ("name", "model", "method", "objective", "preference", "grpo", "quantization", "lora", "data", "training", "distributed",
             "checkpointing", "logging", "samples", "output_dir", "device")


#: The most nodes (mappings, lists, scalars) a recipe's YAML may stand for once its aliases are
#: expanded. A recipe has a few hundred; an alias bomb ("billion laughs") stands for billions in a
#: few hundred bytes, and every consumer of the parsed value (validation, its error messages, the
#: run folder's copy) walks it expanded.
MAX_YAML_NODES = 10_000
#: The longest a value may be where an error message shows it (the rest is cut, with "…").
MAX_SHOWN_CHARS = 120
#: The longest one line of a validation error may be, and the most lines it has.
MAX_ERROR_LINE = 400
MAX_ERROR_LINES = 40


class _RecipeYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no Python objects) that builds a document only after checking its node
    graph: :func:`_check_nodes`."""


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Refuse a document that stands for more than :data:`MAX_YAML_NODES` nodes once its aliases are
    expanded, or that gives one key twice in a mapping (YAML keeps the last silently)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:  # an alias: the same node object again, counted again in full
            return sizes[id(node)]
        sizes[id(node)] = MAX_YAML_NODES + 1  # a node that contains itself (a recursive alias) is too big
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], yaml.Node] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    first = seen.setdefault((key.tag, key.value), key)
                    if first is not key:
                        raise UserError(
                            f"{source}: line {key.start_mark.line + 1}: the key '{shown(key.value, quote=False)}' is given twice "
                            f"in one section (first on line {first.start_mark.line + 1}); YAML would keep only the last.",
                            hint="Keep one of them.",
                        )
                total += size(key) + size(value)
                if total > MAX_YAML_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > MAX_YAML_NODES:
                    break
        sizes[id(node)] = total
        return total

    if size(root) > MAX_YAML_NODES:
        raise UserError(
            f"{source}: the YAML stands for more than {MAX_YAML_NODES:,} values once its aliases (*name) are expanded; "
            "a recipe has a few hundred.",
            hint="Write the values out instead of repeating anchors (&name) many times over.",
        )


def load_yaml(text: str, source: str) -> Any:
    """The value of one YAML document read safely (no Python objects), with aliases bounded and
    duplicate keys refused (:func:`_check_nodes`): every YAML finetuner reads from the user (a
    recipe file, the UI's editor, a run folder's ``recipe.yaml``, a ``--set`` value) goes
    through here. A :class:`UserError` naming ``source`` (and the line and column) when it is not
    valid YAML."""
    loader = None
    try:
        loader = _RecipeYamlLoader(text)  # its reader already refuses unprintable characters
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, source)
        return loader.construct_document(node)
    except RecursionError:
        raise UserError(f"{source}: invalid YAML: lists or mappings nested too deeply.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{source}:{where} invalid YAML: {shown(problem, quote=False)}.") from None
    finally:
        if loader is not None:
            loader.dispose()


def shown(value: Any, quote: bool = True) -> str:
    """``value`` as an error message shows it (``repr``, or ``str`` with ``quote=False``), cut to
    :data:`MAX_SHOWN_CHARS`: a message never echoes a whole hostile input back."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 1] + "…"


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The mapping in a recipe's YAML text (:func:`load_yaml`); a :class:`UserError` naming ``source``
    (and the line and column) when it is not valid YAML, is empty, or is not a mapping of sections."""
    raw = load_yaml(text, source)
    if raw is None:
        raise UserError(f"{source}: the recipe is empty.", hint="See recipes/demo_cpu.yaml for an example.")
    if not isinstance(raw, dict):
        raise UserError(f"{source}: a recipe must be a mapping of sections (model:, data:, ...).")
    return raw


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
        also = "; with fsdp, set distributed.fsdp_offload: true instead" if d.strategy == "fsdp" else ""
        raise ValueError(
            f"distributed.offload: '{d.offload}' needs a DeepSpeed strategy: set distributed.strategy to zero2 "
            f"(optimizer states in CPU memory) or zero3{also}"
        )
    if d.offload == "optimizer+params" and d.strategy != "zero3":
        raise ValueError(
            f"distributed.offload: parameter offload needs strategy zero3 (got {d.strategy}): ZeRO stages 1-2 keep the "
            "parameters on every GPU; use offload 'optimizer' or strategy zero3"
        )
    if (d.deepspeed or d.strategy == "fsdp") and r.training.optimizer not in ("adamw_torch", "sgd", "auto"):
        engine = "DeepSpeed ZeRO" if d.deepspeed else "fsdp (measured: bitsandbytes' and Adafactor's updates fail on its sharded parameters)"
        raise ValueError(
            f"training.optimizer: '{r.training.optimizer}' cannot be sharded by {engine} (bitsandbytes and "
            "factored optimizers keep their own state layout): use adamw_torch, or strategy ddp"
        )
    if d.offload != "none" and r.training.optimizer == "sgd":
        raise ValueError("training.optimizer: ZeRO-Offload runs an Adam optimizer on the CPU: use adamw_torch")
    if d.fsdp_offload and d.strategy != "fsdp":
        raise ValueError(
            f"distributed.fsdp_offload: applies to strategy fsdp (got {d.strategy}): set strategy fsdp, or use "
            "distributed.offload with a ZeRO strategy"
        )
    if r.method == "qlora" and d.strategy == "fsdp" and r.quantization is not None and r.quantization.bits == 8:
        raise ValueError(
            "quantization.bits: 8-bit bitsandbytes weights cannot be sharded by fsdp (their scales live on the parameter "
            "object, which FSDP replaces with its shard): use bits 4 with fsdp, or strategy ddp or zero2 for 8-bit QLoRA"
        )
    if r.method == "qlora" and d.strategy == "zero3":
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
    given = [k for k, f in PreferenceSection.model_fields.items() if getattr(p, k) != f.default]
    if obj not in PREFERENCE_OBJECTIVES:
        if given:
            raise ValueError(
                f"preference.{given[0]}: set, but objective is '{obj}': set objective to dpo, orpo, simpo or kto, "
                "or remove the preference section"
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


def _check_grpo(r: Recipe) -> None:
    """Combinations of ``objective: grpo`` and its ``grpo`` section with the rest of the recipe that cannot run."""
    g = r.grpo
    if r.objective != "grpo":
        if g is not None:
            raise ValueError(f"grpo: set, but objective is '{r.objective}': set objective to grpo, or remove the grpo section")
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
    :func:`finetuner.training.rollout_vllm.check_vllm`). vLLM samples from the base it loads itself
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


def drop_stale_val_path(given: dict[str, Any], raw: dict[str, Any], overrides: list[str]) -> str | None:
    """Drop from ``raw`` (``given`` with ``overrides`` applied) a held-out file that belongs to other data: when
    an override changed ``data.path`` and none named ``data.val_path`` (or the whole ``data`` section), the
    recipe's ``val_path`` holds out rows of the data it was written for, and a run on the new data would pick its
    best adapter by how well it fits the old data. Returns the dropped path, or None when nothing was dropped."""
    named = {".".join(k for k in item.partition("=")[0].strip().split(".") if k) for item in overrides}
    old, new = given.get("data"), raw.get("data")
    if not (isinstance(old, dict) and isinstance(new, dict)) or named & {"data", "data.val_path"}:
        return None
    if "data.path" not in named or new.get("path") == old.get("path") or not new.get("val_path"):
        return None
    return str(new.pop("val_path"))


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``key.path=value`` override to a raw recipe dict; the value is parsed as YAML."""
    if "=" not in item:
        raise UserError(f"--set {item!r}: expected key.path=value, e.g. training.lr=1e-4.")
    key, _, value_text = item.partition("=")
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise UserError(f"--set {item!r}: the key is empty.")
    try:
        value = load_yaml(value_text, f"--set {key.strip()}") if value_text.strip() else None
    except UserError as e:
        if "invalid YAML" not in str(e):
            raise
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


# ---------------------------------------------------------------------- error messages
#: Names other fine-tuning tools (transformers' TrainingArguments, peft, LLaMA-Factory, Axolotl)
#: use for a recipe key, and the key finetuner uses for it.
SYNONYMS: dict[str, str] = {
    **dict.fromkeys(["learning_rate", "learningrate"], "training.lr"),
    **dict.fromkeys(["batch_size", "per_device_train_batch_size", "train_batch_size", "micro_batch",
                     "micro_batch_per_gpu", "train_micro_batch_size_per_gpu"], "training.micro_batch_size"),
    **dict.fromkeys(["gradient_accumulation_steps", "grad_accum", "accumulation_steps", "grad_accumulation"],
                    "training.gradient_accumulation"),
    **dict.fromkeys(["global_batch_size", "total_batch_size", "effective_batch_size"], "training.effective_batch"),
    **dict.fromkeys(["num_train_epochs", "num_epochs", "epoch", "n_epochs"], "training.epochs"),
    **dict.fromkeys(["steps", "num_steps", "train_steps", "max_iters", "total_steps"], "training.max_steps"),
    **dict.fromkeys(["lr_scheduler_type", "lr_scheduler", "scheduler_type"], "training.scheduler"),
    **dict.fromkeys(["warmup", "num_warmup_steps"], "training.warmup_steps"),
    **dict.fromkeys(["optim", "optimizer_type"], "training.optimizer"),
    **dict.fromkeys(["grad_clip", "gradient_clipping", "clip_grad_norm"], "training.max_grad_norm"),
    **dict.fromkeys(["activation_checkpointing"], "training.gradient_checkpointing"),
    **dict.fromkeys(["bf16", "fp16", "mixed_precision"], "training.precision"),
    **dict.fromkeys(["torch_compile"], "training.compile"),
    **dict.fromkeys(["eval_steps", "evaluation_steps"], "training.eval_every"),
    **dict.fromkeys(["save_steps"], "checkpointing.save_every"),
    **dict.fromkeys(["save_total_limit"], "checkpointing.keep_last"),
    **dict.fromkeys(["logging_steps"], "logging.every"),
    **dict.fromkeys(["rank", "lora_r", "lora_rank"], "lora.r"),
    **dict.fromkeys(["lora_alpha"], "lora.alpha"),
    **dict.fromkeys(["lora_dropout"], "lora.dropout"),
    **dict.fromkeys(["lora_target", "lora_target_modules", "target", "targets", "modules"], "lora.target_modules"),
    **dict.fromkeys(["cutoff_len", "max_length", "sequence_len", "seq_len", "max_seq_length", "max_len",
                     "block_size", "context_length", "sequence_length"], "data.max_seq_len"),
    **dict.fromkeys(["dataset", "datasets", "data_path", "train_file", "dataset_path", "file"], "data.path"),
    **dict.fromkeys(["val_set_size", "validation_split", "val_split", "eval_split", "test_size"], "data.val_size"),
    **dict.fromkeys(["eval_dataset", "val_file", "validation_file", "eval_file"], "data.val_path"),
    **dict.fromkeys(["template", "prompt_template"], "data.chat_template"),
    **dict.fromkeys(["sample_packing", "pack", "packed"], "data.packing"),
    **dict.fromkeys(["max_samples", "num_samples"], "data.max_examples"),
    **dict.fromkeys(["system", "system_message"], "data.system_prompt"),
    **dict.fromkeys(["preprocessing_num_workers", "dataset_num_proc", "num_workers"], "data.num_proc"),
    **dict.fromkeys(["model_name_or_path", "base_model", "model_name", "model_id", "model_path"], "model.name"),
    **dict.fromkeys(["torch_dtype"], "model.dtype"),
    **dict.fromkeys(["flash_attention", "flash_attn"], "model.attn_implementation"),
    **dict.fromkeys(["load_in_4bit", "load_in_8bit", "quantization_bit"], "quantization.bits"),
    **dict.fromkeys(["bnb_4bit_quant_type"], "quantization.quant_type"),
    **dict.fromkeys(["bnb_4bit_use_double_quant"], "quantization.double_quant"),
    **dict.fromkeys(["bnb_4bit_compute_dtype"], "quantization.compute_dtype"),
    **dict.fromkeys(["finetuning_type", "finetune_type", "adapter"], "method"),
    **dict.fromkeys(["output", "output_path", "save_dir"], "output_dir"),
    **dict.fromkeys(["run_name"], "name"),
    **dict.fromkeys(["rl", "rl_type", "pref_loss", "training_objective", "stage"], "objective"),
    **dict.fromkeys(["pref_beta", "rl_beta", "dpo_beta"], "preference.beta"),
    **dict.fromkeys(["dpo_loss", "dpo_loss_type"], "preference.loss_type"),
    **dict.fromkeys(["dpo_label_smoothing", "cdpo_label_smoothing"], "preference.label_smoothing"),
    **dict.fromkeys(["simpo_gamma"], "preference.gamma"),
    **dict.fromkeys(["orpo_alpha", "orpo_lambda", "orpo_beta"], "preference.orpo_weight"),
    **dict.fromkeys(["kto_chosen_weight", "kto_desirable_weight"], "preference.desirable_weight"),
    **dict.fromkeys(["kto_rejected_weight", "kto_undesirable_weight"], "preference.undesirable_weight"),
    **dict.fromkeys(["ref_model", "reference_model", "precompute_ref_log_probs"], "preference.reference"),
    **dict.fromkeys(["sft_run", "init_from", "adapter_name_or_path"], "preference.start_from"),
    **dict.fromkeys(["group_size", "n_samples_per_prompt"], "grpo.num_generations"),
    **dict.fromkeys(["max_completion_length", "generate_max_length", "response_length"], "grpo.max_new_tokens"),
    **dict.fromkeys(["reward_funcs", "reward_functions", "reward_fn", "reward_model"], "grpo.rewards"),
    **dict.fromkeys(["cliprange", "clip_range", "clip_eps"], "grpo.epsilon"),
    **dict.fromkeys(["clip_ratio_high"], "grpo.epsilon_high"),
    **dict.fromkeys(["ppo_epochs", "mu"], "grpo.num_iterations"),
    **dict.fromkeys(["kl_coef", "init_kl_coef", "kl_beta"], "grpo.beta"),
}


def _union_members(tp: Any) -> tuple[Any, ...] | None:
    """The members of a union type (``X | Y``, ``Optional[X]``), else None."""
    import types
    import typing

    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _unwrap_optional(tp: Any) -> Any:
    members = _union_members(tp)
    if members is not None:
        rest = [m for m in members if m is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


_TAGS = ("function-", "json-", "lax-", "literal[", "constrained-", "nullable[", "default[")


def _error_key(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any, list[Any]]:
    """The recipe key an error location names, the type expected there and its constraints.

    pydantic puts the union member it tried into the location (``('method', "literal['auto']")``,
    ``('training', 'micro_batch_size', 'constrained-int')``): those tags are left out, and an
    error inside any member of a union is about the whole union (its key is the field's).
    The type is None where it is not known.
    """
    import typing

    node: Any = Recipe
    metadata: list[Any] = []
    key: list[Any] = []
    for part in loc:
        node = _unwrap_optional(node)
        if _union_members(node) is not None:  # the rest of the location is inside one member
            break
        if isinstance(part, str) and part.startswith(_TAGS):
            continue
        key.append(part)
        if isinstance(node, type) and issubclass(node, BaseModel):
            field = node.model_fields.get(part) if isinstance(part, str) else None
            node, metadata = (field.annotation, list(field.metadata)) if field else (None, [])
        elif typing.get_origin(node) in (list, dict):
            node, metadata = typing.get_args(node)[-1], []
        else:
            node, metadata = None, []
    return tuple(key), _unwrap_optional(node), metadata


def _bounds(metadata: list[Any], whole: bool) -> str:
    """`` ≥ 1``, `` ≥ 0 and < 1``, `` from 1 to 1024``: a number's constraints in words."""
    lo = hi = None
    for m in metadata:
        for c in getattr(m, "metadata", None) or [m]:  # a Field(...) inside Annotated holds its own
            if getattr(c, "gt", None) is not None:
                lo = ("≥", c.gt + 1) if whole else (">", c.gt)
            elif getattr(c, "ge", None) is not None:
                lo = ("≥", c.ge)
            if getattr(c, "lt", None) is not None:
                hi = ("≤", c.lt - 1) if whole else ("<", c.lt)
            elif getattr(c, "le", None) is not None:
                hi = ("≤", c.le)
    if whole and lo and hi:
        return f" from {lo[1]} to {hi[1]}"
    parts = [f"{op} {v}" for op, v in (b for b in (lo, hi) if b)]
    return " " + " and ".join(parts) if parts else ""


def _expected(tp: Any, metadata: list[Any] | None = None) -> tuple[list[str], list[Any]]:
    """What a type accepts, in words: (descriptions of its kinds of value, its literal choices)."""
    import typing

    metadata = list(metadata or [])
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return _expected(base, metadata + extra)
    members = _union_members(tp)
    if members is not None:
        words: list[str] = []
        choices: list[Any] = []
        for m in members:
            if m is type(None):
                continue
            w, c = _expected(m, metadata)
            words += [x for x in w if x not in words]
            choices += [x for x in c if x not in choices]
        return words, choices
    if origin is Literal:
        return [], list(typing.get_args(tp))
    if tp is bool:
        return ["true or false"], []
    if tp is int:
        return ["a whole number" + _bounds(metadata, whole=True)], []
    if tp is float:
        return ["a number" + _bounds(metadata, whole=False)], []
    if tp is str:
        return ["text"], []
    if origin is list:
        return ["a list of texts" if typing.get_args(tp)[0] is str else "a list"], []
    if origin is dict:
        return ["a mapping of keys to values"], []
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [f"a section of keys ({', '.join(list(tp.model_fields)[:3])}, ...)"], []
    return [], []


def _value_message(errs: list[dict[str, Any]], tp: Any, metadata: list[Any]) -> str:
    """One message for every error pydantic reported about one key's value."""
    got = errs[0].get("input")
    custom = [e for e in errs if e["type"] in ("value_error", "assertion_error")]
    if custom:  # a validator of ours said what is wrong
        return custom[0]["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ") + "."
    words, choices = _expected(tp, metadata) if tp is not None else ([], [])
    if not words and not choices:
        ctx_choices = [c for e in errs if e["type"] == "literal_error"
                       for c in re.findall(r"'([^']*)'", e.get("ctx", {}).get("expected", ""))]
        if ctx_choices:
            choices = list(dict.fromkeys(ctx_choices))
        else:
            echo = "" if isinstance(got, dict) else f" (got {shown(got)})"
            return errs[0]["msg"] + echo + "."
    if any(e["type"] == "finite_number" for e in errs):  # inf or nan given (pydantic: allow_inf_nan=False)
        words = [w.replace("a number", "a finite number", 1) for w in words]
    best = closest(got, [c for c in choices if isinstance(c, str)]) if isinstance(got, str) else None
    hint = f" Did you mean '{best}'?" if best else ""
    if not words:  # choices only
        return f"invalid value {shown(got)}.{hint} Valid choices: {', '.join(map(str, choices))}."
    expected = " or ".join(words) + (f" (or {' or '.join(map(str, choices))})" if choices else "")
    return f"must be {expected}; got {shown(got)}.{hint}"


def _unknown_key_message(loc: tuple[Any, ...]) -> str:
    """``unknown key.`` with the key finetuner uses for it (a synonym or a close spelling)."""
    section = ".".join(str(p) for p in loc[:-1])
    parent = _model_at(loc[:-1])
    fields = list(parent.model_fields) if parent else []
    name = str(loc[-1])
    # a name from another tool, or the right name in the wrong section (training.max_seq_len)
    target = SYNONYMS.get(name.strip().lower().replace("-", "_")) or next(
        (k for k in recipe_keys() if k.rsplit(".", 1)[-1] == name), None)
    if target is not None:
        where, _, leaf = target.rpartition(".")
        if where == section:
            return f"unknown key. Did you mean '{leaf}'? (finetuner's name for {name})"
        place = f"in the {where} section" if where else "at the top level of the recipe"
        return f"unknown key. Did you mean '{target}'? (finetuner's name for {name}; it goes {place})"
    return f"unknown key.{did_you_mean(name, fields)}" if fields else "unknown key."


def recipe_keys() -> list[str]:
    """Every key of a recipe that holds a value, dotted (``training.lr``, ``method``)."""
    out = []
    for name, field in Recipe.model_fields.items():
        section = _unwrap_optional(field.annotation)
        if isinstance(section, type) and issubclass(section, BaseModel):
            out += [f"{name}.{k}" for k in section.model_fields]
        else:
            out.append(name)
    return out


def accepted_values(key: str) -> tuple[list[str], list[Any]]:
    """What a dotted ``key`` accepts, as the error messages say it: the kinds of value in words
    (``a whole number ≥ 1``) and the named choices (``auto``)."""
    loc, tp, metadata = _error_key(tuple(key.split(".")))
    if ".".join(map(str, loc)) != key or tp is None:
        raise KeyError(key)
    return _expected(tp, metadata)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Recipe
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return model


def format_validation_error(e: ValidationError, source: str) -> str:
    """Turn pydantic's errors into lines that name the key, say what it must be and suggest a fix."""
    lines = [f"{source}: the recipe is not valid:"]
    by_key: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    types: dict[tuple[Any, ...], tuple[Any, list[Any]]] = {}
    for err in e.errors():
        loc, tp, metadata = _error_key(tuple(err["loc"]))
        by_key.setdefault(loc, []).append(err)
        types.setdefault(loc, (tp, metadata))
    for loc, errs in by_key.items():
        key = ".".join(str(p) if str(p).strip() else repr(str(p)) for p in loc)  # a blank key shown quoted: ''
        if not loc:  # a cross-field check: its message starts with the key it is about
            for err in errs:
                k, _, rest = err["msg"].removeprefix("Value error, ").partition(": ")
                lines.append(f"  - {k}: {rest}.")
            continue
        kinds = {err["type"] for err in errs}
        if "extra_forbidden" in kinds:
            msg = _unknown_key_message(loc)
        elif "missing" in kinds:
            msg = "required key is missing."
        else:
            msg = _value_message(errs, *types[loc])
        lines.append(f"  - {key}: {msg}")
    lines = [line if len(line) <= MAX_ERROR_LINE else line[: MAX_ERROR_LINE - 1] + "…" for line in dict.fromkeys(lines)]
    if len(lines) > MAX_ERROR_LINES:
        lines = lines[:MAX_ERROR_LINES] + [f"  ... and {len(lines) - MAX_ERROR_LINES} more."]
    return "\n".join(lines)

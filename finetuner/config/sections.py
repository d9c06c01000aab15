"""The sections of a recipe (:class:`~finetuner.config.recipe.Recipe`): one schema each (``model``, ``lora``,
``quantization``, ``data``, ``training``, ``checkpointing``, ``logging``, ``samples``, ``distributed``), the kinds of value
their keys take, and the bounds every number in a recipe keeps. An objective's own section (``preference``, ``grpo``,
``neftune``) is the schema its description holds (:attr:`~finetuner.objectives.specs.base.ObjectiveSpec.section_schema`).
Each field checks its own value; combinations across sections are checked by the recipe
(:mod:`finetuner.config.recipe`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from finetuner.config.columns import check_columns
from finetuner.model import gguf_base
from finetuner.schema import MAX_WHOLE, Section
from finetuner.objectives.specs import names_where
from finetuner.objectives.specs import names as objective_names
from finetuner.strategy_table import DEEPSPEED_ENGINE, DEFAULT as DEFAULT_STRATEGY, NAMES as STRATEGY_NAMES, StrategyRow, strategy_row

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
#: The names come from the objectives' descriptions (:mod:`finetuner.objectives.specs`).
Objective = Literal[objective_names()]  # type: ignore[valid-type]
#: The objectives that compare the model with a reference model (ORPO and SimPO need none).
REFERENCE_OBJECTIVES = names_where(reference_model=True)

DATA_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet")

#: one module name (``q_proj``, ``self_attn.q_proj``), and names separated by commas or spaces
_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
_NAMES = re.compile(r"\s*[A-Za-z0-9_.]+(\s*[,\s]\s*[A-Za-z0-9_.]+)*\s*,?\s*")


#: the seeds torch, numpy and ``random`` all accept (numpy's ``SeedSequence`` takes 0 to 2**32 - 1)
MAX_SEED = 2**32 - 1


class ModelSection(Section):
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


class LoraSection(Section):
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


class QuantizationSection(Section):
    """bitsandbytes quantization of the frozen base weights."""

    bits: Literal[4, 8] = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Dtype = "auto"


class DataSection(Section):
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
    reasoning: Literal["auto", "keep", "drop_history", "strip"] = Field(
        "auto",
        description=("Which assistant turns keep the reasoning the data wrote (reasoning_content, or <think>...</think>): "
                     "auto as the model's chat template does at inference (Qwen3-style: earlier turns' thinking "
                     "dropped), keep every turn's (refused where the template drops it), drop_history only the turns "
                     "after the last user message, strip none. A template-made empty <think></think> is never a label."),
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
        check_columns(v, info.data.get("format", "auto"))
        return v


class TrainingSection(Section):
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
    loss_chunk_size: Annotated[int, Field(ge=0)] | Auto = Field(
        "auto",
        description=(
            "Tokens per cross-entropy chunk (full logits are never held); 0 computes full logits. auto: from the "
            "vocabulary, the most tokens (a multiple of 64, 64 to 1024) whose chunk's backward stays within 512 MiB "
            "(finetuner.losses.chunk); the planner writes the number it predicted with."
        ),
    )
    precision: Dtype = Field("auto", description="Autocast dtype for compute.")
    kernels: Literal["auto", "liger", "none"] = Field(
        "auto", description="Fused Liger kernels (CUDA, finetuner[speed]); auto uses them when installed on a CUDA GPU."
    )
    compile: bool = Field(False, description="torch.compile each decoder layer (slower start, faster steps).")
    threads: PositiveInt | Auto = Field(
        "auto",
        description=(
            "torch's CPU threads for the steps and the answers the run generates. auto: the cores other processes "
            "leave free now, at least 1 (finetuner.threads; OMP_NUM_THREADS, when set, decides instead); on busy "
            "cores one thread is many times faster than two."
        ),
    )
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


class CheckpointSection(Section):
    save_every: int | None = Field(100, gt=0, description="Save a resumable checkpoint every N steps.")
    keep_last: int = Field(2, ge=1, description="Keep only the last K checkpoints.")


#: The trackers a run can report to (:mod:`finetuner.tracking`); each but TensorBoard is an optional extra
#: (``pip install 'finetuner[mlflow]'``, ``'finetuner[wandb]'``, ``'finetuner[trackio]'``).
Tracker = Literal["tensorboard", "mlflow", "wandb", "trackio"]
TRACKERS: tuple[str, ...] = get_args(Tracker)


class LoggingSection(Section):
    every: int = Field(1, gt=0, description="Write a step event every N optimizer steps.")
    report_to: list[Tracker] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Where the run reports its parameters, metrics and artifacts: any of tensorboard, mlflow, "
                    "wandb, trackio ([] for none). MLflow follows MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME; W&B WANDB_MODE, "
                    "WANDB_PROJECT and WANDB_DIR (else the run folder's wandb/); Trackio TRACKIO_DIR.")
    tensorboard: bool | None = Field(
        None, description="The older switch for TensorBoard, kept working: true adds it to report_to, false takes it out.")

    @property
    def trackers(self) -> list[str]:
        """``report_to`` with the ``tensorboard`` switch applied, each tracker once, in the order given."""
        chosen = list(dict.fromkeys(self.report_to))
        if self.tensorboard is True and "tensorboard" not in chosen:
            chosen.append("tensorboard")
        if self.tensorboard is False:
            chosen = [t for t in chosen if t != "tensorboard"]
        return chosen


class SamplesSection(Section):
    """Generations shown after training: base model vs fine-tuned, same prompt, asked as ``finetuner chat`` asks (the
    run's system prompt, a tool-calling run's tools, its thinking form) by the adapter the run ships."""

    prompts: list[str] = Field(default_factory=list)
    max_new_tokens: PositiveInt | Auto = Field(
        "auto", description="New tokens for each answer; auto: the training rows' longest answer (its reasoning "
        "included) and a quarter more, 64 to 1024 (finetuner.infer.generate.sample_new_tokens).")


Strategy = Literal[STRATEGY_NAMES]  # type: ignore[valid-type]  (the table of strategies, in its order)
Offload = Literal["none", "optimizer", "optimizer+params"]


class DistributedSection(Section):
    """Several processes (GPUs, or CPU processes on gloo) training one model: :mod:`finetuner.training.launch`.

    The effective batch stays ``micro_batch_size x gradient_accumulation`` whatever the number of
    processes: each optimizer step's micro-batches are split across them, so N processes follow
    the loss curve of one.
    """

    strategy: Strategy = Field(
        DEFAULT_STRATEGY,
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
    def row(self) -> StrategyRow:
        """The strategy's row of :mod:`finetuner.strategy_table`."""
        return strategy_row(self.strategy)

    @property
    def deepspeed(self) -> bool:
        return self.row.engine == DEEPSPEED_ENGINE


"""The schema of ``events.jsonl``: every event kind with its fields, and the states of a run.

Each kind is a ``TypedDict`` (use them to type a consumer: ``ev: StepEvent``); :data:`EVENT_TYPES`
maps the ``event`` name to it. :class:`finetuner.runs.events.EventWriter` checks every event it
writes with :func:`validate_event`. The ``start`` event carries :data:`SCHEMA_VERSION`.

A run's state (one of :data:`RUN_STATES`) is derived from its events and from whether a process
holds the run folder by :class:`RunStateTracker` / :func:`run_state`; the run status of the web UI
(:func:`finetuner.runs.jobs.run_status`), :attr:`finetuner.Run.status`, :func:`finetuner.follow`
and the multi-process launcher all take it from here. ``docs/events.md`` describes the stream
for people who build on it.

Every event has ``event`` (its kind) and ``time`` (Unix seconds). Counts are plain integers,
memory is in bytes, durations in seconds. A float that is not finite is written as ``null`` (NaN)
or the string ``"inf"`` / ``"-inf"``. Readers must ignore fields they do not know: fields may be
added without a new schema version; removing or renaming one, or changing its meaning, bumps it.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypedDict, Union

#: Written in every ``start`` event as ``schema_version``.
SCHEMA_VERSION = 1


# --------------------------------------------------------------------------- the kinds
class Event(TypedDict):
    """Fields of every event."""

    event: str  # the kind: a key of EVENT_TYPES
    time: float  # Unix seconds, when it was written


class _Memory(TypedDict):
    """Device memory now, in bytes: the CUDA caching allocator's counters, or on CPU the process RSS."""

    mem_allocated: int
    mem_reserved: int
    mem_peak: int


class PlanEvent(Event):
    """The planner filled the recipe's ``auto`` values (before ``start``; only when it ran)."""

    gpu: str
    choice: Union[dict[str, Any], None]
    reasons: list[str]
    predicted_total_bytes: int
    device_bytes: int


class ReplayEvent(Event):
    """``data.replay``: the base model's own answers mixed into the training rows, and where they came from (before
    ``start``; only when the recipe asks for them). ``reason``: ``cached`` (read from the cache file, its SHA-256
    checked, made with this base), ``new`` (none cached yet), ``model_changed`` (the file was made with other
    weights or another config, tokenizer, chat template or dtype: ``changed`` names them; answered again),
    ``damaged`` (the file failed its check: edited or cut short; answered again) or ``unpinned`` (no weight file
    found to fingerprint: answered, not cached); see finetuner.data.replay."""

    rows: int
    ratio: float
    from_cache: bool
    reason: str
    changed: list[str]
    message: str
    cache: Union[str, None]
    weights: Union[str, None]
    prompts_file: str


class CheckpointInvalidEvent(Event):
    """A checkpoint could not be read on resume; the one before it is tried (before ``start``)."""

    path: str
    reason: str


class _Objective(TypedDict, total=False):
    """The objective trained (absent in the events of runs from before it was written: sft)."""

    objective: str  # sft, dpo, orpo, simpo, kto or grpo


class _Rewards(TypedDict, total=False):
    """A preference objective's implicit rewards (finetuner.objectives.preference), means over the
    step's examples: of the chosen (KTO: desirable) and rejected (undesirable) responses, their
    difference, and the fraction of pairs whose chosen reward is the higher (KTO: of responses whose
    reward has the sign of their label). Absent for SFT."""

    reward_chosen: float
    reward_rejected: float
    reward_margin: float
    reward_accuracy: float


class _EvalRewards(TypedDict, total=False):
    """:class:`_Rewards` on the validation examples."""

    eval_reward_chosen: float
    eval_reward_rejected: float
    eval_reward_margin: float
    eval_reward_accuracy: float


class _GroupRewards(TypedDict, total=False):
    """GRPO's step (finetuner.objectives.grpo): the rollout's rewards, means over the step's completions:
    ``reward`` the weighted total, ``reward_std`` its within-group standard deviation averaged over the
    groups, ``rewards`` each function's ``{"mean", "std"}`` by name; the completions' mean length in
    tokens and the share cut at ``max_new_tokens``; the share of groups whose rewards were all equal
    (no signal); the loss's token-mean KL to the reference (``beta > 0`` only) and clip fractions;
    ``completions``, a few sampled completions ``{"prompt", "completion", "reward", "rewards"}``;
    ``decode_steps``, the tokens ``generate`` produced for the rollout summed over its calls (each call's
    longest completion); ``rollout_s``, the wall seconds this step spent on its rollout (generation,
    scoring, reference/old log-probabilities; 0 on the steps that reuse a batch's rollout with
    ``num_iterations > 1``). Absent for the other objectives."""

    reward: float
    reward_std: float
    rewards: dict[str, Any]
    completion_length: float
    completions_clipped: float
    zero_std_groups: float
    kl: float
    clip_ratio: float
    clip_ratio_low: float
    clip_ratio_high: float
    completions: list[dict[str, Any]]
    decode_steps: int
    rollout_s: float


class _EvalGroupRewards(TypedDict, total=False):
    """GRPO's evaluation: the mean total reward of completions of the held-out prompts (sampled with a
    fixed seed), each function's mean by name, and the completions' mean length (its ``eval_loss`` is
    null: GRPO has no validation loss)."""

    eval_reward: float
    eval_rewards: dict[str, Any]
    eval_completion_length: float


class _Tiling(TypedDict, total=False):
    """Tokens per MLP chunk with ``training.tiled_mlp`` (0: the MLP runs whole; absent in the events
    of runs from before it was written)."""

    tiled_mlp: int


class _LossChunk(TypedDict, total=False):
    """Tokens per cross-entropy chunk the loss ran with (``training.loss_chunk_size``, ``auto`` resolved by
    :mod:`finetuner.losses.chunk`: the number the memory model predicted with; 0: full logits; absent in the
    events of runs from before it was written)."""

    loss_chunk_size: int


class _Gguf(TypedDict, total=False):
    """The GGUF file the base was loaded (dequantized) from, or None (absent in the events of runs from
    before it was written): ``file``, ``architecture``, ``quant_type`` (``Q4_1``), ``bits`` (4),
    ``tensor_types`` (share of the weights per GGML type) and ``note`` (what it means for quality);
    see :meth:`finetuner.model.gguf_base.GGUFInfo.to_event`."""

    gguf: Union[dict[str, Any], None]


class _PredictedSpeed(TypedDict, total=False):
    """The speed model's prediction for this run on this device (finetuner.planning.speed), or None
    when it cannot say (absent in the events of runs from before it was written): ``tokens_per_s``,
    ``step_s``, ``total_s`` (optimizer steps x step time) and ``source`` (a calibration of this
    machine, or a card's data sheet)."""

    predicted_speed: Union[dict[str, Any], None]


class _Resolved(TypedDict, total=False):
    """What the recipe's data ``auto`` values became, ``{key: {"value", "reason"}}``
    (finetuner.planning.data_auto); empty when it has none (absent in the events of runs from before it was written,
    and in a multi-process run's, whose launcher says them)."""

    resolved: dict[str, dict[str, Any]]


class _Threads(TypedDict, total=False):
    """torch's CPU threads for the steps (finetuner.threads.Choice.to_dict): ``threads``, ``cores`` (this process
    may run on), ``load`` (the tasks other processes kept running when it chose), ``source`` (``auto``,
    ``training.threads`` or ``OMP_NUM_THREADS``), ``reason`` (in words) and ``auto_threads`` (what auto would
    take at that load). Absent in the events of runs from before it was written."""

    threads: dict[str, Any]


class StartEvent(Event, _Memory, _Objective, _Tiling, _LossChunk, _Gguf, _PredictedSpeed, _Resolved, _Threads):
    """Training begins (again, for a resumed run: ``resumed_from_step`` is set)."""

    schema_version: int
    run_dir: str
    name: str
    resumed_from_step: Union[int, None]
    max_steps: int
    steps_per_epoch: int
    device: str
    base_dtype: str
    precision: str
    attention: Union[str, None]
    kernels: str
    loss_path: str
    compile: bool
    method: str
    trainable_params: int
    total_params: int
    micro_batch_size: int
    gradient_accumulation: int
    data: dict[str, Any]
    predicted: Union[dict[str, Any], None]


class _Fsdp(TypedDict, total=False):
    """What an fsdp run adds (finetuner.training.strategies.fsdp): whether its shards, gradients and
    optimizer states live in CPU memory, and for QLoRA what each rank measured of the 4-bit base
    weights after sharding (``{"bits", "ranks": [{"local_bytes", "quantized_bytes", "dtypes",
    "world_size", "ratio"}, ...]}``; None without QLoRA), and the bytes of weights each rank had
    loaded before sharding (``loaded_bytes``, by rank: rank 0 loads the model, the others build it
    empty, finetuner.training.strategies.rank0_loading). Absent for other strategies."""

    fsdp_offload: bool
    quantized_storage: Union[dict[str, Any], None]
    loaded_bytes: list[int]


class DistributedEvent(Event, _Fsdp):
    """A multi-process run's set-up (after ``start``, written by rank 0)."""

    strategy: str
    offload: str
    world_size: int
    nodes: int
    backend: str
    engine: str
    optimizer: str
    configs: list[str]


class _EtaFrom(TypedDict, total=False):
    """Where ``eta_s`` came from (absent in the events of runs from before it was written): ``planned`` (the
    plan's seconds a step, for the first steps of a process) or ``measured`` (the steps timed since;
    finetuner.training.step_rate)."""

    eta_from: str


class StepEvent(Event, _Memory, _Rewards, _GroupRewards, _EtaFrom):
    """An optimizer step (every ``logging.every`` steps, and the last one)."""

    step: int
    max_steps: int
    epoch: float
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    tokens_seen: int
    tokens_per_s: float
    elapsed_s: float
    eta_s: float
    micro_batch_size: int


class OomBackoffEvent(Event):
    """Out of device memory in a step: the micro-batch is halved, accumulation raised (same effective batch)."""

    step: int
    old_micro_batch_size: int
    old_gradient_accumulation: int
    micro_batch_size: int
    gradient_accumulation: int
    message: str


class SlowStepsEvent(Event):
    """The steps timed so far take much longer than planned (finetuner.training.step_rate.SLOW_FACTOR times or
    more); written once a run (a resume may write it again). The ETA follows the measured steps."""

    step: int
    measured_step_s: float
    planned_step_s: float
    factor: float
    message: str


class EvalEvent(Event, _EvalRewards, _EvalGroupRewards):
    """Validation loss (every ``training.eval_every`` steps and at the end)."""

    step: int
    eval_loss: float
    eval_ppl: float


class CheckpointEvent(Event):
    """A checkpoint was saved (atomically)."""

    step: int
    path: str


class MemorySnapshotEvent(Event):
    """``--profile-memory`` wrote its CUDA allocation history."""

    step: int
    path: str


class StoppedEvent(Event):
    """A stop was asked for; a checkpoint is saved and the run can be resumed. Terminal."""

    step: int
    max_steps: int


class _SpeedCheck(TypedDict, total=False):
    """Predicted against measured speed (absent in the events of runs from before it was written):
    the speed model's tokens/s and seconds per optimizer step for this run (None when it could not
    say), and what the run measured over its steps; and the run's wall time by part, predicted
    (:mod:`finetuner.planning.wait`: ``download``, ``load``, ``steps``, ``evaluations``, ``checkpoints``,
    ``samples``, ``total``; None when it could not say) and measured (``load`` from the run's start to
    its first step, ``steps``, ``evaluations``, ``checkpoints``, ``samples`` 0 until the ``samples`` event,
    ``total`` until this event)."""

    predicted_tokens_per_s: Union[float, None]
    measured_tokens_per_s: float
    predicted_step_s: Union[float, None]
    measured_step_s: float
    predicted_wait_s: Union[dict[str, float], None]
    measured_wait_s: dict[str, float]


class DoneEvent(Event, _SpeedCheck):
    """Training finished: the adapter is saved, ``metrics.json`` written. Terminal."""

    step: int
    adapter_dir: str
    metrics: dict[str, Any]


class _SamplesTime(TypedDict, total=False):
    """Wall seconds the answers took (absent in the events of runs from before it was written)."""

    samples_s: float


class _SamplesAsked(TypedDict, total=False):
    """How the samples were asked (absent in the events of runs from before it was written): the system prompt, the
    tools' names, the new tokens and why, the thinking switches, and which step's model answered
    (:func:`finetuner.training.samples.answer_samples`)."""

    asked: dict[str, Any]


class SamplesEvent(Event, _SamplesTime, _SamplesAsked):
    """The sample prompts answered by the base and the fine-tuned model (after ``done``): each ``prompt``, the answers
    after their reasoning (``fine_tuned``, ``base``: None without a base) and the reasoning apart
    (``fine_tuned_reasoning``, ``base_reasoning``, when the answer reasoned first)."""

    samples: list[dict[str, Any]]


class _PhaseTokensAndPlan(TypedDict, total=False):
    """Absent in the events of runs from before they were written."""

    tokens: Union[int, None]  # tokens generated so far in the phase; None when it generates nothing
    planned_s: Union[float, None]  # the phase's predicted seconds; None without a plan


class PhaseEvent(Event, _PhaseTokensAndPlan):
    """Progress of a phase that is not a training step (:mod:`finetuner.phases`): loading the model, tokenizing,
    replay answers, the general probe, an evaluation, a checkpoint, the adapter's save, the sample answers. Written
    when a phase starts, every few seconds while it runs (also when its one call blocks: a heartbeat), and when it
    ends; may come before ``start`` and, for the samples, after ``done``."""

    phase: str  # a key of finetuner.phases.PHASES
    label: str  # its words, as the console and the UI show them
    state: Literal["start", "progress", "end"]
    done: int
    total: Union[int, None]  # None while not known
    unit: str
    elapsed_s: float
    eta_s: Union[float, None]  # None when it cannot say
    eta_from: Union[Literal["measured", "planned", "past_plan"], None]  # past_plan: the plan's seconds spent, no item done


class ErrorEvent(Event):
    """The run failed. Terminal."""

    message: str
    type: str
    user_error: bool


#: Every kind of event, by its ``event`` name, in the order a run writes them.
EVENT_TYPES: dict[str, type] = {
    "plan": PlanEvent,
    "replay": ReplayEvent,
    "checkpoint_invalid": CheckpointInvalidEvent,
    "start": StartEvent,
    "distributed": DistributedEvent,
    "step": StepEvent,
    "oom_backoff": OomBackoffEvent,
    "slow_steps": SlowStepsEvent,
    "eval": EvalEvent,
    "checkpoint": CheckpointEvent,
    "memory_snapshot": MemorySnapshotEvent,
    "stopped": StoppedEvent,
    "done": DoneEvent,
    "samples": SamplesEvent,
    "phase": PhaseEvent,
    "error": ErrorEvent,
}

#: After one of these, the process that wrote it writes nothing more except :data:`AFTER_END_EVENTS`.
TERMINAL_EVENTS: tuple[str, ...] = ("done", "stopped", "error")
#: Written after ``done`` by the same process (before it lets go of the run folder).
AFTER_END_EVENTS: tuple[str, ...] = ("samples", "phase")


# --------------------------------------------------------------------------- checking an event
class EventSchemaError(ValueError):
    """An event that does not follow the schema (a programming error in the writer)."""


@functools.lru_cache(maxsize=None)
def fields(kind: str) -> dict[str, tuple[Any, bool]]:
    """``{field: (type, required)}`` of an event kind (``event`` and ``time`` included)."""
    cls = EVENT_TYPES[kind]
    hints = typing.get_type_hints(cls)
    return {name: (tp, name in cls.__required_keys__) for name, tp in hints.items()}


def _matches(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if tp is float:  # non-finite floats are written as null / "inf" / "-inf"
        return value is None or value in ("inf", "-inf") or (isinstance(value, (int, float)) and not isinstance(value, bool))
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


def validate_event(record: Mapping[str, Any], allow_extra: bool = True) -> list[str]:
    """What is wrong with an event, as sentences (empty when it follows the schema).

    An unknown kind, a missing field and a value of the wrong type are reported; a field the
    schema does not know only with ``allow_extra=False`` (readers must ignore such fields).
    """
    kind = record.get("event")
    if kind not in EVENT_TYPES:
        return [f"unknown event kind {kind!r} (known: {', '.join(EVENT_TYPES)})"]
    problems = []
    spec = fields(kind)
    for name, (tp, required) in spec.items():
        if name not in record:
            if required:
                problems.append(f"{kind}: missing field {name!r}")
        elif not _matches(record[name], tp):
            problems.append(f"{kind}: field {name!r} is {record[name]!r}, not {_type_name(tp)}")
    if not allow_extra:
        extra = [k for k in record if k not in spec]
        if extra:
            problems.append(f"{kind}: fields not in the schema: {', '.join(extra)}")
    return problems


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) if typing.get_origin(tp) is None else str(tp).replace("typing.", "")


def clean_value(v: Any) -> Any:
    """A value as JSON can hold it: NaN → None, ±inf → ``"inf"`` / ``"-inf"`` (also inside lists and dicts)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else str(v)
    if isinstance(v, dict):
        return {k: clean_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean_value(x) for x in v]
    return v


# --------------------------------------------------------------------------- the states of a run
RunState = Literal["new", "starting", "running", "finishing", "stopped", "done", "error", "interrupted"]

#: Every state a run can be in, as :func:`run_state` names it:
#: ``new`` no event yet and no process; ``starting`` a process holds the run folder but has not
#: written ``start`` yet (loading the model, the data); ``running`` it has; ``finishing`` a terminal
#: event is written and the process is still ending (samples, clean-up); ``stopped``, ``done``,
#: ``error`` the last process ended with that terminal event; ``interrupted`` the last process ended
#: without one (killed, power lost).
RUN_STATES: tuple[str, ...] = typing.get_args(RunState)
#: States in which a process holds the run folder.
ACTIVE_STATES: tuple[str, ...] = ("starting", "running", "finishing")
#: States from which starting the run again continues it (when a checkpoint exists).
RESUMABLE_STATES: tuple[str, ...] = ("stopped", "interrupted", "error")


class RunStateTracker:
    """Reads events one at a time and knows the run's state (for a reader that follows the file).

    A process writes ``plan`` / ``replay`` / ``checkpoint_invalid`` / ``start``, then its progress, then one
    terminal event (then perhaps :data:`AFTER_END_EVENTS`). Any other event after a terminal one
    means a new process (a resume) has begun.
    """

    def __init__(self) -> None:
        self.seen = False  # any event read
        self.started = False  # a ``start`` of the current process has been read
        self.end: dict[str, Any] | None = None  # the terminal event of the last process, if it wrote one

    def feed(self, ev: Mapping[str, Any]) -> None:
        kind = ev.get("event")
        if kind is None:
            return
        self.seen = True
        if kind in TERMINAL_EVENTS:
            self.end, self.started = dict(ev), False
        elif kind in AFTER_END_EVENTS and self.end is not None:
            pass
        else:
            self.end = None
            if kind == "start":
                self.started = True

    @property
    def ended(self) -> bool:
        """The last process has written its terminal event."""
        return self.end is not None

    def state(self, busy: bool) -> RunState:
        """The state, given whether a process holds the run folder's lock (or is known to be alive)."""
        if self.end is not None:
            return "finishing" if busy else self.end["event"]
        if busy:
            return "running" if self.started else "starting"
        return "interrupted" if self.seen else "new"


def run_state(events: Iterable[Mapping[str, Any]], busy: bool) -> RunState:
    """A run's state from its events and whether a process holds its folder (see :data:`RUN_STATES`)."""
    tracker = RunStateTracker()
    for ev in events:
        tracker.feed(ev)
    return tracker.state(busy)

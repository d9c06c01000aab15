"""The whole wait of a run, not only its steps: what ``finetuner run`` spends from its start to its end, by part.

A run (:func:`finetuner.training.run.train`) does, in this order:

* **download** (only for a hub model not in the local Hugging Face cache): the checkpoint's bytes
  (:func:`model_files`) at ``DOWNLOAD_BYTES_PER_S``, a stated assumption (the output says it);
* **load**: the libraries a run imports (:attr:`DeviceSpeed.startup_s`, measured by the calibration,
  else ``STARTUP_S``), then the base model's bytes read at the disk's rate
  (:attr:`DeviceSpeed.disk_read_bytes_per_s`, else ``DISK_READ_BYTES_PER_S``); a GGUF base not yet in
  finetuner's conversion cache is dequantized by transformers at ``GGUF_CONVERT_BYTES_PER_S`` of the file;
* **replay** (``data.replay``, :mod:`finetuner.data.replay`): the base model answers ``replay_count`` of its
  general prompts, greedy, ``replay.BATCH`` prompts a ``generate`` call, before the first step; none when its
  cache already holds these answers of these weights (:func:`finetuner.data.replay.cached_before_load`, or the
  run's own record of it). Timed as :class:`Answering` says;
* **steps**: ``optimizer steps x step_s`` (the step model, :mod:`finetuner.planning.speed`);
* **evaluations**: ``(steps - 1) // eval_every + 1`` of them (every ``training.eval_every`` steps before the
  last, and the final one), each ``ceil(held-out rows / micro_batch_size)`` micro-batches forward only
  (:func:`finetuner.planning.speed.forward_seconds`), at the training micro-batch's average padded length;
  a GRPO run's evaluation instead samples ``num_generations`` completions of each held-out prompt
  (:func:`finetuner.planning.speed_grpo.evaluation_seconds`); none without held-out rows;
* **checkpoints**: ``(steps - 1) // save_every + 1`` of them (every ``checkpointing.save_every`` steps
  before the last, and the final one; ``save_every`` 0: the final one only), each the trainable weights (fp32: 4 bytes a parameter) and the optimizer's states
  (:func:`finetuner.memory.storage.optimizer_state_bytes`) written at the disk's write rate
  (:attr:`DeviceSpeed.disk_write_bytes_per_s`, else ``DISK_WRITE_BYTES_PER_S``) plus ``CHECKPOINT_FILES``
  files written and ``fsync``-ed (:attr:`DeviceSpeed.file_sync_s`, else ``FILE_SYNC_S``); then the
  adapter (trainable weights, ``ADAPTER_FILES`` files);
* **probe** (an adapter run on one process: :func:`finetuner.training.samples.general_probe`): the base (the adapter off) and the
  fine-tune each answer ``run_probe_count(training.general_probe)`` questions of the general probe set
  (:mod:`finetuner.infer.probe`), after the adapter is saved; timed as :class:`Answering` says;
* **tool_calls** (such a run whose held-out rows make tool calls: :func:`finetuner.training.samples.held_out_tool_calls`):
  the base and the fine-tune each asked every held-out call, one at a time (``tool_eval.MAX_NEW_TOKENS``), a
  prompt's text its messages and tool schemas; timed as :class:`Answering` says;
* **samples**: each of ``samples.prompts`` answered by the fine-tune and, for an adapter, by the base
  (the adapter switched off): as many decode steps as the data's average response has tokens (a greedy
  answer ends where the model writes its end token, and a fine-tune writes like the responses it was
  trained on; ``label fraction x`` the average row, at most ``max_new_tokens``, the bound taken when the
  data cannot be read), a decode step being a forward of one token (:func:`forward_seconds` at ``seq_len`` 1), the
  base weights read once (``weight bytes / bandwidth``: decoding is memory-bound) and
  ``GENERATE_OPS_PER_TOKEN`` operations of ``generate``'s own loop.

Replay, probe and tool-call answers (:class:`Answering`, :func:`answering_seconds`) are GRPO's rollout generation
(:func:`finetuner.planning.speed_grpo.generation_seconds`: one model of batched generation, a call of ``B``
prompts decoding ``B`` tokens a forward): each call's prompts left-padded to its longest, a prompt's tokens
its characters at :data:`finetuner.data.stats.CHARS_PER_TOKEN` plus ``CHAT_TURN_TOKENS`` of the chat
template, and every call decoding its ``max_new_tokens`` (``replay.MAX_NEW_TOKENS``, ``probe.MAX_NEW_TOKENS``,
``tool_eval.MAX_NEW_TOKENS``):
an upper bound, since a call stops once all its rows have ended, said in :attr:`Wait.assumptions`.

Not counted: tokenizing the data (cached after the first run), writing the run folder's small files,
the prompt's prefill before each answer, a GRPO run's reward functions (user code). The cost of a run is its wall
time at the price of an hour (:func:`finetuner.planning.time_text.cost_text`). Pure arithmetic, a few ``stat`` calls and reading
the held-out rows for their tool calls: no torch.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetuner.device import CUDA
from finetuner.objectives.specs import DEFAULT as PLAIN_PASS  # a supervised pass: no pairs, no reference
from finetuner.errors import UserError
from finetuner.objectives.specs import spec_of
from finetuner.memory.model import optimizer_state_bytes, trainable_params, trainable_tensors
from finetuner.planning.speed import DTYPE_BYTES, EAGER_OP_FACTOR, forward_seconds

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.memory.model import Settings
    from finetuner.model.shapes import ModelShape
    from finetuner.planning.lengths import BatchShape
    from finetuner.planning.speed import DeviceSpeed, StepTime

#: Download rate assumed for a hub model not in the local cache (50 MB/s, 400 Mbit/s: a cloud machine's
#: typical rate from the Hugging Face hub's CDN; a home line is often slower). An assumption, said in the output.
DOWNLOAD_BYTES_PER_S = 50e6
#: Bytes per parameter of a hub checkpoint whose files are not here to measure (bf16/fp16: how models are published).
HUB_BYTES_PER_PARAM = 2
#: Seconds to import the libraries a run loads when the calibration did not measure it
#: (:data:`finetuner.planning.calibrate.STARTUP_IMPORTS`): their import in a new process took 12.7-14.7 s
#: on the 2-core development machine while other jobs kept its cores busy (2026-11-27); an idle or a faster
#: machine takes less.
STARTUP_S = 12.0
#: Disk rates without a calibration: a SATA SSD's sequential read and write (~500 and ~300 MB/s; NVMe
#: reads several GB/s, a cloud network disk 100-250 MB/s).
DISK_READ_BYTES_PER_S = 500e6
DISK_WRITE_BYTES_PER_S = 300e6
#: Seconds to write and ``fsync`` a small file without a calibration (an SSD's flush: a few milliseconds).
FILE_SYNC_S = 0.005
#: Files a checkpoint writes and ``fsync``-s (counted in a LoRA run's ``checkpoints/step-*``: the adapter's
#: weights, config and README, optimizer, scheduler, RNG state, trainer state, recipe) and the final
#: adapter folder (weights, config, README, tokenizer, its config, chat template).
CHECKPOINT_FILES = 8
ADAPTER_FILES = 6
#: Bytes per parameter a checkpoint keeps of each trainable weight (fp32, the memory model's ``R``).
TRAINABLE_WEIGHT_BYTES = 4
#: transformers' GGUF loader parses and dequantizes a file at about 1.7 MB/s on one core (~58 s for the
#: 100 MB SmolLM2-135M file, :mod:`finetuner.model.gguf_base`); a converted base loads as a plain folder.
GGUF_CONVERT_BYTES_PER_S = 100e6 / 58
#: Tensor operations ``generate`` launches per new token besides the model's forward: the key/value cache's
#: update (2 a layer, counted separately), the logits processors and the greedy choice, the stopping
#: criteria, appending the token and the finished-sequence mask. An estimate from transformers' decoding
#: loop, not a fit.
GENERATE_OPS_PER_TOKEN = 30
#: Tokens a chat template adds to one user turn and the assistant's opening: ChatML's markers (~10) and a
#: default system block such as SmolLM2's (~15). An estimate, not a fit: only a replay or probe prompt's prefill uses it.
CHAT_TURN_TOKENS = 24
#: The parts of a run's wait, in the order a run spends them (the keys of :attr:`Wait.parts`).
PARTS = ("download", "load", "replay", "steps", "evaluations", "checkpoints", "probe", "tool_calls", "samples")
#: Weight files of a model folder or hub snapshot, whose bytes a load reads.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class ModelFiles:
    """The base model's bytes a run reads, and whether it downloads them first."""

    bytes: int
    download: bool
    #: a GGUF file that transformers dequantizes (not yet in finetuner's conversion cache)
    gguf_convert: bool = False
    source: str = ""


@dataclass(frozen=True)
class Wait:
    """A run's predicted wall time by part (seconds, :data:`PARTS`), the counts behind them and what
    the figures assume."""

    parts: dict[str, float]
    counts: dict[str, int]
    assumptions: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        """The whole wait: the sum of the parts."""
        return sum(self.parts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 2), "parts_s": {k: round(v, 3) for k, v in self.parts.items()},
                "counts": dict(self.counts), "assumptions": list(self.assumptions)}


@dataclass(frozen=True)
class Answering:
    """Greedy answers a run generates in batches (replay before training, the probe after it): each prompt's
    tokens as the chat template renders it (``prompt_tokens``), ``batch`` prompts a ``generate`` call (left-padded
    to the call's longest), ``new_tokens`` decoded a call (the bound), each prompt answered once a pass, each
    pass with the adapter on or off (``adapters``; replay: the base alone, the probe: the base, then the fine-tune)."""

    prompt_tokens: tuple[float, ...]
    new_tokens: int
    batch: int
    adapters: tuple[bool, ...] = (False,)

    @classmethod
    def of_texts(cls, texts: list[str], new_tokens: int, batch: int, adapters: tuple[bool, ...] = (False,)) -> Answering:
        """Of the prompts' texts: ``ceil(characters / CHARS_PER_TOKEN) + CHAT_TURN_TOKENS`` tokens each."""
        from finetuner.data.stats import CHARS_PER_TOKEN

        return cls(tuple(math.ceil(len(t) / CHARS_PER_TOKEN) + CHAT_TURN_TOKENS for t in texts), new_tokens, batch, adapters)

    @property
    def answers(self) -> int:
        return len(self.prompt_tokens) * len(self.adapters)

    def calls(self) -> list[tuple[int, float]]:
        """One pass's ``generate`` calls: ``(rows, width)``, the width its longest prompt."""
        p, b = self.prompt_tokens, max(1, self.batch)
        return [(len(p[i:i + b]), max(p[i:i + b])) for i in range(0, len(p), b)]


def answering_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed, a: Answering | None) -> float:
    """The answers' time: each pass's calls, each :func:`finetuner.planning.speed_grpo.generation_seconds`'
    prefill and decode of its rows at its width, ``new_tokens`` decoded, the adapter on or off as the pass has it."""
    if a is None or not a.prompt_tokens:
        return 0.0
    from finetuner.planning.speed_grpo import generation_seconds

    return sum(sum(generation_seconds(shape, s, speed, calls=1, rows=rows, prompt_width=width, decode_steps=a.new_tokens,
                                      adapter=adapter))
               for adapter in a.adapters for rows, width in a.calls())


# ---------------------------------------------------------------------- counts
def evaluation_count(steps: int, eval_every: int, held_out: int) -> int:
    """Evaluations a run of ``steps`` makes: after every ``eval_every``-th step before the last, and
    the final one (the trainer's loop); none without held-out rows."""
    if held_out <= 0 or steps <= 0:
        return 0
    return ((steps - 1) // eval_every if eval_every else 0) + 1


def checkpoint_count(steps: int, save_every: int) -> int:
    """Checkpoints a run of ``steps`` writes: after every ``save_every``-th step before the last, and the final one."""
    if steps <= 0:
        return 0
    return ((steps - 1) // save_every if save_every else 0) + 1


def sample_answers(prompts: int, method: str) -> int:
    """Answers the samples generate: the fine-tune's, and the base's (the adapter switched off) except
    after full fine-tuning (no adapter to switch off)."""
    return prompts * (1 if method == "full" else 2)


# ---------------------------------------------------------------------- the base model's files
def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _weight_bytes(folder: Path) -> int:
    """Bytes of the weight files directly in ``folder`` (a model folder, a hub snapshot: links followed)."""
    total = 0
    for p in folder.iterdir() if folder.is_dir() else ():
        if p.suffix in WEIGHT_SUFFIXES and p.is_file():
            total += p.stat().st_size
    return total


def first_load(name: str) -> tuple[bool, bool]:
    """``(download, gguf_convert)``: what loading base model ``name`` would do first, as things stand now (a hub
    model not in the local cache is downloaded; a GGUF file not in the conversion cache is dequantized). A
    run records it before it loads the model (:class:`finetuner.training.trainer.Trainer`), since its
    prediction is made after the load has filled those caches."""
    from finetuner.model import gguf_base

    path = Path(name).expanduser()
    if gguf_base.is_gguf_name(name) and path.is_file():
        return False, not gguf_base.converted(name)
    if path.is_dir():
        return False, False
    return not _snapshot_bytes(name), False


def _snapshot_bytes(name: str) -> int:
    """Weight bytes of hub model ``name``'s largest snapshot in the local Hugging Face cache (0: not downloaded)."""
    snapshots = _snapshots(name)
    return max((_weight_bytes(s) for s in snapshots.iterdir()), default=0) if snapshots.is_dir() else 0


def _snapshots(name: str) -> Path:
    return hub_cache_dir() / f"models--{name.replace('/', '--')}" / "snapshots"


def model_files(name: str, shape: ModelShape) -> ModelFiles:
    """The bytes a run reads of base model ``name``: a GGUF file's size (dequantized by transformers unless
    finetuner's conversion cache holds it, :func:`finetuner.model.gguf_base.converted`), a local folder's
    weight files, a hub snapshot's weight files in the local cache; else (a hub id not downloaded) the
    parameters at ``HUB_BYTES_PER_PARAM``, downloaded first."""
    from finetuner.model import gguf_base

    path = Path(name).expanduser()
    if gguf_base.is_gguf_name(name) and path.is_file():
        return ModelFiles(path.stat().st_size, False, gguf_convert=not gguf_base.converted(name), source=str(path))
    if path.is_dir():
        return ModelFiles(_weight_bytes(path), False, source=str(path))
    held = _snapshot_bytes(name)
    if held:
        return ModelFiles(held, False, source=str(_snapshots(name)))
    return ModelFiles(shape.num_params * HUB_BYTES_PER_PARAM, True, source="the hub")


# ---------------------------------------------------------------------- the parts
def load_seconds(files: ModelFiles, speed: DeviceSpeed) -> float:
    """The libraries' import, then the model's bytes read (and a GGUF file's conversion)."""
    startup = speed.startup_s or STARTUP_S
    read = files.bytes / (speed.disk_read_bytes_per_s or DISK_READ_BYTES_PER_S)
    return startup + read + (files.bytes / GGUF_CONVERT_BYTES_PER_S if files.gguf_convert else 0.0)


def evaluation_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed, held_out: int,
                       batch: BatchShape | None = None) -> float:
    """One evaluation: ``ceil(held_out / micro_batch)`` micro-batches forward only, each at the training
    micro-batch's average padded length and labelled share (``batch``; without it every row
    ``seq_len`` long), as :func:`finetuner.planning.speed.step_time` times a micro-batch."""
    if held_out <= 0:
        return 0.0
    if batch is not None:
        padded = max(1, min(s.seq_len, round(batch.padded_len)))
        real = min(batch.real_per_row, padded)
        s = s.with_(seq_len=padded, label_fraction=s.label_fraction * real / padded)
    return math.ceil(held_out / s.micro_batch) * forward_seconds(shape, s, speed)


def checkpoint_bytes(shape: ModelShape, s: Settings) -> int:
    """Bytes a checkpoint holds: each trainable weight (``TRAINABLE_WEIGHT_BYTES``) and the optimizer's states."""
    return trainable_params(shape, s) * TRAINABLE_WEIGHT_BYTES + optimizer_state_bytes(trainable_tensors(shape, s), s.optimizer)


def checkpoint_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed, checkpoints: int) -> float:
    """``checkpoints`` checkpoints and the final adapter: their bytes at the write rate plus each file's ``fsync``."""
    rate, sync = speed.disk_write_bytes_per_s or DISK_WRITE_BYTES_PER_S, speed.file_sync_s or FILE_SYNC_S
    adapter = trainable_params(shape, s) * TRAINABLE_WEIGHT_BYTES
    return (checkpoints * (checkpoint_bytes(shape, s) / rate + CHECKPOINT_FILES * sync)
            + adapter / rate + ADAPTER_FILES * sync)


def decode_token_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed) -> float:
    """One new token of an answer: the forward of one token (:func:`forward_seconds`), the base's linear
    weights read once (``linear_weight_numel x`` their bytes ``/ bandwidth``: a 4-bit or 8-bit base also
    dequantized once, in the forward), and ``generate``'s own ``GENERATE_OPS_PER_TOKEN`` plus 2 a layer
    for the key/value cache, at the per-operation cost."""
    one = s.with_(micro_batch=1, seq_len=1, label_fraction=1.0, objective=PLAIN_PASS, reference="none",
                  gradient_checkpointing=False, loss_chunk=0)
    weight = (s.quant_bits / 8 if s.method == "qlora" else DTYPE_BYTES.get(s.weight_dtype, 2)) * shape.linear_weight_numel
    if shape.experts:  # one token reads top_k experts of each MoE layer (4-bit under 4-bit QLoRA)
        weight += (0.5 if s.method == "qlora" and s.quant_bits == 4 else DTYPE_BYTES.get(s.weight_dtype, 2)) * shape.experts.active_numel
    ops = (GENERATE_OPS_PER_TOKEN + 2 * shape.num_layers) * speed.op_overhead_s * EAGER_OP_FACTOR
    return forward_seconds(shape, one, speed) + weight / speed.bandwidth_bytes_per_s + ops


def predict_wait(shape: ModelShape, s: Settings, speed: DeviceSpeed, step: StepTime, steps: int, *,
                 eval_every: int, save_every: int, held_out: int | None, sample_prompts: int, max_new_tokens: int | str,
                 files: ModelFiles, batch: BatchShape | None = None, evaluation_s: float | None = None,
                 answer_tokens: float | None = None, replay: Answering | None = None,
                 probe: Answering | None = None, tool_calls: Answering | None = None) -> Wait:
    """A run's wait by part (see the module doc). ``held_out``: the held-out rows, None when unknown (the
    data cannot be read here: no evaluation counted, and said); ``evaluation_s``: one evaluation's seconds
    where the objective times its own (GRPO's held-out rollouts: :func:`recipe_wait`), else
    :func:`evaluation_seconds`; ``answer_tokens``: the tokens of a sample answer expected (the data's average
    response), at most ``max_new_tokens``, which it is when not given; ``replay`` and ``probe``: the answers
    generated before and after training (None: none); ``tool_calls``: the held-out tool calls asked of the base and
    the fine-tune after training (None: none)."""
    assumptions = []
    if files.download:
        assumptions.append(f"the model ({files.bytes / 1e9:.2g} GB) downloaded at {DOWNLOAD_BYTES_PER_S / 1e6:.0f} MB/s")
    if files.gguf_convert:
        assumptions.append(f"the GGUF file dequantized at {GGUF_CONVERT_BYTES_PER_S / 1e6:.1f} MB/s (its first load)")
    if not speed.startup_s:
        assumptions.append(f"{STARTUP_S:g} s to import the libraries (not calibrated here)")
    n_val = held_out or 0
    if held_out is None:
        assumptions.append("held-out rows unknown (the data cannot be read here): evaluations not counted")
    evals = evaluation_count(steps, eval_every, n_val)
    ckpts = checkpoint_count(steps, save_every)
    answers = sample_answers(sample_prompts, s.method)
    from finetuner.infer.generate import AUTO_LEAST, AUTO_MOST

    # samples.max_new_tokens auto: its bound is the data's longest answer, known when the run has tokenized it
    most = AUTO_MOST if max_new_tokens == "auto" else int(max_new_tokens)
    per_answer = float(AUTO_LEAST if max_new_tokens == "auto" else most) if answer_tokens is None else \
        min(float(most), max(1.0, answer_tokens))
    if answers and answer_tokens is not None:
        assumptions.append(f"sample answers as long as the data's responses ({per_answer:.0f} tokens on average, "
                           f"at most {max_new_tokens if max_new_tokens != 'auto' else f'{most} (auto)'})")
    parts = {
        "download": files.bytes / DOWNLOAD_BYTES_PER_S if files.download else 0.0,
        "load": load_seconds(files, speed),
        "replay": answering_seconds(shape, s, speed, replay),
        "steps": step.step_s * steps,
        "evaluations": evals * (evaluation_s if evaluation_s is not None else evaluation_seconds(shape, s, speed, n_val, batch)),
        "checkpoints": checkpoint_seconds(shape, s, speed, ckpts),
        "probe": answering_seconds(shape, s, speed, probe),
        "tool_calls": answering_seconds(shape, s, speed, tool_calls),
        "samples": answers * per_answer * decode_token_seconds(shape, s, speed),
    }
    counts = {"optimizer_steps": steps, "evaluations": evals, "held_out_rows": n_val, "checkpoints": ckpts,
              "sample_answers": answers, "sample_tokens": round(answers * per_answer), "model_bytes": files.bytes}
    for name, a in (("replay", replay), ("probe", probe), ("tool_calls", tool_calls)):
        n = a.answers if a is not None else 0
        counts[f"{name}_answers"], counts[f"{name}_tokens"] = n, n * (a.new_tokens if a is not None else 0)
        if n:
            words = {"tool_calls": "tool-call"}.get(name, name)
            assumptions.append(f"{words} answers at their longest ({a.new_tokens} tokens)")
    return Wait(parts, counts, assumptions)


def recipe_wait(recipe: Any, shape: ModelShape, s: Settings, speed: DeviceSpeed, step: StepTime, steps: int, *,
                held_out: int | None, batch: BatchShape | None = None, eval_prompts: BatchShape | None = None,
                loaded_as: tuple[bool, bool] | None = None, train_rows: int | None = None,
                replay_cached: bool | None = None) -> Wait:
    """:func:`predict_wait` of a resolved recipe (``s``: its settings, as the step model read them; ``batch``:
    the data's average micro-batch). A GRPO run's evaluation generates the held-out prompts' completions
    (:func:`finetuner.planning.speed_grpo.evaluation_seconds`: ``eval_prompts``, the held-out prompts as
    :func:`finetuner.planning.lengths.prompt_batch` pads them, else at their longest; the completions at
    their longest: an upper bound, said). ``loaded_as``: :func:`first_load` as recorded before the model
    was loaded (a run's own prediction), else as things stand now. ``train_rows``: the user's training rows
    (``data.replay``'s count is a share of them; None: unknown, replay not counted, said); ``replay_cached``:
    whether the replay's answers came from its cache (a run's own record), else as things stand now
    (:func:`recipe_answering`)."""
    t = recipe.training
    files = model_files(recipe.model.name, shape)
    if loaded_as is not None:
        files = replace(files, download=loaded_as[0], gguf_convert=loaded_as[1])
    evaluation_s = None
    if spec_of(recipe.objective).generates:
        from finetuner.memory.grpo import grpo_settings_of
        from finetuner.planning.speed_grpo import evaluation_seconds as grpo_evaluation_seconds

        evaluation_s = grpo_evaluation_seconds(shape, s, grpo_settings_of(recipe), speed, held_out or 0,
                                               top_p=recipe.grpo.top_p, prompts=eval_prompts)
    # a sample answer as long as the data's average response (its labelled share of the average row)
    answer_tokens = s.label_fraction * batch.real_per_row if batch is not None and not spec_of(recipe.objective).generates else None
    replay, probe, tool_calls, said = recipe_answering(recipe, train_rows, cuda=s.platform == CUDA,
                                                       replay_cached=replay_cached)
    w = predict_wait(shape, s, speed, step, steps, eval_every=t.eval_every or 0,
                     save_every=recipe.checkpointing.save_every or 0, held_out=held_out,
                     sample_prompts=len(recipe.samples.prompts), max_new_tokens=recipe.samples.max_new_tokens,
                     files=files, batch=batch, evaluation_s=evaluation_s,
                     answer_tokens=answer_tokens, replay=replay, probe=probe, tool_calls=tool_calls)
    w.assumptions.extend(said)
    if evaluation_s and w.counts["evaluations"]:
        w.assumptions.append(f"GRPO's held-out rollouts at their longest completions ({recipe.grpo.max_new_tokens} tokens)")
    return w


def recipe_answering(recipe: Any, train_rows: int | None, *, cuda: bool, replay_cached: bool | None = None
                     ) -> tuple[Answering | None, Answering | None, Answering | None, list[str]]:
    """``(replay, probe, tool calls, what is said of them)`` of a run of ``recipe``, as the trainer makes them: ``data.replay``'s
    prompts (:func:`finetuner.data.replay.replay_count` of ``train_rows``, drawn with the run's seed), none when
    their answers are cached (``replay_cached``, else :func:`finetuner.data.replay.cached_before_load`); the
    probe's questions (:func:`finetuner.infer.probe.run_probe_count` on ``cuda`` or the CPU, spread over the set)
    for an adapter trained on one process, answered twice; and for such an adapter, the tool calls of its held-out rows
    (:func:`finetuner.infer.tool_eval.held_out_requests`), asked of the base and the fine-tune one at a time."""
    said: list[str] = []
    replay = probe = tool_calls = None
    if recipe.data.replay:
        from finetuner.data import replay as rp

        if train_rows is None:
            said.append("data.replay's answers not counted (the data cannot be read here to count its rows)")
        else:
            prompts = rp.chosen_prompts(rp.load_prompts(), rp.replay_count(recipe.data.replay, train_rows,
                                                                          len(rp.load_prompts())), recipe.training.seed)
            cached = (rp.cached_before_load(recipe.model.name, recipe.model.revision, prompts) is not None
                      if replay_cached is None else replay_cached)
            if cached:
                said.append(f"data.replay's {len(prompts)} answers read from its cache (made with these weights)")
            elif prompts:
                replay = Answering.of_texts(prompts, rp.MAX_NEW_TOKENS, rp.BATCH)
    if recipe.method != "full" and recipe.distributed.world_size == 1:
        from finetuner.infer import probe as pb

        n = pb.run_probe_count(recipe.training.general_probe, cuda=cuda)
        if n:
            probe = Answering.of_texts([p.question for p in pb.spread(pb.load_probes(), n)], pb.MAX_NEW_TOKENS,
                                       pb.BATCH, adapters=(False, True))
        from finetuner.infer import tool_eval

        texts = held_out_request_texts(recipe)
        if texts:
            tool_calls = Answering.of_texts(list(texts), tool_eval.MAX_NEW_TOKENS, 1, adapters=(False, True))
    return replay, probe, tool_calls, said


def held_out_request_texts(recipe: Any) -> tuple[str, ...]:
    """The prompts' texts of the tool calls a run of ``recipe`` holds out (:func:`finetuner.infer.tool_eval.held_out_requests`),
    read once per version of its data files; () when its data is not local files readable here."""
    d = recipe.data
    files = [f for f in ([d.path] if isinstance(d.path, str) else list(d.path or [])) + [d.val_path] if f]
    try:
        stamp = tuple((str(Path(f).expanduser().resolve()), Path(f).expanduser().stat().st_mtime_ns) for f in files)
    except OSError:
        return ()
    if not files or not all(Path(f).expanduser().is_file() for f in files):
        return ()
    key = json.dumps({"data": d.model_dump(mode="json"), "seed": recipe.training.seed, "objective": recipe.objective,
                      "files": stamp}, sort_keys=True, default=str)
    if key not in _REQUEST_TEXTS:
        from finetuner.infer import tool_eval

        try:
            requests = tool_eval.held_out_requests(recipe) or []
        except (UserError, OSError, ValueError):  # unreadable here: the trainer reports its rows
            requests = []
        _REQUEST_TEXTS[key] = tuple(tool_eval.prompt_text(r) for r in requests)
    return _REQUEST_TEXTS[key]


#: :func:`held_out_request_texts` by recipe data and file versions
_REQUEST_TEXTS: dict[str, tuple[str, ...]] = {}


# ---------------------------------------------------------------------- what it costs, and how it is said
#: A currency as ``--currency`` takes it: a code or a symbol, letters and currency signs, at most 8 characters.
CURRENCY = re.compile(r"^[^\W\d_]{1,8}$|^[^\w\s]{1,3}$", re.UNICODE)


def check_currency(currency: str | None, price_per_hour: float | None) -> str | None:
    """``currency`` as the plan says it (stripped), None when not given; a UserError when it is not a code or
    symbol, or when no price is given for it to be a unit of."""
    if currency is None:
        return None
    c = currency.strip()
    if not CURRENCY.match(c):
        raise UserError(f"--currency {currency!r}: give a currency code or symbol (USD, EUR, $), up to 8 letters.")
    if price_per_hour is None:
        raise UserError(f"--currency {c}: give --price-per-hour too (the currency is the unit of that price).")
    return c


def cost_of(wall_s: float | None, price_per_hour: float | None) -> float | None:
    """The run's cost: its whole wait at ``price_per_hour``."""
    if wall_s is None or price_per_hour is None:
        return None
    return wall_s / 3600 * price_per_hour

"""Size a run to its data: sequence length, packing, held-out rows, effective batch, epochs,
learning rate and how often to evaluate and save — each with the reason the planner prints.

The planner (:mod:`finetuner.planning.planner`) decides what *fits* the card; this module decides what
makes a *useful* run of the data at hand. Pure arithmetic on the data's token lengths
(:class:`finetuner.data.stats.DataProfile`), no torch. The rules:

* **Sequence length**: the longest example rounded up to a multiple of 64, never beyond the
  model's positions (examples longer than that are truncated, with a note); when a few rows are outliers
  (the longest more than twice the 99th percentile), that percentile rounded up instead, saying the rows
  cut (:mod:`finetuner.planning.length_cap`; not for GRPO, whose trainer refuses a longer prompt). Only when packing
  is chosen does the sequence grow to ``PACKED_SEQ_LEN`` (2,048) to fill it with examples.
* **Packing** when examples average under half the sequence *and* the packed data still give at
  least ``MIN_STEPS_PER_EPOCH_TO_PACK`` optimizer steps per epoch: packing a small set into a
  handful of long rows would leave almost nothing to step on.
* **Held out**: 2 % of the rows (at most 200) for a large set; 10 % (at least 2) below 200 rows;
  none below 10 rows.
* **Steps**: ``ceil(training rows / effective batch)`` an epoch (:func:`finetuner.steps.steps_per_epoch`, the
  trainer's own count: the last step takes the rows left over), times the epochs; packed rows are
  counted by packing the data's lengths as the trainer does (:func:`finetuner.data.split.count_packed_rows`).
* **Effective batch**: the user's, else 16, halved until an epoch has at least
  ``MIN_STEPS_PER_EPOCH`` optimizer steps.
* **Epochs**: enough to reach ``MIN_TOTAL_STEPS`` optimizer steps, between 1 and ``MAX_EPOCHS``.
* **Learning rate**: 2e-4 for LoRA / QLoRA and 2e-5 for full fine-tuning at hidden size 4,096
  (the common 7B settings), scaled by ``sqrt(4096 / hidden)`` for narrower models and capped
  at 10x, to one significant digit (a narrower layer takes larger steps for the same change of
  its output).

A preference objective (DPO, ORPO, SimPO, KTO) changes three of these: no packing (each response
is scored as a whole sequence), at most the description's ``max_epochs`` epochs (the alignment handbook's
Zephyr-7B DPO recipes train one epoch; a small set of pairs gets up to three to come nearer
``MIN_TOTAL_STEPS``), and learning rates a fortieth of SFT's (its ``learning_rates``: 5e-6 for LoRA /
QLoRA, 5e-7 for full fine-tuning at hidden size 4,096, the rates of those recipes), scaled as above.
GRPO (``objective: grpo``) is sized on its prompts (:func:`finetuner.data.stats.profile_prompts`): the
sequence is the longest prompt plus ``grpo.max_new_tokens``, rounded up as above; the effective batch
counts prompts (each generates ``num_generations`` completions), its ``default_effective_batch`` (8) by default,
halved like SFT's for small sets; epochs as a preference objective's; learning rates its ``learning_rates`` (TRL's
``GRPOConfig`` default, 1e-6, for full fine-tuning; 5e-6 for LoRA / QLoRA, the rate of Unsloth's GRPO
LoRA notebooks), scaled as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from finetuner.data.split import count_packed_rows, held_out_rows, held_out_size
from finetuner.objectives.specs import spec_of
from finetuner.planning.expectations import is_toy
from finetuner.steps import steps_per_epoch, total_steps
from finetuner.planning.length_cap import SEQ_ROUND, LengthCap, outlier_cap, round_up

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.data.stats import DataProfile
    from finetuner.model.shapes import ModelShape

#: Examples per optimizer step when the user gives none and the data are large enough.
DEFAULT_EFFECTIVE_BATCH = 16
#: Sequence length when neither the user nor the data say.
DEFAULT_SEQ_LEN = 2048
#: Sequence length packed rows are filled to (capped by the model's positions).
PACKED_SEQ_LEN = 2048
#: Fewer optimizer steps per epoch than this and the effective batch is lowered.
MIN_STEPS_PER_EPOCH = 8
#: Pack only when the packed data give at least this many optimizer steps per epoch.
MIN_STEPS_PER_EPOCH_TO_PACK = 50
#: Epochs are raised until the run has at least this many optimizer steps ...
MIN_TOTAL_STEPS = 100
#: ... but never beyond this many passes over the data.
MAX_EPOCHS = 10
#: Below this many training examples the plan says the data set is small.
FEW_EXAMPLES = 200
#: ``data.replay`` the plan sets for a small SFT file whose rows carry a system prompt, on one process. Measured
#: (scripts/bench/replay_guard.py, docs/replay_guard.json, SmolLM2-135M's default plan, twice): on such a file (a
#: ferry desk's 40 chats) the unguarded runs answered 1 and 2 of 3 simple facts asked without the system prompt
#: (10 and 9 epochs), the guarded ones 3 of 3, the file's style kept (8 of 8 held-out answers signed), the probe
#: 37 -> 40 and 40 -> 41 of the base's 47; on a file without a system prompt (bike_shop) the guard kept no more
#: facts (2 -> 1 of 3), so it is not set there.
REPLAY_FOR_SYSTEM_PROMPT = 0.25
#: Why rows with pictures are not packed (the data pipeline refuses ``data.packing: true`` on them).
NO_PACK_PICTURES = "no packing: the rows have pictures, which are not packed"
#: Learning rates at hidden size ``REFERENCE_HIDDEN`` (the common 7B LoRA and full settings).
REFERENCE_LR = {"lora": 2e-4, "qlora": 2e-4, "full": 2e-5}
REFERENCE_HIDDEN = 4096
MAX_LR_SCALE = 10.0
#: An objective's own learning rates, epoch cap and default batch are in its description
#: (:class:`~finetuner.objectives.specs.base.ObjectiveSpec`: ``learning_rates``, ``max_epochs``, ``default_effective_batch``).


@dataclass
class Sizing:
    """What :func:`size_run` chose, and why (one line per choice)."""

    seq_len: int
    packing: bool
    val_size: float
    effective_batch: int
    epochs: int | None
    train_rows: int | None
    steps_per_epoch: int | None
    eval_every: int
    save_every: int
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: data.replay chosen for the run (0: none)
    replay: float = 0.0
    #: the sequence capped below the longest row (a few outliers), None when it is not
    cap: LengthCap | None = None

    @property
    def total_steps(self) -> int | None:
        return None if self.steps_per_epoch is None or self.epochs is None else total_steps(self.epochs, self.steps_per_epoch)


def learning_rate(method: str, shape: ModelShape, objective: str | None = None) -> tuple[float, str]:
    """The planned learning rate for ``method`` and ``objective`` on ``shape`` (one significant digit), and the reason."""
    spec = spec_of(objective)
    rates = spec.learning_rates or REFERENCE_LR
    base = rates.get(method, rates["lora"])
    scale = min(MAX_LR_SCALE, math.sqrt(REFERENCE_HIDDEN / max(1, shape.hidden_size)))
    lr = float(f"{base * max(1.0, scale):.1g}")
    what = "LoRA" if method in ("lora", "qlora") else "full fine-tuning"
    if spec.lr_source:
        what = f"{spec.label} {what} ({spec.lr_source.get(method, spec.lr_source['lora'])})"
    hidden = shape.hidden_size
    if hidden == REFERENCE_HIDDEN:
        return lr, f"learning rate {lr:g}: the usual {what} rate for 7B-class models (hidden size {REFERENCE_HIDDEN})"
    if hidden > REFERENCE_HIDDEN:
        return lr, (f"learning rate {lr:g}: the usual {what} rate for 7B-class models (hidden size {REFERENCE_HIDDEN}), "
                    f"not raised for this wider model (hidden size {hidden})")
    if lr == base:
        return lr, (f"learning rate {lr:g}: the usual {what} rate {base:g} (hidden size {REFERENCE_HIDDEN}); "
                    f"scaled by sqrt({REFERENCE_HIDDEN}/{hidden}) for hidden size {hidden} it rounds to the same")
    return lr, (f"learning rate {lr:g}: the usual {what} rate {base:g} (hidden size {REFERENCE_HIDDEN}) scaled by "
                f"sqrt({REFERENCE_HIDDEN}/{hidden}) for this narrower model")


def _held_out(rows: int) -> tuple[float, int]:
    """``data.val_size`` for ``rows`` examples, and how many rows it holds out."""
    val_size = held_out_size(rows)
    return val_size, held_out_rows(val_size, rows)


def _pow2_floor(n: float) -> int:
    return 1 << max(0, int(math.floor(math.log2(max(1.0, n)))))


def data_sequence(profile: DataProfile, positions: int, objective: str | None = None,
                  max_new_tokens: int = 0) -> tuple[int, str, LengthCap | None]:
    """The sequence the data need before any packing (the module doc's rule): ``(length, why, cap)``, the cap set
    when a few outlier rows are cut (:func:`~finetuner.planning.length_cap.outlier_cap`; ``why`` is then empty: the
    cap's :meth:`~finetuner.planning.length_cap.LengthCap.reason` says it). GRPO's is its longest prompt plus
    ``max_new_tokens``, never capped. The plan and a recipe's ``data.max_seq_len: auto`` both take it from here."""
    spec = spec_of(objective)
    grpo = spec.generates
    cap = None if grpo else outlier_cap(profile, positions, spec.whole_sequences)
    if cap is not None:
        return cap.seq, "", cap
    longest = profile.max_tokens + max_new_tokens
    what = (f"the longest prompt ({profile.max_tokens} tokens) + grpo.max_new_tokens ({max_new_tokens})" if grpo
            else f"the longest example ({longest} tokens)")
    if longest > positions:
        return positions, f"the model's {positions} positions ({what} = {longest} tokens)", None
    return min(round_up(longest, SEQ_ROUND), positions), f"{what} rounded up to a multiple of {SEQ_ROUND}", None


def replay_share(profile: DataProfile, train_rows: int, objective: str | None = None, gpus: int = 1) -> tuple[float, str]:
    """``data.replay`` for ``train_rows`` training rows of ``profile``: ``REPLAY_FOR_SYSTEM_PROMPT`` for a small SFT
    file on one process whose rows (at least half of them) carry a system prompt, else 0; and why not, when 0. The
    plan and a recipe's ``data.replay: auto`` both take it from here."""
    spec = spec_of(objective)
    objective = spec.name
    if not spec.replay:
        return 0.0, f"objective {objective}: the base's answers are mixed into SFT rows only"
    if gpus > 1:
        return 0.0, f"{gpus} processes: the base's answers are mixed in on one process only"
    if profile.pictures:
        return 0.0, "the rows have pictures: the base's text answers are not mixed into a picture run"
    if train_rows >= FEW_EXAMPLES:
        return 0.0, f"{train_rows} training rows, not a small set (under {FEW_EXAMPLES})"
    if not profile.system_rows * 2 >= profile.rows > 0:
        return 0.0, (f"{profile.system_rows} of {profile.rows} rows carry a system prompt (not half): measured on such "
                     "a file, the guard kept no more facts (docs/replay_guard.json)")
    return REPLAY_FOR_SYSTEM_PROMPT, ""


def replay_reason(replay: float, replayed: int, train_rows: int) -> str:
    """Why the run mixes ``replayed`` answers of the base (``data.replay`` ``replay``) into ``train_rows`` rows."""
    return (f"data.replay {replay:g}: {replayed} answers the base model itself gives to general prompts (asked without "
            f"your system prompt) are mixed into your {train_rows} examples, because they carry a system prompt: "
            "measured twice on such a file, fine-tunes without them answered 1 and 2 of 3 simple facts asked without the "
            "system prompt, with them 3 of 3, their style still learned (docs/replay_guard.json)")


def size_run(
    shape: ModelShape,
    profile: DataProfile | None = None,
    *,
    seq_len: int | None = None,
    effective_batch: int | None = None,
    gpus: int = 1,
    objective: str | None = None,
    seed: int = 42,
    max_new_tokens: int = 0,
    epochs: int | None = None,
) -> Sizing:
    """Choose the data-dependent settings of a run (see the module doc for the rules). ``max_new_tokens``:
    GRPO's longest completion, added to the longest prompt (``profile`` holds prompts then); ``epochs``: the
    passes over the data as asked (default: the rule above)."""
    spec = spec_of(objective)
    objective = spec.name
    preference = spec.whole_sequences
    grpo = spec.generates
    units_word = spec.units
    no_pack = ("no packing: grpo generates a group of completions for each prompt" if grpo else
               f"no packing: {objective} scores each response as a whole sequence")
    reasons: list[str] = []
    notes: list[str] = []
    positions = shape.max_position_embeddings
    if seq_len is not None and seq_len > positions:
        notes.append(f"--seq-len {seq_len} is longer than the model's {positions} positions: using {positions}")
        seq_len = positions
    eff_given = effective_batch is not None
    default_eff = spec.default_effective_batch or DEFAULT_EFFECTIVE_BATCH
    eff = effective_batch or default_eff
    if profile is None:
        seq = seq_len or min(DEFAULT_SEQ_LEN, positions)
        if preference:
            return Sizing(seq, False, 0.02, eff, epochs or 1, None, None, 200, 200,
                          reasons=[f"sequence {seq}, not packed ({no_pack.removeprefix('no packing: ')}): "
                                   + ("as asked" if seq_len else "no data to measure")], notes=notes)
        # without data to measure, assume instruction data (short examples): packed
        return Sizing(seq, True, 0.02, eff, epochs or 1, None, None, 200, 200,
                      reasons=[f"sequence {seq} packed: " + ("as asked" if seq_len else "no data to measure")], notes=notes)

    val_size, n_val = _held_out(profile.rows)
    train_rows = max(1, profile.rows - n_val)
    longest = profile.max_tokens + max_new_tokens
    if seq_len is not None:
        seq, why_seq, length_cap = seq_len, "as asked", None
    else:
        seq, why_seq, length_cap = data_sequence(profile, positions, objective, max_new_tokens)
    packing = False
    if preference:
        reasons.append(no_pack)
    elif profile.pictures:
        reasons.append(NO_PACK_PICTURES)
    elif profile.should_pack(seq) or (seq_len is None and profile.should_pack(min(PACKED_SEQ_LEN, positions))):
        pack_seq = seq if seq_len is not None else max(seq, min(PACKED_SEQ_LEN, positions))
        packed_rows = max(1, math.ceil(profile.mean_tokens * train_rows / pack_seq))
        if packed_rows / eff >= MIN_STEPS_PER_EPOCH_TO_PACK:
            packing, seq = True, pack_seq
            why_seq = (f"{seq} packed: examples average {profile.mean_tokens:.0f} tokens, under half the sequence, and "
                       f"{train_rows} of them fill ~{packed_rows} packed rows (no attention between examples)")
        else:
            reasons.append(f"no packing: {train_rows} examples would fill only ~{packed_rows} packed rows "
                           f"of {pack_seq} tokens, too few optimizer steps")
    cut = profile.truncated(seq - max_new_tokens) if not packing else 0
    if length_cap is not None and packing:  # packed at the cap or longer: the rows still longer than the packed rows are cut
        length_cap = replace(length_cap, seq=seq, cut=profile.truncated(seq)) if profile.truncated(seq) else None
    if length_cap is not None:
        reasons.insert(0, length_cap.reason(units_word, why_seq.removeprefix(f"{seq} ") if packing else None))
    elif cut and grpo:
        notes.append(f"{cut} of {profile.rows} prompts are longer than {seq - max_new_tokens} tokens (data.max_seq_len - "
                     f"grpo.max_new_tokens; longest {profile.max_tokens}): the run stops at them (data.on_bad_row: skip "
                     "skips them)")
    elif cut:
        notes.append(f"{cut} of {profile.rows} examples are longer than {seq} tokens (longest {longest}) and will be truncated")
    if length_cap is None:
        reasons.insert(0, f"sequence {seq}: {why_seq}")

    # packed rows counted as the trainer packs them (its split, its seeded greedy packing)
    units = count_packed_rows(profile.lengths, n_val, seq, seed) if packing else train_rows
    replay, replayed = replay_share(profile, train_rows, objective, gpus)[0], 0
    if replay:
        from finetuner.data.replay import load_prompts, replay_count

        replayed = replay_count(replay, train_rows, len(load_prompts()))
        units += replayed  # packed apart, each a row of its own, as the trainer takes them
    if not eff_given:
        while eff > max(1, gpus) and units / eff < MIN_STEPS_PER_EPOCH:
            eff //= 2
        eff = max(eff, gpus)
        if eff < default_eff:
            reasons.append(f"effective batch {eff} (not {default_eff}): {train_rows} training {units_word} "
                           f"give {steps_per_epoch(units, eff)} optimizer steps per epoch")
    per_epoch = steps_per_epoch(units, eff)
    max_epochs = spec.max_epochs or MAX_EPOCHS
    asked_epochs = epochs
    epochs = asked_epochs or min(max_epochs, max(1, math.ceil(MIN_TOTAL_STEPS / per_epoch)))
    total = total_steps(epochs, per_epoch)
    about = ""  # packed rows are counted as the run packs them
    if asked_epochs:
        reasons.append(f"{epochs} epoch{'s' if epochs > 1 else ''} (as asked): {per_epoch} steps per epoch, {total} optimizer steps")
    elif epochs > 1:
        kind = "GRPO" if grpo else "preference"
        cap = f" (at most {max_epochs}{' for ' + objective + f': {kind} recipes train about one epoch' if preference else ''})" if epochs == max_epochs else ""
        reasons.append(f"{epochs} epochs{cap}: {about}{per_epoch} steps per epoch, {about}{total} optimizer steps in all "
                       f"(at least {MIN_TOTAL_STEPS} wanted)")
    else:
        reasons.append(f"1 epoch: {about}{per_epoch} optimizer steps")
    if grpo:
        reasons.append(f"held out: {n_val} prompts for the held-out mean reward" if n_val else
                       f"no held-out prompts: {profile.rows} rows are too few to spare any")
    else:
        reasons.append(f"held out: {n_val} examples for the eval loss" if n_val else
                       f"no held-out examples: {profile.rows} rows are too few to spare any")
    if train_rows < FEW_EXAMPLES and not grpo:
        # a toy model picks up no style worth the name: the plan's expectation note says what it does instead
        expect = "" if is_toy(shape) else "expect the model to pick up their format and style rather than new knowledge; "
        notes.append(
            f"{train_rows} training examples is a small data set: {expect}a few hundred to a few thousand examples "
            "fine-tune better. Watch the eval loss: "
            "when it rises while the train loss falls, the model is memorising (lower training.epochs); the run keeps the "
            "adapter of its lowest eval loss (training.keep_best) and training.early_stopping_patience ends it sooner"
        )
    every = max(10, min(500, round_up(max(1, total // 5), 10)))
    if replay:
        reasons.append(replay_reason(replay, replayed, train_rows))
    return Sizing(seq, packing, val_size, eff, epochs, train_rows, per_epoch, every, every, reasons, notes, replay, length_cap)

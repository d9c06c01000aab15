"""Preference accuracy and margin of the base model and the fine-tune on held-out pairs.

``finetuner eval RUN --data PAIRS`` (or a preference run's own validation split) comes here
(:func:`finetuner.infer.evaluate.evaluate_run` hands pairs over). For each pair, each model's
log-probability of the chosen and of the rejected response is summed over the response tokens
(:func:`finetuner.model.scoring.sequence_logps`, the trainer's own scoring): a model
*prefers* the chosen response when it gives it the higher log-probability. Reported per model:

* ``accuracy``: the fraction of pairs it prefers the chosen response of;
* ``margin``: the mean of (chosen − rejected) log-probability, in nats;
* ``accuracy_per_token``, ``margin_per_token``: the same on log-probabilities averaged over each
  response's tokens (SimPO's and ORPO's view; summed log-probabilities favour the shorter response).

And, as the training events report it, the implicit reward of the fine-tune against the base
(DPO's, with the base as the reference): ``reward_accuracy``, the fraction of pairs whose chosen
response gained more log-probability than the rejected one, and ``reward_margin``, the mean of
that gain difference. Both models come from one loaded model (the base is the adapter switched off).

A preference run that started from a finished SFT run (``preference.start_from``) is compared with
that SFT model instead of the bare base: it is the model the preference run set out to improve, and
its reference. ``compared_with`` says which model the ``base`` column is.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.objectives.specs import spec_of
from finetuner.errors import UserError


@dataclass
class PreferenceScore:
    accuracy: float
    margin: float
    accuracy_per_token: float
    margin_per_token: float
    tokens: int  # scored response tokens, chosen and rejected


@dataclass
class PreferenceEvalResult:
    """Preference accuracy and margin of ``base`` and ``fine_tuned`` on ``examples`` held-out pairs."""

    source: str
    data: str
    examples: int
    base: PreferenceScore
    fine_tuned: PreferenceScore
    reward_accuracy: float
    reward_margin: float
    #: what the ``base`` scores are of: ``base`` (the adapter switched off) or ``start: RUN`` (the SFT
    #: run the preference run started from)
    compared_with: str = "base"
    kind: str = "preference"
    samples: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    #: what the pairs are to the run: ``held-out``, ``training`` or ``other`` (:func:`examples_are`)
    examples_are: str = "held-out"

    def describe(self) -> str:
        """One line on what was scored: ``40 held-out pairs from ...``."""
        return describe_examples(self.examples, "pairs", self.data, self.examples_are, "the scores show")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        before = "base" if self.compared_with == "base" else "SFT start"
        rows = [("", before, "fine-tuned"),
                ("preference accuracy", f"{self.base.accuracy:.1%}", f"{self.fine_tuned.accuracy:.1%}"),
                ("log-prob margin", f"{self.base.margin:.3f}", f"{self.fine_tuned.margin:.3f}"),
                ("accuracy per token", f"{self.base.accuracy_per_token:.1%}", f"{self.fine_tuned.accuracy_per_token:.1%}"),
                ("margin per token", f"{self.base.margin_per_token:.3f}", f"{self.fine_tuned.margin_per_token:.3f}"),
                (f"reward accuracy (vs {before})", "", f"{self.reward_accuracy:.1%}")]
        w = max(len(r[0]) for r in rows)
        table = "\n".join(f"{a:<{w}}  {b:>10}  {c:>10}" for a, b, c in rows)
        if self.compared_with != "base":
            table += f"\n{before}: the model of the SFT run the preference run started from ({self.compared_with[len('start: '):]})"
        return table


def held_out_pairs(src, tokenizer, data: str | Path | None, max_seq_len: int | None = None):
    """The tokenized held-out pairs and where they came from: ``data``, or the run's validation split."""
    from finetuner.config.sections import DataSection
    from finetuner.data.formats import AUTO_OBJECTIVE
    from finetuner.data.preference import prepare_preference_data

    reader = AUTO_OBJECTIVE["pairs"]  # the pairs are read as the objective a file of pairs trains by default reads them
    recipe = src.recipe
    if data is not None:
        base_cfg = recipe.data.model_dump() if recipe is not None else {}
        base_cfg.update(path=str(Path(data).expanduser().resolve()), format="auto", columns=None, val_size=0.0,
                        val_path=None, packing=False, max_examples=None, train_on_prompt=False)
        if max_seq_len:
            base_cfg["max_seq_len"] = max_seq_len
        return prepare_preference_data(DataSection.model_validate(base_cfg), reader, tokenizer, seed=0).train, str(data)
    cfg = recipe.data
    if not cfg.val_path and not cfg.val_size:
        raise UserError(f"The run {src.path} kept no held-out pairs (data.val_size is 0 and there is no data.val_path).",
                        hint="Pass a file of pairs with --data.")
    prepared = prepare_preference_data(cfg, reader, tokenizer, recipe.training.seed)
    return prepared.val, cfg.val_path or f"the run's validation split ({len(prepared.val)} pairs of {cfg.path})"


def describe_examples(count: int, unit: str, data: str, relation: str, measure: str) -> str:
    """One line on what an eval scored: ``12 held-out examples from FILE``; for the run's own training
    rows, that ``measure`` (``the loss shows``) how well the fine-tune fits them, not new ones."""
    if relation == "held-out":
        return f"{count} held-out {unit} from {data}"
    if relation == "training":
        return (f"{count} {unit} from {data}, the run's training data: {measure} how well the fine-tune fits "
                f"what it trained on, not how it does on new {unit}")
    return f"{count} {unit} from {data}"


def examples_are(recipe, data: str | Path | None) -> str:
    """What the examples of ``data`` are to the run of ``recipe``: ``held-out`` (no ``data``: the run's
    own validation split or data.val_path), ``training`` (a file the run trained on) or ``other``."""
    if data is None:
        return "held-out"
    trained = recipe.data.path if recipe is not None else []
    trained = {str(Path(p).resolve()) for p in ([trained] if isinstance(trained, str) else trained)}
    return "training" if str(Path(data).resolve()) in trained else "other"


def _scores(model, collate, pairs, batch_size: int, device: str, who: str):
    """Summed log-probabilities of every pair's chosen and rejected responses under ``who`` (the fine-tune, the
    model before it), their numbers of scored tokens, and the scored tokens in all."""
    import torch

    from finetuner.model.scoring import sequence_logps

    chosen, rejected, n_chosen, n_rejected, tokens = [], [], [], [], 0
    with torch.no_grad(), phases.phase("eval", total=len(pairs), unit="pairs", label=f"preference scores of {who}") as p:
        for i in range(0, len(pairs), batch_size):
            batch = collate(pairs[i : i + batch_size])
            batch = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items()}
            sums, counts = sequence_logps(model, batch, 1024)
            n = batch["idx"].numel()
            chosen.append(sums[:n].float().cpu())
            rejected.append(sums[n:].float().cpu())
            n_chosen.append(counts[:n].clamp(min=1).float().cpu())
            n_rejected.append(counts[n:].clamp(min=1).float().cpu())
            tokens += int(counts.sum())
            p.advance(n)
    return torch.cat(chosen), torch.cat(rejected), torch.cat(n_chosen), torch.cat(n_rejected), tokens


def evaluate_pairs(src, tokenizer, data, batch_size: int, device: str, load_model) -> PreferenceEvalResult:
    """Score the held-out pairs with the fine-tune and the base (see the module's docstring)."""
    from finetuner.data.preference import PreferenceCollator

    t0 = time.perf_counter()
    pairs, what = held_out_pairs(src, tokenizer, data)
    if not pairs:
        raise UserError(f"No pairs to evaluate in {what}.")
    collate = PreferenceCollator(tokenizer.pad_token_id)
    start = _start_run(src)
    if start is not None or src.kind == "full":  # two models, one after the other: the fine-tune, then the one before it
        tuned_model, dev = load_model(src, adapter=True, device=device)
        tc, tr, nc, nr, tokens = _scores(tuned_model, collate, pairs, batch_size, dev, "the fine-tune")
        del tuned_model
        # before = the SFT run it started from (its adapter on), or a full fine-tune's base
        before_src, before_adapter = (start, True) if start is not None else (src, False)
        before, dev = load_model(before_src, adapter=before_adapter, device=device)
        bc, br, *_ = _scores(before, collate, pairs, batch_size, dev, "the model before it")
        del before
    else:
        model, dev = load_model(src, adapter=True, device=device)
        tc, tr, nc, nr, tokens = _scores(model, collate, pairs, batch_size, dev, "the fine-tune")
        with model.disable_adapter():
            bc, br, *_ = _scores(model, collate, pairs, batch_size, dev, "the base model")

    def score(c, r) -> PreferenceScore:
        ac, ar = c / nc, r / nr
        return PreferenceScore(round(float((c > r).float().mean()), 6), round(float((c - r).mean()), 6),
                               round(float((ac > ar).float().mean()), 6), round(float((ac - ar).mean()), 6), tokens)

    gain = (tc - bc) - (tr - br)
    return PreferenceEvalResult(
        source=str(src.path), data=what, examples=len(pairs), base=score(bc, br), fine_tuned=score(tc, tr),
        reward_accuracy=round(float((gain > 0).float().mean()), 6), reward_margin=round(float(gain.mean()), 6),
        compared_with="base" if start is None else f"start: {start.path}", seconds=round(time.perf_counter() - t0, 2),
        examples_are=examples_are(src.recipe, data),
    )


def _start_run(src):
    """The source of the finished SFT run a preference run started from (``preference.start_from``), or None."""
    from finetuner.infer.loading import resolve_source

    recipe = src.recipe
    if recipe is None or spec_of(recipe.objective).section != "preference" or not recipe.preference.start_from:
        return None
    start = recipe.preference.start_from
    if not Path(start).is_dir():
        raise UserError(f"{src.path}: the run started from {start}, which no longer exists: its model is the one to compare with.",
                        hint="Restore that run folder (its adapter/ is what the comparison loads).")
    return resolve_source(start, trust_remote_code=src.allow_code, allow_pickle=src.allow_pickle_files)

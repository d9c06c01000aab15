"""Preference objectives: DPO (and IPO, cDPO), ORPO, SimPO and KTO on the trainer's steps.

A micro-batch of ``n`` pairs is one forward pass over ``2n`` rows, the chosen responses then the
rejected ones (:class:`finetuner.data.preference.PreferenceCollator`; KTO: the rated responses
then their mismatched pairs). :func:`finetuner.model.scoring.sequence_logps` sums each row's log-probabilities over its
response tokens, computing the logits ``loss_chunk_size`` scored tokens at a time through the LM
head (as the SFT loss does): the ``tokens × vocab`` logits never exist at once.

The reference model (DPO, KTO) is the policy's own base:

* ``preference.reference: adapter_off`` (the default with a fresh adapter): the same weights with
  the adapter switched off (peft's ``disable_adapter()``), under ``no_grad``, each micro-batch; no
  second copy of the weights, and for QLoRA the same 4-bit base.
* ``precomputed``: the model as training starts, scored once over the training and validation
  examples before the first step (in evaluation mode) and kept in the run folder
  (``reference_logps.pt``), so a resumed run reads them back. Starting from a finished SFT run
  (``preference.start_from``) uses this: the step-0 model is the base with the SFT adapter on,
  which is exactly the SFT model the reference should be; switching the adapter off would give
  the base instead. A full fine-tune (no adapter) uses it too.

The losses (:mod:`finetuner.losses.preference`: ``dpo_loss``, ``orpo_loss``, ``simpo_loss``, ``kto_loss``) take
per-sequence log-probabilities and return the per-example losses and the rewards the events
report. A step's loss is the mean over the step's examples, whatever its split into micro-batches.

On several processes (:mod:`finetuner.training.distributed`) each rank sums the rewards of its own
micro-batches (:class:`StepMetrics`), not those of the zero-weight pass a rank with fewer
micro-batches runs (:meth:`PreferenceObjective.uncounted`); the trainer sums them over the ranks
with the step's loss, so every rank holds, and rank 0 reports, the rewards of all the step's
examples. Evaluation and the ``precomputed`` scores are computed whole on every rank from the same
weights: the same numbers everywhere, as on one process. KTO's reference point ``z`` is a
micro-batch's, so KTO (on one process or several) depends on how a step is cut into micro-batches.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.config.recipe import Recipe
from finetuner.config.recipe_yaml import load_yaml
from finetuner.config.sections import REFERENCE_OBJECTIVES, LoraSection
from finetuner.data.preference import PreferenceCollator, prepare_preference_data
from finetuner.errors import UserError
from finetuner.losses.preference import dpo_loss, kto_loss, orpo_loss, simpo_loss
from finetuner.model.scoring import sequence_logps
from finetuner.objectives.base import Objective, loss_module, register

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.pt"


def _read_reference(path: Path, sizes: dict[str, int]) -> dict[str, Any] | None:
    """The reference scores saved in ``path`` (``{split: tensor of shape (rows, 2)}``), read as
    plain tensors only (``weights_only``: a planted pickle runs no code); None when the file is
    missing, unreadable, or made for other data (then the caller computes the scores again: they
    are the step-0 model's, so the result is the same)."""
    import torch

    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
        fits = (isinstance(saved, dict) and set(saved) == set(sizes)
                and all(isinstance(v, torch.Tensor) and tuple(v.shape) == (sizes[k], 2) and bool(v.isfinite().all())
                        for k, v in saved.items()))
    except Exception as e:  # noqa: BLE001 - truncated, not a torch file, or a pickle of something else
        log.warning("%s cannot be read (%s: %s); computing the reference scores again.", path, type(e).__name__, str(e)[:200])
        return None
    if not fits:
        log.warning("%s does not hold the reference scores of this data; computing them again.", path)
        return None
    return saved


class StepMetrics:
    """Sums over a step's (or an evaluation's) examples of the rewards the events report.

    On several processes each rank sums its own micro-batches; :meth:`totals` and
    :meth:`from_totals` carry the sums through the step's all-reduce, so the step's rewards are
    those of all its examples, as on one process."""

    #: the sums, in the order of :meth:`totals`
    FIELDS = ("n", "n_chosen", "n_rejected", "chosen", "rejected", "correct", "loss")

    def __init__(self) -> None:
        self.n = self.n_chosen = self.n_rejected = 0
        self.chosen = self.rejected = self.correct = self.loss = 0.0

    def totals(self) -> list[float]:
        return [float(getattr(self, f)) for f in self.FIELDS]

    @classmethod
    def from_totals(cls, values) -> StepMetrics:
        out = cls()
        for f, v in zip(cls.FIELDS, values, strict=True):
            setattr(out, f, round(v) if f.startswith("n") else float(v))
        return out

    def add_pairs(self, chosen, rejected) -> None:
        self.n += len(chosen)
        self.n_chosen += len(chosen)
        self.n_rejected += len(rejected)
        self.chosen += float(chosen.sum())
        self.rejected += float(rejected.sum())
        self.correct += float((chosen > rejected).sum())

    def add_rated(self, rewards, desirable) -> None:
        self.n += len(rewards)
        self.n_chosen += int(desirable.sum())
        self.n_rejected += int((~desirable).sum())
        self.chosen += float(rewards[desirable].sum())
        self.rejected += float(rewards[~desirable].sum())
        self.correct += float(((rewards > 0) == desirable).sum())

    def to_dict(self, prefix: str = "") -> dict[str, float]:
        chosen = self.chosen / max(self.n_chosen, 1)
        rejected = self.rejected / max(self.n_rejected, 1)
        return {
            f"{prefix}reward_chosen": round(chosen, 6),
            f"{prefix}reward_rejected": round(rejected, 6),
            f"{prefix}reward_margin": round(chosen - rejected, 6),
            f"{prefix}reward_accuracy": round(self.correct / max(self.n, 1), 6),
        }


@register("dpo", "orpo", "simpo", "kto")
class PreferenceObjective(Objective):
    """What the trainer asks of a preference objective: its data, its collator, the loss of a
    micro-batch, the reference scores, and the rewards of a step and of an evaluation."""

    def __init__(self, recipe: Recipe, run_dir: Path | None = None):
        super().__init__(recipe, run_dir)
        self.data_kind = "rated" if self.name == "kto" else "pairs"
        self.settings = recipe.preference
        self.beta = self.settings.beta_for(self.name)
        self.needs_reference = self.name in REFERENCE_OBJECTIVES
        self.precomputed = self.needs_reference and self.settings.reference == "precomputed"
        self.reference: dict[str, Any] = {}
        self.metrics = StepMetrics()

    # ---------------------------------------------------------------- set-up
    def prepare_data(self, tokenizer, processor=None):
        r = self.recipe
        return prepare_preference_data(r.data, self.name, tokenizer, r.training.seed)

    def collator(self, pad_token_id: int) -> PreferenceCollator:
        return PreferenceCollator(pad_token_id)

    def adopt(self, recipe: Recipe) -> Recipe:
        """The recipe with the LoRA settings of the SFT run it starts from (its adapter must fit)."""
        start = self.settings.start_from
        if not start:
            return recipe
        saved = Path(start) / "recipe.yaml"
        try:
            sft = load_yaml(saved.read_text(encoding="utf-8"), str(saved))
        except OSError as e:
            raise UserError(f"preference.start_from: cannot read {saved} ({e}).",
                            hint="Start from the folder of a finished finetuner run.") from None
        base = (sft.get("model") or {}).get("name")
        if base and Path(base).name != Path(recipe.model.name).name and base != recipe.model.name:
            raise UserError(
                f"preference.start_from: the run {start} trained an adapter for {base}, and this recipe's model is "
                f"{recipe.model.name}.",
                hint=f"Set model.name to {base}, or start from a run on {recipe.model.name}.",
            )
        lora = LoraSection(**sft.get("lora", {}))
        if lora != recipe.lora:
            log.info("preference.start_from: LoRA settings of %s adopted (r=%s).", start, lora.r)
        self.recipe = recipe.model_copy(update={"lora": lora})
        return self.recipe

    def on_model(self, model) -> None:
        """Put the SFT run's adapter weights into the freshly attached adapter."""
        if not self.settings.start_from:
            return
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(self.settings.start_from) / "adapter" / "adapter_model.safetensors"
        if not path.is_file():
            raise UserError(f"preference.start_from: {path} is missing.", hint="Start from a finished LoRA run.")
        result = set_peft_model_state_dict(model, load_file(str(path)))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing:
            raise UserError(f"preference.start_from: the adapter in {path.parent} does not fit this model ({missing[0]} is missing).")
        log.info("Starting from the adapter of %s.", self.settings.start_from)

    def prepare(self, trainer) -> None:
        """``precomputed``: the reference scores of every example, read from the run folder or
        computed now with the model as it starts (before any checkpoint is applied). On several
        processes every rank scores every example (the same weights: the same scores) and rank 0
        writes the file, atomically, so a rank that finds it already there reads the same numbers."""
        if not self.precomputed:
            return
        import torch

        path = self.run_dir / REFERENCE_FILE
        sizes = {"train": len(trainer.data.train), "val": len(trainer.data.val or [])}
        saved = _read_reference(path, sizes)
        if saved is not None:
            self.reference = saved
            return
        was_training = trainer.model.training
        trainer.model.eval()
        mbs = trainer.recipe.training.micro_batch_size
        with torch.no_grad():
            for split in ("train", "val"):
                data = getattr(trainer.data, split) or []
                out = torch.zeros(len(data), 2)
                for i in range(0, len(data), mbs):
                    batch = trainer.to_device(trainer.collate([data[j] for j in range(i, min(i + mbs, len(data)))]))
                    with trainer.autocast():
                        sums, _ = sequence_logps(trainer.model, batch, trainer.recipe.training.loss_chunk_size)
                    n = batch["idx"].numel()
                    out[batch["idx"].cpu(), 0], out[batch["idx"].cpu(), 1] = sums[:n].float().cpu(), sums[n:].float().cpu()
                self.reference[split] = out
        trainer.model.train(was_training)
        if trainer.rank == 0:  # written whole or not at all
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save(self.reference, tmp)
            tmp.replace(path)

    # ---------------------------------------------------------------- a micro-batch
    def loss_sum(self, model, batch: dict[str, Any], chunk_size: int, split: str = "train", metrics: StepMetrics | None = None):
        """The sum of the micro-batch's per-example losses; its rewards go to ``metrics``
        (default: the step's)."""
        import torch

        metrics = metrics if metrics is not None else self.metrics
        n = batch["idx"].numel()
        policy, counts = sequence_logps(model, batch, chunk_size)
        counts = counts.clamp(min=1).to(policy.dtype)
        ref = None
        if self.needs_reference:
            if self.precomputed:
                ref = self.reference[split][batch["idx"].cpu()].T.reshape(-1).to(policy.device)
            else:
                with torch.no_grad(), model.disable_adapter():
                    ref, _ = sequence_logps(model, batch, chunk_size)
        s = self.settings
        if self.name == "kto":
            losses, rewards = kto_loss(policy[:n], ref[:n], policy[n:], ref[n:], batch["desirable"], self.beta,
                                       s.desirable_weight, s.undesirable_weight)
            metrics.add_rated(rewards.float().cpu(), batch["desirable"].cpu())
        else:
            pc, pr, nc, nr = policy[:n], policy[n:], counts[:n], counts[n:]
            if self.name == "dpo":
                losses, rc, rr = dpo_loss(pc, pr, ref[:n], ref[n:], self.beta, s.loss_type, s.label_smoothing, nc, nr)
            elif self.name == "orpo":
                losses, rc, rr = orpo_loss(pc, pr, nc, nr, s.orpo_weight)
            else:
                losses, rc, rr = simpo_loss(pc, pr, nc, nr, self.beta, s.gamma)
            metrics.add_pairs(rc.float().cpu(), rr.float().cpu())
        metrics.loss += float(losses.detach().sum())
        return losses.sum()

    def step_loss_module(self, model, chunk_size: int, fused_ce=None):
        """The module a step's forward goes through (DDP wraps it, as the SFT one); the fused
        cross-entropy is SFT's only."""
        return loss_module(model, lambda m, batch: self.loss_sum(m, batch, chunk_size))

    def start_step(self, examples: list[dict[str, Any]]) -> int:
        """A step (or its retry after an out-of-memory back-off) begins: the rewards are summed
        afresh; returns what the step's loss sum is divided by, its number of examples."""
        self.metrics = StepMetrics()
        return len(examples)

    @contextlib.contextmanager
    def uncounted(self):
        """A pass whose examples are not the step's (the zero-weight pass a rank with fewer
        micro-batches runs so that the ranks' collectives stay in step): its rewards go nowhere."""
        kept, self.metrics = self.metrics, StepMetrics()
        try:
            yield
        finally:
            self.metrics = kept

    def step_totals(self) -> list[float]:
        """This process's sums of the step's rewards, to be summed over the ranks (:meth:`set_step_totals`)."""
        return self.metrics.totals()

    def set_step_totals(self, values) -> None:
        """The step's sums over all ranks (what :meth:`step_totals` gave, summed)."""
        self.metrics = StepMetrics.from_totals(values)

    def step_metrics(self) -> dict[str, float]:
        """The rewards of the step just taken (over all ranks), and a fresh sum for the next."""
        out = self.metrics.to_dict()
        self.metrics = StepMetrics()
        return out

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, trainer) -> tuple[float | None, dict[str, float]]:
        """Mean loss and rewards over the validation examples."""
        import torch

        if not trainer.data.val:
            return None, {}
        metrics = StepMetrics()
        trainer.model.eval()
        mbs = trainer.recipe.training.micro_batch_size
        val = trainer.data.val
        with torch.no_grad(), trainer.evaluation():
            for i in range(0, len(val), mbs):
                batch = trainer.to_device(trainer.collate(val[i : i + mbs]))
                with trainer.autocast():
                    self.loss_sum(trainer.model, batch, trainer.recipe.training.loss_chunk_size, "val", metrics)
                phases.advance(len(val[i : i + mbs]))  # the trainer's "eval" phase
        trainer.model.train()
        loss = metrics.loss / max(metrics.n, 1)
        return loss, metrics.to_dict("eval_")


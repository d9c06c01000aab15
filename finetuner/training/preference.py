"""Preference objectives: DPO (and IPO, cDPO), ORPO, SimPO and KTO on the trainer's steps.

A micro-batch of ``n`` pairs is one forward pass over ``2n`` rows, the chosen responses then the
rejected ones (:class:`finetuner.data.preference.PreferenceCollator`; KTO: the rated responses
then their mismatched pairs). :func:`sequence_logps` sums each row's log-probabilities over its
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

The losses (:func:`dpo_loss`, :func:`orpo_loss`, :func:`simpo_loss`, :func:`kto_loss`) take
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

from finetuner.config.recipe import REFERENCE_OBJECTIVES, LoraSection, Recipe, load_yaml
from finetuner.data.pipeline import IGNORE_INDEX
from finetuner.data.preference import PreferenceCollator, prepare_preference_data
from finetuner.errors import UserError
from finetuner.training.lm_head import at_least_fp32, decoder_and_head

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.pt"


# --------------------------------------------------------------------------- log-probabilities
def _chunk_logps(head, softcap, hidden, targets):
    import torch.nn.functional as F

    logits = at_least_fp32(head(hidden))
    if softcap:
        logits = (logits / softcap).tanh() * softcap
    return -F.cross_entropy(logits, targets, reduction="none")


def sequence_logps(model, batch: dict[str, Any], chunk_size: int = 1024):
    """Per row: the sum of the log-probabilities of its scored tokens (labels not ``-100``), and
    their number (both ``[rows]``, the sums in fp32). With ``chunk_size > 0`` the logits exist only
    for ``chunk_size`` scored tokens at a time, each chunk recomputed in backward."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    counts = keep.sum(-1)
    rows = torch.arange(labels.size(0), device=labels.device).unsqueeze(1).expand_as(labels)[keep]
    decoder, head, softcap = decoder_and_head(model) if chunk_size else (None, None, None)
    if decoder is None:
        logits = at_least_fp32(model(**inputs, use_cache=False).logits[:, :-1])
        token = -F.cross_entropy(logits[keep], labels[keep], reduction="none")
    else:
        hidden = decoder(**inputs, use_cache=False).last_hidden_state[:, :-1][keep]
        targets = labels[keep]
        parts = []
        for start in range(0, targets.numel(), chunk_size):
            h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
            parts.append(checkpoint(_chunk_logps, head, softcap, h, t, use_reentrant=False)
                         if torch.is_grad_enabled() else _chunk_logps(head, softcap, h, t))
        token = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
    sums = token.new_zeros(labels.size(0)).index_add(0, rows, token)
    return sums, counts


# --------------------------------------------------------------------------- the losses
def dpo_loss(pc, pr, rc, rr, beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0, nc=None, nr=None):
    """DPO (Rafailov et al. 2023), with cDPO's label smoothing, or IPO (Azar et al. 2023).

    ``pc, pr``: the policy's summed log-probabilities of the chosen and rejected responses;
    ``rc, rr``: the reference's. IPO takes log-probabilities averaged over the response tokens
    (``nc, nr``: their numbers), as TRL does. Returns (losses, chosen rewards, rejected rewards),
    the rewards ``beta · (policy − reference)``, detached.
    """
    import torch.nn.functional as F

    if loss_type == "ipo":
        h = (pc - rc) / nc - (pr - rr) / nr
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        h = (pc - pr) - (rc - rr)
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    return losses, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


def orpo_loss(pc, pr, nc, nr, weight: float):
    """ORPO (Hong et al. 2024): the chosen response's mean token NLL minus ``weight`` times the log
    sigmoid of the log odds ratio, on log-probabilities averaged over response tokens. Rewards:
    ``weight ·`` the mean log-probabilities (TRL's), detached."""
    import torch
    import torch.nn.functional as F

    ac, ar = pc / nc, pr / nr
    log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
    losses = -ac - weight * F.logsigmoid(log_odds)
    return losses, (weight * ac).detach(), (weight * ar).detach()


def simpo_loss(pc, pr, nc, nr, beta: float, gamma: float):
    """SimPO (Meng et al. 2024): ``-log σ(β (mean logp chosen − mean logp rejected) − γ)``, no
    reference. Rewards: ``β ·`` the mean log-probabilities, detached."""
    import torch.nn.functional as F

    ac, ar = pc / nc, pr / nr
    losses = -F.logsigmoid(beta * (ac - ar) - gamma)
    return losses, (beta * ac).detach(), (beta * ar).detach()


def kto_loss(policy, reference, policy_kl, reference_kl, desirable, beta: float, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0):
    """KTO (Ethayarajh et al. 2024) on rated responses.

    ``policy``, ``reference``: summed log-probabilities of the responses; ``policy_kl``,
    ``reference_kl``: of the mismatched pairs, whose mean log-ratio (clamped at 0, no gradient)
    is the reference point ``z``; ``desirable``: the labels. A desirable response's loss is
    ``w_d (1 − σ(β (r − z)))``, an undesirable one's ``w_u (1 − σ(β (z − r)))`` with ``r`` its
    log-ratio. Returns (losses, rewards ``β r`` detached).
    """
    import torch

    z = (policy_kl - reference_kl).mean().clamp(min=0).detach()
    ratio = policy - reference
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - z))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z - ratio))))
    return losses, (beta * ratio).detach()


# --------------------------------------------------------------------------- the objective
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


class PreferenceObjective:
    """What the trainer asks of a preference objective: its data, its collator, the loss of a
    micro-batch, the reference scores, and the rewards of a step and of an evaluation."""

    def __init__(self, recipe: Recipe, run_dir: Path):
        self.recipe, self.run_dir = recipe, Path(run_dir)
        self.name = recipe.objective
        self.settings = recipe.preference
        self.beta = self.settings.beta_for(self.name)
        self.needs_reference = self.name in REFERENCE_OBJECTIVES
        self.precomputed = self.needs_reference and self.settings.reference == "precomputed"
        self.reference: dict[str, Any] = {}
        self.metrics = StepMetrics()

    # ---------------------------------------------------------------- set-up
    def prepare_data(self, tokenizer):
        r = self.recipe
        return prepare_preference_data(r.data, self.name, tokenizer, r.training.seed)

    def collator(self, pad_token_id: int) -> PreferenceCollator:
        return PreferenceCollator(pad_token_id)

    def adopt_start(self, recipe: Recipe) -> Recipe:
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

    def load_start_adapter(self, model) -> None:
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

    def prepare_reference(self, trainer) -> None:
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
                    batch = trainer._to_device(trainer.collate([data[j] for j in range(i, min(i + mbs, len(data)))]))
                    with trainer._autocast():
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

    def step_loss_module(self, model, chunk_size: int):
        """The module a step's forward goes through (DDP wraps it, as the SFT one)."""
        import torch

        objective = self

        class PreferenceStepLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, batch: dict[str, Any]):
                return objective.loss_sum(self.model, batch, chunk_size)

        return PreferenceStepLoss()

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
                batch = trainer._to_device(trainer.collate(val[i : i + mbs]))
                with trainer._autocast():
                    self.loss_sum(trainer.model, batch, trainer.recipe.training.loss_chunk_size, "val", metrics)
        trainer.model.train()
        loss = metrics.loss / max(metrics.n, 1)
        return loss, metrics.to_dict("eval_")


"""The preference losses: DPO (and IPO, cDPO), ORPO, SimPO and KTO, on per-sequence
log-probabilities (:func:`finetuner.model.scoring.sequence_logps`). Each returns the per-example
losses and the implicit rewards the events report; the objective
(:mod:`finetuner.objectives.preference`) and evaluation read them."""

from __future__ import annotations


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

"""GRPO: group-relative advantages, per-token log-probabilities and the clipped surrogate loss.

Notation (one prompt ``q``, its group of ``G`` completions ``o_1 … o_G`` with rewards ``r_i``; token ``t``
of completion ``i``): the importance ratio ``ρ_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | …)``,
computed as ``exp(logp − old_logp)``.

* **Advantages** (Shao et al. 2024, *DeepSeekMath*, §4.1.2, outcome supervision): every token of
  ``o_i`` gets ``Â_i = (r_i − mean(r)) / std(r)`` over its group (:func:`group_advantages`); Dr. GRPO
  (Liu et al. 2025, *Understanding R1-Zero-Like Training*) drops the division by ``std`` (``scale_rewards
  = "none"``). As in TRL, ``std`` is the unbiased (Bessel) standard deviation and the division is by
  ``std + 1e-4``.
* **Per-token objective** (DeepSeekMath eq. 3; the two bounds are DAPO's *Clip-Higher*, Yu et al. 2025,
  *DAPO: An Open-Source LLM Reinforcement Learning System at Scale*, §3.1):
  ``ℓ_{i,t} = −min(ρ_{i,t} Â_i, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) Â_i) + β · KL_{i,t}``,
  with the KL to the reference estimated per token by the unbiased *k3* estimator of DeepSeekMath eq. 4:
  ``KL_{i,t} = π_ref/π_θ − log(π_ref/π_θ) − 1 = exp(ref − logp) − (ref − logp) − 1`` (≥ 0). ``β = 0``:
  no KL term and no reference log-probabilities needed.
* **Normalisation** of the per-token losses into one number (``loss_type``), ``|o_i|`` the number of
  completion tokens of ``o_i`` (the mask), ``N`` the number of completions:

  - ``grpo`` (DeepSeekMath eq. 3): ``1/N Σ_i 1/|o_i| Σ_t ℓ_{i,t}``, a mean per sequence, then over sequences;
  - ``dr_grpo`` (Liu et al. 2025, Dr. GRPO, as TRL implements it): ``1/(N · L_max) Σ_i Σ_t ℓ_{i,t}``,
    ``L_max`` the maximum completion length (a constant: no length bias);
  - ``dapo`` (Yu et al. 2025, §3.3, token-level policy gradient loss): ``1/(Σ_i |o_i|) Σ_i Σ_t ℓ_{i,t}``.

These are TRL's (1.16) ``GRPOTrainer._compute_loss`` formulas for ``importance_sampling_level="token"``,
``loss_type`` ``grpo``, ``dr_grpo`` and ``dapo``, with ``use_bias_correction_kl`` off or on (tests/losses/
test_grpo_trl.py calls TRL's method: same loss, gradient and clip/KL metrics). TRL 1.16's default is
``use_bias_correction_kl=True`` (DeepSeek-V3.2): the KL term weighted by the ratio, ``β ρ_{i,t} KL_{i,t}``;
finetuner's default (``grpo.use_bias_correction_kl: false``) is DeepSeekMath's ``β KL_{i,t}``: the two differ
only when ``β ≠ 0``, off policy in value and also on policy in gradient (``ρ`` is differentiable). A batch split into micro-batches gives the same total
when each micro-batch passes the whole batch's ``num_sequences`` and ``num_tokens`` (the losses then add up;
TRL's grpo and dr_grpo get the same by dividing each micro-batch's loss by the accumulation steps when the
micro-batches have equal sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: The loss normalisations (``loss_type``) of :func:`grpo_loss`.
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
#: How rewards are scaled into advantages (TRL's ``scale_rewards``; ``True`` is ``group``, ``False`` ``none``).
SCALE_REWARDS = ("group", "batch", "none")
#: Added to the standard deviation before dividing by it (TRL's value).
STD_EPS = 1e-4


@dataclass
class GroupAdvantages:
    """The advantages of a batch of groups and the per-group statistics behind them."""

    advantages: torch.Tensor  #: ``[N]``, one per completion (every token of a completion gets its value)
    mean: torch.Tensor  #: ``[N / G]``: each group's mean reward
    std: torch.Tensor  #: ``[N / G]``: each group's unbiased standard deviation (0 for a group of one)
    zero_std: torch.Tensor  #: ``[N / G]`` bool: the group's rewards are all equal (its advantages are 0)


def _scale_mode(scale_rewards: str | bool) -> str:
    mode = ("group" if scale_rewards else "none") if isinstance(scale_rewards, bool) else scale_rewards
    if mode not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)} (or True/False), not {scale_rewards!r}")
    return mode


def group_advantages(rewards: torch.Tensor, num_generations: int, *, scale_rewards: str | bool = "group") -> GroupAdvantages:
    """Group-relative advantages (DeepSeekMath §4.1.2): ``Â_i = (r_i − mean_group(r)) / (std + 1e-4)``.

    ``rewards``: ``[N]``, the completions of one prompt consecutive (``N = prompts × num_generations``).
    ``scale_rewards``: ``group`` divides by the group's standard deviation (GRPO), ``batch`` by the whole
    batch's (as TRL's ``batch``), ``none`` not at all (Dr. GRPO). A group whose rewards are all equal carries
    no signal: its advantages are exactly 0 (never NaN, whatever the scaling). Elsewhere these are TRL 1.16's
    advantages to fp32 rounding (tests/losses/test_grpo_trl.py runs TRL's ``_generate_and_score_completions``);
    on such a group TRL keeps ``(r − mean) / (std + 1e-4)``: the fp32 rounding error of the mean over ``1e-4``
    plus a rounding-level std, 0 only where the mean is exact (six rewards of 0.9 give −6e-4 with ``group``
    scaling; the error grows with the rewards' magnitude).
    """
    import torch

    mode = _scale_mode(scale_rewards)
    if rewards.dim() != 1 or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards must be [prompts × num_generations]; got shape {tuple(rewards.shape)} "
                         f"for num_generations={num_generations}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite numbers")
    grouped = rewards.float().view(-1, num_generations)
    mean = grouped.mean(dim=1)
    std = grouped.std(dim=1) if num_generations > 1 else torch.zeros_like(mean)
    zero_std = grouped.amax(dim=1) == grouped.amin(dim=1)
    advantages = grouped - mean.unsqueeze(1)
    if mode == "group":
        advantages = advantages / (std.unsqueeze(1) + STD_EPS)
    elif mode == "batch":
        batch_std = grouped.std() if grouped.numel() > 1 else grouped.new_zeros(())
        advantages = advantages / (batch_std + STD_EPS)
    advantages = advantages.masked_fill(zero_std.unsqueeze(1), 0.0)
    return GroupAdvantages(advantages.reshape(-1), mean, std, zero_std)


def token_logps(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities ``log softmax(logits / temperature)[label]`` of a causal LM, in fp32.

    ``logits``: ``[B, T, V]`` over the input ids; ``labels``: ``[B, T]``, the input ids with the tokens not
    scored (the prompt, padding, anything after a completion's end) set to ``ignore_index``. As in
    transformers' loss, position ``t`` of the logits scores ``labels[:, t + 1]``: returns ``(logps, mask)``,
    both ``[B, T − 1]``, ``logps`` 0 where ``mask`` (float, 1 on scored tokens) is 0. ``temperature``: the
    sampling temperature, so that the log-probabilities are those of the distribution sampled from (as TRL).
    For a GRPO batch ``cat(prompt_ids, completion_ids)``, the completion's tokens are the last
    ``completion_ids.size(1)`` columns of the result.
    """
    import torch.nn.functional as F

    scores = logits[:, :-1].float()
    if temperature != 1.0:
        scores = scores / temperature
    targets = labels[:, 1:]
    mask = targets != ignore_index
    logps = -F.cross_entropy(scores.reshape(-1, scores.size(-1)), targets.reshape(-1).masked_fill(~mask.reshape(-1), 0),
                             reduction="none").view_as(targets)
    return logps * mask, mask.float()


def _chunk_logps(head, softcap, temperature, hidden, targets):
    import torch.nn.functional as F

    logits = head(hidden)
    logits = logits.float() if logits.element_size() < 4 else logits
    if softcap:
        logits = (logits / softcap).tanh() * softcap
    if temperature != 1.0:
        logits = logits / temperature
    return -F.cross_entropy(logits, targets, reduction="none")


def chunked_token_logps(hidden: torch.Tensor, head, labels: torch.Tensor, *, chunk_size: int = 1024,
                        temperature: float = 1.0, softcap: float | None = None,
                        ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logps` from the decoder's hidden states, the logits computed ``chunk_size`` scored
    tokens at a time through ``head`` (the LM head) and each chunk recomputed in backward (activation
    checkpointing): the ``tokens × vocab`` logits never exist at once, as in the SFT and preference losses.

    ``hidden``: ``[B, T, H]`` (position ``t`` predicts ``labels[:, t + 1]``); ``softcap``: the model's final
    logit soft-capping (Gemma-2), applied before the temperature. Returns ``(logps, mask)`` as
    :func:`token_logps` does (``[B, T − 1]``, fp32 at least).
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    targets_all = labels[:, 1:]
    mask = targets_all != ignore_index
    h = hidden[:, :-1][mask]
    targets = targets_all[mask]
    parts = []
    for start in range(0, targets.numel(), chunk_size):
        hc, tc = h[start:start + chunk_size], targets[start:start + chunk_size]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logps, head, softcap, temperature, hc, tc, use_reentrant=False))
        else:
            parts.append(_chunk_logps(head, softcap, temperature, hc, tc))
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    flat = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=dtype)
    logps = torch.zeros(targets_all.shape, dtype=flat.dtype, device=hidden.device).masked_scatter(mask, flat)
    return logps, mask.to(flat.dtype)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The per-token KL estimate of DeepSeekMath eq. 4 (Schulman's *k3*):
    ``exp(ref − logp) − (ref − logp) − 1``, non-negative, 0 where the two agree."""
    import torch

    d = ref_logps - logps
    return torch.exp(d) - d - 1


@dataclass
class GRPOLoss:
    """:func:`grpo_loss`'s result."""

    loss: torch.Tensor  #: the scalar to backpropagate
    per_token_loss: torch.Tensor  #: ``[B, T]`` ``ℓ_{i,t}`` before masking and normalisation
    #: masked means over the batch's completion tokens (``kl`` only with ``beta != 0``; the clip fractions as
    #: TRL counts them: ``low`` where ``ρ < 1 − ε_low`` and ``Â < 0``, ``high`` where ``ρ > 1 + ε_high`` and
    #: ``Â > 0``, ``region`` either), plus ``tokens`` and ``sequences`` (this batch's counts, for weighting)
    metrics: dict[str, float] = field(default_factory=dict)


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
              beta: float = 0.0, epsilon: float = 0.2, epsilon_high: float | None = None,
              loss_type: str = "dapo", max_completion_length: int | None = None,
              num_sequences: int | None = None, num_tokens: float | None = None,
              use_bias_correction_kl: bool = False) -> GRPOLoss:
    """The GRPO clipped surrogate with an optional KL term (see the module's docstring for the formulas).

    ``logps``: ``[B, T]`` the policy's per-token log-probabilities of the completion tokens (with grad);
    ``advantages``: ``[B]`` (or ``[B, T]``); ``mask``: ``[B, T]``, 1 on completion tokens, 0 on padding and
    after the end. ``old_logps``: the log-probabilities under the policy that sampled the completions (None:
    ``logps`` detached, the ratio is 1, the first of ``num_iterations`` passes); ``ref_logps``: the
    reference's, required when ``beta != 0``. ``epsilon``/``epsilon_high``: the clip bounds ``1 − ε_low``,
    ``1 + ε_high`` (``epsilon_high`` None: ``epsilon``). ``loss_type``: ``grpo``, ``dr_grpo`` (needs
    ``max_completion_length``) or ``dapo`` (TRL's default). ``num_sequences``/``num_tokens``: the whole
    batch's number of completions and of completion tokens when this call sees one micro-batch of it
    (default: this call's). ``use_bias_correction_kl``: weight each token's KL by its importance ratio
    ``ρ`` (differentiable), which makes the KL term's gradient the unbiased reverse-KL gradient (the
    DeepSeek-V3.2 report; TRL 1.16's ``use_bias_correction_kl``, on by default there); off (the default
    here): DeepSeekMath's ``β · KL``. The ``kl`` metric is the weighted KL when it is on, as TRL reports it.
    """
    import torch

    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {loss_type!r}")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type dr_grpo needs max_completion_length")
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs the reference log-probabilities (ref_logps)")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    logps = logps.float()
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    old = logps.detach() if old_logps is None else old_logps.float()

    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        kl = k3_kl(logps, ref_logps.float())
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl

    n_seq = logps.size(0) if num_sequences is None else num_sequences
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n_seq
    elif loss_type == "dr_grpo":
        loss = masked.sum() / (n_seq * max_completion_length)
    else:
        n_tok = mask.sum().clamp(min=1.0) if num_tokens is None else max(float(num_tokens), 1.0)
        loss = masked.sum() / n_tok

    with torch.no_grad():
        tokens = mask.sum()
        denom = tokens.clamp(min=1.0)
        low = ((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)
        metrics = {
            "clip_ratio/low": float((low * mask).sum() / denom),
            "clip_ratio/high": float((high * mask).sum() / denom),
            "clip_ratio/region": float((torch.maximum(low, high) * mask).sum() / denom),
            "tokens": float(tokens),
            "sequences": float(logps.size(0)),
        }
        if kl is not None:
            metrics["kl"] = float((kl * mask).sum() / denom)
    return GRPOLoss(loss=loss, per_token_loss=per_token, metrics=metrics)

"""A causal LM's scores of a batch: the token-loss sum of SFT and the per-sequence and per-token
log-probabilities the other objectives take (:mod:`finetuner.losses` holds the formulas that turn
them into losses). Training and evaluation both score through here.

The logits are computed only for the scored positions (labels not ``-100``), ``chunk_size`` tokens
at a time through the LM head, each chunk under activation checkpointing: the full ``tokens ×
vocab`` logits tensor (and its fp32 copy and gradient) never exists, which for a 128k vocabulary is
several GB per 4k tokens. The results equal the full computation.
"""

from __future__ import annotations

from typing import Any

from finetuner.labels import IGNORE_INDEX


def decoder_and_head(model):
    """The transformer body and the LM head of a (peft-wrapped) causal LM, and its final logit
    soft-capping; ``(None, None, None)`` when it does not have the usual shape."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None or getattr(base.config, "logit_scale", None) is not None:
        return None, None, None
    return decoder, head, getattr(base.config, "final_logit_softcapping", None)


def router_balance(model):
    """``(loss function, coefficient, experts, top_k)`` of a mixture of experts' load-balancing loss, as its
    transformers causal LM adds it to the loss when ``output_router_logits`` is on (``router_aux_loss_coef x
    load_balancing_loss_func(router_logits, ...)``, Switch Transformers' auxiliary loss); None for a dense model
    or a family that balances its experts otherwise (GLM-4.5's and DeepSeek-V3's bias terms)."""
    import sys

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cfg = getattr(base, "config", None)
    coef = getattr(cfg, "router_aux_loss_coef", None) or 0.0
    fn = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if coef <= 0 or fn is None or not experts or not top_k:
        return None
    return fn, float(coef), int(experts), int(top_k)


def _with_balance(balance, router_logits, attention_mask, loss, n_tokens):
    """``loss`` (a token sum) plus the load-balancing loss weighted as transformers weights it in a mean loss:
    ``coef x aux`` per trained token."""
    if balance is None or not router_logits:
        return loss
    fn, coef, experts, top_k = balance
    return loss + coef * fn(router_logits, experts, top_k, attention_mask) * n_tokens


def at_least_fp32(t):
    """fp16/bf16 → fp32 for the loss; fp32 and fp64 as they are."""
    return t.float() if t.element_size() < 4 else t


def _chunk_ce(head, softcap, hidden, targets):
    import torch.nn.functional as F

    logits = at_least_fp32(head(hidden))
    if softcap:
        logits = (logits / softcap).tanh() * softcap
    return F.cross_entropy(logits, targets, reduction="sum")


def token_loss_sum(model, batch: dict[str, Any], chunk_size: int = 1024, fused_ce=None):
    """Sum of next-token cross-entropy (fp32) over labelled tokens, and their number.

    With ``chunk_size > 0`` the logits are computed only for labelled positions, ``chunk_size``
    tokens at a time (see the module's docstring). ``fused_ce`` (``(head, hidden, targets, softcap)
    -> loss sum``, Liger's fused linear cross-entropy, see :mod:`finetuner.model.kernels`) replaces
    the chunked loop when given; it too runs on the labelled positions only.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    inputs.update(batch.get("pictures") or {})  # an image-text-to-text model's pixel values (finetuner.data.images)
    labels = batch["labels"][:, 1:]
    n_tokens = int((labels != IGNORE_INDEX).sum())
    decoder, head, softcap = decoder_and_head(model) if chunk_size else (None, None, None)
    # a mixture of experts trains with its load-balancing loss, as transformers' own loss does; evaluations and
    # the logged held-out loss are the cross-entropy alone
    balance = router_balance(model) if torch.is_grad_enabled() else None
    extra = {"output_router_logits": True} if balance else {}
    mask = inputs.get("attention_mask")
    if decoder is None:
        out = model(**inputs, use_cache=False, **extra)
        logits = out.logits
        loss = F.cross_entropy(
            at_least_fp32(logits[:, :-1]).reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return _with_balance(balance, getattr(out, "router_logits", None), mask, loss, n_tokens), n_tokens
    out = decoder(**inputs, use_cache=False, **extra)
    router_logits = getattr(out, "router_logits", None)
    hidden = out.last_hidden_state[:, :-1]
    keep = labels != IGNORE_INDEX
    hidden, targets = hidden[keep], labels[keep]
    if fused_ce is not None and torch.is_grad_enabled():
        return _with_balance(balance, router_logits, mask, fused_ce(head, hidden, targets, softcap), n_tokens), n_tokens
    loss = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for start in range(0, targets.numel(), chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        loss = loss + (checkpoint(_chunk_ce, head, softcap, h, t, use_reentrant=False) if torch.is_grad_enabled() else _chunk_ce(head, softcap, h, t))
    return _with_balance(balance, router_logits, mask, loss, n_tokens), n_tokens


def _chunk_logps(head, softcap, hidden, targets):
    import torch.nn.functional as F

    logits = at_least_fp32(head(hidden))
    if softcap:
        logits = (logits / softcap).tanh() * softcap
    return -F.cross_entropy(logits, targets, reduction="none")


def scored_token_logps(model, batch: dict[str, Any], chunk_size: int = 1024):
    """The log-probability of every scored token (labels not ``-100``, after the first position),
    flattened in row-major order (fp32 at least), and the mask ``[rows, length - 1]`` they fill."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    decoder, head, softcap = decoder_and_head(model) if chunk_size else (None, None, None)
    if decoder is None:
        logits = at_least_fp32(model(**inputs, use_cache=False).logits[:, :-1])
        return -F.cross_entropy(logits[keep], labels[keep], reduction="none"), keep
    hidden = decoder(**inputs, use_cache=False).last_hidden_state[:, :-1][keep]
    targets = labels[keep]
    parts = []
    for start in range(0, targets.numel(), chunk_size):
        h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        parts.append(checkpoint(_chunk_logps, head, softcap, h, t, use_reentrant=False)
                     if torch.is_grad_enabled() else _chunk_logps(head, softcap, h, t))
    return (torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)), keep


def sequence_logps(model, batch: dict[str, Any], chunk_size: int = 1024):
    """Per row: the sum of the log-probabilities of its scored tokens (labels not ``-100``), and
    their number (both ``[rows]``, the sums in fp32). With ``chunk_size > 0`` the logits exist only
    for ``chunk_size`` scored tokens at a time, each chunk recomputed in backward."""
    import torch

    token, keep = scored_token_logps(model, batch, chunk_size)
    rows = torch.arange(keep.size(0), device=keep.device).unsqueeze(1).expand_as(keep)[keep]
    return token.new_zeros(keep.size(0)).index_add(0, rows, token), keep.sum(-1)

"""Tiled MLP: each decoder layer's MLP runs over the tokens in chunks, one checkpoint per chunk.

A gated MLP (``down(act(gate(x)) * up(x))``) is position-wise, so it can run on any split of the
tokens. Plain, it keeps four ``tokens × intermediate_size`` tensors for backward (the gate, its
activation, the up projection and their product; with LoRA also its adapters' inputs), and with
gradient checkpointing a layer's backward recomputes all of them for the whole sequence at once:
the largest term of the peak at long sequences (:mod:`finetuner.memory.model`). Tiled
(``training.tiled_mlp``, the TiledMLP of Arctic Long Sequence Training), the batch × sequence
tokens are flattened and split into chunks of :data:`CHUNK_TOKENS`, and each chunk runs under
its own non-reentrant ``torch.utils.checkpoint``: the forward keeps only the MLP's input; the
backward recomputes one chunk, takes its gradients and frees it before the next. The output and
the gradients are those of the plain MLP up to the order of fp32 sums (each matmul sums over the
same features; only the LoRA weight gradients add the chunks' shares in another order).

LoRA layers inside the MLP (peft, on a dense or a bitsandbytes 4/8-bit base) run unchanged inside
the chunk. Their dropout draws one mask per chunk (so other masks than an untiled run draws from
the same seed, with the same distribution); ``torch.utils.checkpoint`` saves the RNG state at
each chunk's forward and restores it for the recompute, so the backward uses the forward's masks.
It nests inside transformers' per-layer gradient checkpointing (the layer's recompute re-runs the
chunk loop, whose chunks are recomputed once more in the backward): one more MLP forward per step.

Nothing here imports torch at module level (the runtime resolver reads :data:`CHUNK_TOKENS`).
"""

from __future__ import annotations

import logging
import types

log = logging.getLogger(__name__)

#: Tokens per chunk. One chunk's recomputed MLP tensors are then ``CHUNK_TOKENS`` tokens' worth
#: (for an 8B Llama about 2048 × 115 KB = 0.23 GiB, plus their gradients), while a matmul of
#: 2048 rows still fills a GPU.
CHUNK_TOKENS = 2048

#: ``training.tiled_mlp: auto`` turns tiling on from this sequence length (``data.max_seq_len``),
#: with gradient checkpointing (see :func:`resolve_tiled_mlp`).
AUTO_MIN_SEQ_LEN = 8 * CHUNK_TOKENS

_ORIGINAL = "_finetuner_untiled_forward"
_CHUNK = "_finetuner_tiled_mlp_chunk"


def resolve_tiled_mlp(setting: bool | str, gradient_checkpointing: bool | str, max_seq_len: int) -> int:
    """Tokens per chunk for ``training.tiled_mlp`` (0: not tiled).

    ``true``: :data:`CHUNK_TOKENS`; ``false``: 0; ``auto``: tiled when gradient checkpointing is
    on and ``data.max_seq_len`` is at least :data:`AUTO_MIN_SEQ_LEN` (16,384 tokens, eight chunks).
    By the memory model a recomputed layer's backward then holds the MLP's tensors of at least
    16k tokens (four ``intermediate_size`` values per token: 1.75 GiB for an 8B Llama in bf16, the
    largest part of that phase), and tiling leaves at most an eighth of them, for one more MLP
    forward per step. Below that, or without checkpointing (a run that chose speed), a smaller
    micro-batch is the cheaper way to save memory, and ``auto`` leaves the MLP whole; the
    micro-batch is not counted, so the planner's choice of it does not switch tiling on.
    """
    if setting is True:
        return CHUNK_TOKENS
    if setting is False:
        return 0
    return CHUNK_TOKENS if gradient_checkpointing is True and max_seq_len >= AUTO_MIN_SEQ_LEN else 0


def _is_mlp(module) -> bool:
    """A dense MLP as transformers writes it: gated (Llama, Mistral, Qwen2/3, Gemma, Phi-3, ...) or up, activation,
    down (Arcee), each token on its own."""
    return hasattr(module, "down_proj") and any(hasattr(module, n) for n in ("gate_proj", "gate_up_proj", "up_proj"))


def _tiled_forward(self, x, *args, **kwargs):
    import torch
    from torch.utils.checkpoint import checkpoint

    plain = getattr(self, _ORIGINAL) or types.MethodType(type(self).forward, self)
    chunk = getattr(self, _CHUNK)
    if args or kwargs or x.dim() < 2:
        return plain(x, *args, **kwargs)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= chunk:
        return plain(x)
    graph = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
    outs = [checkpoint(plain, piece, use_reentrant=False) if graph else plain(piece) for piece in flat.split(chunk)]
    out = torch.cat(outs)
    return out.view(*x.shape[:-1], out.shape[-1])


def apply_tiled_mlp(model, chunk: int = CHUNK_TOKENS) -> int:
    """Run every dense MLP of ``model`` (a transformers model, peft-wrapped or not) in chunks of
    ``chunk`` tokens; returns how many were patched. Parameter names are unchanged (the instance's
    ``forward`` is replaced), so adapters and checkpoints are the same files. Patching twice
    changes the chunk size only."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, not {chunk}")
    n = 0
    for module in model.modules():
        if not _is_mlp(module):
            continue
        if not hasattr(module, _ORIGINAL):
            # the class's forward (None), or one patched into the instance before (Liger's SwiGLU)
            setattr(module, _ORIGINAL, module.__dict__.get("forward"))
            module.forward = types.MethodType(_tiled_forward, module)
        setattr(module, _CHUNK, int(chunk))
        n += 1
    if n == 0:
        log.warning("training.tiled_mlp: this model has no gated MLP where finetuner looks; not tiled.")
    return n


def remove_tiled_mlp(model) -> int:
    """Undo :func:`apply_tiled_mlp`; returns how many MLPs were restored."""
    n = 0
    for module in model.modules():
        if hasattr(module, _ORIGINAL):
            original = getattr(module, _ORIGINAL)
            if original is None:
                del module.forward  # back to the class's method
            else:
                module.forward = original
            delattr(module, _ORIGINAL)
            delattr(module, _CHUNK)
            n += 1
    return n

"""Activation offload: keep what backward needs in (pinned) CPU memory instead of on the GPU.

Two ways, chosen by the recipe (``training.offload_activations``):

- with gradient checkpointing, :func:`offloaded_checkpoint` replaces transformers' checkpoint
  function: each decoder layer's input — the only activation a checkpointed layer keeps — is
  copied to CPU memory in forward and brought back in backward, where the layer is recomputed
  (the "offloaded gradient checkpointing" of Unsloth and Axolotl). GPU activation memory then
  no longer grows with the number of layers: it is one layer's recompute, plus the copies in flight.
- without checkpointing, the whole forward runs under :func:`torch.autograd.graph.save_on_cpu`,
  which moves every saved activation to CPU memory (slow, but fits very long sequences).

Both give the same gradients as the plain computation; the cost is the PCIe traffic (2 bytes
× tokens × hidden size per layer each way, for the checkpointed variant).
"""

from __future__ import annotations

import contextlib
from typing import Any

import finetuner.device as dev


def _offloaded_function():
    import torch

    class OffloadedCheckpoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, run_fn, hidden, *args):
            ctx.run_fn, ctx.args = run_fn, args
            ctx.device = hidden.device
            ctx.autocast = (torch.is_autocast_enabled(hidden.device.type), torch.get_autocast_dtype(hidden.device.type))
            ctx.cpu_rng = torch.get_rng_state()
            ctx.device_rng = dev.device_rng_state(hidden.device)
            if hidden.is_cuda:
                ctx.saved_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device="cpu", pin_memory=True)
                ctx.saved_hidden.copy_(hidden.detach(), non_blocking=True)
            else:
                ctx.saved_hidden = hidden.detach().clone()
            with torch.no_grad():
                return run_fn(hidden, *args)

        @staticmethod
        def backward(ctx, *grads):
            hidden = ctx.saved_hidden.to(ctx.device, non_blocking=True).requires_grad_(True)
            with dev.fork_rng(ctx.device):  # replay the forward's dropout masks
                torch.set_rng_state(ctx.cpu_rng)
                dev.set_device_rng_state(ctx.device_rng, ctx.device)
                with torch.enable_grad(), torch.autocast(ctx.device.type, enabled=ctx.autocast[0], dtype=ctx.autocast[1]):
                    out = ctx.run_fn(hidden, *ctx.args)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            return (None, hidden.grad) + (None,) * len(ctx.args)

    return OffloadedCheckpoint


def offloaded_checkpoint(function, hidden, *args: Any, **kwargs: Any):
    """Drop-in for ``torch.utils.checkpoint.checkpoint`` whose saved layer input lives on the CPU."""
    if kwargs:
        from functools import partial

        function = partial(function, **kwargs)
    return _offloaded_function().apply(function, hidden, *args)


def enable_offloaded_checkpointing(model) -> int:
    """Route every checkpointed layer of ``model`` through :func:`offloaded_checkpoint`; returns how many."""
    n = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = offloaded_checkpoint
            n += 1
    return n


def save_on_cpu(enabled: bool, pin_memory: bool):
    """The context for activation offload without checkpointing (or a no-op)."""
    if not enabled:
        return contextlib.nullcontext()
    import torch

    return torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)

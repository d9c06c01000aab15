"""Activation offload saves memory: what the forward leaves behind for backward, counted byte by byte.

On the CPU there is no second memory to move to, so the tests count *which tensors* backward
keeps, which is what would stay on a GPU:

- with gradient checkpointing, each decoder layer keeps its input for the recompute. Offloaded
  (``training.offload_activations: true``), that input is copied into a CPU buffer (pinned memory
  on a GPU) and the layer's own tensor is freed: the copies hold ``layers × batch × seq × hidden ×
  bytes per element`` on the CPU, and the bytes kept drop by one hidden state for every layer but
  the first, ``(layers - 1) × batch × seq × hidden × bytes``. The first layer's input is the
  frozen embeddings' output, which transformers and peft make a leaf that requires grad
  (``enable_input_require_grads``, so that backward reaches the LoRA weights of checkpointed
  layers): the autograd graph keeps that leaf, offloaded or not;
- without checkpointing, every tensor autograd saves goes through the offload's pack hook
  (``torch.autograd.graph.save_on_cpu``), which hands it to CPU memory: nothing saved for
  backward is left to the compute device.

The bytes are counted with a ``TorchDispatchMode`` that notes the storage of every tensor an
operation creates during the forward; after the forward, the storages still alive are what the
graph keeps for backward (a CPU stand-in for ``torch.cuda.memory_allocated()``).
"""

from __future__ import annotations

from finetuner.config.recipe import Recipe

BATCH, SEQ = 2, 24


def _model(recipe_dict, overrides):
    from finetuner.config.runtime import resolve_runtime
    from finetuner.model.loading import load_base_model, prepare_for_training

    import torch

    r = Recipe.from_dict(recipe_dict, ["lora.dropout=0.1", *overrides])
    torch.manual_seed(0)  # the same LoRA weights every time
    model = prepare_for_training(load_base_model(r, resolve_runtime(r)), r)
    model.train()
    return model


def _batch():
    import torch

    ids = torch.randint(3, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def _forward_and_count(model, context=None):
    """Run the training loss's forward; returns (the loss, {storage: (bytes, device)} of every tensor
    created in the forward that is still alive after it, the CPU buffers of the offloaded checkpoints)."""
    import contextlib

    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from finetuner.model.scoring import token_loss_sum

    created: list[tuple[StorageWeakRef, int, str]] = []

    class Created(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    created.append((StorageWeakRef(s), s.nbytes(), t.device.type))
            return out

    torch.manual_seed(0)
    with Created(), context or contextlib.nullcontext():
        loss, _ = token_loss_sum(model, _batch())
    alive = {ref.cdata: (n, dev) for ref, n, dev in created if not ref.expired()}  # views share a storage: counted once
    # the offloaded checkpoints' CPU copies, found on their autograd nodes
    buffers, seen, stack = {}, set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "saved_hidden"):
            t = node.saved_hidden
            buffers[t.untyped_storage()._cdata] = (t.untyped_storage().nbytes(), t.device.type)
        stack += [f for f, _ in node.next_functions]
    return loss, alive, buffers


def test_offloaded_checkpointing_keeps_one_hidden_state_per_layer_less(recipe_dict):
    """Exactly the layer inputs leave; weights (and views of them) are not counted."""
    import torch

    cfg = _model(recipe_dict, []).config
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    per_layer = BATCH * SEQ * hidden * torch.finfo(torch.float32).bits // 8  # one layer's input: the fp32 hidden state

    kept, copies, grads = {}, {}, {}
    for offload in (False, True):
        model = _model(recipe_dict, ["training.gradient_checkpointing=true", f"training.offload_activations={str(offload).lower()}"])
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        loss, alive, buffers = _forward_and_count(model)
        kept[offload] = sum(n for k, (n, _dev) in alive.items() if k not in buffers and k not in params)
        copies[offload] = buffers
        loss.backward()  # and backward still works from what is left
        grads[offload] = [p.grad for n, p in model.named_parameters() if p.requires_grad]

    assert copies[False] == {}
    assert len(copies[True]) == layers and all(dev == "cpu" for _n, dev in copies[True].values())
    assert sum(n for n, _dev in copies[True].values()) == layers * per_layer
    # without offload the layer inputs are among what is kept; with it, exactly those bytes are gone
    assert kept[False] > layers * per_layer
    assert kept[False] - kept[True] == (layers - 1) * per_layer, (kept, per_layer)
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same computation, so the same bits


def test_offload_without_checkpointing_moves_everything_saved_for_backward(recipe_dict):
    """Every tensor autograd saves in the forward goes through the offload's pack hook to CPU memory."""
    import torch

    from finetuner.model.offload import save_on_cpu

    model = _model(recipe_dict, [])
    params = {p.untyped_storage()._cdata for p in model.parameters()}

    saved: dict[int, int] = {}

    def count(t):
        if t.untyped_storage()._cdata not in params:  # weights are not activations (and stay where they are)
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        _forward_and_count(model)
    plain = sum(saved.values())

    moved: dict[int, tuple[int, str]] = {}
    ctx = save_on_cpu(True, pin_memory=False)
    pack = ctx.pack_hook

    def counting_pack(t):
        device, packed = pack(t)
        if t.untyped_storage()._cdata not in params:
            moved[t.untyped_storage()._cdata] = (packed.untyped_storage().nbytes(), packed.device.type)
        return device, packed

    ctx.pack_hook = counting_pack
    loss, _alive, _buffers = _forward_and_count(model, ctx)
    loss.backward()  # unpacked from the CPU copies
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    # more than the layer inputs checkpointing keeps: every intermediate of every layer
    assert plain > model.config.num_hidden_layers * BATCH * SEQ * model.config.hidden_size * 4
    assert len(moved) == len(saved) and sum(n for n, _dev in moved.values()) == plain
    assert {dev for _n, dev in moved.values()} == {"cpu"}

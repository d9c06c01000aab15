"""Load the model once and shard it: rank 0 reads the weights, every rank keeps only its shards.

Under ``fsdp`` no process needs the whole model on its device: rank 0 loads it into CPU memory
(QLoRA: quantized there by bitsandbytes), the other ranks build the same modules on the meta
device (no memory: :func:`finetuner.model.loading.load_base_model` with ``place="meta"``), and
the weights reach each rank's device already cut into that rank's shards. As in Answer.AI's
fsdp_qlora ("low memory" loading) and accelerate's ``cpu_ram_efficient_loading``, but with FSDP2:

1. :func:`to_meta` (before ``fully_shard``): rank 0 keeps its loaded tensors aside in CPU memory,
   tells every rank each parameter's name, shape and dtype (one small broadcast), and on every
   rank each parameter becomes an empty one on the meta device, so ``fully_shard`` allocates
   nothing and every rank's modules are the same (a 4-bit weight has its packed shape everywhere);
2. :func:`share_quant_states`: each 4-bit layer's quantization state (absmax, code, shape: not a
   parameter, so not sharded; bitsandbytes reads it from the module, :func:`bitsandbytes.nn.modules.fix_4bit_weight_quant_state_from_module`)
   is broadcast from rank 0 and placed on the device, one decoder layer at a time;
3. ``fully_shard``;
4. :func:`fill`: module by module, each rank allocates the module's shards (``to_empty``: on the
   device, or in CPU memory under ``CPUOffloadPolicy``), then torch's
   ``distribute_tensor(..., src_data_rank=0)`` scatters rank 0's tensors into them (the other
   ranks receive only theirs; each device holds at most one whole tensor while it passes), and
   rank 0 drops each tensor once sent; last the buffers (rotary frequencies) are broadcast.

So the device's peak while loading is its shards plus the largest single tensor, and the
machine's CPU memory holds the model once (rank 0's copy, emptying as the shards fill), not once
per process (:func:`finetuner.memory.fsdp.loading_host_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Loaded:
    """Rank 0's loaded tensors (empty on the other ranks) and every parameter's full size."""

    params: dict[str, Any]  # name -> the whole tensor in CPU memory (rank 0 only)
    buffers: dict[str, Any]  # name -> buffer (rank 0 only)
    shapes: dict[str, tuple[tuple[int, ...], Any]]  # name -> (shape, dtype), on every rank
    bytes_loaded: int  # what this rank had loaded: the bytes of its parameters that were not on meta

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_loaded": self.bytes_loaded}


def _broadcast_object(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _unique_parameters(model) -> list[tuple[Any, str, str, Any]]:
    """``(module, attribute, full name, parameter)`` for every parameter slot, in module order; a
    parameter shared by several modules (tied embeddings) is named by its first slot."""
    out = []
    for mod_name, module in model.named_modules():
        for attr, p in module.named_parameters(recurse=False):
            out.append((module, attr, f"{mod_name}.{attr}" if mod_name else attr, p))
    return out


def to_meta(model, rank: int) -> Loaded:
    """Every parameter of ``model`` on the meta device with rank 0's shape and dtype; rank 0's
    tensors (and every rank's own loaded bytes) returned."""
    import torch

    slots = _unique_parameters(model)
    first: dict[int, str] = {}
    for _, _, name, p in slots:
        first.setdefault(id(p), name)
    bytes_loaded = sum(p.numel() * p.element_size() for p in {id(p): p for *_, p in slots}.values() if not p.is_meta)
    params: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    if rank == 0:
        for _, _, name, p in slots:
            if first[id(p)] == name:
                params[name] = p.detach()
        buffers = {n: b.detach().cpu().clone() for n, b in model.named_buffers()}
    shapes = _broadcast_object({n: (tuple(t.shape), t.dtype) for n, t in params.items()} if rank == 0 else None)
    new: dict[int, Any] = {}
    for module, attr, name, p in slots:
        if id(p) not in new:
            key = first[id(p)]
            if key not in shapes:
                raise RuntimeError(f"rank {rank} has parameter {key} that rank 0 does not: the ranks built different models")
            shape, dtype = shapes[key]
            new[id(p)] = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad)
        setattr(module, attr, new[id(p)])
    return Loaded(params=params, buffers=buffers, shapes=shapes, bytes_loaded=bytes_loaded)


def four_bit_layers(model) -> list[tuple[str, Any]]:
    """``(name, module)`` of every bitsandbytes 4-bit linear layer, in module order."""
    import bitsandbytes as bnb

    return [(n, m) for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]


def share_quant_states(model, rank: int, device) -> None:
    """Each 4-bit layer's quantization state from rank 0, on ``device``, on every rank (sent in
    groups of layers so that no single message holds the whole model's)."""
    from bitsandbytes.functional import QuantState

    layers = four_bit_layers(model)
    group = 16
    for start in range(0, len(layers), group):
        chunk = layers[start:start + group]
        states = None
        if rank == 0:
            states = {n: {k: (v.cpu() if hasattr(v, "cpu") else v) for k, v in m.quant_state.as_dict(packed=True).items()}
                      for n, m in chunk}
        states = _broadcast_object(states)
        for n, m in chunk:
            m.quant_state = QuantState.from_dict(states[n], device=device)


def fill(model, loaded: Loaded, rank: int, device, shard_device) -> None:
    """Allocate every rank's shards (on ``shard_device``) and scatter rank 0's tensors into them,
    one module at a time, then set the buffers.

    Module by module, so that the machine's CPU memory never holds rank 0's copy and the offloaded
    shards at once: what rank 0 has sent it drops, and only then are the next shards allocated."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    done: set[int] = set()
    with torch.no_grad():
        for owner, module in model.named_modules():
            own = list(module.named_parameters(recurse=False))
            if all(id(p) in done for _, p in own):
                continue  # nothing new here (a tied LM head: its weight was filled as the embeddings')
            kept = {id(p): p.detach().clone() for _, p in own if id(p) in done}
            module.to_empty(device=shard_device, recurse=False)  # this module's shards, allocated now
            for attr, p in module.named_parameters(recurse=False):
                if id(p) in done:
                    p.copy_(kept.pop(id(p)))  # shared with a module filled before: put it back
                    continue
                done.add(id(p))
                name = f"{owner}.{attr}" if owner else attr
                shape, dtype = loaded.shapes[name]
                whole = (loaded.params.pop(name).to(device) if rank == 0
                         else torch.empty(shape, dtype=dtype, device=device))
                if isinstance(p, DTensor):
                    shard = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=0)
                    p.to_local().copy_(shard.to_local())
                else:
                    dist.broadcast(whole, src=0)
                    p.copy_(whole)
                del whole
        left = [n for n, p in model.named_parameters() if p.is_meta or (isinstance(p, DTensor) and p.to_local().is_meta)]
        if left:
            raise RuntimeError(f"rank {rank}: parameters left without weights after loading: {left[:5]}")
        buffers = _broadcast_object(loaded.buffers if rank == 0 else None)
        for name, value in buffers.items():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, value.to(device))  # a buffer stays one (and keeps its persistence)
    loaded.buffers.clear()

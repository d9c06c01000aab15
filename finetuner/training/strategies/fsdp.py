"""``fsdp``: torch's FSDP2 (``torch.distributed.fsdp.fully_shard``) under the same torchrun launcher.

Each decoder layer is one FSDP unit (its parameters all-gathered for its forward and backward,
sharded again after its forward: ``reshard_after_forward``), then the step's loss module is the
root unit (embeddings, final norm, LM head). The mixed-precision policy follows the run's
precision (parameters all-gathered in bf16/fp16, gradients reduced in fp32; fp32 runs cast
nothing). ``distributed.fsdp_offload`` keeps the shards, their gradients and the optimizer states
in CPU memory (``CPUOffloadPolicy``). The optimizer is built again on the sharded parameters.

Gradients are reduce-scattered in every backward pass (each rank keeps the sum of its shard), and
averaged over the ranks like DDP's, so the step's gradient is that of one process. Nothing
changes inside a step that cannot be undone: after an out-of-memory back-off the ranks drop the
step's gradients and run it again with the smaller micro-batch, as one process does.

QLoRA: bitsandbytes keeps a 4-bit weight packed in a tensor of ``bnb_4bit_quant_storage`` (the
compute dtype under fsdp, :func:`finetuner.model.loading.bnb_config`), which FSDP shards as it
is. :func:`quantized_storage` measures, after sharding, what each rank holds of the base weights
of the decoder layers' linear layers; if that is not about the 4-bit size over the number of
processes (the weights became ordinary tensors, with little or no memory saved), the run refuses
to start (:func:`check_quantized_storage`).

Saving: the trained weights (the adapter, or every weight of a full fine-tune) are gathered into
one state dict on rank 0 (``get_model_state_dict(full_state_dict=True)``) and saved as a normal
peft (or transformers) folder. A checkpoint holds, besides that folder, ``fsdp/``: the trained
weights' and the optimizer's shards through ``torch.distributed.checkpoint`` (one file per rank),
from which a resume (with the same number of processes) loads them. A write that fails on any rank (a
full disk) fails on every rank as an ordinary error naming its cause (:func:`_failures_as_errors`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

from finetuner.errors import UserError
from finetuner.strategy_table import FSDP_ENGINE, checkpoint_dir_of, names_run_by
from finetuner.training import checkpoint as ckpt_io
from finetuner.training.strategies.base import Strategy, check_same_world
from finetuner.training.optimizer import local_part

#: the folder of a checkpoint that holds the FSDP shards (``torch.distributed.checkpoint``)
SHARDS_DIR = checkpoint_dir_of(FSDP_ENGINE)
#: how far above ``4-bit bytes / world size`` a rank's share of the base weights may be (padding, rounding)
STORAGE_TOLERANCE = 1.25


def decoder_layers(model) -> list:
    """The model's decoder layers (the classes transformers names in ``_no_split_modules``), in order."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(
            f"distributed.strategy: fsdp found no decoder layers to shard in {type(base).__name__} "
            "(its _no_split_modules names none).",
            hint="Use strategy zero3 or ddp for this model.",
        )
    return layers


def mixed_precision(rt):
    """FSDP2's ``MixedPrecisionPolicy`` for the runtime ``rt``: all-gather the parameters in its
    :attr:`~finetuner.config.runtime.Runtime.gather_dtype` (bf16/fp16) and reduce the gradients in
    fp32; fp32: cast nothing."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if rt.gather_dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=rt.torch_dtype(rt.gather_dtype), reduce_dtype=torch.float32)


@dataclass(frozen=True)
class StorageReport:
    """What this rank holds of the frozen base weights of the decoder layers' linear layers."""

    local_bytes: int  # this rank's shards of them
    quantized_bytes: int  # all of them at the quantized size (bits/8 bytes a weight), on all ranks together
    dtypes: tuple[str, ...]  # the dtypes their shards are stored in
    world_size: int

    @property
    def expected_bytes(self) -> float:
        return self.quantized_bytes / self.world_size

    @property
    def ratio(self) -> float:
        return self.local_bytes / max(self.expected_bytes, 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {"local_bytes": self.local_bytes, "quantized_bytes": self.quantized_bytes, "dtypes": list(self.dtypes),
                "world_size": self.world_size, "ratio": round(self.ratio, 4)}


def quantized_storage(layers, bits: int, world_size: int) -> StorageReport:
    """Measure, on this rank, the frozen base weights of every linear layer in ``layers``: the bytes of
    its shards and their dtype, against the size they have quantized to ``bits`` (``in x out x bits / 8``)."""
    local = quantized = 0
    dtypes: set[str] = set()
    for layer in layers:
        for module in layer.modules():
            w = getattr(module, "weight", None)
            if w is None or w.requires_grad or not hasattr(module, "in_features") or not hasattr(module, "out_features"):
                continue
            shard = local_part(w)
            local += shard.numel() * shard.element_size()
            quantized += module.in_features * module.out_features * bits // 8
            dtypes.add(str(shard.dtype).removeprefix("torch."))
    return StorageReport(local, quantized, tuple(sorted(dtypes)), world_size)


def check_quantized_storage(report: StorageReport, rank: int, bits: int) -> None:
    """Refuse to train when the sharded base weights are not about their ``bits``-bit size per rank."""
    if report.quantized_bytes and report.ratio <= STORAGE_TOLERANCE:
        return
    raise UserError(
        f"distributed.strategy: fsdp with method qlora: after sharding, rank {rank} holds "
        f"{report.local_bytes / 2**20:.2f} MiB of base weights (stored as {', '.join(report.dtypes) or 'nothing'}), "
        f"where {bits}-bit weights split over {report.world_size} processes take {report.expected_bytes / 2**20:.2f} MiB: "
        f"the quantized weights became ordinary tensors ({report.ratio:.1f} x the {bits}-bit size), which saves little "
        "or no memory. The run was not started.",
        hint="Train with distributed.strategy ddp or zero2 (the 4-bit base is replicated, the rest shared), or method lora "
        "with fsdp; if bitsandbytes or torch was upgraded, check the versions finetuner's constraints.txt pins.",
    )


class FSDP(Strategy):
    """torch FSDP2 with one unit per decoder layer."""

    names: ClassVar[tuple[str, ...]] = names_run_by(FSDP_ENGINE)
    whole_model_on_rank0: ClassVar[bool] = False

    def base_placement(self) -> str | None:
        """Rank 0 loads the model into CPU memory, the others build it empty (:mod:`.rank0_loading`)."""
        return "cpu" if self.trainer.rank == 0 else "meta"

    def wrap(self, step_loss):
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        from finetuner.training.strategies.rank0_loading import fill, share_quant_states, to_meta
        from finetuner.training.optimizer import build_optimizer, build_scheduler

        tr = self.trainer
        r, t = tr.recipe, tr.recipe.training
        if tr.scaler is not None:
            raise UserError(
                "training.precision: fp16 cannot be used with distributed.strategy fsdp (its loss scaler does not "
                "handle sharded gradients).",
                hint="Use precision bf16 (or fp32), or strategy ddp/zero2 for fp16.",
            )
        offload = CPUOffloadPolicy(pin_memory=tr.ctx.cuda) if r.distributed.fsdp_offload else OffloadPolicy()
        kw = dict(mp_policy=mixed_precision(tr.rt), offload_policy=offload, reshard_after_forward=True)
        layers = decoder_layers(tr.model)
        device = torch.device(tr.rt.device)
        loaded = to_meta(step_loss, tr.rank)
        if r.method == "qlora":
            share_quant_states(step_loss, tr.rank, device)
        for layer in layers:
            fully_shard(layer, **kw)
        fully_shard(step_loss, **kw)
        fill(step_loss, loaded, tr.rank, device, torch.device("cpu") if r.distributed.fsdp_offload else device)
        self.loading = self._everywhere_loaded(loaded)
        self.root = step_loss
        self.storage = None
        if r.method == "qlora":
            report = quantized_storage(layers, r.quantization.bits, tr.world_size)
            self.storage = self._everywhere(report)
            check_quantized_storage(report, tr.rank, r.quantization.bits)
        tr.trainable_params(refresh=True)  # fully_shard replaced the parameters
        tr.optimizer = build_optimizer(tr.model, t, tr.ctx.cuda)
        tr.scheduler = build_scheduler(tr.optimizer, t, tr.max_steps)
        return step_loss

    def _everywhere_loaded(self, loaded) -> list[int]:
        """The bytes of weights each rank had loaded before sharding (rank 0: all; the others: none)."""
        import torch.distributed as dist

        out: list = [None] * self.trainer.world_size
        dist.all_gather_object(out, loaded.bytes_loaded)
        return out

    def _everywhere(self, report: StorageReport) -> dict[str, Any]:
        """Every rank's measurement (for the ``distributed`` event): one all-gather of small objects."""
        import torch.distributed as dist

        reports: list = [None] * self.trainer.world_size
        dist.all_gather_object(reports, report.to_dict())
        return {"bits": self.trainer.recipe.quantization.bits, "ranks": reports}

    def describe(self) -> str:
        return "torch FSDP2 (fully_shard per decoder layer)"

    def event_fields(self) -> dict[str, Any]:
        return {"fsdp_offload": self.trainer.recipe.distributed.fsdp_offload, "quantized_storage": self.storage,
                "loaded_bytes": self.loading}

    @contextlib.contextmanager
    def whole_forward(self):
        """Around a forward pass that does not enter the root unit (evaluation calls the model's parts
        directly): the root's parameters (embeddings, norm, LM head) all-gathered, then sharded again."""
        self.root.unshard()
        try:
            yield
        finally:
            self.root.reshard()

    def optimizer_step(self) -> float | None:
        """Clip by the norm of the whole gradient (its shards' norms reduced over the ranks), then step."""
        import torch

        tr = self.trainer
        params = tr.trainable_params()
        max_norm = tr.recipe.training.max_grad_norm
        total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm if max_norm is not None else float("inf"), total)
        tr.optimizer.step()
        tr.scheduler.step()
        tr.optimizer.zero_grad(set_to_none=True)
        return float(total)

    # ---------------------------------------------------------------- saving and resuming
    def _options(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.trainer.recipe.method != "full", **kw)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[dict[str, Any] | None]:
        """The trained weights, whole, on rank 0 (in CPU memory); the other ranks get an empty dict."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        model = self.trainer.model
        weights = get_model_state_dict(model, options=self._options(full_state_dict=True, cpu_offload=True))
        # a tied weight (the LM head sharing the embeddings) is saved once, under its first name, as
        # save_pretrained does with the model's own (it finds ties by storage, which gathered copies lose)
        aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        yield {k: v for k, v in weights.items() if k not in aliases}

    @property
    def saves_optimizer(self) -> bool:
        return False

    def _sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        tr = self.trainer
        return {"model": get_model_state_dict(tr.model, options=self._options()),
                "optimizer": get_optimizer_state_dict(tr.model, tr.optimizer, options=self._options())}

    unpickles_checkpoints = True  # .metadata and byte items (DCP), state files (DeepSpeed): pickles

    def write_shards(self, tmp: Path) -> None:
        import torch.distributed.checkpoint as dcp

        with _failures_as_errors(self.trainer.rank):
            dcp.save(self._sharded_state(), checkpoint_id=str(tmp / SHARDS_DIR))

    def read_parts(self, ckpt: Path) -> dict[str, Any]:
        tr = self.trainer
        return ckpt_io.read_checkpoint(ckpt, engine=True, rank=tr.rank, world_size=tr.world_size, engine_dir=SHARDS_DIR)

    def load_shards(self, ckpt: Path, parts: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        tr = self.trainer
        check_same_world(ckpt, parts, tr.world_size, "FSDP checkpoints hold one shard per process")
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(ckpt / SHARDS_DIR))
        set_model_state_dict(tr.model, state["model"], options=self._options(strict=False))
        set_optimizer_state_dict(tr.model, tr.optimizer, state["optimizer"], options=self._options())


@contextlib.contextmanager
def _failures_as_errors(rank: int) -> Iterator[None]:
    """``torch.distributed.checkpoint`` gathers what failed on each rank (a full disk on one of them, say) into
    a ``CheckpointException``, the same on every rank, which is a ``BaseException``: no ``except Exception``
    sees it (the staging folder's removal, the full-disk message). Raise it as an ordinary error instead,
    from this rank's own failure (or the first rank's), whose ``OSError`` says why."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failed = e.failures
        cause, _trace = failed.get(rank) or next(iter(failed.values()))
        ranks = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, sorted(failed)))}"
        raise RuntimeError(f"torch.distributed.checkpoint failed on {ranks}: {type(cause).__name__}: {cause}") from cause

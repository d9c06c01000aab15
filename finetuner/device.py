"""The device: every question finetuner asks an accelerator, answered in one place.

Every other module asks this one whether a CUDA device is there and what it is (name, capability, bf16,
memory, count), for its memory counters, its random generators, an autocast context and a gradient
scaler, the process group's backend, to empty the allocator's cache or wait for the device; and reads
the per-platform constants here (the memory model's CUDA context and cuBLAS workspace). torch is
imported inside the functions only: a plan, an estimate and the recipe checks import this module without
loading torch.

Platform names are torch's device types and also data: the recipe's ``device`` setting, a card
profile's ``platform`` and the plan and calibration files say ``cuda`` or ``cpu``; :data:`CUDA` and
:data:`CPU` are those strings.

:data:`PLATFORMS` holds what differs by platform. Only ``cuda`` and ``cpu`` are built. Apple Silicon
(``mps``: torch's ``torch.mps`` module, the gloo backend, no context outside the allocator's counters
that the memory model has measured) and AMD (ROCm builds of torch answer as ``cuda`` through HIP, with
``torch.version.hip`` set; RCCL behind the ``nccl`` backend) would go in as rows of that table, with the
functions below growing a branch on the row's name where torch's module differs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from finetuner.errors import UserError

CUDA = "cuda"
CPU = "cpu"
MiB = 1024**2


@dataclass(frozen=True)
class Platform:
    """What differs between the kinds of device finetuner runs on."""

    name: str  # torch's device type, and the platform string in recipes, card profiles and plans
    backend: str  # torch.distributed's backend for processes on this platform
    #: device memory the runtime holds outside torch's caching allocator (so not in ``max_memory_reserved``)
    context_bytes: int
    #: the BLAS library's workspaces, allocated through the caching allocator
    workspace_bytes: int
    #: process memory statistics come from the caching allocator (else from the process's RSS)
    allocator_counters: bool
    #: what a run's measured peak is, as its prediction record names it
    peak_counter: str


#: The platforms finetuner runs on. CUDA's context: the CUDA context, cuBLAS/cuDNN handles and kernel
#: images, ~300-500 MiB with lazy module loading on recent drivers (nvidia-smi of a process that only ran
#: ``torch.zeros(1, device="cuda")``), plus the bitsandbytes and attention kernels once loaded; taken on
#: the safe side. CUDA's workspace: cuBLAS/cuBLASLt workspaces, through the caching allocator (torch >= 2.3),
#: up to 32 MiB each on Hopper (``CUBLAS_WORKSPACE_CONFIG`` defaults), one per handle and stream.
#: A new platform (``mps``, a ROCm row if HIP's numbers differ) is a row here (see the module doc).
PLATFORMS: dict[str, Platform] = {
    CUDA: Platform(CUDA, backend="nccl", context_bytes=640 * MiB, workspace_bytes=64 * MiB, allocator_counters=True,
                   peak_counter="torch.cuda.max_memory_allocated"),
    CPU: Platform(CPU, backend="gloo", context_bytes=0, workspace_bytes=0, allocator_counters=False,
                  peak_counter="process peak RSS"),
}


def platform_of(device: str) -> Platform:
    """The platform of a device string (``cuda``, ``cuda:1``, ``cpu``)."""
    return PLATFORMS[CUDA if is_cuda(device) else CPU]


def is_cuda(device: str) -> bool:
    """Whether a device string (``cuda``, ``cuda:1``, a platform name) names a CUDA device."""
    return str(device).startswith(CUDA)


# -- what is there ------------------------------------------------------------------------------------


def available() -> bool:
    """Whether torch sees a CUDA device. Imports torch."""
    import torch

    return torch.cuda.is_available()


def count() -> int:
    """How many CUDA devices torch sees."""
    import torch

    return torch.cuda.device_count()


def current_index() -> int:
    """The index of this process's current CUDA device (a rank's ``LOCAL_RANK`` once :func:`use` set it)."""
    import torch

    return torch.cuda.current_device()


def use(index: int) -> None:
    """Make CUDA device ``index`` this process's current one."""
    import torch

    torch.cuda.set_device(index)


def current() -> Any:
    """This process's current CUDA device as a ``torch.device``."""
    import torch

    return torch.device(CUDA, current_index())


def name(index: int = 0) -> str:
    """The CUDA device's name as the driver reports it (``NVIDIA GeForce RTX 4090``)."""
    import torch

    return torch.cuda.get_device_name(index)


def total_memory(index: int = 0) -> int:
    """The CUDA device's memory in bytes, as ``get_device_properties`` reports it."""
    import torch

    return int(torch.cuda.get_device_properties(index).total_memory)


def capability(index: int = 0) -> tuple[int, int]:
    """The CUDA device's compute capability (major, minor): 8 and up is Ampere or newer."""
    import torch

    return tuple(torch.cuda.get_device_capability(index))


def bf16_supported() -> bool:
    """Whether the current CUDA device computes in bf16."""
    import torch

    return bool(torch.cuda.is_bf16_supported())


def half_precision() -> str:
    """The 16-bit type this machine's CUDA device computes in: ``bf16`` where it can, else ``fp16``."""
    return "bf16" if bf16_supported() else "fp16"


def resolve(want: str = "auto") -> str:
    """The platform for a ``device`` setting (``auto``, ``cpu``, ``cuda``, ``cuda:N``): ``auto`` takes CUDA
    where torch sees it; asking for CUDA where there is none is a :class:`UserError`. Imports torch
    unless ``want`` is ``cpu``."""
    if want == CPU:
        return CPU
    there = available()
    if is_cuda(want) and not there:
        raise UserError(f"device: '{want}' was asked for but no CUDA GPU is visible.", hint="Set device: auto or cpu.")
    return CUDA if there else CPU


# -- memory ---------------------------------------------------------------------------------------------


def memory_stats(device: str) -> dict[str, int]:
    """The caching allocator's counters of a CUDA ``device`` now, in bytes: allocated, reserved and the
    peak allocated (since the process started or a script reset torch's peak counters)."""
    import torch

    return {"allocated": int(torch.cuda.memory_allocated(device)), "reserved": int(torch.cuda.memory_reserved(device)),
            "peak": int(torch.cuda.max_memory_allocated(device))}


def empty_cache() -> None:
    """Give the caching allocator's free blocks back to the driver."""
    import torch

    torch.cuda.empty_cache()


def synchronize() -> None:
    """Wait for the CUDA device's queued work (a timing's end)."""
    import torch

    torch.cuda.synchronize()


def record_allocations(max_entries: int = 200_000) -> None:
    """Start recording the caching allocator's history (for https://pytorch.org/memory_viz)."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_allocations(path: str) -> None:
    """Write the recorded history to ``path`` and stop recording."""
    import torch

    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


# -- random generators -------------------------------------------------------------------------------


def rng_state() -> Any:
    """Every CUDA device's generator state (None where torch sees no CUDA device): a checkpoint's ``cuda``
    entry, and what an out-of-memory retry restores."""
    if not available():
        return None
    import torch

    return torch.cuda.get_rng_state_all()


def set_rng_state(state: Any) -> None:
    """Restore what :func:`rng_state` returned (nothing for None, or where no CUDA device is seen now)."""
    if state is not None and available():
        import torch

        torch.cuda.set_rng_state_all(state)


def device_rng_state(device: Any) -> Any:
    """One torch device's own generator state: a CUDA device's, None for the CPU (torch's CPU generator is
    ``torch.get_rng_state``)."""
    import torch

    return torch.cuda.get_rng_state(device) if device.type == CUDA else None


def set_device_rng_state(state: Any, device: Any) -> None:
    """Restore what :func:`device_rng_state` returned for ``device``."""
    import torch

    if state is not None:
        torch.cuda.set_rng_state(state, device)


def fork_rng(device: Any):
    """``torch.random.fork_rng`` over the CPU generator and ``device``'s own (a CUDA device's)."""
    import torch

    return torch.random.fork_rng(devices=[device] if device.type == CUDA else [])


# -- precision -----------------------------------------------------------------------------------------


def autocast(device: str, dtype: Any):
    """The autocast context on ``device`` (a device string or platform) in ``dtype``; None: no autocast."""
    import torch

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=platform_of(device).name, dtype=dtype)


def grad_scaler(device: str, precision: str):
    """The gradient scaler fp16 on CUDA needs (its range underflows without one), else None."""
    if precision != "fp16" or not is_cuda(device):
        return None
    import torch

    return torch.amp.GradScaler(CUDA)


# -- processes -----------------------------------------------------------------------------------------


def backend(device: str) -> str:
    """torch.distributed's backend for processes on ``device``: NCCL on CUDA, gloo on the CPU."""
    return platform_of(device).backend


def reduce_device(backend_name: str) -> Any:
    """Where a tensor must live for an all-reduce under ``backend_name``: the current CUDA device under NCCL
    (which has no CPU tensors), None (the CPU) otherwise."""
    return current() if backend_name == PLATFORMS[CUDA].backend else None

"""Recognising an out-of-memory error, and the smaller micro-batch a step is retried with.

torch raises :class:`torch.OutOfMemoryError` when its caching allocator cannot get memory, but a
library that allocates on its own reports the same failure as its own ``RuntimeError``: cuBLAS
(``CUBLAS_STATUS_ALLOC_FAILED`` when it creates a handle or workspace), cuDNN, cuSOLVER,
cuSPARSE, a raw ``cudaMalloc`` (``CUDA error: out of memory``), or text like ``CUDA out of
memory`` re-raised by another layer. :func:`is_out_of_memory` treats all of these as out of memory.
"""

from __future__ import annotations

#: texts of allocation failures that surface as a plain RuntimeError
OOM_MARKERS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "HIP out of memory",
    "MPS backend out of memory",
    "XPU out of memory",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a failed device allocation (see the module's docstring)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in OOM_MARKERS)


def describe(error: BaseException) -> str:
    """The start of an out-of-memory error's text, for the event and the log (not the error itself:
    its traceback holds the frames, and with them the tensors, of the step that failed)."""
    return f"{type(error).__name__}: {error}"[:300]


def smaller_micro_batch(micro_batch_size: int, effective_batch: int) -> int | None:
    """The largest micro-batch at most half of ``micro_batch_size`` that divides the effective batch
    (so the accumulation is a whole number), or None when ``micro_batch_size`` is 1."""
    return next((d for d in range(micro_batch_size // 2, 0, -1) if effective_batch % d == 0), None)


class StepOutOfMemory(Exception):
    """A step's micro-batches did not fit (on this process or, agreed, on another rank): retry it smaller.

    Raised outside the ``except`` block that caught the allocation failure, so it holds only text.
    """

    def __init__(self, message: str):
        self.message = message
        super().__init__(message)

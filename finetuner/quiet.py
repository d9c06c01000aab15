"""Keeping other libraries' chatter (progress bars, deprecation notes, start-up warnings) out of finetuner's output.

Two scopes:

- :func:`quiet_libraries` is for a finetuner process (the CLI, a training rank): it sets the
  environment and the loggers once, for the whole process.
- :func:`quieted` is for the Python API, around finetuner's own calls into transformers, peft,
  datasets and DeepSpeed (loading and saving models, attaching adapters, saving tokenized data).
  While it runs, transformers logs errors only; no progress bars are drawn ("Loading weights",
  "Writing model shards", "Saving the dataset"); DeepSpeed's warnings below ERROR are dropped
  ("Setting accelerator to CPU", printed on stdout when accelerate imports it on a machine
  without a GPU); and peft's read of a transformers property deprecated in v5
  (``is_gradient_checkpointing``, peft's call, not finetuner's) does not warn; transformers' GGUF loader
  draws no "Converting and de-quantizing GGUF tensors" bar (a plain tqdm it does not switch off). Everything is put
  back afterwards, so the user's other code keeps its own settings.

``finetuner --debug`` (:data:`DEBUG_ENV`) turns both off: everything the libraries say is shown.

Nothing here imports torch or transformers at module level.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

#: peft reads ``model.is_gradient_checkpointing`` (deprecated in transformers 5) when it wraps a model
_PEFT_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"
#: peft, saving an adapter of a model loaded from a GGUF file (SmolLM2's): it looks for the base's ``config.json``
#: beside the file and on the Hub, finds neither (a file, offline) and warns; finetuner never changes the vocabulary
_PEFT_NO_CONFIG = r"Could not find a config file in .* will assume that the vocabulary was not modified"

#: Set (to 1) by ``finetuner --debug``: the libraries' warnings and progress bars are shown, in this process and
#: in those it starts (a run's ranks, the web UI's jobs), which inherit the environment.
DEBUG_ENV = "FINETUNER_DEBUG"


def libraries_shown() -> bool:
    """Whether the libraries' own output is wanted (``finetuner --debug``, :data:`DEBUG_ENV`)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class _ErrorsOnly(logging.Filter):
    """Drops records below ERROR (DeepSpeed resets its logger's level and handler when imported, not its filters)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


_DEEPSPEED_FILTER = _ErrorsOnly()

#: the logger bitsandbytes (0.50) warns on, when it is imported on a CPU machine without the optional ``kernels`` package
BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"


class _NoKernelsNotice(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community: No module named
    'kernels'" (printed on import, so on every LoRA run on a CPU, since peft imports bitsandbytes): an optional
    faster 4-bit kernel that finetuner does not need. Its other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Failed to load CPU gemm_4bit_forward from kernels-community")
                    and "No module named 'kernels'" in text)


_NO_KERNELS_NOTICE = _NoKernelsNotice()


def drop_bnb_kernels_notice() -> None:
    """Keep bitsandbytes' notice about the missing optional ``kernels`` package (:class:`_NoKernelsNotice`)
    out of the output, and nothing else it says. Installed when :mod:`finetuner` is imported, before
    anything imports bitsandbytes (its logger is configured before the module exists)."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if _NO_KERNELS_NOTICE not in logger.filters:
        logger.addFilter(_NO_KERNELS_NOTICE)


def quiet_libraries() -> None:
    """Keep library chatter (progress bars, deprecation notes, DeepSpeed's accelerator warning, peft's notice on a GGUF
    base) out of a finetuner process; with :func:`libraries_shown` (``--debug``) let all of it through instead."""
    if libraries_shown():
        logging.getLogger(BNB_CPU_LOGGER).removeFilter(_NO_KERNELS_NOTICE)  # installed by ``import finetuner``
        return
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=_PEFT_NO_CONFIG, category=UserWarning)
    warnings.filterwarnings("ignore", message=".*TRANSFORMERS_CACHE.*")
    drop_bnb_kernels_notice()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("DeepSpeed").addFilter(_DEEPSPEED_FILTER)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


_lock = threading.Lock()
_depth = 0
_undo: list[Callable[[], None]] = []


def _silence() -> list[Callable[[], None]]:
    """Quiet the libraries; returns the steps that put every setting back."""
    from transformers.utils import logging as hf_logging

    undo: list[Callable[[], None]] = []
    level = hf_logging.get_verbosity()
    if level < logging.ERROR:
        hf_logging.set_verbosity_error()
        undo.append(lambda: hf_logging.set_verbosity(level))
    if hf_logging.is_progress_bar_enabled():
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars

        hub_was_off = are_progress_bars_disabled()
        hf_logging.disable_progress_bar()  # also turns the hub's bars off; enable_progress_bar turns both on

        def _bars_back() -> None:
            hf_logging.enable_progress_bar()
            if hub_was_off:
                disable_progress_bars()

        undo.append(_bars_back)
    datasets = sys.modules.get("datasets")  # only when the caller uses it (importing it costs a second)
    if datasets is not None and datasets.is_progress_bar_enabled():
        datasets.disable_progress_bars()
        undo.append(datasets.enable_progress_bars)
    deepspeed = logging.getLogger("DeepSpeed")
    if _DEEPSPEED_FILTER not in deepspeed.filters:
        deepspeed.addFilter(_DEEPSPEED_FILTER)
        undo.append(lambda: deepspeed.removeFilter(_DEEPSPEED_FILTER))
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.filterwarnings("ignore", message=_PEFT_DEPRECATION, category=FutureWarning)
    warnings.filterwarnings("ignore", message=_PEFT_NO_CONFIG, category=UserWarning)
    undo.append(lambda: caught.__exit__(None, None, None))
    return undo


def quiet_gguf_loader() -> None:
    """Inside :func:`quieted`: also keep transformers' GGUF loader from drawing its "Converting and
    de-quantizing GGUF tensors" bar (a plain tqdm, outside transformers' switch); called when a GGUF
    file is about to load (importing the loader costs torch), put back when the quiet spell ends."""
    with _lock:
        if _depth == 0:
            return
        import transformers.modeling_gguf_pytorch_utils as gguf_loader

        if isinstance(gguf_loader.tqdm, functools.partial):
            return
        bar = gguf_loader.tqdm
        gguf_loader.tqdm = functools.partial(bar, disable=True)
        _undo.append(lambda: setattr(gguf_loader, "tqdm", bar))


@contextlib.contextmanager
def quieted() -> Iterator[None]:
    """Quiet transformers, peft and DeepSpeed while the block runs (nested and concurrent uses share one quiet spell)."""
    global _depth
    if libraries_shown():
        yield
        return
    with _lock:
        if _depth == 0:
            _undo[:] = _silence()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _undo:
                    _undo.pop()()

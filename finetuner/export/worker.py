"""Merge or export in a separate process: the model is loaded there, never in the caller (the web UI).

The worker speaks finetuner's worker protocol (:mod:`finetuner.worker_protocol`). Started as
``python -m finetuner.export.worker``, it reads one request from stdin: the keywords of
:func:`finetuner.export.merge.merge_adapter`, ``{"source": "runs/demo", "output_dir": "out", "dtype":
"auto", "overwrite": false}``, or, with ``"task": "export"``, those of
:func:`finetuner.export.gguf.export_model` (``{"task": "export", "source": "runs/demo", "output":
"demo.gguf", "quant": "q8_0"}``). While it works it prints its phases' progress, ``{"kind": "phase", "phase":
"write", "done": 1, "total": 2, ...}`` (:mod:`finetuner.phases`: loading the base, merging, writing, checking), then
one last message: ``{"kind": "done", "result": {...}}`` (the result's ``to_dict()``), or ``{"kind": "error",
"message": ..., "hint": ..., "user_error": ...}``: a :class:`~finetuner.errors.UserError` as the merge or export
raised it, or anything else (a bug, ``user_error: false``). Whatever else is printed (library output) goes to stderr.

:func:`merge_in_subprocess` and :func:`export_in_subprocess` are the caller's side: the arguments
and the results of :func:`~finetuner.export.merge.merge_adapter` and
:func:`~finetuner.export.gguf.export_model`, and the same :class:`UserError`; :class:`Job` is the same with the
phase records as they come (the web UI shows them while it waits).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import finetuner.phases as phases
import finetuner.worker_protocol as protocol
from finetuner.children import module_command, safe_env, stop_signals_abort
from finetuner.errors import UserError
from finetuner.surface import child_env

#: the keywords of merge_adapter a request may carry
KEYS = ("source", "output_dir", "dtype", "shard_size", "overwrite", "base_model", "verify", "trust_remote_code", "allow_pickle")
#: the keywords of export_model an export request may carry
EXPORT_KEYS = ("source", "output", "format", "quant", "overwrite", "base_model", "merge_dtype", "verify", "trust_remote_code",
               "allow_pickle", "ollama_name")


# --------------------------------------------------------------------------- the worker process
def _bad_request(text: str) -> dict[str, Any]:
    """The answer to a request the worker cannot read: a caller's bug, not the user's."""
    return protocol.message("error", message=text, hint=None, type="BadRequest", user_error=False)


def serve(request: Any, on_phase: phases.Sink | None = None) -> dict[str, Any]:
    """The answer to one request (a dict of :data:`KEYS`, or ``task: export`` and :data:`EXPORT_KEYS`):
    a ``done`` or ``error`` message of the worker protocol; the work's phase records go to ``on_phase``."""
    if isinstance(request, dict) and request.get("task") == "export":
        request = {k: v for k, v in request.items() if k != "task"}
        keys, required, what = EXPORT_KEYS, {"source", "output"}, "An export"
    else:
        keys, required, what = KEYS, {"source", "output_dir"}, "A merge"
    if not isinstance(request, dict) or not required <= set(request) or set(request) - set(keys):
        return _bad_request(f"{what} request is a JSON object with {', '.join(sorted(required))} and some of "
                            f"{', '.join(k for k in keys if k not in required)}; got {json.dumps(request)[:200]}.")
    try:
        with phases.reporting(on_phase) if on_phase is not None else contextlib.nullcontext():
            return protocol.message("done", result=_work(request, keys is EXPORT_KEYS).to_dict())
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - a UserError as raised, a stop ("interrupted"); anything else the caller shows as a bug
        return protocol.error_message(e)


def _work(request: dict[str, Any], export: bool) -> Any:
    if export:
        from finetuner.export.gguf import export_model

        return export_model(**request)
    from finetuner.export.merge import merge_adapter

    return merge_adapter(**request)


def main() -> int:
    """Read one request from stdin, print its answer message; exit 0 (merged), 2 (a UserError) or 1."""
    out = protocol.take_stdout()  # library prints must not corrupt the answer line
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        request = json.loads(sys.stdin.read())
    except json.JSONDecodeError as e:
        answer = _bad_request(f"The merge request is not JSON ({e}).")
    else:
        with stop_signals_abort():  # SIGTERM as Ctrl-C: the work's staging removed, then the answer "interrupted"
            answer = serve(request, lambda rec: out.send("phase", **rec))
    out.send(**answer)
    if answer["kind"] == "done":
        return 0
    return UserError.exit_code if answer["user_error"] else 1


# --------------------------------------------------------------------------- the caller's side
class Job:
    """One request run in a new worker process. Iterate it for the work's phase records (:mod:`finetuner.phases`)
    as the worker sends them; then :attr:`result` holds its result dict, or iterating raised its error. A job left
    before its end (a page closed) still runs to its end and publishes its output: its messages are read (and
    dropped) by a thread of their own, so its pipe never fills."""

    def __init__(self, request: dict[str, Any], what: str):
        self.request, self.what = request, what
        self.result: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        proc = subprocess.Popen(
            module_command("finetuner.export.worker"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, encoding="utf-8",
            env=safe_env(child_env()),  # its messages are worded for where the caller shows them
        )
        tail: collections.deque[str] = collections.deque(maxlen=5)  # its last words, for a process that dies
        reading = threading.Thread(target=tail.extend, args=(proc.stderr,), daemon=True)
        reading.start()
        answer = None
        messages = protocol.Receiver(proc.stdout)  # read in a thread of its own: a job left early still finishes
        with contextlib.suppress(BrokenPipeError):  # a worker that died at once: said below with its last words
            proc.stdin.write(json.dumps(self.request))
            proc.stdin.close()
        while True:
            try:
                msg = messages.get(timeout=60.0)
            except queue.Empty:
                continue
            if msg is None:
                break
            if msg["kind"] == "phase":
                yield {k: v for k, v in msg.items() if k != "kind"}
            elif msg["kind"] in ("done", "error"):
                answer = msg
        proc.wait()
        reading.join()
        if answer is None:
            said = "".join(tail).strip()
            raise RuntimeError(f"The {self.what} process ended without an answer (exit status {proc.returncode}).\n{said}".strip())
        if answer["kind"] == "error":
            protocol.raise_error(answer)
        self.result = answer["result"]


def _answer(job: Job, on_phase: phases.Sink | None) -> dict[str, Any]:
    """Run ``job`` (its phase records to ``on_phase``); its result dict, or raise its error."""
    for rec in job:
        if on_phase is not None:
            on_phase(rec)
    assert job.result is not None
    return job.result


def _check_keywords(func: str, kwargs: dict[str, Any], keys: tuple[str, ...]) -> None:
    unknown = sorted(set(kwargs) - set(keys))
    if unknown:
        raise TypeError(f"{func}() got unexpected keyword arguments: {', '.join(unknown)}")


def merge_job(source: str | Path, output_dir: str | Path, **kwargs: Any) -> Job:
    """The :class:`Job` of a merge (the keywords of :func:`~finetuner.export.merge.merge_adapter`); its
    :attr:`~Job.result` is a :meth:`MergeResult.to_dict() <finetuner.export.merge.MergeResult.to_dict>`."""
    _check_keywords("merge_in_subprocess", kwargs, KEYS)
    return Job({"source": str(source), "output_dir": str(output_dir), **kwargs}, "merge")


def export_job(source: str | Path, output: str | Path, **kwargs: Any) -> Job:
    """The :class:`Job` of an export (the keywords of :func:`~finetuner.export.gguf.export_model`)."""
    _check_keywords("export_in_subprocess", kwargs, EXPORT_KEYS)
    return Job({"task": "export", "source": str(source), "output": str(output), **kwargs}, "export")


def merge_in_subprocess(source: str | Path, output_dir: str | Path, on_phase: Callable[[dict[str, Any]], Any] | None = None,
                        **kwargs: Any):
    """:func:`~finetuner.export.merge.merge_adapter` run in a new Python process, so that the
    caller never holds the model; its phase records go to ``on_phase``. Returns its
    :class:`~finetuner.export.merge.MergeResult`; raises its :class:`UserError` (message and hint as the merge
    raised them), or :class:`RuntimeError` for anything else (a bug, or the process killed, e.g. out of memory)."""
    from finetuner.export.merge import MergeResult

    return MergeResult.from_dict(_answer(merge_job(source, output_dir, **kwargs), on_phase))


def export_in_subprocess(source: str | Path, output: str | Path, on_phase: Callable[[dict[str, Any]], Any] | None = None,
                         **kwargs: Any) -> dict[str, Any]:
    """:func:`~finetuner.export.gguf.export_model` run in a new Python process (its phase records to
    ``on_phase``). Returns its :meth:`ExportResult.to_dict() <finetuner.export.gguf.ExportResult.to_dict>`; raises
    its :class:`UserError`, or :class:`RuntimeError` for anything else."""
    return _answer(export_job(source, output, **kwargs), on_phase)


if __name__ == "__main__":
    sys.exit(main())

"""Merge or export in a separate process: the model is loaded there, never in the caller (the web UI).

The worker speaks finetuner's worker protocol (:mod:`finetuner.runs.worker_protocol`). Started as
``python -m finetuner.export.worker``, it reads one request from stdin: the keywords of
:func:`finetuner.export.merge.merge_adapter`, ``{"source": "runs/demo", "output_dir": "out", "dtype":
"auto", "overwrite": false}``, or, with ``"task": "export"``, those of
:func:`finetuner.export.gguf.export_model` (``{"task": "export", "source": "runs/demo", "output":
"demo.gguf", "quant": "q8_0"}``). It prints one message on stdout: ``{"kind": "done", "result":
{...}}`` (the result's ``to_dict()``), or ``{"kind": "error", "message": ..., "hint": ...,
"user_error": ...}``: a :class:`~finetuner.errors.UserError` as the merge or export raised it, or
anything else (a bug, ``user_error: false``). Whatever else is printed (library output) goes to stderr.

:func:`merge_in_subprocess` and :func:`export_in_subprocess` are the caller's side: the arguments
and the results of :func:`~finetuner.export.merge.merge_adapter` and
:func:`~finetuner.export.gguf.export_model`, and the same :class:`UserError`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from finetuner.children import module_command, safe_env
from finetuner.errors import UserError
from finetuner.runs import worker_protocol as protocol
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


def serve(request: Any) -> dict[str, Any]:
    """The answer to one request (a dict of :data:`KEYS`, or ``task: export`` and :data:`EXPORT_KEYS`):
    a ``done`` or ``error`` message of the worker protocol."""
    if isinstance(request, dict) and request.get("task") == "export":
        request = {k: v for k, v in request.items() if k != "task"}
        keys, required, what = EXPORT_KEYS, {"source", "output"}, "An export"
    else:
        keys, required, what = KEYS, {"source", "output_dir"}, "A merge"
    if not isinstance(request, dict) or not required <= set(request) or set(request) - set(keys):
        return _bad_request(f"{what} request is a JSON object with {', '.join(sorted(required))} and some of "
                            f"{', '.join(k for k in keys if k not in required)}; got {json.dumps(request)[:200]}.")
    try:
        if keys is EXPORT_KEYS:
            from finetuner.export.gguf import export_model

            result = export_model(**request)
        else:
            from finetuner.export.merge import merge_adapter

            result = merge_adapter(**request)
    except Exception as e:  # noqa: BLE001 - a UserError as raised; anything else the caller shows as a bug
        return protocol.error_message(e)
    return protocol.message("done", result=result.to_dict())


def main() -> int:
    """Read one request from stdin, print its answer message; exit 0 (merged), 2 (a UserError) or 1."""
    out = protocol.take_stdout()  # library prints must not corrupt the answer line
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        request = json.loads(sys.stdin.read())
    except json.JSONDecodeError as e:
        answer = _bad_request(f"The merge request is not JSON ({e}).")
    else:
        answer = serve(request)
    out.send(**answer)
    if answer["kind"] == "done":
        return 0
    return UserError.exit_code if answer["user_error"] else 1


# --------------------------------------------------------------------------- the caller's side
def _answer(request: dict[str, Any], what: str) -> dict[str, Any]:
    """Run one request in a new worker process; its result dict, or raise its error."""
    proc = subprocess.run(
        module_command("finetuner.export.worker"), input=json.dumps(request), capture_output=True,
        text=True, encoding="utf-8", env=safe_env(child_env()),  # its messages are worded for where the caller shows them
    )
    answer = protocol.last_message(proc.stdout)
    if answer is None or answer["kind"] not in ("done", "error"):
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"The {what} process ended without an answer (exit status {proc.returncode}).\n{tail}".strip())
    if answer["kind"] == "error":
        protocol.raise_error(answer)
    return answer["result"]


def _check_keywords(func: str, kwargs: dict[str, Any], keys: tuple[str, ...]) -> None:
    unknown = sorted(set(kwargs) - set(keys))
    if unknown:
        raise TypeError(f"{func}() got unexpected keyword arguments: {', '.join(unknown)}")


def merge_in_subprocess(source: str | Path, output_dir: str | Path, **kwargs: Any):
    """:func:`~finetuner.export.merge.merge_adapter` run in a new Python process, so that the
    caller never holds the model. Returns its :class:`~finetuner.export.merge.MergeResult`;
    raises its :class:`UserError` (message and hint as the merge raised them), or
    :class:`RuntimeError` for anything else (a bug, or the process killed, e.g. out of memory)."""
    from finetuner.export.merge import MergeResult

    _check_keywords("merge_in_subprocess", kwargs, KEYS)
    return MergeResult.from_dict(_answer({"source": str(source), "output_dir": str(output_dir), **kwargs}, "merge"))


def export_in_subprocess(source: str | Path, output: str | Path, **kwargs: Any) -> dict[str, Any]:
    """:func:`~finetuner.export.gguf.export_model` run in a new Python process. Returns its
    :meth:`ExportResult.to_dict() <finetuner.export.gguf.ExportResult.to_dict>`; raises its
    :class:`UserError`, or :class:`RuntimeError` for anything else."""
    _check_keywords("export_in_subprocess", kwargs, EXPORT_KEYS)
    return _answer({"task": "export", "source": str(source), "output": str(output), **kwargs}, "export")


if __name__ == "__main__":
    sys.exit(main())

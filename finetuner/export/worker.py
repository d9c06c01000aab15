"""Merge in a separate process: the model is loaded there, never in the caller (the web UI).

Protocol (one JSON line each way). The worker is started as ``python -m finetuner.export.worker``
and reads one request from stdin, the keywords of :func:`finetuner.export.merge.merge_adapter`:
``{"source": "runs/demo", "output_dir": "out", "dtype": "auto", "overwrite": false}``. It prints
one line on stdout: ``{"result": {...}}`` (:meth:`MergeResult.to_dict`), ``{"error": message,
"hint": hint}`` for a :class:`~finetuner.errors.UserError` (as the merge raised it), or
``{"error": ..., "unexpected": true}`` for anything else (a bug). Whatever else is printed
(library output) goes to stderr.

:func:`merge_in_subprocess` is the caller's side: the arguments and the result of
:func:`~finetuner.export.merge.merge_adapter`, and the same :class:`UserError`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from finetuner.errors import UserError

#: the keywords of merge_adapter a request may carry
KEYS = ("source", "output_dir", "dtype", "shard_size", "overwrite", "base_model", "verify")


# --------------------------------------------------------------------------- the worker process
def serve(request: Any) -> dict[str, Any]:
    """The answer to one request (a dict of :data:`KEYS`)."""
    from finetuner.export import merge

    if not isinstance(request, dict) or not {"source", "output_dir"} <= set(request) or set(request) - set(KEYS):
        return {"error": f"A merge request is a JSON object with source, output_dir and some of {', '.join(KEYS[2:])}; "
                         f"got {json.dumps(request)[:200]}.", "unexpected": True}
    try:
        result = merge.merge_adapter(**request)
    except UserError as e:
        return {"error": e.message, "hint": e.hint}
    except Exception as e:  # noqa: BLE001 - the caller shows it as a bug
        return {"error": f"{type(e).__name__}: {e}", "unexpected": True}
    return {"result": result.to_dict()}


def main() -> int:
    """Read one request from stdin, print its answer line; exit 0 (merged), 2 (a UserError) or 1."""
    out, sys.stdout = sys.stdout, sys.stderr  # library prints must not corrupt the answer line
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        request = json.loads(sys.stdin.read())
    except json.JSONDecodeError as e:
        answer: dict[str, Any] = {"error": f"The merge request is not JSON ({e}).", "unexpected": True}
    else:
        answer = serve(request)
    out.write(json.dumps(answer, ensure_ascii=False, default=str) + "\n")
    out.flush()
    return 0 if "result" in answer else 1 if answer.get("unexpected") else UserError.exit_code


# --------------------------------------------------------------------------- the caller's side
def merge_in_subprocess(source: str | Path, output_dir: str | Path, **kwargs: Any):
    """:func:`~finetuner.export.merge.merge_adapter` run in a new Python process, so that the
    caller never holds the model. Returns its :class:`~finetuner.export.merge.MergeResult`;
    raises its :class:`UserError` (message and hint as the merge raised them), or
    :class:`RuntimeError` for anything else (a bug, or the process killed, e.g. out of memory)."""
    from finetuner.export.merge import MergeResult

    unknown = sorted(set(kwargs) - set(KEYS))
    if unknown:
        raise TypeError(f"merge_in_subprocess() got unexpected keyword arguments: {', '.join(unknown)}")
    request = {"source": str(source), "output_dir": str(output_dir), **kwargs}
    proc = subprocess.run(
        [sys.executable, "-m", "finetuner.export.worker"], input=json.dumps(request), capture_output=True,
        text=True, encoding="utf-8",
    )
    lines = proc.stdout.strip().splitlines()
    if len(lines) != 1:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"The merge process ended without an answer (exit status {proc.returncode}).\n{tail}".strip())
    answer = json.loads(lines[0])
    if "result" in answer:
        return MergeResult.from_dict(answer["result"])
    if answer.get("unexpected"):
        raise RuntimeError(answer["error"])
    raise UserError(answer["error"], hint=answer.get("hint"))


if __name__ == "__main__":
    sys.exit(main())

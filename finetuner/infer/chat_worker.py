"""Chat in a separate process: the model is loaded there once, never in the caller (the web UI).

The worker speaks finetuner's worker protocol (:mod:`finetuner.worker_protocol`, JSON lines on
its stdout). Started as ``python -m finetuner.infer.chat_worker RUN_OR_MODEL [--base]``, it sends
``{"kind": "started", "describe": ..., "has_adapter": ...}`` once the model is loaded (or an
``error`` message and exits). Each request on stdin, ``{"id": 1, "messages": [{"role": "user",
"content": "Hi"}], "max_new_tokens": 128, "temperature": 0.7, "top_p": 0.9, "seed": null,
"adapter": true}`` (``adapter: false``: the base model's answer, the adapter switched off), is
answered by ``{"kind": "progress", "id": 1, "token": "..."}`` lines as text is generated, then
``{"kind": "done", "id": 1}`` (or ``{"kind": "error", "id": 1, "message": ...}``).

:class:`ChatWorker` is the caller's side: it starts the process and turns a request into an
iterator of text pieces.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import finetuner.worker_protocol as protocol
from finetuner.children import module_command, safe_env
from finetuner.errors import UserError

GEN_KEYS = ("max_new_tokens", "temperature", "top_p", "seed", "adapter", "images")


# --------------------------------------------------------------------------- the worker process
def serve(source: str, out: protocol.Sender, adapter: bool = True, allow_code: bool = False) -> int:
    """Load the model and answer requests from stdin until it closes, reporting on ``out``.
    ``allow_code``: the user's opt-in to the run's ``model.trust_remote_code`` and ``model.allow_pickle``."""
    try:
        from finetuner.infer.chat import load_chat_model

        model = load_chat_model(source, adapter=adapter, trust_remote_code=allow_code, allow_pickle=allow_code)
    except Exception as e:  # noqa: BLE001 - reported to the caller as a message
        out.error(e)
        return UserError.exit_code if isinstance(e, UserError) else 1
    out.send("started", describe=model.describe(), has_adapter=bool(getattr(model, "has_adapter", False)))
    for line in sys.stdin:
        if not line.strip():
            continue
        rid = None
        try:
            req = json.loads(line)
            rid = req.get("id")
            gen = {k: req[k] for k in GEN_KEYS if req.get(k) is not None}
            model.tools = req.get("tools") or None  # the schemas this conversation offers (the UI's tools file)
            for piece in model.stream(req["messages"], **gen):
                if piece:
                    out.send("progress", id=rid, token=piece)
            out.send("done", id=rid)
        except Exception as e:  # noqa: BLE001 - one bad request must not end the worker
            out.error(e, id=rid)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m finetuner.infer.chat_worker", description=__doc__.splitlines()[0])
    p.add_argument("source", help="A run folder, an adapter folder or a model.")
    p.add_argument("--base", action="store_true", help="The base model alone (no adapter).")
    p.add_argument("--allow-code", action="store_true",
                   help="Allow the run's model.trust_remote_code and model.allow_pickle (code from the run's folder may run).")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore")
    return serve(args.source, protocol.take_stdout(), adapter=not args.base, allow_code=args.allow_code)


# --------------------------------------------------------------------------- the caller's side
class ChatWorker:
    """A chat model in its own process. ``stream()`` yields text pieces as they are generated."""

    def __init__(self, source: str, adapter: bool = True, start_timeout: float = 600.0, allow_code: bool = False):
        self.source, self.adapter, self.allow_code = str(source), adapter, allow_code
        self.start_timeout = start_timeout
        self.describe = ""
        self.has_adapter = False
        self._proc: subprocess.Popen | None = None
        self._messages: protocol.Receiver | None = None
        self._lock = threading.Lock()
        self._next_id = 0
        self._ready = False  # its model has loaded (the "started" message came)
        self._loading_since = 0.0

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> ChatWorker:
        """Start the process (unless it runs) and wait until its model is loaded."""
        for _waited in self._wait_loaded(self.start_timeout):
            pass
        return self

    def loading(self, every: float = 1.0) -> Iterator[float]:
        """Start the process (unless it runs) and yield the seconds waited, every ``every`` seconds, until its
        model is loaded: what a page shows so that a model that takes minutes to load (a large one, a busy
        machine) is seen loading, not hanging. A failure to load raises :class:`UserError` with the worker's
        message; more than ``start_timeout`` seconds, one that says so."""
        with self._lock:  # one reader of the worker's messages at a time (stream() waits)
            yield from self._wait_loaded(every)

    def _wait_loaded(self, every: float) -> Iterator[float]:
        if self.alive and self._ready:
            return
        if not self.alive:
            cmd = module_command("finetuner.infer.chat_worker", self.source, *([] if self.adapter else ["--base"]),
                                 *(["--allow-code"] if self.allow_code else []))
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=safe_env(),
                text=True, encoding="utf-8", bufsize=1, start_new_session=True,
            )
            self._messages = protocol.Receiver(self._proc.stdout)  # type: ignore[arg-type]
            self._ready = False
            self._loading_since = time.monotonic()
        deadline = self._loading_since + self.start_timeout
        assert self._messages is not None
        while True:
            try:
                first = self._messages.get(max(0.0, min(every, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise self._failed(f"did not answer within {self.start_timeout:.0f} s (loading the model)") from None
                yield time.monotonic() - self._loading_since
                continue
            if first is None:
                raise self._failed(f"ended unexpectedly (exit status {self._proc.poll() if self._proc else None})")
            break
        if first["kind"] == "error":
            self.close()
            raise UserError(f"Could not load {self.source} for chat: {protocol.error_text(first)}")
        self.describe = first.get("describe", "")
        self.has_adapter = bool(first.get("has_adapter"))
        self._ready = True

    def _get(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            assert self._messages is not None
            msg = self._messages.get(timeout)
        except queue.Empty:
            raise self._failed(f"did not answer within {timeout:.0f} s ({what})") from None
        if msg is None:
            raise self._failed(f"ended unexpectedly (exit status {self._proc.poll() if self._proc else None})")
        return msg

    def _failed(self, what: str) -> UserError:
        """The worker is closed; the error to raise says what it did (``what``)."""
        self.close()
        return UserError(f"The chat worker for {self.source} {what}.")

    def stream(self, messages: list[dict[str, str]], timeout: float = 300.0, tools: list[dict[str, Any]] | None = None,
               **gen: Any) -> Iterator[str]:
        """Send one conversation (offering ``tools``, schemas, when given); yield the reply's text pieces as they
        arrive."""
        with self._lock:
            self.start()
            self._next_id += 1
            rid = self._next_id
            req = {"id": rid, "messages": messages, "tools": tools, **{k: v for k, v in gen.items() if k in GEN_KEYS}}
            assert self._proc is not None and self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(req, ensure_ascii=False) + "\n")
            self._proc.stdin.flush()
            deadline = time.monotonic() + timeout
            while True:
                msg = self._get(max(1.0, deadline - time.monotonic()), "generating")
                if msg.get("id") != rid:
                    continue
                if msg["kind"] == "progress":
                    yield msg["token"]
                elif msg["kind"] == "done":
                    return
                elif msg["kind"] == "error":
                    raise UserError(f"Chat failed: {msg['message']}")

    def reply(self, messages: list[dict[str, str]], **gen: Any) -> str:
        return "".join(self.stream(messages, **gen))

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin:
                proc.stdin.close()
            proc.wait(timeout=5)
        except (subprocess.TimeoutExpired, OSError):
            proc.kill()
            proc.wait(timeout=5)

    def __enter__(self) -> ChatWorker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())

"""The Chat tab's models, each in a process of its own (:class:`finetuner.infer.chat_worker.ChatWorker`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ChatPool:
    """One chat process per source (a run): it answers as the fine-tune, or as the base model with
    the adapter switched off, so a run's model is in memory once however many pages chat with it.

    Sessions borrow a worker with :meth:`lease`; a worker lent out is never closed (another
    session chatting with another run starts a worker of its own beside it). Once returned, the
    least recently used workers nobody holds are closed down to ``keep`` (default 1: the model
    of the last chat stays loaded, as before; two pages chatting with two runs hold two models
    only while both are answering, and otherwise take turns loading theirs)."""

    def __init__(self, keep: int = 1):
        self.keep = max(0, int(keep))
        self._lock = threading.Lock()
        self._workers: dict[tuple[str, bool], Any] = {}  # (source, allow_code) -> worker, least recently used first
        self._users: dict[tuple[str, bool], int] = {}  # (source, allow_code) -> sessions holding it now

    @staticmethod
    def _new(key: tuple[str, bool]):
        from finetuner.infer.chat_worker import ChatWorker

        source, allow_code = key
        return ChatWorker(source, adapter=True, allow_code=allow_code)

    @property
    def loaded(self) -> list[str]:
        """The sources whose model is loaded now (oldest use first)."""
        with self._lock:
            return [s for (s, _code), w in self._workers.items() if w.alive]

    def is_loaded(self, source: str, allow_code: bool = False) -> bool:
        with self._lock:
            w = self._workers.get((source, bool(allow_code)))
            return w is not None and w.alive

    @contextmanager
    def lease(self, source: str, allow_code: bool = False) -> Iterator[Any]:
        """The worker for ``source``, held for the ``with`` block: not closed while held.
        ``allow_code``: the user confirmed that code from the run's folder may run (its recipe's
        model.trust_remote_code / model.allow_pickle); a worker started without it is never reused with it."""
        key = (source, bool(allow_code))
        with self._lock:
            worker = self._workers.pop(key, None)
            if worker is None:
                worker = self._new(key)
            self._workers[key] = worker  # now the most recently used
            self._users[key] = self._users.get(key, 0) + 1
        try:
            yield worker
        finally:
            with self._lock:
                left = self._users.pop(key, 0) - 1
                if left > 0:
                    self._users[key] = left
                idle = self._trim()
            for w in idle:  # outside the lock: closing waits for the process to end
                w.close()

    def _trim(self) -> list[Any]:
        """The idle workers beyond ``keep``, least recently used first, taken out of the pool."""
        idle = [s for s in self._workers if s not in self._users]
        out = []
        while len(self._workers) > self.keep and idle:
            out.append(self._workers.pop(idle.pop(0)))
        return out

    def close(self) -> None:
        """Close every worker (the app is shutting down)."""
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
            self._users.clear()
        for w in workers:
            w.close()

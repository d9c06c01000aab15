"""The Chat tab's model, in a process of its own (:class:`finetuner.infer.chat_worker.ChatWorker`)."""

from __future__ import annotations

import threading
from typing import Any


class ChatPool:
    """One chat process per source (a run): it answers as the fine-tune, or as the base model with
    the adapter switched off, so the model is in memory once. Another source replaces it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._worker: Any = None

    @property
    def loaded(self) -> str | None:
        w = self._worker
        return w.source if w is not None and w.alive else None

    def get(self, source: str, allow_code: bool = False):
        """The worker for ``source``; ``allow_code``: the user confirmed that code from the run's
        folder may run (its recipe's model.trust_remote_code / model.allow_pickle)."""
        from finetuner.infer.chat_worker import ChatWorker

        with self._lock:
            if self._worker is not None and (self._worker.source != source or self._worker.allow_code != allow_code):
                self._worker.close()
                self._worker = None
            if self._worker is None:
                self._worker = ChatWorker(source, adapter=True, allow_code=allow_code)
            return self._worker

    def close(self) -> None:
        with self._lock:
            if self._worker is not None:
                self._worker.close()
                self._worker = None

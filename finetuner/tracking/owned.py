"""Which tracking runs named in a run folder's ``tracking.json`` this user's finetuner started.

A resumed run continues the tracking run whose id ``tracking.json`` keeps. A run folder may come from someone else,
and its ``tracking.json`` may name any run id: a finished run of the user's own MLflow server, say, which resuming
would then write its metrics and adapter into (issue 66). So each id a run starts is kept with a mark: an
HMAC-SHA256 of the tracker's name and the id under this user's private key (the key that seals checkpoints,
:mod:`finetuner.training.seal`: mode 0600, in ``~/.config/finetuner``). Only an id whose mark this key makes is
continued; any other (a received folder's, an older finetuner's, an edited one) starts a new tracking run, unless
the user says ``--tracking-resume`` (:data:`RESUME_ENV` in a multi-process run's ranks)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable

from finetuner.errors import UserError

log = logging.getLogger(__name__)

#: set (to 1) in the environment of a run's ranks: the ids in tracking.json are continued even without this user's mark
RESUME_ENV = "FINETUNER_TRACKING_RESUME"


def resume_by_env() -> bool:
    return os.environ.get(RESUME_ENV, "") not in ("", "0")


def user_key(private_key: Callable[[], bytes] | None) -> bytes | None:
    """This user's key from ``private_key`` (the trainer passes :func:`finetuner.training.seal.private_key`), or
    None without one or when it cannot be used (a key others could read marks nothing: every id is then foreign)."""
    if private_key is None:
        return None
    try:
        return private_key()
    except UserError as e:
        log.warning("%s", " ".join(str(e).split())[:300])
        return None


def mark(name: str, run_id: str, key: bytes | None) -> str | None:
    """The mark of ``name``'s run ``run_id`` under ``key`` (None without a key)."""
    if key is None:
        return None
    return hmac.new(key, f"finetuner-tracking-run\0{name}\0{run_id}".encode(), hashlib.sha256).hexdigest()


def is_ours(name: str, run_id: str, given: object, key: bytes | None) -> bool:
    """Whether ``given`` (tracking.json's mark of the id) is this user's mark of ``name``'s run ``run_id``."""
    if not isinstance(given, str):
        return False
    ours = mark(name, run_id, key)
    return ours is not None and hmac.compare_digest(ours, given)

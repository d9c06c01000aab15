"""A model read once: its inventory (:mod:`finetuner.model.inventory`) with its first layer's trace
(:mod:`finetuner.model.trace`), cached.

The result depends only on the config and the installed transformers, so it is cached as JSON under
``<cache>/models/`` (:func:`finetuner.fileio.cache_root`). The models finetuner names (its presets) and ships
(``data/demo_model``) come read already: ``finetuner/model/inventories.json`` holds their inventories as the
pinned transformers builds them (written by ``python -m scripts.dev.read_models``; ``tests/model/test_inventory.py``
reads every one again with the installed transformers and fails on any difference), so ``finetuner plan`` on a
preset imports neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from finetuner.errors import first_line
from finetuner.cachedir import EntryRejected, cache_folder, read_json_entry, write_json_entry
from finetuner.model.inventory import FORMAT_VERSION, Inventory, inventory_of

#: inventories of the models finetuner names or ships, by :func:`config_key` (see the module's docstring)
PACKAGED = Path(__file__).with_name("inventories.json")


def read_model(cfg: dict[str, Any]) -> Inventory:
    """:func:`~finetuner.model.inventory.inventory_of` with the first decoder layer's trace (no cache)."""
    return replace(inventory_of(cfg), **_traced(cfg))


def _traced(cfg: dict[str, Any]) -> dict[str, Any]:
    """``trace`` and ``trace_note`` of :class:`Inventory`: the first decoder layer's trace, or why there is none."""
    from finetuner.model.trace import trace_layer  # torch, peft: only when a model is read

    try:
        t = trace_layer(cfg)
    except Exception as e:  # noqa: BLE001 - a layer the meta device cannot run (an MoE's routing): said, not fatal
        why = first_line(str(e)) or type(e).__name__
        if "nonzero" in why:  # transformers' experts gather the tokens routed to each: shapes that depend on values
            why = "its experts route tokens by value (torch.nonzero), which the meta device cannot run"
        return {"trace": None, "trace_note": why}
    return {"trace": (t.constant, t.per_token, t.per_token2), "trace_note": None}


def _digest(blob: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _config_only(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in ("_name_or_path", "_aliases")}


def config_key(cfg: dict[str, Any]) -> str:
    """The key of a config in :data:`PACKAGED`: the config (where it came from left out) and the format."""
    return _digest({"cfg": _config_only(cfg), "format": FORMAT_VERSION})


#: the modules whose code decides what an inventory holds: a cached inventory read by other code is read again
READING_MODULES = ("inventory.py", "layout.py", "reading.py", "trace.py")
_CODE: list[str] = []


def code_digest() -> str:
    """A digest of :data:`READING_MODULES`' source, so that an inventory cached before a change in how models are
    read (a layout that learned a family: BLT's heads read from its own stack's settings) is not served again."""
    if not _CODE:
        here = Path(__file__).parent
        _CODE.append(hashlib.sha256(b"".join((here / name).read_bytes() for name in READING_MODULES)).hexdigest()[:12])
    return _CODE[0]


def _key(cfg: dict[str, Any]) -> str:
    """The cache key: the config, the installed transformers' version (read from its metadata: a cached
    inventory costs no import of transformers) and the reading code (:func:`code_digest`)."""
    from importlib.metadata import version

    return _digest({"cfg": _config_only(cfg), "transformers": version("transformers"), "format": FORMAT_VERSION,
                    "code": code_digest()})


_PACKAGED_READ: dict[str, Any] = {}


def packaged() -> dict[str, Any]:
    """:data:`PACKAGED`: ``{"transformers": version read with, "models": {config_key: {"name", "inventory"}}}``, read
    once a process. A read that fails is tried again (three times, 0.1 s apart) and never kept: an empty answer would
    make every named model be built with torch."""
    if _PACKAGED_READ:
        return _PACKAGED_READ
    for attempt in range(3):
        try:
            _PACKAGED_READ.update(json.loads(PACKAGED.read_text(encoding="utf-8")))
            return _PACKAGED_READ
        except (OSError, ValueError):  # not written yet (scripts.dev.read_models writes it), or read mid-copy
            if attempt < 2:
                time.sleep(0.1)
    return {"transformers": None, "models": {}}


def read_inventory(cfg: dict[str, Any]) -> Inventory:
    """:func:`read_model`: packaged for the models finetuner names or ships, else cached under
    ``<cache>/models/`` by the config and the transformers version."""
    stored = packaged()["models"].get(config_key(cfg))
    if stored is not None:
        return Inventory.from_dict(stored["inventory"])
    name = f"inventory-{_key(cfg)}.json"
    try:
        path = cache_folder("models") / name
        return Inventory.from_dict(read_json_entry(path, name))
    except (OSError, EntryRejected, ValueError, KeyError, TypeError):  # none, or edited or planted: read again
        pass
    inv = read_model(cfg)
    try:
        write_json_entry(cache_folder("models") / name, name, inv.to_dict())
    except OSError:  # a read-only cache folder: the next plan builds it again
        pass
    return inv

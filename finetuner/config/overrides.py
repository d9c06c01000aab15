"""``--set key.path=value``: overrides applied to a raw recipe before it is validated, and the held-out file an
override to other data leaves behind (:func:`drop_stale_val_path`)."""

from __future__ import annotations

from typing import Any

from finetuner.config.recipe_yaml import load_yaml
from finetuner.errors import UserError

def drop_stale_val_path(given: dict[str, Any], raw: dict[str, Any], overrides: list[str]) -> str | None:
    """Drop from ``raw`` (``given`` with ``overrides`` applied) a held-out file that belongs to other data: when
    an override changed ``data.path`` and none named ``data.val_path`` (or the whole ``data`` section), the
    recipe's ``val_path`` holds out rows of the data it was written for, and a run on the new data would pick its
    best adapter by how well it fits the old data. Returns the dropped path, or None when nothing was dropped."""
    named = {".".join(k for k in item.partition("=")[0].strip().split(".") if k) for item in overrides}
    old, new = given.get("data"), raw.get("data")
    if not (isinstance(old, dict) and isinstance(new, dict)) or named & {"data", "data.val_path"}:
        return None
    if "data.path" not in named or new.get("path") == old.get("path") or not new.get("val_path"):
        return None
    return str(new.pop("val_path"))


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one ``key.path=value`` override to a raw recipe dict; the value is parsed as YAML."""
    if "=" not in item:
        raise UserError(f"--set {item!r}: expected key.path=value, e.g. training.lr=1e-4.")
    key, _, value_text = item.partition("=")
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise UserError(f"--set {item!r}: the key is empty.")
    try:
        value = load_yaml(value_text, f"--set {key.strip()}") if value_text.strip() else None
    except UserError as e:
        if "invalid YAML" not in str(e):
            raise
        value = value_text
    node = raw
    for i, k in enumerate(keys[:-1]):
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise UserError(f"--set {item!r}: '{'.'.join(keys[: i + 1])}' is not a section.")
        node = nxt
    node[keys[-1]] = value

"""Reward functions named by the user before a run: ``FILE.py:FUNCTION`` or a built-in's name (``finetuner
plan --reward``, the web UI's Plan tab), checked without running any user code.

A file is read and parsed, not imported (importing runs it; only ``finetuner run`` does that, see
:mod:`finetuner.rewards.loading`): the check is that it is a Python file defining the function at its top
level. A built-in is checked by name (:data:`finetuner.rewards.builtin.BUILTINS`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from finetuner.errors import UserError
from finetuner.rewards.builtin import BUILTINS

#: How a reward is written where one line names it (a command-line option, a text box).
SPEC_FORM = f"FILE.py:FUNCTION (a function with TRL's signature) or a built-in ({', '.join(BUILTINS)})"


def parse_reward_spec(text: str) -> dict[str, Any]:
    """``FILE.py:FUNCTION`` as ``{"function", "file"}``, a bare name as ``{"function"}`` (a built-in): the
    recipe's ``grpo.rewards`` item. A :class:`UserError` on an empty side."""
    file, colon, function = text.strip().rpartition(":")
    if colon and (not file.strip() or not function.strip()) or not text.strip():
        raise UserError(f"reward {text!r}: write {SPEC_FORM}.")
    return {"function": function.strip(), "file": file.strip()} if colon else {"function": text.strip()}


def parse_reward_specs(text: str) -> list[dict[str, Any]]:
    """Several reward specs in one text (the web UI's Rewards box): separated by commas or new lines, blank
    ones ignored, each read by :func:`parse_reward_spec`; ``[]`` for a blank text. A :class:`UserError`
    naming the first spec that is not one."""
    return [parse_reward_spec(item.strip()) for item in re.split(r"[,\n]", text or "") if item.strip()]


def top_level_names(path: Path) -> set[str]:
    """The functions, classes and assigned names at the top level of a Python file (parsed, not run)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: not a readable Python file: {e}") from None
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    return names | {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}


def check_reward_specs(rewards: list[Any], base_dir: Path | None = None) -> list[dict[str, Any]]:
    """``grpo.rewards`` items (dicts, or bare names for built-ins) checked and with each file made
    absolute (relative to ``base_dir``, default the current folder): a :class:`UserError` naming the
    reward when a built-in is unknown, a file is missing or does not define its function."""
    out = []
    for r in rewards:
        r = {"function": r} if isinstance(r, str) else dict(r)
        name = r.get("function")
        if not r.get("file"):
            if name not in BUILTINS:
                raise UserError(f"reward '{name}': not a built-in reward ({', '.join(BUILTINS)}) and no file given.",
                                hint=f"Name a file that defines it: {SPEC_FORM}.")
        else:
            f = Path(r["file"]).expanduser()
            if not f.is_absolute() and base_dir is not None:
                f = base_dir / f
            if not f.is_file():
                raise UserError(f"reward '{name}': {f} is not a file.", hint=f"Give the Python file that defines it: {SPEC_FORM}.")
            try:
                defined = top_level_names(f)
            except UserError as e:
                raise UserError(f"reward '{name}': {e.message}") from None
            if name not in defined:
                raise UserError(f"reward '{name}': {f} defines no top-level '{name}'.",
                                hint=f"Functions it defines: {', '.join(sorted(defined)) or 'none'}.")
            r["file"] = str(f.resolve())
        out.append(r)
    return out

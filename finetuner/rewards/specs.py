"""Reward functions named by the user before a run: ``FILE.py:FUNCTION`` or a built-in's name (``finetuner
plan --reward``, the web UI's Plan tab), checked without running any user code.

A file is read and parsed, not imported (importing runs it; only ``finetuner run`` does that, see
:mod:`finetuner.rewards.loading`): the check is that it is a Python file defining the function at its top
level. A built-in is made with its settings (:func:`finetuner.rewards.builtin.make_builtin`: no user code),
so a missing or unknown setting is refused before the run; on one line its settings are written as a call
with literal keyword arguments: ``length_bounds(min_length=4, max_length=8)``, ``exact_match(column='answer')``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from finetuner.errors import UserError
from finetuner.rewards.builtin import BUILTINS, make_builtin

#: How a reward is written where one line names it (a command-line option, a text box).
SPEC_FORM = (f"FILE.py:FUNCTION (a function with TRL's signature) or a built-in ({', '.join(BUILTINS)}) with its "
             "settings, e.g. length_bounds(max_length=80)")


def _builtin_call(text: str) -> dict[str, Any] | None:
    """``name(key=literal, ...)`` as ``{"function": name, "args": {...}}``; None when ``text`` is not a call."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None
    if node.args or any(k.arg is None for k in node.keywords):
        raise UserError(f"reward {text!r}: name each setting: {node.func.id}(key=value, ...).")
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        raise UserError(f"reward {text!r}: a setting's value must be a number, a text in quotes, true/false "
                        "(True/False) or None.") from None
    return {"function": node.func.id, "args": args}


def parse_reward_spec(text: str) -> dict[str, Any]:
    """``FILE.py:FUNCTION`` as ``{"function", "file"}``, a built-in's name as ``{"function"}`` and its call with
    settings (``length_bounds(max_length=80)``) as ``{"function", "args"}``: the recipe's ``grpo.rewards`` item.
    A :class:`UserError` on an empty side or a call that is not one."""
    if "(" in text:
        call = _builtin_call(text)
        if call is None:
            raise UserError(f"reward {text!r}: write {SPEC_FORM}.")
        return call
    file, colon, function = text.strip().rpartition(":")
    if colon and (not file.strip() or not function.strip()) or not text.strip():
        raise UserError(f"reward {text!r}: write {SPEC_FORM}.")
    return {"function": function.strip(), "file": file.strip()} if colon else {"function": text.strip()}


def _split(text: str) -> list[str]:
    """``text`` cut at new lines and at commas outside parentheses."""
    items, depth, current = [], 0, []
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "\n" or (ch == "," and depth <= 0):
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    return items + ["".join(current)]


def parse_reward_specs(text: str) -> list[dict[str, Any]]:
    """Several reward specs in one text (the web UI's Rewards box): separated by new lines or by commas
    outside a built-in's settings, blank ones ignored, each read by :func:`parse_reward_spec`; ``[]`` for a
    blank text. A :class:`UserError` naming the first spec that is not one."""
    return [parse_reward_spec(item.strip()) for item in _split(text or "") if item.strip()]


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
            make_builtin(name, r.get("args"), name_at=f"reward '{name}'")  # its settings make a reward
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

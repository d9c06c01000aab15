"""The Python API reference of docs/python-api.md: one entry for each name ``finetuner`` exports (its ``__all__``),
written from the code itself: the signature as the source writes it (annotations and defaults as text, read with
:mod:`ast`, so nothing is evaluated and no model is loaded), a data class's fields with their ``#:`` comments, and the
docstring (Google style: ``Args:`` becomes a table with each parameter's type and default, ``Example::`` a Python
block), then the class's own public methods and properties that have a docstring.
``python -m scripts.docs.references --write`` puts it into the page.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from typing import Any

from scripts.docs.markdown_text import inline

#: a signature longer than this is written one parameter a line
WIDTH = 100
ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:")
#: an ``Args:`` item: ``name: text`` or ``name (type): text``
ITEM = re.compile(r"^(\*{0,2}\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


# --------------------------------------------------------------------------- signatures, from the source
def function_node(func: Any) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The ``def`` of ``func`` (a decorator such as ``contextmanager`` unwrapped)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(func))))
    return next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> list[tuple[str, str | None, str | None]]:
    """(name as written, annotation, default) of each parameter, ``/`` and ``*`` markers included, in order."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    text = lambda e: None if e is None else ast.unparse(e)  # noqa: E731
    out = [(p.arg, text(p.annotation), text(d)) for p, d in zip(positional, defaults)]
    if a.posonlyargs:
        out.insert(len(a.posonlyargs), ("/", None, None))
    if a.vararg:
        out.append(("*" + a.vararg.arg, text(a.vararg.annotation), None))
    elif a.kwonlyargs:
        out.append(("*", None, None))
    out += [(p.arg, text(p.annotation), text(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append(("**" + a.kwarg.arg, text(a.kwarg.annotation), None))
    return out[1:] if drop_first and out and out[0][0] in ("self", "cls") else out


def param_text(name: str, annotation: str | None, default: str | None) -> str:
    return name + (f": {annotation}" if annotation else "") + (
        (" = " if annotation else "=") + default if default is not None else "")


def signature(name: str, node: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool, prefix: str = "") -> str:
    """``name(a: int = 1, *, b: str) -> T`` on one line, or one parameter a line when it is long."""
    params = [param_text(*p) for p in parameters(node, drop_first)]
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    one = f"{prefix}{name}({', '.join(params)}){returns}"
    if len(one) <= WIDTH:
        return one
    return f"{prefix}{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){returns}"


# --------------------------------------------------------------------------- data classes' fields
def field_comments(source: str) -> dict[int, str]:
    """The comment of each line of ``source`` (1-based): its trailing ``# ...``, or the ``#:`` block above it."""
    comments: dict[int, str] = {}
    block: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            if tok.line.strip().startswith("#:"):
                block.append(tok.string[2:].strip())
            elif tok.line.strip() != tok.string.strip():  # trailing: after code on its line
                comments[tok.start[0]] = tok.string[1:].strip()
        elif tok.type == tokenize.NAME and block:
            comments.setdefault(tok.start[0], " ".join(block))
            block = []
    return comments


def fields_table(cls: type) -> list[str]:
    """A data class's fields (those its constructor takes, public): name, type and default as the source writes
    them, and the field's comment."""
    source = textwrap.dedent(inspect.getsource(cls))
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    comments = field_comments(source)
    written = {n.target.id: n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_") or f.name not in written:
            continue
        n = written[f.name]
        default = "required" if n.value is None else f"`{ast.unparse(n.value)}`"
        rows.append(f"| `{f.name}` | {inline(ast.unparse(n.annotation), table=True)} | "
                    f"{inline(default, table=True)} | {inline(comments.get(n.lineno, ''), table=True)} |")
    return ["| field | type | default | description |", "|---|---|---|---|", *rows] if rows else []


# --------------------------------------------------------------------------- docstrings
def indented_block(lines: list[str], i: int) -> tuple[list[str], int]:
    """The lines from ``i`` that are indented or blank (up to the last indented one), dedented, and where they end."""
    j, last = i, i
    while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
        j += 1
        if lines[j - 1].strip():
            last = j
    return textwrap.dedent("\n".join(lines[i:last])).splitlines(), last


def args_table(block: list[str], params: dict[str, tuple[str | None, str | None]]) -> list[str]:
    """An ``Args:`` section as a table: each parameter's type and default from the signature, its text from the docstring."""
    items: list[list[str]] = []
    for line in block:
        m = ITEM.match(line) if not line.startswith((" ", "\t")) else None
        if m:
            items.append([m.group(1), m.group(2)])
        elif items:
            items[-1][1] += " " + line.strip()
    rows = []
    for name, text in items:
        known = name.lstrip("*") in params
        annotation, default = params.get(name.lstrip("*"), (None, None))
        default_cell = inline(f"`{default}`", table=True) if default else "required" if known and default is None else ""
        rows.append(f"| `{name}` | {inline(annotation, table=True) if annotation else ''} | {default_cell} | "
                    f"{inline(text, table=True)} |")
    return ["| parameter | type | default | description |", "|---|---|---|---|", *rows]


def docstring_markdown(doc: str | None, params: dict[str, tuple[str | None, str | None]] | None = None) -> list[str]:
    """A docstring as Markdown lines: paragraphs with their inline markup converted, ``Args:`` as a table, a
    literal block (after a line ending ``::``, or an ``Example:`` section) as a fenced Python block."""
    lines = inspect.cleandoc(doc or "").splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        literal = stripped.endswith("::") or re.fullmatch(r"Examples?:", stripped) is not None
        if stripped in ARGS_HEADERS or literal:
            block, i = indented_block(lines, i + 1)
            if stripped in ARGS_HEADERS:
                out += ["Parameters:", "", *args_table(block, params or {}), ""]
                continue
            lead = stripped[:-1] if stripped.endswith("::") else stripped
            out += [*([inline(lead.rstrip(":") + ":") if lead.rstrip(":") else []]), ""]
            while block and not block[0].strip():
                block.pop(0)
            out += ["```python", *block, "```", ""]
            continue
        out.append(inline(line) if stripped else "")
        i += 1
    text = "\n".join(out).strip()
    return re.sub(r"\n{3,}", "\n\n", text).splitlines()


# --------------------------------------------------------------------------- entries
def signature_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, tuple[str | None, str | None]]:
    """Each parameter's (annotation, default): None for a required one, "" for ``*args`` and ``**kwargs``."""
    return {name.lstrip("*"): (annotation, "" if name.startswith("*") else default)
            for name, annotation, default in parameters(node, True) if name not in ("*", "/")}


def code_block(text: str) -> list[str]:
    return ["```python", text, "```", ""]


def member_entries(cls: type) -> list[str]:
    """The class's own public methods and properties that have a docstring, in the order the class defines them."""
    out: list[str] = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        kind = "property" if isinstance(value, property) else (
            "classmethod" if isinstance(value, classmethod) else "staticmethod" if isinstance(value, staticmethod) else "")
        func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if not inspect.isfunction(inspect.unwrap(func)) or not func.__doc__:
            continue
        if not inspect.unwrap(func).__qualname__.startswith(cls.__qualname__ + "."):  # written by a library, not the class
            continue
        node = function_node(func)
        if kind == "property":
            head = f"@property\n{name}" + (f": {ast.unparse(node.returns)}" if node.returns is not None else "")
        else:
            head = signature(name, node, drop_first=kind != "staticmethod", prefix=f"@{kind}\n" if kind else "")
        out += [f"#### `{cls.__name__}.{name}`", "", *code_block(head),
                *docstring_markdown(func.__doc__, signature_params(node)), ""]
    return out


def class_entry(public: str, cls: type) -> list[str]:
    from pydantic import BaseModel

    from finetuner.config.recipe import Recipe

    out: list[str] = []
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    if bases and not issubclass(cls, BaseModel):
        out += [f"Bases: {', '.join(f'`{b}`' for b in bases)}", ""]
    init = vars(cls).get("__init__")
    if dataclasses.is_dataclass(cls):
        constructor = None
    elif issubclass(cls, BaseModel):
        constructor = None
    else:
        constructor = signature(public, function_node(init), drop_first=True) if inspect.isfunction(init) else None
    if constructor:
        out += code_block(constructor)
    out += [*docstring_markdown(cls.__doc__, signature_params(function_node(init)) if constructor else None), ""]
    if dataclasses.is_dataclass(cls):
        out += [*fields_table(cls), ""]
    if cls is Recipe:  # the recipe reference lists what its fields hold
        out += ["Its fields are the recipe's keys: [every key](recipes.md#every-key).", ""]
    return out + member_entries(cls)


def entry(name: str, obj: Any) -> list[str]:
    """One exported name: its heading, then its signature and docstring (a class: its fields and members too). A
    class's heading says ``class``: ``finetuner.Plan`` and ``finetuner.plan`` would have the same anchor."""
    if inspect.isclass(obj):
        return [f"### class `finetuner.{name}`", "", *class_entry(name, obj)]
    out = [f"### `finetuner.{name}`", ""]
    node = function_node(obj)
    return out + code_block(signature(name, node, drop_first=False)) + [
        *docstring_markdown(obj.__doc__, signature_params(node)), ""]


def reference() -> str:
    """One entry for each name ``finetuner`` exports, in ``__all__``'s order (the objects are imported, which loads
    no model: the package's modules import torch and transformers lazily)."""
    import finetuner

    out: list[str] = []
    for name in finetuner.__all__:
        out += entry(name, getattr(finetuner, name))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"

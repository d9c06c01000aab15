"""The import structure: no cycles between modules and no private names borrowed across them.

Every ``import`` of ``finetuner`` and ``ui`` is read from the source (imports inside functions
included; those under ``if TYPE_CHECKING:`` excluded, as they never run), so a cycle hidden by a
function-level import fails here as surely as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("finetuner", "ui")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((REPO / pkg).rglob("*.py")):
            parts = p.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Module → the project modules it imports; and (importer, module, name) for private names."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module in mods:
                    edges[name].add(node.module)
                    private += [(name, node.module, a.name) for a in node.names
                                if a.name.startswith("_") and node.module != name]
                edges[name].update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in mods)
    for name in edges:
        edges[name].discard(name)
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    edges, _ = import_graph()
    assert len(edges) > 30 and edges["finetuner.training.trainer"]  # the walk found the code
    assert cycles(edges) == []


def test_no_private_names_imported_from_other_modules():
    _, private = import_graph()
    assert private == []


def test_the_checker_sees_cycles_and_function_level_imports(tmp_path):
    """The checks themselves: a cycle through an import inside a function is found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import y\ndef f():\n    from z import w\n")
    skipped = _type_checking_only(tree)
    kept = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and id(n) not in skipped]
    assert kept == ["typing", "z"]


def test_data_does_not_import_planning():
    """The held-out split and packing belong to the data (finetuner.data.split): the pipelines split and pack
    with it and the planner counts with it, so no data module reaches into the planner."""
    edges, _ = import_graph()
    reach = {(a, b) for a, bs in edges.items() for b in bs
             if a.startswith("finetuner.data.") and b.startswith("finetuner.planning")}
    assert reach == set()

"""The import structure: no cycles between modules and no private names borrowed across them.

Every ``import`` of ``finetuner`` and ``ui`` is read from the source, imports inside functions and
under ``if TYPE_CHECKING:`` included, so a cycle hidden by a function-level import or by a type
annotation fails here as surely as one at the top of a module (a type-only cycle is still two modules
that each need the other: the design says neither).
"""

from __future__ import annotations

import ast
import sys
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


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Module → the project modules it imports; and (importer, module, name) for private names."""
    mods = modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module in mods:
                    edges[name].add(node.module)
                    private += [(name, node.module, a.name) for a in node.names
                                if a.name.startswith("_") and not a.name.endswith("__") and node.module != name]
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


def test_the_checker_sees_cycles_and_function_level_imports(tmp_path, monkeypatch):
    """The checks themselves: a cycle through an import inside a function and one under TYPE_CHECKING is found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    pkg = tmp_path / "finetuner"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from finetuner.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from finetuner.a import A\n")
    (tmp_path / "ui").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    edges, _ = import_graph()
    assert edges["finetuner.a"] == {"finetuner.b"} and edges["finetuner.b"] == {"finetuner.a"}
    assert cycles(edges) == [["finetuner.a", "finetuner.b"]]


def test_data_does_not_import_planning():
    """The held-out split and packing belong to the data (finetuner.data.split): the pipelines split and pack
    with it and the planner counts with it, so no data module reaches into the planner."""
    edges, _ = import_graph()
    reach = {(a, b) for a, bs in edges.items() for b in bs
             if a.startswith("finetuner.data.") and b.startswith("finetuner.planning")}
    assert reach == set()


ARCHITECTURE = REPO / "docs" / "architecture.md"

def layer_order(text: str | None = None) -> list[str]:
    """The packages of docs/architecture.md's numbered list, bottom first (``1. `name` — job``)."""
    import re

    text = ARCHITECTURE.read_text(encoding="utf-8") if text is None else text
    return re.findall(r"^\d+\. `([\w.]+)`", text, flags=re.M)


def layer_of(module: str, order: list[str]) -> str | None:
    """The layer ``module`` belongs to: the longest name in ``order`` that is it or a package above it in the
    dotted path; None when it is only under the bare ``finetuner`` (a package the order does not name)."""
    found = max((name for name in order if module == name or module.startswith(name + ".")), key=len, default=None)
    return None if found == "finetuner" and module != "finetuner" else found


def upward_imports(edges: dict[str, set[str]], order: list[str]) -> set[tuple[str, str]]:
    """(importer, imported) pairs where the imported module's layer is above the importer's."""
    height = {name: i for i, name in enumerate(order)}
    return {(a, b) for a, bs in edges.items() for b in bs
            if height[layer_of(b, order)] > height[layer_of(a, order)]}


def test_layers_only_look_down():
    """Every import looks down the order docs/architecture.md writes (or within its own layer), with no exception:
    those inside functions count as those at the top (the walk reads both)."""
    order = layer_order()
    assert len(order) == len(set(order)) > 20 and order[0] == "finetuner.version"
    edges, _ = import_graph()
    unplaced = sorted(m for m in edges if layer_of(m, order) is None)
    assert unplaced == [], "add these packages to docs/architecture.md's order"
    up = upward_imports(edges, order)
    assert sorted(up) == []


def test_the_layer_check_sees_an_upward_import():
    """The order is parsed from the page's list, a module falls in its longest named package, and an import of a
    higher layer is found while one of a lower layer is not."""
    order = layer_order("intro 1. `x` not this\n1. `finetuner.errors` — a\n2. `finetuner.objectives.specs` — b\n"
                        "3. `finetuner.objectives` — c\n4. `finetuner` — d\n")
    assert order == ["finetuner.errors", "finetuner.objectives.specs", "finetuner.objectives", "finetuner"]
    assert layer_of("finetuner.objectives.specs.grpo", order) == "finetuner.objectives.specs"
    assert layer_of("finetuner.objectives.grpo", order) == "finetuner.objectives"
    assert layer_of("finetuner", order) == "finetuner" and layer_of("finetuner.newpkg.x", order) is None
    edges = {"finetuner.objectives.specs.grpo": {"finetuner.errors", "finetuner.objectives.base"},
             "finetuner.objectives.base": {"finetuner.objectives.specs.grpo"}, "finetuner.errors": set()}
    assert upward_imports(edges, order) == {("finetuner.objectives.specs.grpo", "finetuner.objectives.base")}


#: the most lines a module of finetuner/ or ui/ may have (issue 57: files of one job; a longer one is split along a seam)
MAX_MODULE_LINES = 700


def modules_over(limit: int, mods: dict[str, Path]) -> dict[str, int]:
    """The modules of ``mods`` longer than ``limit`` lines, with their line counts."""
    counts = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in mods.items()}
    return {name: n for name, n in counts.items() if n > limit}


def test_no_module_over_700_lines():
    assert modules_over(MAX_MODULE_LINES, modules()) == {}


def test_the_line_count_sees_a_long_module(tmp_path):
    """A module one line over the limit is named with its count; one at the limit is not."""
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1), encoding="utf-8")
    (tmp_path / "fits.py").write_text("x = 1\n" * MAX_MODULE_LINES, encoding="utf-8")
    mods = {"long": tmp_path / "long.py", "fits": tmp_path / "fits.py"}
    assert modules_over(MAX_MODULE_LINES, mods) == {"long": MAX_MODULE_LINES + 1}

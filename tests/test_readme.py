"""README.md and the documentation site's pages (docs/**/*.md) as a newcomer meets them: every command parses,
every file, module, flag and test they name exists, and the generated parts (the "what fits where" table of
docs/planning.md) are current.

The pages' ``bash`` blocks (``bash runnable`` among them) are run, in the order a reader meets them (the README,
then the site's nav), by ``tests/test_readme_walkthrough.py``; the commands it cannot run (GPU recipes, the web UI,
placeholders such as RECIPE) must still parse here with the real CLI.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
#: the site's pages that hold what the README once did (each test below reads the one it checks)
PLANNING, RECIPES, SAFETY = (REPO / "docs" / name for name in ("planning.md", "recipes.md", "safety.md"))
BIN = Path(sys.executable).parent  # the environment's bin/, where the `finetuner` entry point lives
FAKE_TOKEN = "hf_readmeTestTokenNotReal0123456789abcdef"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def commands(body: str) -> list[str]:
    """The commands of a shell block: backslash continuations joined, blank and comment lines dropped."""
    out: list[str] = []
    pending = ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = pending + line
        pending = ""
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    assert not pending, f"a block ends in a line continuation: {pending!r}"
    return out


def runnable_commands(text: str) -> list[str]:
    return [c for info, body in blocks(text) if info.split() == ["bash", "runnable"] for c in commands(body)]


def nav_pages(nav: list) -> list[str]:
    """The files of mkdocs.yml's nav, in order (sections nested)."""
    out: list[str] = []
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            out += nav_pages(value) if isinstance(value, list) else [value]
    return out


def reading_order() -> list[Path]:
    """README.md, then the site's pages in the order of its nav: the order a newcomer reads them, and the order
    ``tests/test_readme_walkthrough.py`` runs their commands in (a page's commands may use what an earlier one made)."""
    import yaml

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    return [README, *(REPO / "docs" / page for page in nav_pages(nav))]


def test_blocks_are_marked():
    """The README opens with the two set-up commands; the runnable walk-through blocks exist on the site; every
    shell block of every page is ``bash`` or ``bash runnable`` (a block the tests read), none ``sh`` or ``console``."""
    text = README.read_text(encoding="utf-8")
    quick = next(body for info, body in blocks(text) if info == "bash")  # the first block: the quick start
    assert [c.split("#")[0].strip() for c in commands(quick)] == ["./scripts/demo.sh", "./scripts/test.sh"]
    infos = [info for doc in DOCS for info, _ in blocks(doc.read_text(encoding="utf-8"))]
    assert all(i in ("bash", "bash runnable", "python", "") for i in infos), sorted(set(infos))
    pages = "\n".join(p.read_text(encoding="utf-8") for p in reading_order())
    assert [info for info, _ in blocks(pages)].count("bash runnable") >= 2
    walk = runnable_commands(pages)
    for sub in ("gpus", "plan", "estimate", "run", "chat", "eval", "merge"):
        assert any(shlex.split(c, comments=True)[1] == sub for c in walk), f"no runnable `finetuner {sub}`"


def test_every_finetuner_line_parses():
    """Commands shown but not run (GPU recipes, placeholders) still name real subcommands and flags."""
    from finetuner.cli.main import build_parser

    parser = build_parser()
    checked = 0
    for doc in DOCS:
        for info, body in blocks(doc.read_text(encoding="utf-8")):
            if not info.startswith("bash"):
                continue
            for cmd in commands(body):
                argv = shlex.split(cmd, comments=True)
                if not argv or argv[0] != "finetuner":
                    continue
                try:
                    parser.parse_args(argv[1:])
                except SystemExit as e:  # argparse exits on an unknown flag or a missing argument
                    pytest.fail(f"{doc.relative_to(REPO)}: command does not parse (exit {e.code}): {cmd}")
                checked += 1
    assert checked >= 20


def test_fit_table_is_current():
    """The table between the fit-table markers is exactly `python -m scripts.dev.fit_table`'s output."""
    text = PLANNING.read_text(encoding="utf-8")
    m = re.search(r"<!-- fit-table:start -->\n(.*?)<!-- fit-table:end -->", text, re.S)
    assert m, "docs/planning.md has no <!-- fit-table:start --> ... <!-- fit-table:end --> section"
    out = subprocess.run([sys.executable, "-m", "scripts.dev.fit_table"], capture_output=True, text=True,
                         cwd=REPO, timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr
    assert m.group(1) == out.stdout, ("docs/planning.md's fit table is stale: run `python -m scripts.validate.gpu_all --tables` "
                                      "(or paste the output of `python -m scripts.dev.fit_table`)")


@pytest.mark.parametrize("installed", [True, False], ids=["liger-and-flash-attn-installed", "neither-installed"])
def test_fit_table_does_not_depend_on_what_is_installed(monkeypatch, installed):
    """The table is made for a default install whatever this environment has: the same with
    liger-kernel (and triton, flash_attn) importable as without, where a plan for the card as
    found here does change."""
    import finetuner.config.runtime as runtime
    from finetuner.planning.planner import plan
    from scripts.dev.fit_table import table

    text = PLANNING.read_text(encoding="utf-8")
    section = re.search(r"<!-- fit-table:start -->\n(.*?)<!-- fit-table:end -->", text, re.S).group(1)
    monkeypatch.setattr(runtime, "_installed", lambda package: installed)
    assert table() == section
    # the simulation reaches the planner: the card as found here (no assumption) is planned differently
    found_here = plan("llama-3.1-8b", "a100-40gb", seq_len=2048).estimate.settings
    assert (found_here.fused_ce, found_here.attn_implementation) == (
        (True, "flash_attention_2") if installed else (False, "sdpa"))


# --------------------------------------------------------------------------- names that go stale
DOCS = [README, *sorted((REPO / "docs").rglob("*.md"))]
#: the repository's top-level folders and files: a backticked path that starts with one is a repository path
TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".")} - {"runs", "exports"}
#: paths inside other projects that the docs cite (their source, not ours)
EXTERNAL = ("torch/", "peft/", "transformers/", "bitsandbytes/", "deepspeed/", "accelerate/")
CODE_SUFFIXES = (".py", ".sh", ".ipynb", ".md")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def inline_spans(text: str) -> list[str]:
    """The `inline code` of a Markdown text (fenced blocks left out)."""
    return INLINE.findall(FENCE.sub("", text))


def shell_words(text: str) -> list[str]:
    """Every word of every inline span and fenced shell block."""
    words = [w for span in inline_spans(text) for w in span.split()]
    words += [w for info, body in blocks(text) if info.startswith("bash") for c in commands(body) for w in c.split()]
    return [w.strip("\"'()[]{},;:") for w in words]


def repository_paths(text: str) -> list[str]:
    """Words that name a file or folder of this repository: rooted at one of its top-level entries,
    or a script/module/doc file name (``.py``, ``.sh``, ``.ipynb``, ``.md``) that must be found somewhere in it."""
    out = []
    for w in shell_words(text):
        w = re.sub(r"(\.py):\w+$", r"\1", w.removeprefix("./").split("::")[0].rstrip("."))  # FILE.py:FUNCTION (a reward)
        if not w or w.startswith(EXTERNAL) or "://" in w or re.fullmatch(r"[A-Z_]+\.py", w):  # FILE.py: a placeholder
            continue
        if w.split("/")[0] in TOP and ("/" in w or "." in w):
            out.append(w)
        elif w.endswith(CODE_SUFFIXES) and re.fullmatch(r"[\w./-]+", w):
            out.append(w)
    return out


def path_exists(w: str) -> bool:
    """A path of the checkout (placeholders ``<name>`` and ``RUN`` match anything; a folder .gitignore
    names is made at run time), or a file name found in it or written by finetuner (a run folder's ``launch.sh``)."""
    if w.split("/")[0] in TOP:
        if w in IGNORED:
            return True
        pattern = re.sub(r"<[^>]+>|\bRUN\b", "*", w.rstrip("/"))
        return any(REPO.glob(pattern)) if "*" in pattern else (REPO / pattern).exists()
    found = any(p.as_posix().endswith("/" + w) for p in REPO.rglob(Path(w).name) if ".venv" not in p.parts)
    return found or f'"{Path(w).name}"' in CODE_TEXT


IGNORED = set((REPO / ".gitignore").read_text(encoding="utf-8").split())
CODE_TEXT = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "finetuner").rglob("*.py"))


def test_every_repository_path_in_the_docs_exists():
    """Every file or folder of the repository named in backticks, a shell block or a relative link of README.md and docs/**/*.md exists."""
    missing, checked = [], 0
    for doc in DOCS:
        for w in repository_paths(doc.read_text(encoding="utf-8")):
            checked += 1
            if not path_exists(w):
                missing.append(f"{doc.name}: {w}")
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text(encoding="utf-8")):  # Markdown links
            if "://" not in target and not target.startswith("mailto:"):
                checked += 1
                if not (doc.parent / target).exists():
                    missing.append(f"{doc.name}: link {target}")
    assert checked >= 100
    assert not missing, "paths in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))


def defined_names(module: Path) -> set[str]:
    """The names a module defines or imports at any level (functions, classes, assignments, imports)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def dotted_name_error(name: str) -> str | None:
    """Why ``finetuner.x.y`` / ``scripts.x.y`` (a module, then perhaps an attribute) names nothing, or None."""
    import finetuner

    parts = name.split(".")
    i = 1
    while i < len(parts) and ((REPO.joinpath(*parts[: i + 1])).is_dir() or REPO.joinpath(*parts[: i + 1]).with_suffix(".py").is_file()):
        i += 1
    module = REPO.joinpath(*parts[:i])
    attrs = parts[i:]
    if not attrs:
        return None
    if parts[:i] == ["finetuner"]:
        return None if attrs[0] in finetuner.__all__ or attrs[0] == "__version__" else f"finetuner has no {attrs[0]}"
    source = module / "__init__.py" if module.is_dir() else module.with_suffix(".py")
    if not source.is_file():
        return f"no module {'.'.join(parts[:i])}"
    return None if attrs[0] in defined_names(source) else f"{'.'.join(parts[:i])} has no {attrs[0]} (nor a module of that name)"


def test_every_module_and_function_named_in_the_docs_exists():
    """``finetuner.runs.jobs.start_job``, ``python -m scripts.dev.fit_table``: each module exists, and the name after it is defined there."""
    wrong, checked = [], 0
    for doc in DOCS:
        for w in shell_words(doc.read_text(encoding="utf-8")):
            m = re.match(r"^((?:finetuner|scripts)(?:\.\w+)+)", w)
            if not m:
                continue
            checked += 1
            why = dotted_name_error(m.group(1).rstrip("."))
            if why:
                wrong.append(f"{doc.name}: {w}: {why}")
    assert checked >= 20
    assert not wrong, "names in the docs that do not exist:\n" + "\n".join(sorted(set(wrong)))


def test_every_finetuner_flag_in_the_docs_exists():
    """Each ``--flag`` written after ``finetuner SUBCOMMAND`` (inline or in a block) is one of that subcommand's options."""
    import contextlib
    import io

    from finetuner.cli.main import build_parser

    parser = build_parser()
    helps: dict[str, str] = {}

    def help_of(sub: str) -> str:
        if sub not in helps:
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                parser.parse_args([sub, "--help"])
            helps[sub] = out.getvalue()
        return helps[sub]

    wrong, checked = [], 0
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        spans = inline_spans(text) + [c for info, body in blocks(text) if info.startswith("bash") for c in commands(body)]
        for span in spans:  # each command of the span (a comment dropped) that starts with `finetuner SUBCOMMAND`
            for cmd in re.split(r"\s*(?:&&|\|\||\|)\s*", span.split(" #")[0]):
                words = cmd.split()
                if len(words) < 2 or words[0] != "finetuner" or words[1].startswith("-"):
                    continue
                sub = words[1]
                usage = help_of(sub)
                if not usage:
                    wrong.append(f"{doc.name}: `{span}`: no subcommand {sub}")
                    continue
                for f in (x.split("=")[0].rstrip(".,)`") for x in words[2:] if x.startswith("--")):
                    checked += 1
                    if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", usage):
                        wrong.append(f"{doc.name}: `{span}`: finetuner {sub} has no {f}")
    assert checked >= 30
    assert not wrong, "flags in the docs that do not exist:\n" + "\n".join(sorted(set(wrong)))


def test_every_script_flag_in_the_docs_exists():
    """Each ``--flag`` written after ``python -m scripts.X`` (or ``scripts/X.py``) is in that script's ``--help``."""
    wanted: dict[tuple[str, ...], set[str]] = {}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for span in inline_spans(text) + [c for info, body in blocks(text) if info.startswith("bash") for c in commands(body)]:
            m = re.search(r"(?:python -m (scripts(?:\.\w+)+)|(scripts/[\w/]+)\.py)((?: [^|&#]*)?)", span)
            if not m or "--" not in m.group(3):
                continue
            module = m.group(1) or m.group(2).replace("/", ".")
            words = m.group(3).split()
            positional = tuple(itertools.takewhile(lambda w: not w.startswith("-"), words))
            wanted.setdefault((module, *positional), set()).update(w.split("=")[0] for w in words if w.startswith("--"))
    assert len(wanted) >= 8
    wrong = []
    for (module, *positional), flags in sorted(wanted.items()):
        out = subprocess.run([sys.executable, "-m", module, *positional, "--help"], cwd=REPO, capture_output=True,
                             text=True, timeout=HANG_GUARD_S)
        assert out.returncode == 0, f"python -m {module} {' '.join(positional)} --help: {out.stderr[-1500:]}"
        wrong += [f"python -m {module} {' '.join(positional)}: no {f}" for f in sorted(flags)
                  if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", out.stdout)]
    assert not wrong, "script flags in the docs that do not exist:\n" + "\n".join(wrong)


def test_recipe_table_names_every_key():
    """The Recipes page's table at a glance lists every key of every recipe section (a key added to the schema must be
    described there too; the page's full reference is generated from the schema, tests/test_docs_references.py)."""
    import typing

    from finetuner.config.recipe import Recipe

    text = RECIPES.read_text(encoding="utf-8")
    table = text[text.index("| section | keys (defaults) |"):text.index("Relative paths in a recipe")]
    missing = []
    for name, field in Recipe.model_fields.items():
        section = next((a for a in (field.annotation, *typing.get_args(field.annotation)) if hasattr(a, "model_fields")), None)
        if section is None:
            if f"`{name}`" not in table:
                missing.append(name)
            continue
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}`")), "")
        missing += [f"{name}.{key}" for key in section.model_fields if f"`{key}`" not in row]
    assert not missing, f"recipe keys missing from docs/recipes.md's table: {missing}"


def test_the_model_list_names_every_preset():
    """docs/planning.md's "Models: the presets ..." sentence is the list `plan --model` accepts, no more, no less."""
    from finetuner.model.shapes import preset_names

    text = PLANNING.read_text(encoding="utf-8")
    sentence = text[text.index("Models: the presets "):text.index("(their hub ids work")]
    assert sorted(re.findall(r"`([^`]+)`", sentence)) == sorted(preset_names())


TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def test_every_test_named_in_the_docs_exists():
    """``tests/x.py::test_name`` in README.md and docs/**/*.md (the Safety page names the test of each promise): the
    file defines a test of that name, so a promise never points at a test that was renamed or removed."""
    missing, checked = [], 0
    for doc in DOCS:
        for path, name in TEST_REF.findall(doc.read_text(encoding="utf-8")):
            checked += 1
            source = REPO / path
            if not source.is_file() or name not in defined_names(source):
                missing.append(f"{doc.name}: {path}::{name}")
    assert checked >= 10
    assert not missing, "tests named in the docs that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_safety_promise_names_its_test():
    """Each bullet of the Safety page (docs/safety.md) ends in the test (``tests/x.py::test_name``) that holds it."""
    text = SAFETY.read_text(encoding="utf-8")
    section = text.split("# Safety: what finetuner guarantees", 1)[1]
    bullets = [b for b in re.split(r"\n- ", section)[1:]]
    assert len(bullets) >= 15
    bare = [b.splitlines()[0][:80] for b in bullets if not TEST_REF.search(b)]
    assert not bare, "Safety promises that name no test:\n" + "\n".join(bare)

"""The recipe reference (docs/recipes.md) and the Python API reference (docs/python-api.md) are Markdown in the files
themselves, as GitHub shows them: current with the code (``python -m scripts.docs.references --write`` regenerates
them), the same text under GitHub's renderer (CommonMark with GFM tables: markdown-it-py) as under the site's
(Python-Markdown with mkdocs.yml's extensions), and every link into them lands on a heading under either's anchors."""

from __future__ import annotations

import html.parser
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import markdown
import pytest
import yaml
from markdown.extensions.toc import slugify
from markdown_it import MarkdownIt

from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = ("recipes.md", "python-api.md")
COMMAND = "python -m scripts.docs.references --write"


def references(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.docs.references", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=HANG_GUARD_S)


def test_the_references_in_the_pages_are_current():
    """What the schema and the code generate now is what the pages hold (regenerated in memory)."""
    from scripts.docs.references import COMMAND as command, stale

    assert command == COMMAND
    wrong = stale(DOCS)
    assert not wrong, f"stale generated docs: {', '.join(wrong)}; run `{COMMAND}` and commit the pages"


def test_check_names_the_stale_page_and_write_brings_it_up_to_date(tmp_path):
    """As a developer meets it: a page edited by hand (or a schema key added) is named by ``--check`` with the command
    to run, ``--write`` rewrites only that page, and a page without its markers is a one-line error."""
    for page in PAGES:
        shutil.copy(DOCS / page, tmp_path / page)
    recipes = tmp_path / "recipes.md"
    current = recipes.read_text(encoding="utf-8")
    row = next(line for line in current.splitlines() if line.startswith("| `lora.r` |"))
    recipes.write_text(current.replace(row + "\n", ""), encoding="utf-8")  # a key the schema has, gone from the page

    checked = references("--check", "--docs", str(tmp_path))
    assert checked.returncode == 1
    assert "recipes.md's recipe-reference" in checked.stderr and COMMAND in checked.stderr
    assert "python-api.md" not in checked.stderr

    written = references("--write", "--docs", str(tmp_path))
    assert written.returncode == 0, written.stderr
    assert f"wrote: {recipes}" in written.stdout and f"current: {tmp_path / 'python-api.md'}" in written.stdout
    assert recipes.read_text(encoding="utf-8") == current

    from scripts.docs.references import main

    api = tmp_path / "python-api.md"
    api.write_text(api.read_text(encoding="utf-8").replace("<!-- api-reference:end -->", ""), encoding="utf-8")
    with pytest.raises(SystemExit) as stopped:  # Python prints the message alone, exit status 1
        main(["--check", "--docs", str(tmp_path)])
    assert str(stopped.value) == ("docs/python-api.md: needs one '<!-- api-reference:begin -->' ... "
                                  "'<!-- api-reference:end -->' pair, each marker on a line of its own")


def test_docstrings_and_schema_text_become_markdown_both_renderers_show_alike():
    """Sphinx roles and double backticks as code spans, ``<``/``*`` escaped outside code, a pipe inside code kept out
    of a table cell's code; ``Args:`` as a table with the signature's types and defaults, ``Example::`` as a block."""
    import ast

    from scripts.docs.api_reference import docstring_markdown, signature, signature_params
    from scripts.docs.markdown_text import inline

    assert inline("see :func:`~finetuner.infer.chat.load_chat_model` and :mod:`finetuner.data` in ``runs/<name>``, "
                  "not runs/<name> *x*") == ("see `load_chat_model` and `finetuner.data` in `runs/<name>`, "
                                             "not runs/&lt;name&gt; \\*x\\*")
    assert inline("``a | b`` or\n  ``c``", table=True) == "a \\| b or `c`"

    source = '''def f(path: str | None, n: int = 2, *, flag: bool = False, **kw: Any) -> list[str]:
        """Read ``path``.

        Args:
            path: the file (see
                :class:`Recipe`).
            n: how many.
            **kw: passed on.

        Example::

            >>> f("a.txt")
            ['a']
        """
    '''
    node = ast.parse(source.replace("\n    ", "\n")).body[0]
    assert signature("f", node, drop_first=False) == (
        "f(path: str | None, n: int = 2, *, flag: bool = False, **kw: Any) -> list[str]")
    assert docstring_markdown(ast.get_docstring(node, clean=False), signature_params(node)) == [
        "Read `path`.", "", "Parameters:", "",
        "| parameter | type | default | description |", "|---|---|---|---|",
        "| `path` | str \\| None | required | the file (see `Recipe`). |",
        "| `n` | int | `2` | how many. |",
        "| `**kw` | Any |  | passed on. |", "",
        "Example:", "", "```python", '>>> f("a.txt")', "['a']", "```"]


def test_the_pages_hold_every_recipe_key_and_every_exported_name():
    """The Markdown itself (what GitHub shows), not only the built site: a row for each key of the schema with its
    default, and for each name ``finetuner`` exports a heading, its signature and its docstring's opening."""
    import inspect

    import finetuner
    from finetuner.config.recipe import Recipe
    from scripts.docs.markdown_text import code_spans
    from scripts.docs.recipe_reference import section_model

    recipes = (DOCS / "recipes.md").read_text(encoding="utf-8")
    keys = []
    for name, field in Recipe.model_fields.items():
        model = section_model(field)
        keys += [f"{name}.{key}" for key in model.model_fields] if model else [name]
    missing = [k for k in keys if f"\n| `{k}` |" not in recipes]
    assert not missing and len(keys) > 100, f"keys without a row in docs/recipes.md: {missing} (run `{COMMAND}`)"
    assert "\n| `lora.r` | int | `16` |" in recipes and "Hub branch, tag or commit." in recipes

    api = (DOCS / "python-api.md").read_text(encoding="utf-8")
    for name in finetuner.__all__:
        obj = getattr(finetuner, name)
        start = api.index(f"\n### {'class ' if inspect.isclass(obj) else ''}`finetuner.{name}`\n")
        entry = api[start:api.find("\n### ", start + 1)]
        if inspect.isfunction(obj):
            assert f"```python\n{name}(" in entry, name
            for param in inspect.signature(obj).parameters:
                assert re.search(rf"\b{param}\b", entry), (name, param)
        first = " ".join(code_spans(inspect.cleandoc(obj.__doc__ or "")).split()[:5])
        assert first in " ".join(entry.split()), (name, first)
    assert "| `seq_len` | int \\| None | `None` | the sequence length;" in api  # plan's Args: type, default, text


# --------------------------------------------------------------------------- the two renderers
class Texts(html.parser.HTMLParser):
    """The text of each heading, table cell and code element of an HTML page, in order."""

    KEEP = {"h1", "h2", "h3", "h4", "h5", "th", "td", "code", "p", "li"}

    def __init__(self) -> None:
        super().__init__()
        self.out: list[tuple[str, str]] = []
        self.open: list[tuple[str, list[str]]] = []

    def handle_starttag(self, tag, attrs):
        if tag in self.KEEP:
            self.open.append((tag, []))

    def handle_endtag(self, tag):
        if tag in self.KEEP and self.open and self.open[-1][0] == tag:
            kind, parts = self.open.pop()
            text = " ".join("".join(parts).replace("\u00b6", "").split())  # the site's permalink sign
            self.out.append((kind, text))
            if self.open:
                self.open[-1][1].append(text)

    def handle_data(self, data):
        if self.open:
            self.open[-1][1].append(data)


def texts(html_text: str) -> list[tuple[str, str]]:
    parser = Texts()
    parser.feed(html_text)
    return parser.out


def github_html(text: str) -> str:
    """GitHub's Markdown as far as these pages use it: CommonMark and GFM's tables."""
    return MarkdownIt("commonmark").enable("table").render(text)


def site_html(text: str) -> str:
    """The site's Markdown: Python-Markdown with mkdocs.yml's extensions."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    extensions = [e if isinstance(e, str) else next(iter(e)) for e in config["markdown_extensions"]]
    return markdown.markdown(text, extensions=extensions)


def test_the_references_read_the_same_on_github_and_on_the_site():
    """Each heading, table cell, paragraph and code block of the two pages has the same text under both renderers
    (a ``|`` or ``<`` that one of them took for markup would differ), and the tables are tables under both."""
    for page in PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        github, site = texts(github_html(text)), texts(site_html(text))
        assert sum(kind == "td" for kind, _ in github) > (400 if page == "recipes.md" else 100), page
        for i, (a, b) in enumerate(zip(github, site)):
            assert a == b, f"{page}: GitHub shows {a}, the site {b} (element {i})"
        assert len(github) == len(site), page


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (github-slugger): lower case, punctuation dropped, spaces as ``-``."""
    kept = "".join(c for c in heading.lower()
                   if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def headings(text: str) -> list[str]:
    """The text of each heading of a Markdown page as GitHub renders it (code spans' text kept, markup dropped)."""
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    return ["".join(c.content for c in tokens[i + 1].children or [] if c.type in ("text", "code_inline"))
            for i, t in enumerate(tokens) if t.type == "heading_open"]


def github_anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(text):
        slug = github_slug(heading)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_the_generated_headings_have_one_anchor_on_github_and_on_the_site():
    """A heading of the two pages has the same anchor under GitHub's slugs as under the site's (mkdocs' toc), and
    no two headings share one (GitHub would number the second ``-1``, the site ``_1``)."""
    for page in PAGES:
        names = headings((DOCS / page).read_text(encoding="utf-8"))
        assert len(names) > (10 if page == "recipes.md" else 30)
        github = [github_slug(h) for h in names]
        site = [slugify(h, "-") for h in names]
        assert github == site, [(h, g, s) for h, g, s in zip(names, github, site) if g != s]
        assert len(set(github)) == len(github), sorted(s for s in github if github.count(s) > 1)


def test_links_into_the_references_land_on_a_heading_on_github():
    """Every link of README.md and docs/*.md to an anchor of the two pages (``recipes.md#data``) names a heading's
    GitHub anchor (the site build checks its own anchors)."""
    anchors = {page: github_anchors((DOCS / page).read_text(encoding="utf-8")) for page in PAGES}
    links, wrong = 0, []
    for doc in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            page = (doc.parent / target).resolve() if target else doc.resolve()
            if page.parent == DOCS and page.name in PAGES:
                links += 1
                if anchor not in anchors[page.name]:
                    wrong.append(f"{doc.relative_to(REPO)}: {target}#{anchor}")
    assert links >= 2
    assert not wrong, "links to anchors these pages do not have on GitHub:\n" + "\n".join(wrong)
    assert {"data", "every-key", "top-level-keys", "training"} <= anchors["recipes.md"]
    assert {"finetunerplan", "class-finetunerplan", "planto_yaml", "runfollow"} <= anchors["python-api.md"]

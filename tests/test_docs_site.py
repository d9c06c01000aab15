"""The documentation site builds as CI builds it (``mkdocs build --strict``: a broken link, a missing page or anchor
is an error), and its generated pages hold what they are generated from: the recipe reference every key of the
schema, the Python API reference every name ``finetuner`` exports (the Markdown files themselves are checked in
tests/test_docs_references.py)."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this file's tests into a temporary folder (never ``site/`` in the checkout)."""
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    return out


def text_of(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


def test_the_site_builds_strict_with_every_nav_page(site):
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["strict"] is True and config["validation"]["anchors"] == "warn"  # strict turns warnings into errors
    from tests.test_readme import nav_pages

    for page in nav_pages(config["nav"]):
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.is_file(), page
    # the screenshots the UI page shows are published with it
    from tests.ui.docs_screenshots import referenced

    assert all((site / "img" / "ui" / name).is_file() for name in referenced())


def test_the_ui_page_shows_exactly_the_screenshots_the_browser_tests_take():
    """docs/ui.md shows each screenshot tests/ui/test_ui_browser.py takes once, and no other; docs/img/ui holds exactly
    those, each a real screenshot (the PNG check the browser tests make of their own), so a screenshot no test takes
    any more, or one the page forgot, fails here."""
    from tests.ui.docs_screenshots import ALL, DOCS_FOLDER, problems, referenced

    shown = referenced()
    assert len(shown) == len(set(shown)) and set(shown) == ALL, f"docs/ui.md shows {shown}, the tests take {sorted(ALL)}"
    assert sorted(p.name for p in DOCS_FOLDER.iterdir()) == sorted(ALL)
    wrong = [p for name in sorted(ALL) for p in problems(DOCS_FOLDER / name)]
    assert not wrong, "\n".join(wrong) + "\nrefresh them: FINETUNER_DOCS_SCREENSHOTS=docs/img/ui python -m pytest tests/ui/test_ui_browser.py"
    assert sum((DOCS_FOLDER / name).stat().st_size for name in ALL) < 2_000_000  # the site stays light to load


def test_the_recipe_reference_names_every_key_of_the_schema(site):
    from finetuner.config.recipe import Recipe
    from scripts.docs.recipe_reference import section_model

    page = text_of(site / "recipes" / "index.html")
    keys = []
    for name, field in Recipe.model_fields.items():
        model = section_model(field)
        keys += [f"{name}.{key}" for key in model.model_fields] if model else [name]
    missing = [k for k in keys if not re.search(rf"(?<![\w.]){re.escape(k)}(?![\w.])", page)]
    assert not missing, f"keys missing from the built recipe reference: {missing}"
    assert len(keys) > 100
    # defaults and descriptions come from the schema, not from hand-written text
    assert re.search(r"lora\.r\s*int\s*16", page) and "Hub branch, tag or commit." in page


def test_the_api_reference_documents_every_exported_name(site):
    import finetuner

    def plain(text: str) -> str:  # Sphinx roles (:func:) and backticks out, as either side writes them
        return " ".join(re.sub(r":\w+:|`", "", text).split())

    page = plain(text_of(site / "python-api" / "index.html"))
    for name in finetuner.__all__:
        assert f"finetuner.{name}" in page, name
        doc = (getattr(finetuner, name).__doc__ or "").strip()
        if doc:  # the docstring's first words are on the page
            first = " ".join(plain(doc).split()[:4])
            assert first in page, (name, first)

"""The documentation site builds as CI builds it (``mkdocs build --strict``: a broken link, a missing page or anchor,
a docstring mkdocstrings cannot read is an error), and its generated pages hold what they are generated from: the
recipe reference every key of the schema, the Python API reference every name ``finetuner`` exports."""

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
    assert (site / "ui-plan.png").is_file() and (site / "ui-train.png").is_file()


def test_the_recipe_reference_names_every_key_of_the_schema(site):
    from finetuner.config.recipe import Recipe
    from scripts.docs.hooks import section_model

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
        if doc:  # the docstring's first words are on the page: mkdocstrings rendered it
            first = " ".join(plain(doc).split()[:4])
            assert first in page, (name, first)

"""The generated parts of the documentation pages, kept in the Markdown files themselves so that the pages read the
same on GitHub as on the site: the recipe reference of docs/recipes.md (:mod:`scripts.docs.recipe_reference`,
from the recipe schema) and the Python API reference of docs/python-api.md (:mod:`scripts.docs.api_reference`,
from the code's signatures and docstrings), each between its ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``
markers.

``python -m scripts.docs.references --write`` rewrites them; ``--check`` (tests/test_docs_references.py) exits 1
naming each stale page. Generating them imports ``finetuner`` and reads source files: no model is loaded, and the
same code gives the same text.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from scripts.docs import api_reference, recipe_reference

REPO = Path(__file__).resolve().parents[2]
#: the command that brings the pages up to date (said by every message about a stale page)
COMMAND = "python -m scripts.docs.references --write"
#: page (under docs/) -> (its region's name, what generates the region)
REGIONS: dict[str, tuple[str, Callable[[], str]]] = {
    "recipes.md": ("recipe-reference", recipe_reference.reference),
    "python-api.md": ("api-reference", api_reference.reference),
}


def region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- {name}:begin -->\n)(.*?)(<!-- {name}:end -->)", re.S)


def filled(text: str, page: str, name: str, body: str) -> str:
    """``text`` with ``body`` between the page's markers (a page without them is an error naming them)."""
    pattern = region(name)
    if len(pattern.findall(text)) != 1:
        raise SystemExit(f"docs/{page}: needs one '<!-- {name}:begin -->' ... '<!-- {name}:end -->' pair, "
                         f"each marker on a line of its own")
    return pattern.sub(lambda m: m.group(1) + "\n" + body.strip() + "\n\n" + m.group(3), text)


def pages(docs: Path) -> dict[Path, tuple[str, str]]:
    """Each generated page: (its text now, its text with the regions generated)."""
    out = {}
    for page, (name, generate) in REGIONS.items():
        path = docs / page
        text = path.read_text(encoding="utf-8")
        out[path] = (text, filled(text, page, name, generate()))
    return out


def stale(docs: Path) -> list[str]:
    """The pages under ``docs`` whose generated regions differ from what the code generates now."""
    return [f"{path.name}'s {REGIONS[path.name][0]}" for path, (now, fresh) in pages(docs).items() if now != fresh]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.docs.references", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the generated regions of the pages")
    mode.add_argument("--check", action="store_true", help="exit 1, naming each stale page, when one is stale")
    parser.add_argument("--docs", type=Path, default=REPO / "docs", help="the folder of the pages (default: docs/)")
    args = parser.parse_args(argv)
    if args.check:
        wrong = stale(args.docs)
        if wrong:
            print(f"stale: {', '.join(wrong)} (run `{COMMAND}`)", file=sys.stderr)
            return 1
        print(f"current: {', '.join(REGIONS)}")
        return 0
    for path, (now, fresh) in pages(args.docs).items():
        if now != fresh:
            path.write_text(fresh, encoding="utf-8")
        print(f"{'wrote' if now != fresh else 'current'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

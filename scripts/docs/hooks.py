"""The documentation site's one change to the pages as written (``mkdocs.yml``'s ``hooks``): ```` ```bash runnable````
fences (the blocks tests/test_readme.py marks as run) shown as the bash they are. The generated references are in
the pages themselves (:mod:`scripts.docs.references` writes them), so the site shows what GitHub shows.
"""

from __future__ import annotations

import re
from typing import Any


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """mkdocs hook: ```` ```bash runnable```` fences as ```` ```bash````: Markdown takes one word after the fence,
    and would read the block's closing fence as an opening one."""
    return re.sub(r"^```bash runnable[ \t]*$", "```bash", markdown, flags=re.M)

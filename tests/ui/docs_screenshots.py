"""The web UI's screenshots on the documentation site (docs/ui.md) are the browser tests' own: the flows of
``tests/ui/test_ui_browser.py`` take each one at the moment the page shows, at 1280×800.

By default they go to the tests' temporary folder, where each flow checks that it took its screenshots and that each
is a real PNG of that size showing a page; with ``FINETUNER_DOCS_SCREENSHOTS=docs/img/ui`` they are written into the
docs instead (a maintainer's refresh, docs/ui.md). ``tests/test_docs_site.py`` checks that docs/ui.md shows exactly
the screenshots :data:`TAKEN_BY` lists and that docs/img/ui holds exactly those, so the page and the tests cannot
drift apart. This module imports no browser: the site's test reads it too.
"""

from __future__ import annotations

import io
import os
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: names the folder the screenshots are written to instead of the tests' temporary one (relative: to the checkout)
ENV = "FINETUNER_DOCS_SCREENSHOTS"
#: where the docs keep them, and the page that shows them
DOCS_FOLDER = ROOT / "docs" / "img" / "ui"
UI_PAGE = ROOT / "docs" / "ui.md"
#: the window the screenshots are taken in: a common laptop's, as tests/ui/test_ui_display.py checks the layout at
VIEWPORT = {"width": 1280, "height": 800}
#: each screenshot the docs show, by the browser test that takes it
TAKEN_BY: dict[str, tuple[str, ...]] = {
    "test_whole_flow_in_browser": ("model.png", "data.png", "plan.png", "train.png", "chat.png", "export.png"),
    "test_dpo_run_in_browser": ("dpo-train.png",),
}
ALL = {name for names in TAKEN_BY.values() for name in names}
#: a screenshot of the UI, compressed: a blank or half-drawn page is far smaller, and 1280×800 at 4 bytes a pixel
#: (4 MB) would mean it was not compressed at all
PLAUSIBLE_BYTES = (25_000, 600_000)


def folder(tmp_path_factory) -> Path:
    """Where the screenshots go: :data:`ENV`'s folder when it is set, else a fresh temporary one."""
    named = os.environ.get(ENV)
    if not named:
        return tmp_path_factory.mktemp("docs-screenshots")
    out = Path(named) if Path(named).is_absolute() else ROOT / named
    out.mkdir(parents=True, exist_ok=True)
    return out


def referenced() -> list[str]:
    """The screenshots docs/ui.md shows (``![...](img/ui/NAME.png)``), in its order."""
    return re.findall(r"!\[[^\]]*\]\(img/ui/([^)\s]+\.png)\)", UI_PAGE.read_text(encoding="utf-8"))


def problems(path: Path) -> list[str]:
    """What is wrong with ``path`` as one of the docs' screenshots (nothing when it is a real PNG of the viewport's
    size, of plausible bytes, showing more than a blank page)."""
    from PIL import Image

    if not path.is_file():
        return [f"{path} was not written"]
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return [f"{path} is not a PNG"]
    out = []
    if not PLAUSIBLE_BYTES[0] <= len(data) <= PLAUSIBLE_BYTES[1]:
        out.append(f"{path} has {len(data):,} bytes, not {PLAUSIBLE_BYTES[0]:,} to {PLAUSIBLE_BYTES[1]:,}")
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # the whole file decodes
        if img.size != (VIEWPORT["width"], VIEWPORT["height"]):
            out.append(f"{path} is {img.size[0]}×{img.size[1]}, not the viewport's {VIEWPORT['width']}×{VIEWPORT['height']}")
        colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
        if colours is not None and len(colours) < 32:  # text, charts and controls are drawn anti-aliased
            out.append(f"{path} shows {len(colours)} colours: a blank page")
    return out


#: a toast still on the page (an upload's "Saved as …") would cover what the screenshot is for: hidden while it is taken
HIDE_TOASTS = ".toast-wrap { display: none !important; }"
#: scrolls the element a selector names to the window's top (a little room above it), or the page to its top
SCROLL_JS = """(selector) => { if (!selector) { window.scrollTo(0, 0); return; }
  document.querySelector(selector).scrollIntoView({block: 'start'}); window.scrollBy(0, -16); }"""


class Screenshots:
    """The docs' screenshots one module's browser tests take into :attr:`folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.taken: list[str] = []
        self.seconds = 0.0  # what taking them cost the flows (printed, for the record)

    def take(self, page, name: str, top: str | None = None, settle=None) -> None:
        """The page as a 1280×800 window shows it, into ``name``; the element ``top`` (a selector) at the window's top,
        else the page's top. The flow's own window size is restored afterwards; ``settle(page)`` waits for the page
        to be laid out again after each resize (its charts re-fitted)."""
        assert name in ALL, f"{name} is not among the docs' screenshots (TAKEN_BY in {__name__})"
        t0 = time.monotonic()
        own = page.viewport_size
        page.set_viewport_size(VIEWPORT)
        try:
            if settle:
                settle(page)
            page.evaluate(SCROLL_JS, top)
            page.wait_for_timeout(300)  # a chart's transition ends
            page.screenshot(path=str(self.folder / name), style=HIDE_TOASTS, animations="disabled")
        finally:
            page.set_viewport_size(own)
            if settle:
                settle(page)
        self.taken.append(name)
        self.seconds += time.monotonic() - t0

    def check(self, test: str) -> None:
        """``test`` took exactly its screenshots of :data:`TAKEN_BY`, each a real one."""
        mine = [n for n in self.taken if n in TAKEN_BY[test]]
        assert sorted(mine) == sorted(TAKEN_BY[test]), f"{test} took {mine}, the docs show {TAKEN_BY[test]}"
        wrong = [p for name in mine for p in problems(self.folder / name)]
        assert not wrong, "\n".join(wrong)
        print(f"\ndocs screenshots: {len(self.taken)} so far in {self.seconds:.1f} s, in {self.folder}")

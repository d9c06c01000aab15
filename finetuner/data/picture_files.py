"""Opening a picture file: its size read from the header and bounded before a pixel is decoded.

A PNG of 110 KB can hold 30000 x 30000 pixels, 2.7 GB once decoded as RGB (and a 17 KB one 12000 x 12000). Every
picture finetuner opens goes through :func:`opened` (a data row's, ``chat --image``'s, the web UI's thumbnails): the
header is read (PIL's ``Image.open`` decodes nothing), its width times height checked against a limit, and only a
picture within it is decoded; over it, one :class:`PictureTooLarge` naming the file and its size (exit 2 on the
command line, the error box in the web UI), never PIL's own ``DecompressionBombError`` or its warning.

The limit follows the model (:func:`pixel_limit`): a processor shrinks every picture to its largest size (its
pixel budget, its fixed size or tiles), so more than :data:`SIDE_FACTOR` times its largest side is memory spent on
pixels the model never sees; every ordinary photo (:data:`FLOOR_PIXELS`) is decoded whatever the model, and nothing
over :data:`CAP_PIXELS`. What a decoded picture costs is then bounded: at most the limit's pixels, 4 bytes each
(:func:`decoded_bytes`). A thumbnail (:func:`thumbnail_png`) is decoded reduced where the format allows it (a JPEG
at 1/2 to 1/8 of its size, PIL's ``draft``) and never converted to RGB at full size when its mode can be shrunk
as it is.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from finetuner.errors import UserError

#: the pixels decoded whatever the model: a 24-megapixel camera's 6000 x 4000 (and every phone's usual 12 MP)
FLOOR_PIXELS = 25_000_000
#: the pixels never decoded, whatever the model: 8192 x 8192 (under PIL's own warning, 89,478,485)
CAP_PIXELS = 8192 * 8192
#: a picture up to this many times the processor's largest side (its square: pixels) is decoded
SIDE_FACTOR = 4
#: the most bytes a decoded pixel takes here (RGBA, or RGB with a mode's own copy)
BYTES_PER_PIXEL = 4

#: held while a header is read with PIL's own check off (:func:`_header`): it is a module setting of PIL's
_OPENING = threading.Lock()


class PictureTooLarge(UserError):
    """A picture whose header says it has more pixels than finetuner decodes."""


def pixel_limit(processor: Any = None) -> int:
    """The most pixels of a picture decoded for ``processor`` (a processor, or an image processor alone; None: a
    model whose processor is not known here): :data:`SIDE_FACTOR`² times its largest size
    (:func:`finetuner.model.vision.largest_pixels`), at least :data:`FLOOR_PIXELS`, at most :data:`CAP_PIXELS`."""
    from finetuner.model.vision import largest_pixels

    largest = largest_pixels(processor) if processor is not None else None
    return min(CAP_PIXELS, max(FLOOR_PIXELS, SIDE_FACTOR * SIDE_FACTOR * (largest or 0)))


def decoded_bytes(limit: int) -> int:
    """The most memory one decoded picture of at most ``limit`` pixels takes."""
    return limit * BYTES_PER_PIXEL


def _header(path: str | Path):
    """The picture at ``path`` opened, only its header read. PIL's own bomb check is off while it opens (under
    :data:`_OPENING`): it raises without the picture's size, or warns; :func:`opened` checks the size itself."""
    from PIL import Image

    with _OPENING:
        kept, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            return Image.open(path)
        finally:
            Image.MAX_IMAGE_PIXELS = kept


def unreadable(path: str | Path, e: Exception) -> str:
    return f"picture {path} cannot be read ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"


@contextlib.contextmanager
def opened(path: str | Path, limit: int) -> Iterator[Any]:
    """The picture at ``path`` as an unloaded PIL image whose size is at most ``limit`` pixels (closed after the
    block); over it, :class:`PictureTooLarge`, before anything is decoded. A file that is not a picture PIL reads
    raises what PIL raises (``OSError``, ``ValueError``): the caller says what that means for it."""
    im = _header(path)
    try:
        width, height = im.size
        if width * height > limit:
            raise PictureTooLarge(
                f"picture {path} is {width:,} x {height:,} pixels; the most finetuner decodes is {limit:,} pixels.",
                hint="Make it smaller (the model's processor shrinks it to far less anyway), or leave its row out.")
        yield im
    finally:
        im.close()


def picture_size(path: str | Path, limit: int) -> tuple[int, int] | None:
    """The width and height of the picture at ``path`` from its header (:func:`opened`); None when it is not a
    picture PIL reads (its reader reports it with its row)."""
    try:
        with opened(path, limit) as im:
            return im.size
    except (OSError, ValueError):
        return None


def load_picture(path: str | Path, limit: int):
    """The picture at ``path`` decoded as RGB, when it has at most ``limit`` pixels (:func:`opened`); a
    :class:`~finetuner.data.formats.RowError` naming the path when it cannot be read."""
    from PIL import UnidentifiedImageError

    from finetuner.data.formats import RowError

    try:
        with opened(path, limit) as im:
            return im.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise RowError(unreadable(path, e)) from None


#: modes PIL shrinks as they are (others are converted first: a palette or 1-bit picture to RGB or grey)
SHRINKS = ("RGB", "RGBA", "L", "LA")


def thumbnail_png(path: str | Path, side: int, limit: int = CAP_PIXELS) -> bytes | None:
    """The picture at ``path`` as a PNG of at most ``side`` pixels a side, decoded reduced where its format allows
    (a JPEG: PIL's ``draft``, at 1/2 to 1/8 of its size), shrunk before it is converted to RGB; None when it is not
    a picture PIL reads; :class:`PictureTooLarge` over ``limit`` pixels."""
    try:
        with opened(path, limit) as im:
            im.draft("RGB", (side, side))
            if im.mode not in SHRINKS:
                im = im.convert("L" if im.mode == "1" else "RGBA" if "transparency" in im.info else "RGB")
            im.thumbnail((side, side))
            buf = io.BytesIO()
            im.convert("RGB").save(buf, format="PNG")
            return buf.getvalue()
    except (OSError, ValueError):
        return None

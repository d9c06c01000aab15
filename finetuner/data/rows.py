"""What a row of a data file is before and after it is read: its place, the error that refuses it, and the checks
every format shares (valid Unicode text, pictures in its messages). :mod:`finetuner.data.formats` reads the formats
through these; :mod:`finetuner.data.tools` reads tool calls."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetuner.data import scope
from finetuner.labels import IGNORE_INDEX  # re-exported: data.formats and data.pipeline name it to their callers


class RowError(ValueError):
    """One row of a data file cannot be used; the message says why."""


class PictureRefused(RowError):
    """A row names a picture outside the web UI's scope (:mod:`finetuner.data.scope`): it is never read."""


@dataclass
class RawRow:
    """A row as read from its source, with where it came from (for error messages)."""

    source: str
    where: str  # "line 12" / "row 12"
    data: Any

    @property
    def place(self) -> str:
        return f"{self.source}, {self.where}"


def valid_text(v: str, what: str) -> str:
    """``v`` if it is valid Unicode: JSON's \\ud800-style escapes can carry lone surrogates, which
    no tokenizer or Arrow table takes."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(f"{what} contains an unpaired surrogate (\\u{ord(v[e.start]):04x} at character {e.start + 1}): "
                       "not valid Unicode text") from None
    return v


# --------------------------------------------------------------------------- pictures in a row
#: where a picture sits in a message's text (LLaMA-Factory's placeholder; OpenAI-style image parts become it)
IMAGE_PLACEHOLDER = "<image>"


def picture_ref(part: dict, where: str) -> str:
    """The local path of an OpenAI-style image part: ``{"type": "image", "image": PATH}`` (or ``"path"``, ``"url"``),
    ``{"type": "image_url", "image_url": {"url": PATH}}`` or ``"image_url": PATH``; ``file://`` is read as a path."""
    ref = part.get("image") or part.get("path") or part.get("url") or part.get("image_url")
    if isinstance(ref, dict):
        ref = ref.get("url") or ref.get("path")
    if not isinstance(ref, str) or not ref.strip():
        raise RowError(f"{where}: an image part needs the picture's path (\"image\": \"img/001.png\")")
    ref = ref.strip()
    if ref.startswith("file://"):
        ref = ref[len("file://"):]
    if "://" in ref or ref.startswith("data:"):
        raise RowError(f"{where}: picture {ref[:80]!r} is not a local file: finetuner reads pictures from disk only "
                       "(download it and give its path, relative to the data file)")
    return ref


def content_parts(content: list, where: str) -> tuple[str, list[str]]:
    """An OpenAI-style content list as text with :data:`IMAGE_PLACEHOLDER` where each picture is, and the pictures."""
    text, pictures = [], []
    for j, part in enumerate(content, start=1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind in ("image", "image_url"):
            pictures.append(picture_ref(part, f"{where}, part {j}"))
            text.append(IMAGE_PLACEHOLDER)
        else:
            raise RowError(f"{where}, part {j}: expected {{\"type\": \"text\", \"text\": ...}} or "
                           f"{{\"type\": \"image\", \"image\": PATH}}, got {str(part)[:80]}")
    return "".join(text), pictures


def attach_pictures(messages: list[dict[str, str]], row: dict, in_parts: list[str]) -> dict[str, Any]:
    """``{"messages": ...}`` with ``"images"`` when the row has pictures: the image parts' (in order) or the row's
    ``images`` column (LLaMA-Factory's; its pictures go where the ``<image>`` placeholders are, or before the first
    user message's text when it has none). The placeholders must be as many as the pictures."""
    column = row.get("images")
    if column is not None and not (isinstance(column, list) and not column):
        if in_parts:
            raise RowError("the row has both image parts in its messages and an 'images' column: give one of them")
        column = [column] if isinstance(column, str) else column
        if not isinstance(column, list) or not all(isinstance(x, str) and x.strip() for x in column):
            raise RowError("'images' must be a list of picture paths")
        in_parts = [picture_ref({"image": x}, "'images'") for x in column]
        if not any(IMAGE_PLACEHOLDER in m["content"] for m in messages):
            first = next(i for i, m in enumerate(messages) if m["role"] == "user")
            messages[first] = {**messages[first], "content": IMAGE_PLACEHOLDER * len(in_parts) + messages[first]["content"]}
    if not in_parts:
        return {"messages": messages}
    placed = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if placed != len(in_parts):
        raise RowError(f"{placed} {IMAGE_PLACEHOLDER} placeholder(s) in the messages for {len(in_parts)} picture(s): "
                       "give one placeholder per picture")
    if any(IMAGE_PLACEHOLDER in m["content"] for m in messages if m["role"] == "assistant"):
        raise RowError("a picture in an assistant message: pictures go in user (or system) messages")
    return {"messages": messages, "images": in_parts}


def picture_path(data_file: str, ref: str) -> str:
    """A picture's path as the data file names it (relative to the file's folder, or absolute), checked to exist;
    inside the web UI's scope when it has one (:func:`finetuner.data.scope.picture`: one refusal outside it,
    whatever is there, before anything on disk is looked at)."""
    p = Path(ref).expanduser()
    where = scope.picture(p if p.is_absolute() else Path(data_file).expanduser().resolve().parent / p)
    if where is None:
        raise PictureRefused(scope.picture_refusal(ref))
    if not where.is_file():
        raise RowError(f"picture {ref!r} not found (looked for {where})")
    return str(where)

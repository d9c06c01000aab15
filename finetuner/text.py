"""Plain text for display: cut between words, never inside one; a decoded answer without the replacement
characters of bytes that are not UTF-8."""

from __future__ import annotations

#: What marks text that was cut.
CUT_MARK = "…"


def cut_words(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its longest start of at most ``limit``
    characters (the mark included) that ends between words, then :data:`CUT_MARK`. A first word longer
    than half the limit is cut where it must be."""
    if len(text) <= limit:
        return text
    room = text[: max(limit - len(CUT_MARK), 0)]
    if text[len(room)].isspace():  # the room ends at a word's end
        return room.rstrip(" ,;:\n\t") + CUT_MARK
    space = max(room.rfind(" "), room.rfind("\n"), room.rfind("\t"))
    kept = room[:space] if space > len(room) // 2 else room
    return kept.rstrip(" ,;:\n\t") + CUT_MARK


def drop_partial_word(text: str) -> str:
    """``text`` that was cut at an arbitrary point (a token limit), ending at its last whole word, then
    :data:`CUT_MARK`; text that already ends between words keeps all of it."""
    if not text or text[-1].isspace() or not text[-1].isalnum():
        return text.rstrip() + CUT_MARK if text.strip() else text
    space = max(text.rfind(" "), text.rfind("\n"))
    return (text[: space + 1].rstrip() if space >= 0 else text) + CUT_MARK


#: what a tokenizer's decode makes of bytes that are not valid UTF-8
REPLACEMENT_CHAR = "\ufffd"


def clean_text(text: str) -> str:
    """``text`` without replacement characters (the model's invalid byte sequences)."""
    return text.replace(REPLACEMENT_CHAR, "")

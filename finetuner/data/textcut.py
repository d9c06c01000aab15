"""Cutting text to what ``max_seq_len`` tokens can hold *before* it is tokenized.

Training keeps at most ``max_seq_len`` tokens of an example, but a tokenizer builds ids, offsets
and intermediate strings for the whole text it is given: a 100 MB row took 17 GB. No token stands
for more characters than the longest entry of the tokenizer's vocabulary (:func:`max_token_chars`:
a byte-level BPE entry of n characters decodes to at most n characters, a SentencePiece ``▁`` is
one space, a byte-fallback ``<0xE4>`` one byte), so ``n`` tokens never cover more than
``n × max_token_chars`` characters. :func:`char_budget` is twice the characters that
``max_seq_len + 1`` tokens can cover: a text longer than that has more than ``max_seq_len`` tokens
(it is truncated in any case), its kept tokens lie in its first half, and the cut is far enough
from them that the tokens it changes (those of the word it falls in) are not kept. Cut to the
budget, a text gives the same kept tokens and the same "truncated" count as in full.
(A tokenizer that deletes characters, e.g. one collapsing runs of spaces, can cover more
characters per token; what such a text loses is then what lies after the budget.)
"""

from __future__ import annotations

import weakref
from typing import Any

_MAX_CHARS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
#: Used when a tokenizer lists no vocabulary: longer than any entry of common vocabularies.
DEFAULT_MAX_TOKEN_CHARS = 64


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for: its longest vocabulary entry
    (a transformers tokenizer or a ``tokenizers.Tokenizer``), at least 1."""
    try:
        return _MAX_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = tokenizer.get_vocab()
        n = max((len(t) for t in vocab), default=0) or DEFAULT_MAX_TOKEN_CHARS
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary
        n = DEFAULT_MAX_TOKEN_CHARS
    try:
        _MAX_CHARS[tokenizer] = n
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return n


def char_budget(tokenizer: Any, max_len: int) -> int:
    """The characters of an example worth tokenizing when ``max_len`` tokens are kept (module doc)."""
    return 2 * (max_len + 1) * max_token_chars(tokenizer)


def head(text: str, budget: int) -> str:
    """The first ``budget`` characters of ``text``."""
    return text if len(text) <= budget else text[:budget]


def tail(text: str, budget: int) -> str:
    """The last ``budget`` characters of ``text``."""
    return text if len(text) <= budget else text[len(text) - budget:]


def head_messages(messages: list[dict[str, Any]], budget: int) -> list[dict[str, Any]]:
    """The messages whose content starts within the first ``budget`` characters of all contents,
    the last of them cut: what lies beyond is past the tokens a conversation keeps."""
    out: list[dict[str, Any]] = []
    used = 0
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            out.append(m)
            continue
        if used >= budget:
            break
        if len(content) > budget - used:
            m = {**m, "content": content[: budget - used]}
        out.append(m)
        used += len(m["content"])
    return out

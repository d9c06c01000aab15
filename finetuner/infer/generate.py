"""What generation shares: a stream of clean text, and how many new tokens a run's sample answer gets
(:func:`sample_new_tokens`). The prompts are asked by :meth:`finetuner.infer.chat.ChatModel.render`.

A model may sample byte tokens that are not valid UTF-8 (a small or barely trained model often
does: a lone continuation byte, a lead byte followed by a space). The tokenizer decodes each such
sequence to U+FFFD, the replacement character; :func:`clean_text` drops it from every answer and
:func:`text_streamer` from every streamed piece, so no "\ufffd" reaches a terminal or the web UI.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from finetuner.text import REPLACEMENT_CHAR, clean_text  # noqa: F401 - the answers' cleaning, also read from here


def text_streamer(tokenizer: Any, timeout: float | None = None):
    """A ``transformers.TextIteratorStreamer`` (prompt and special tokens skipped) whose pieces are
    cleaned with :func:`clean_text`.

    The streamer hands out text only up to the last space, newline or CJK character it has
    decoded, and the rest when generation ends: an unfinished multi-byte character is held back
    until its last byte arrives, so a replacement character in a piece marks bytes that can no
    longer become a character, and dropping it loses nothing.
    """
    from transformers import TextIteratorStreamer

    class CleanTextStreamer(TextIteratorStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            super().on_finalized_text(clean_text(text), stream_end=stream_end)

    return CleanTextStreamer(tokenizer, skip_prompt=True, timeout=timeout, skip_special_tokens=True)


#: ``samples.max_new_tokens: auto``: at least this many new tokens for a sample answer, at most :data:`AUTO_MOST`
AUTO_LEAST = 64
AUTO_MOST = 1024
#: the training rows whose answers ``auto`` measures (the first ones: a large file is not walked to its end)
AUTO_ROWS = 2000


def longest_answer(label_rows: Iterable[Sequence[int]], ignore: int = -100) -> int:
    """The longest answer of tokenized rows: the longest run of labelled tokens (``labels`` not ``ignore``) in a
    row, one assistant turn with its reasoning when the rows train on it (a packed row's answers stay apart: the
    prompt between two is unlabelled)."""
    most = 0
    for labels in label_rows:
        run = 0
        for t in labels:
            run = run + 1 if t != ignore else 0
            most = max(most, run)
    return most


def sample_new_tokens(setting: int | str, label_rows: Iterable[Sequence[int]] | None) -> tuple[int, str]:
    """The new tokens a sample answer gets and why: ``samples.max_new_tokens`` when the recipe sets a number; for
    ``auto``, the data's longest answer (:func:`longest_answer`, its reasoning included) and a quarter more,
    between :data:`AUTO_LEAST` and :data:`AUTO_MOST`, so that an answer that reasons first ends inside them."""
    if setting != "auto":
        return int(setting), "samples.max_new_tokens"
    longest = longest_answer(itertools.islice(label_rows or [], AUTO_ROWS))
    n = min(AUTO_MOST, max(AUTO_LEAST, -(-longest * 5 // 4)))
    bound = (" (at most)" if n == AUTO_MOST else " (at least)" if n == AUTO_LEAST else "")
    return n, f"auto: the training rows' longest answer, {longest} tokens with any reasoning, and a quarter more{bound}"


def sample_cell(sample: dict[str, Any], who: str) -> str:
    """A run's sample answer as its tables show it (``who``: ``fine_tuned`` or ``base``): the answer after its
    reasoning, marked when it reasoned first (:func:`finetuner.training.samples.answer_samples` keeps the reasoning
    apart), ``-`` for no answer (a full fine-tune has no base to switch to)."""
    text = sample.get(who)
    if text is None:
        return "-"
    reasoning = sample.get(f"{who}_reasoning")
    if reasoning is None:
        return text
    words = len(reasoning.split())
    if not text:
        return f"(still reasoning when its new tokens ran out, after {words} words)"
    return f"{text}\n(after {words} words of reasoning)"

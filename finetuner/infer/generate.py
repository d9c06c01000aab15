"""Generation with a chat template: one answer, a stream of text, or base vs fine-tuned side by side.

A model may sample byte tokens that are not valid UTF-8 (a small or barely trained model often
does: a lone continuation byte, a lead byte followed by a space). The tokenizer decodes each such
sequence to U+FFFD, the replacement character; :func:`clean_text` drops it from every answer and
:func:`text_streamer` from every streamed piece, so no "\ufffd" reaches a terminal or the web UI.
"""

from __future__ import annotations

from typing import Any

import finetuner.phases as phases
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


def render_prompt(tokenizer: Any, chat_template: str, prompt: str, system: str | None = None,
                  switches: dict[str, Any] | None = None) -> str:
    """``prompt`` (after ``system``) as the model is asked it; ``switches``: the template's keyword arguments (the
    run's thinking form, :func:`finetuner.data.thinking.prompt_switches`)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True,
                                         **(switches or {}))


def generate(
    model,
    tokenizer,
    chat_template: str,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    streamer=None,
    switches: dict[str, Any] | None = None,
) -> str:
    """The model's answer to ``prompt`` (greedy when temperature is 0), without replacement characters;
    ``switches``: as :func:`render_prompt`."""
    import torch

    from finetuner.token_progress import counted

    text = render_prompt(tokenizer, chat_template, prompt, switches=switches)
    enc = tokenizer(text, add_special_tokens=False, return_tensors="pt").to(next(model.parameters()).device)
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        streamer=streamer,
        stopping_criteria=counted(tokenizer.eos_token_id),  # the open phase's tokens (the samples'), as they come
    )
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, **kwargs)
    if was_training:
        model.train()
    return clean_text(tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)).strip()


def compare_samples(model, tokenizer, chat_template: str, samples_cfg, runtime,
                    switches: dict[str, Any] | None = None) -> list[dict[str, str]]:
    """For each prompt: the base model's answer (adapter disabled) and the fine-tuned one, both asked in the run's
    thinking form (``switches``: :func:`finetuner.data.thinking.prompt_switches`)."""
    results = []
    use_cache = model.config.use_cache
    model.config.use_cache = True
    try:
        for prompt in samples_cfg.prompts:
            tuned = generate(model, tokenizer, chat_template, prompt, samples_cfg.max_new_tokens, switches=switches)
            phases.advance()  # the run's "samples" phase, when one is open
            if hasattr(model, "disable_adapter"):
                with model.disable_adapter():
                    base = generate(model, tokenizer, chat_template, prompt, samples_cfg.max_new_tokens, switches=switches)
                phases.advance()
            else:
                base = None
            results.append({"prompt": prompt, "base": base, "fine_tuned": tuned})
    finally:
        model.config.use_cache = use_cache
    return results

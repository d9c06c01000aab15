"""Thinking chat templates: which form a chat row renders in.

A thinking family's chat template (Qwen3, Qwen3.5, Qwen3-Next, Gemma 4 ...) takes an ``enable_thinking`` switch:
off, it opens the reply with an empty think block (Qwen3's ``<think>\\n\\n</think>\\n\\n``) or none, and the model
answers at once; on, the model writes its reasoning first. A template takes the switch when its text names
``enable_thinking`` (read from the template, not from a list of models). The form is decided per row, by
``data.thinking``:

- ``auto`` (the default): a row whose assistant turns carry reasoning (``reasoning_content`` on a message, or an
  inline ``<think>...</think>`` in its content) renders in the thinking form (``enable_thinking=True``), the
  reasoning labelled; a row without renders in the non-thinking form (``enable_thinking=False``), as the model
  sees a conversation at inference with thinking off. A file without reasoning thus trains the non-thinking form.
- ``off``: every row in the non-thinking form, the reasoning a row carries dropped.
- ``on``: every row in the thinking form.

The template's own empty think block is written by its generation prompt, so it lies in the prompt and is never a
label (:func:`finetuner.data.pipeline.encode_example` labels from the end of that prompt). A template may write a
reply without reasoning with no think block while its non-thinking generation prompt ends in an empty one
(Qwen3.5's: llama.cpp's models/templates/Qwen3.5-4B.jinja): the last reply is then trained after that prompt, as
the model is asked at inference (:func:`joined_reply`). Such a template writes
an earlier reply of a conversation without the think block it was answered after: that reply is context, not a
label; the last reply is trained. The plan (:class:`finetuner.data.stats.DataProfile`) and the run's ``start`` event
(``resolved``) state the forms and the rows' reasoning (:func:`statement`: how many rows carry it, in which form, how
the template renders it, which turns' reasoning is trained and which dropped), and the run's ``metrics.json`` keeps
it (``data.thinking``).

Whatever the form, an empty think block the template writes into a reply (Qwen3's thinking form, for a reply
without reasoning) is never a label (:func:`past_empty_block`); one the data wrote is. Which turns keep the
reasoning the data wrote is ``data.reasoning`` (:func:`with_reasoning`): ``auto`` (the default) what the template
does at inference (Qwen3's drops the reasoning of turns before the last user message; the probe in
:func:`reasoning_behaviour` reads it from the template), ``keep``, ``drop_history`` or ``strip``. A template that
renders no ``reasoning_content`` (ChatML) gets it inline as ``<think>...</think>``: it is trained, never dropped
unseen.

A prompt the run's model answers (``finetuner chat``, the run's sample answers, its general probe, the notebook's
and the web UI's chat) renders in the form the rows trained in when all of them trained in one
(:func:`prompt_switches`): a file without reasoning trained the non-thinking form, and the model is asked in it;
rows of both forms leave the template's own default. Exact-match answers need nothing: their prompts are the
held-out rows encoded as in training.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

#: The template variable that switches a thinking family's reasoning.
SWITCH = "enable_thinking"
THINK_END = "</think>"


def takes_switch(template: str | None) -> bool:
    """Whether the chat template reads ``enable_thinking`` (module doc)."""
    return bool(template) and SWITCH in template


def carries_reasoning(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether an assistant turn carries reasoning: ``reasoning_content``, or a ``</think>`` in its content."""
    return any(m.get("role") == "assistant" and (bool((m.get("reasoning_content") or "").strip())
                                                 or THINK_END in (m.get("content") or ""))
               for m in messages)


def without_reasoning(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with their reasoning dropped (``data.thinking: off``): the answer after ``</think>``, as the
    Qwen3 templates split it."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            m = {k: v for k, v in m.items() if k != "reasoning_content"}
            if THINK_END in m.get("content", ""):
                m["content"] = m["content"].split(THINK_END)[-1].lstrip("\n")
        out.append(m)
    return out


THINK_START = "<think>"


def split_reply(text: str) -> tuple[str | None, str]:
    """A generated reply as its reasoning and its answer: the text inside ``<think>...</think>`` (None when the reply
    has no think block) and the answer after it. A reply that opened ``<think>`` and ran out of new tokens before
    ``</think>`` is all reasoning: its answer is ``""``."""
    body = text.lstrip()
    if THINK_END in body:
        reasoning, _, answer = body.partition(THINK_END)
        reasoning = reasoning.removeprefix(THINK_START) if reasoning.startswith(THINK_START) else reasoning
        return reasoning.strip(), answer.strip()
    if body.startswith(THINK_START):
        return body[len(THINK_START):].strip(), ""
    return None, text.strip()


def wrote_reasoning(message: dict[str, Any]) -> bool:
    """Whether the data wrote reasoning for this assistant message (``reasoning_content`` or a ``</think>``)."""
    return carries_reasoning([message])


def past_empty_block(text: str, start: int, end: int) -> int:
    """``start`` moved past an empty think block (``<think>`` and ``</think>`` with only white space between) that
    opens ``text[start:end]``: a template-made block, never a label (module doc)."""
    part = text[start:end]
    body = part.lstrip()
    if body.startswith("<think>") and THINK_END in body:
        inner, _, after = body[len("<think>"):].partition(THINK_END)
        if not inner.strip():
            return end - len(after.lstrip("\n"))
    return start


def without_empty_block(prompt: str) -> str:
    """A generation prompt without the empty think block (and white space) a non-thinking prompt ends in."""
    found = re.search(r"<think>\s*</think>\s*$", prompt)
    return prompt[: found.start()] if found else prompt


def joined_reply(prompt: str, rendered: str) -> str | None:
    """The conversation up to a reply as the model sees it with thinking off, where the template renders the reply
    without the empty think block its generation prompt ends in (module doc): ``prompt`` (the generation prompt)
    followed by the reply as ``rendered`` writes it. None when ``prompt`` differs from ``rendered`` otherwise."""
    same = len(os.path.commonprefix([prompt, rendered]))
    inserted = prompt[same:]
    if inserted.strip().replace("\n", "").replace(" ", "") != "<think></think>":
        return None
    return prompt + rendered[same:]


def thinking_on(template: str | None, messages: Sequence[dict[str, Any]], setting: str = "auto") -> bool | None:
    """The form of one row: True (thinking), False (non-thinking), None when the template takes no switch."""
    if not takes_switch(template):
        return None
    if setting != "auto":
        return setting == "on"
    return carries_reasoning(messages)


def row_for(template: str | None, messages: list[dict[str, Any]], setting: str = "auto"
            ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the template's keyword arguments for them (``{}`` without a switch)."""
    on = thinking_on(template, messages, setting)
    if on is None:
        return messages, {}
    return (messages if on else without_reasoning(messages)), {SWITCH: on}


def _forms(messages: Sequence[dict[str, Any]]) -> set[str]:
    """The forms an assistant turn of the row writes its reasoning in: ``think_tags`` (inline ``<think>...</think>``
    in the content) and ``reasoning_content`` (the message's field)."""
    found = set()
    for m in messages:
        if m.get("role") == "assistant":
            if THINK_END in (m.get("content") or ""):
                found.add("think_tags")
            if (m.get("reasoning_content") or "").strip():
                found.add("reasoning_content")
    return found


def _fates(tokenizer: Any, template: str, messages: list[dict[str, Any]], setting: str, reasoning: str
           ) -> tuple[int, int]:
    """``(trained, dropped)``: the row's assistant turns whose reasoning the data wrote that are in the loss, and
    that are left out, as :func:`row_for` and :func:`with_reasoning` render them (a template that leaves out
    earlier turns' reasoning drops those). A row ``data.reasoning: keep`` refuses is counted as dropped (the run
    stops on it, or skips it)."""
    from finetuner.data.rows import RowError

    wrote = [i for i, m in enumerate(messages) if m.get("role") == "assistant" and wrote_reasoning(m)]
    if not wrote:
        return 0, 0
    try:
        msgs = with_reasoning(tokenizer, template, row_for(template, messages, setting)[0], reasoning)
    except RowError:
        return 0, len(wrote)
    drops = reasoning_behaviour(tokenizer, template)[1]
    cut = _history_end(msgs)
    kept = sum(1 for i in wrote if wrote_reasoning(msgs[i]) and not (drops and i < cut))
    return kept, len(wrote) - kept


def statement(tokenizer: Any, template: str | None, rows: Iterable[Sequence[dict[str, Any]]], setting: str = "auto",
              reasoning: str = "auto") -> dict[str, Any] | None:
    """What the plan, the start event and ``metrics.json`` (``data.thinking``) say of the rows' reasoning and, for a
    template that takes the switch, of their forms: the one description of both (``setting``: ``data.thinking``,
    ``reasoning``: ``data.reasoning``). None when the rows are not chat, or carry no reasoning and the template
    takes no switch. Its keys:

    - ``rows``, ``reasoning_rows``: the chat rows, and those whose assistant turns carry reasoning;
    - ``forms``: rows per form the data wrote it in (``think_tags``: inline ``<think>...</think>``,
      ``reasoning_content``: the message's field);
    - ``renders``: ``template`` (the chat template writes ``reasoning_content`` itself, its own field),
      ``inline`` (it does not: finetuner writes it into the reply as ``<think>...</think>``), None where the
      model's tokenizer is not here to tell; ``drops_history``: whether it leaves out the reasoning of turns
      before the last user message (Qwen3's rule, as at inference);
    - ``turns``, ``trained_turns``, ``dropped_turns``: the assistant turns with reasoning, those whose reasoning
      tokens are in the loss (labelled, never masked: a reply's reasoning is trained with it), those left out of
      the text; ``trained``: ``all``, ``some`` or ``none`` of them (None where unknown);
    - ``value``, ``thinking_rows``, ``plain_rows``: the switch's form (``off``, ``on`` or ``per row``) and the rows
      rendered in each, for a template that takes it (``value`` None otherwise);
    - ``reason``: the sentence the plan and the run's console print.
    """
    count = on = off = carried = 0
    forms = {"think_tags": 0, "reasoning_content": 0}
    trained = dropped = 0
    known = tokenizer is not None and bool(template)
    for messages in rows:
        if not messages:
            continue
        count += 1
        found = _forms(messages)
        carried += bool(found)
        for f in found:
            forms[f] += 1
        if takes_switch(template):
            if thinking_on(template, messages, setting):
                on += 1
            else:
                off += 1
        if found and known:
            k, d = _fates(tokenizer, template, list(messages), setting, reasoning)
            trained, dropped = trained + k, dropped + d
    switch = takes_switch(template)
    if not count or not (carried or switch):
        return None
    parts = []
    if switch:
        if off:
            why = "" if setting == "off" else " without reasoning"
            parts.append(f"{off} row(s){why} trained in its non-thinking form ({SWITCH}=False, the template's "
                         "empty think block unlabelled)")
        if on:
            why = "" if setting == "on" else " with reasoning"
            parts.append(f"{on} row(s){why} in its thinking form ({SWITCH}=True, the reasoning labelled)")
    renders = drops = None
    if known:
        renders_field, drops = reasoning_behaviour(tokenizer, template)
        renders = "template" if renders_field else "inline"
    out = {"rows": count, "reasoning_rows": carried, "forms": forms, "renders": renders, "drops_history": drops,
           "turns": trained + dropped if known else None, "trained_turns": trained if known else None,
           "dropped_turns": dropped if known else None,
           "trained": (None if not known or not carried else "all" if not dropped else "some" if trained else "none"),
           "value": ("off" if not on else "on" if not off else "per row") if switch else None,
           "thinking_rows": on, "plain_rows": off}
    said = "; ".join(parts)
    if carried:
        said = (f"the chat template takes {SWITCH}: {said}; " if switch else "") + reasoning_sentence(out, setting,
                                                                                                     reasoning)
    else:
        said = f"the chat template takes {SWITCH}: {said}"
    out["reason"] = said
    return out


def reasoning_sentence(stated: dict[str, Any], setting: str = "auto", reasoning: str = "auto") -> str:
    """The part of :func:`statement`'s ``reason`` that says where the rows' reasoning is and what becomes of it."""
    forms = stated["forms"]
    written = " and ".join(f"{n} {label}" for n, label in
                           [(forms["think_tags"], "inline <think>...</think>"),
                            (forms["reasoning_content"], "as reasoning_content")] if n)
    head = f"reasoning in {stated['reasoning_rows']} of {stated['rows']} row(s) ({written})"
    if stated["renders"] is None:
        return (head + ": how the chat template renders it is not known here (the model's tokenizer is not on this "
                "machine); the run's start line and metrics.json say")
    if stated["renders"] == "template":
        how = "the chat template renders it itself (reasoning_content, its own field)"
    else:
        how = "; ".join(h for h in [
            "the inline blocks stay in the reply as the data wrote them" if forms["think_tags"] else "",
            "reasoning_content, which the chat template does not render, is written into the reply as "
            "<think>...</think> before the answer" if forms["reasoning_content"] else ""] if h)
    if stated["drops_history"]:
        how += " and leaves out the reasoning of turns before the last user message, as at inference"
    why = ("data.thinking: off" if setting == "off" else f"data.reasoning: {reasoning}" if reasoning != "auto"
           else "the template's rule, data.reasoning: auto" if stated["drops_history"] else "data.reasoning: auto")
    k, d = stated["trained_turns"], stated["dropped_turns"]
    fate = (f"trained: the reasoning of {k} assistant turn(s) is labelled (in the loss with its answer)" if k
            else "not trained")
    if d:
        fate += f"{',' if k else ':'} the reasoning of {d} turn(s) dropped ({why})"
    elif k:
        fate += f" ({why})"
    return f"{head}; {how}; {fate}"


def resolved(stated: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The start event's ``resolved`` entry for a :func:`statement` (``{}`` without one): ``data.thinking`` (its
    form) for a template that takes the switch, else ``data.reasoning`` (what becomes of the reasoning: ``keep``,
    ``drop_history`` or ``strip``, as the rows rendered)."""
    if not stated:
        return {}
    if stated.get("value") is not None:
        return {"data.thinking": {"value": stated["value"], "reason": stated["reason"]}}
    k, d = stated.get("trained_turns"), stated.get("dropped_turns")
    value = "strip" if not k and d else "drop_history" if d else "keep"
    return {"data.reasoning": {"value": value, "reason": stated["reason"]}}


def prompt_switches(template: str | None, stated: dict[str, Any] | None, setting: str | None = None
                    ) -> dict[str, Any]:
    """The template's keyword arguments for a prompt the run's model answers (module doc): ``setting`` (``on`` or
    ``off``: ``finetuner chat --thinking``) when given, else the one form every row trained in (``stated``: the
    run's :func:`statement`, as ``metrics.json`` keeps it); ``{}`` when the rows trained in both forms or the
    template takes no switch."""
    if not takes_switch(template):
        return {}
    if setting in ("on", "off"):
        return {SWITCH: setting == "on"}
    value = stated.get("value") if isinstance(stated, dict) else None
    return {SWITCH: value == "on"} if value in ("on", "off") else {}


# --------------------------------------------------------------------------- data.reasoning
#: ``data.reasoning``: which turns keep the reasoning the data wrote (``auto``: what the template does at inference)
REASONING = ("auto", "keep", "drop_history", "strip")
_PROBE_R = "rq8zv"
_BEHAVIOUR: dict[tuple[int, str], tuple[bool, bool]] = {}


def reasoning_behaviour(tokenizer: Any, template: str) -> tuple[bool, bool]:
    """``(renders, drops_history)``: whether the template writes an assistant message's ``reasoning_content``,
    and whether it leaves it out of a turn before the last user message (Qwen3's rule), read from the template's
    output on a probe conversation."""
    key = (id(tokenizer), template)
    if key not in _BEHAVIOUR:
        turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a", "reasoning_content": _PROBE_R}]
        switch = {SWITCH: True} if takes_switch(template) else {}

        def render(msgs: list[dict[str, Any]]) -> str:
            try:
                return tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False, **switch)
            except Exception:  # noqa: BLE001 - a template that refuses the probe renders no reasoning
                return ""
        renders = _PROBE_R in render(turn)
        later = render([*turn, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}])
        _BEHAVIOUR[key] = (renders, renders and _PROBE_R not in later)
    return _BEHAVIOUR[key]


def _history_end(messages: Sequence[dict[str, Any]]) -> int:
    """The index of the last user message (turns before it are history)."""
    return max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)


def inline(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with its ``reasoning_content`` written into the content as ``<think>...</think>``
    (for a template that does not render the field: the reasoning is then trained as the data gave it)."""
    r = (message.get("reasoning_content") or "").strip("\n")
    m = {k: v for k, v in message.items() if k != "reasoning_content"}
    if r.strip():
        m["content"] = f"<think>\n{r}\n{THINK_END}\n\n{m.get('content') or ''}"
    return m


def with_reasoning(tokenizer: Any, template: str, messages: list[dict[str, Any]], setting: str = "auto"
                   ) -> list[dict[str, Any]]:
    """The messages with the reasoning ``data.reasoning`` keeps: ``strip`` none, ``drop_history`` only the turns
    after the last user message, ``keep`` every turn's (a template that drops earlier turns' reasoning cannot keep
    it: a :class:`~finetuner.data.rows.RowError` says so), ``auto`` what the template renders. Reasoning a template
    does not render (``reasoning_content`` to a ChatML template) is inlined as ``<think>...</think>``."""
    from finetuner.data.rows import RowError

    if not carries_reasoning(messages):
        return messages
    if setting == "strip":
        return without_reasoning(messages)
    renders, drops = reasoning_behaviour(tokenizer, template)
    cut = _history_end(messages)
    history = [i for i, m in enumerate(messages) if i < cut and carries_reasoning([m])]
    if setting == "keep" and drops and history:
        raise RowError("data.reasoning is keep, but the chat template leaves earlier turns' reasoning out (as "
                       "the model sees a conversation at inference): use auto or drop_history, or a data.chat_template "
                       "that keeps it")
    out = list(messages)
    if setting == "drop_history":
        out = [without_reasoning([m])[0] if i in history else m for i, m in enumerate(out)]
    if not renders:
        out = [inline(m) if m.get("role") == "assistant" else m for m in out]
    return out

"""Tool-call accuracy of the base model and the fine-tune on held-out tool-calling chats (``finetuner eval``).

Each assistant message of the data that makes calls is a request: the conversation before it (with the row's
``tools``) is asked as ``finetuner chat --tools`` asks it (:meth:`finetuner.infer.chat.ChatModel.tool_reply`: the
run's tool format, greedy), and the reply is read with :func:`finetuner.data.calls.parse_reply`. Counted, each as
a share of the requests:

- ``right``: the reply's calls are the data's, in order, each the same function with the same arguments
  (:func:`finetuner.data.calls.same_call`);
- ``right_function``: the same functions, whatever the arguments;
- ``valid_json``: the reply made calls and every one of them was valid JSON with a name and an arguments object.

A run on tool-calling data scores its held-out calls this way at its end, base and fine-tune
(:func:`finetuner.training.samples.held_out_tool_calls`, into ``metrics.json``'s ``tool_calls``); the plan times it
from :func:`held_out_requests` (:mod:`finetuner.planning.wait`).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any

import finetuner.phases as phases
from finetuner.data.calls import same_call

#: the most tokens a reply to a request is given (greedy decoding stops sooner at the end of the reply)
MAX_NEW_TOKENS = 96


@dataclass
class Request:
    """One held-out call to make: the conversation before it, the row's tools, and the calls the data made."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    wanted: list[dict[str, Any]]


@dataclass
class ToolScore:
    right: float
    right_function: float
    valid_json: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def requests_in(examples) -> list[Request]:
    """The requests (module doc) of normalised examples (``{"messages", "tools"}``), in order."""
    out = []
    for ex in examples:
        msgs = ex.get("messages") or []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant" and m.get("tool_calls"):
                wanted = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
                out.append(Request(msgs[:i], list(ex.get("tools") or []), wanted))
    return out


def held_out_requests(recipe: Any, tokenized: int | None = None) -> list[Request] | None:
    """The requests of the rows a run of ``recipe`` holds out (:func:`finetuner.data.held_out.held_out_examples`;
    ``tokenized``: the run's count of rows its split was drawn over); [] for an objective that does not train on
    examples or when nothing is held out; None when the held-out rows cannot be told here (see there)."""
    from finetuner.data.held_out import held_out_examples
    from finetuner.objectives.specs import spec_of

    if spec_of(recipe.objective).data_kind != "supervised":
        return []
    examples = held_out_examples(recipe.data, recipe.training.seed, tokenized)
    return None if examples is None else requests_in(examples)


def prompt_text(r: Request) -> str:
    """A request's prompt as text, for counting its tokens: its messages' contents and calls and its tools' schemas."""
    import json

    parts = [json.dumps(r.tools, ensure_ascii=False)] if r.tools else []
    for m in r.messages:
        parts.append(m["content"] if isinstance(m.get("content"), str) else "")
        parts += [json.dumps(c, ensure_ascii=False) for c in m.get("tool_calls") or []]
    return "\n".join(parts)


def score(chat, requests: list[Request], adapter: bool, who: str, max_new_tokens: int = MAX_NEW_TOKENS,
          progress: Any = None) -> tuple[ToolScore, list[str]]:
    """``chat``'s calls (adapter on or off) for ``requests``, and its replies' text; each reply advances
    ``progress`` (an open :class:`finetuner.phases.Phase`), else a phase of its own."""
    right = right_fn = valid = 0
    texts = []
    kept = chat.tools
    try:
        with (phases.phase("answers", total=len(requests), unit="calls", label=f"tool calls of {who}")
              if progress is None else contextlib.nullcontext(progress)) as p:
            for r in requests:
                chat.tools = r.tools
                reply = chat.tool_reply(r.messages, temperature=0, max_new_tokens=max_new_tokens, adapter=adapter)
                texts.append(reply.text)
                made = reply.calls
                valid += bool(made) and reply.valid
                same_len = len(made) == len(r.wanted)
                right_fn += same_len and all(a["name"] == b["name"] for a, b in zip(made, r.wanted))
                right += same_len and all(same_call(a, b) for a, b in zip(made, r.wanted))
                p.advance()
    finally:
        chat.tools = kept
    n = max(len(requests), 1)
    return ToolScore(right / n, right_fn / n, valid / n), texts


def scores_entry(requests: int, base: ToolScore, fine_tuned: ToolScore, seconds: float) -> dict[str, Any]:
    """What ``metrics.json`` keeps of a run's held-out tool calls (its ``tool_calls``)."""
    return {"requests": requests, "base": base.to_dict(), "fine_tuned": fine_tuned.to_dict(), "seconds": round(seconds, 3)}


def calls_line(entry: dict[str, Any] | None) -> str | None:
    """``metrics.json``'s ``tool_calls`` in words: ``right call 0 → 6 of 7, right function 0 → 7, valid JSON 0 → 7``
    (the base's count, then the fine-tune's); None without one."""
    if not entry or not entry.get("requests"):
        return None
    n = entry["requests"]
    words = (("right", "right call"), ("right_function", "right function"), ("valid_json", "valid JSON"))
    bits = [f"{w} {round(entry['base'][k] * n)} → {round(entry['fine_tuned'][k] * n)}" for k, w in words]
    return f"{', '.join(bits)} of {n} (base → fine-tune)"

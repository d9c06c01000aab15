"""Tool-call accuracy of the base model and the fine-tune on held-out tool-calling chats (``finetuner eval``).

Each assistant message of the data that makes calls is a request: the conversation before it (with the row's
``tools``) is asked as ``finetuner chat --tools`` asks it (:meth:`finetuner.infer.chat.ChatModel.tool_reply`: the
run's tool format, greedy), and the reply is read with :func:`finetuner.data.calls.parse_reply`. Counted, each as
a share of the requests:

- ``right``: the reply's calls are the data's, in order, each the same function with the same arguments
  (:func:`finetuner.data.calls.same_call`);
- ``right_function``: the same functions, whatever the arguments;
- ``valid_json``: the reply made calls and every one of them was valid JSON with a name and an arguments object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import finetuner.phases as phases
from finetuner.data.calls import same_call


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


def score(chat, requests: list[Request], adapter: bool, who: str, max_new_tokens: int = 96) -> tuple[ToolScore, list[str]]:
    """``chat``'s calls (adapter on or off) for ``requests``, and its replies' text."""
    right = right_fn = valid = 0
    texts = []
    kept = chat.tools
    try:
        with phases.phase("answers", total=len(requests), unit="calls", label=f"tool calls of {who}") as p:
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

"""Reading a model's tool calls back from its reply, in the format of the chat template's family.

One parser for every reader of a reply: ``finetuner chat --tools`` (prints the call as JSON), ``finetuner eval`` on
tool-call data (the share of right calls and of valid JSON) and the GRPO rewards ``tool_call_match``. The formats:

- Qwen2.5/Qwen3's and Hermes' (finetuner's fallback, :data:`finetuner.data.tools.FALLBACK_FORMAT`): one
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` block a call;
- Llama 3.1's: the reply is a JSON object ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` when the
  tokenizer keeps it);
- Mistral's: ``[TOOL_CALLS]`` and a JSON list of ``{"name", "arguments"}`` (v3), or ``[TOOL_CALLS]name[ARGS]{...}``
  (the newer tokenizers); decoded without special tokens the marker is gone and the bare JSON list is read.

A reply *tries* a call when it holds a marker or starts as a call's JSON does; a tried call whose JSON does not parse
into a name and an arguments object is counted as invalid, never guessed at.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_MISTRAL_ARGS = re.compile(r"\s*([\w.-]+)\[ARGS\]")


@dataclass
class ParsedReply:
    """What a reply holds: its calls (``{"name", "arguments"}``, arguments an object), whether it tried to call a
    tool, whether every tried call was valid JSON, and the reply's text."""

    text: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    tried: bool = False
    valid: bool = True

    def to_json(self) -> str:
        """The calls as ``finetuner chat`` prints them: one JSON object a line."""
        return "\n".join(json.dumps(c, ensure_ascii=False) for c in self.calls)

    def shown(self) -> str:
        """The reply as ``finetuner chat`` prints it: its calls (:meth:`to_json`) when it makes any, else its text."""
        return self.to_json() if self.calls else self.text


def _one(obj: Any) -> dict[str, Any] | None:
    """``{"name", "arguments"}`` from a decoded call (``arguments`` or Llama's ``parameters``, an object or a JSON
    string of one), None when it is not one."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"name": obj["name"], "arguments": args} if isinstance(args, dict) else None


def _decode(text: str) -> list[dict[str, Any]] | None:
    """The calls of one JSON value at the start of ``text`` (an object or a list of them), None when it is not."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text.strip())
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_one(v) for v in items]
    return calls if calls and all(c is not None for c in calls) else None


def parse_reply(text: str) -> ParsedReply:
    """The calls in a model's reply (module doc for the formats)."""
    out = ParsedReply(text=text.strip())
    body = out.text
    blocks = _HERMES.findall(body)
    if blocks:
        out.tried = True
        for block in blocks:
            calls = _decode(block)
            if calls is None:
                out.valid = False
            else:
                out.calls += calls
        return out
    if body.startswith("[TOOL_CALLS]"):
        out.tried = True
        body = body[len("[TOOL_CALLS]"):]
        named = _MISTRAL_ARGS.match(body)
        if named:
            try:
                args_value, _ = json.JSONDecoder().raw_decode(body[named.end():].strip())
            except json.JSONDecodeError:
                args_value = None
            if isinstance(args_value, dict):
                out.calls.append({"name": named.group(1), "arguments": args_value})
            else:
                out.valid = False
            return out
    body = body.removeprefix("<|python_tag|>").strip()
    if body.startswith(("{", "[")):
        calls = _decode(body)
        if calls is not None:
            out.tried, out.calls = True, calls
        elif out.tried or re.match(r'[\[{]\s*\{?\s*"name"', body):
            out.tried, out.valid = True, False
    elif out.tried:
        out.valid = False
    return out


def reference_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """The calls a data column holds (a reward's reference): ``{"name", "arguments"}`` or OpenAI's
    ``{"function": {...}}``, a list of them, a JSON string of either, or a reply's text with its calls; none for an
    empty value. A value that is none of these is a :class:`UserError` naming ``where``."""
    from finetuner.errors import UserError

    if value is None or (isinstance(value, (str, list)) and not value):
        return []
    if isinstance(value, str):
        reply = parse_reply(value)
        if reply.tried and reply.valid:
            return reply.calls
    else:
        items = value if isinstance(value, list) else [value]
        calls = [_one(v) for v in items]
        if all(c is not None for c in calls):
            return calls
    raise UserError(f"{where}: the reference {str(value)[:80]!r} is not a tool call",
                    hint='Give each row its call as {"name": ..., "arguments": {...}} (or a list of them, or empty for '
                         'no call).')


def same_call(made: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether a made call is the wanted one: the same name and arguments (numbers compared as numbers: 7 and 7.0
    are one value; text exactly)."""
    return made.get("name") == wanted.get("name") and _norm(made.get("arguments")) == _norm(wanted.get("arguments"))


def _norm(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value

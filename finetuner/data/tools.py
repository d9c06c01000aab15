"""Tool calls in chat rows: reading them as users have them, and finetuner's one fallback format.

Read (:func:`read_tools`, :func:`turn_extras`, :func:`link_results`):

- OpenAI's chat format (TRL's, OpenAI's and mlx-lm's documented one): a ``tools`` column (a list of
  ``{"type": "function", "function": {name, description, parameters}}``, or the bare function objects, or either as
  a JSON string), assistant messages with ``tool_calls`` (``arguments`` as a JSON string or an object; ``content``
  may be ``null`` or ``""``), ``tool`` messages with the result and ``tool_call_id`` / ``name``.
- LLaMA-Factory's ShareGPT: ``function_call`` turns (a JSON ``{"name", "arguments"}``, or a list of them),
  ``observation`` turns (the result), ``tools`` as a JSON string.

A row's calls become transformers' form: ``{"type": "function", "function": {"name", "arguments": {...}}}`` with the
arguments an object (what ``apply_chat_template`` expects), an ``id`` kept when the data gave one. A row is refused
with one line saying what is wrong: a call to a tool ``tools`` does not list, arguments that are not a JSON object, a
``tool`` message with no call before it. Calls are never dropped: an assistant message with ``tool_calls`` keeps them
whatever its ``content``.

Rendering: a chat template that renders tools (:func:`renders_tools`: it writes a probe tool's name and a probe
call's arguments when given them: Qwen2.5/Qwen3's ``<tool_call>`` blocks, Llama 3.1's JSON, Mistral's
``[TOOL_CALLS]``) gets ``tools=`` and the messages' ``tool_calls`` as transformers passes them. A template that
cannot (SmolLM2's, the demo model's) gets the row in :data:`FALLBACK_FORMAT`, finetuner's one fallback
(:func:`fallback_messages`): the Hermes/Qwen2.5 convention that vLLM's ``hermes`` parser and Ollama's Qwen templates
read, the schemas in the system message, each call a ``<tool_call>`` block in the reply, each result a
``<tool_response>`` block in a user turn. The plan states which (:func:`statement`) and the run keeps it in
``metrics.json`` (``data.tools``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from finetuner.data.rows import RowError
from finetuner.errors import UserError

#: what :func:`statement` and the docs call finetuner's fallback
FALLBACK_FORMAT = "hermes"
FALLBACK_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


# --------------------------------------------------------------------------- bounds
#: The most tools one row (or a tools file) may offer: OpenAI's chat completions API takes at most 128 a request;
#: the tool sets of public tool-calling data (xLAM, ToolACE, Glaive, LLaMA-Factory's demos) have 1 to ~20.
MAX_TOOLS = 128
#: The most bytes of a row's ``tools`` value (as JSON, UTF-8): 1 MiB, about 8 KiB for each of 128 tools, where a
#: real schema (name, description, a handful of typed parameters) is 0.2 to 2 KiB. Schemas are rendered whole
#: into every example, so this also bounds the text a template renders from them.
MAX_TOOLS_BYTES = 2**20
#: The deepest nesting of arrays and objects in a row's ``tools``: 64 levels. A schema nests two JSON levels a
#: schema level (``properties``, then the property); OpenAI's structured outputs allow 5 schema levels (10 JSON
#: levels, plus 4 for the tools list, the tool, ``function`` and ``parameters``).
MAX_TOOLS_DEPTH = 64

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = {ord(c): None for c in map(chr, range(0x80)) if c not in "[]{}"}


def _over(what: str) -> RowError:
    return RowError(f"'tools' {what}: a row may offer at most {MAX_TOOLS} tools, in at most {MAX_TOOLS_BYTES:,} bytes "
                    f"(1 MiB) nested at most {MAX_TOOLS_DEPTH} levels deep (docs/tools.md)")


def _text_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text``, counted without parsing it (strings left out)."""
    depth = deepest = 0
    for c in _JSON_STRING.sub("", text).translate(_BRACKETS):
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _value_bounds(value: Any) -> None:
    """The bounds of an already-read ``tools`` value (a list from a JSON Lines or Parquet row), walked without
    recursion, stopping at the first bound passed: so never more than :data:`MAX_TOOLS_BYTES` steps."""
    size, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_TOOLS_DEPTH and isinstance(v, (dict, list, tuple)):
            raise _over(f"nests arrays or objects more than {MAX_TOOLS_DEPTH} levels deep")
        if isinstance(v, dict):
            size += 2 + sum(len(str(k)) + 4 for k in v)
            stack += [(x, depth + 1) for x in v.values()]
        elif isinstance(v, (list, tuple)):
            size += 2 + len(v)
            stack += [(x, depth + 1) for x in v]
        else:
            size += len(v) + 2 if isinstance(v, str) else 8
        if size > MAX_TOOLS_BYTES:
            raise _over(f"is over {MAX_TOOLS_BYTES:,} bytes")


def check_bounds(value: Any) -> None:
    """A :class:`RowError` naming the bound when a row's ``tools`` value passes one (:data:`MAX_TOOLS_BYTES`,
    :data:`MAX_TOOLS_DEPTH`; :data:`MAX_TOOLS` once read), checked before it is parsed or rendered."""
    if isinstance(value, str):
        n = len(value) if len(value) > MAX_TOOLS_BYTES else len(value.encode("utf-8", "surrogatepass"))
        if n > MAX_TOOLS_BYTES:  # characters are at most bytes: the text is not encoded when it is that long
            raise _over(f"is {n:,} {'characters' if len(value) > MAX_TOOLS_BYTES else 'bytes'} of JSON")
        depth = _text_depth(value)
        if depth > MAX_TOOLS_DEPTH:
            raise _over(f"nests arrays or objects {depth:,} levels deep")
    elif isinstance(value, list) and len(value) > MAX_TOOLS:
        raise _over(f"lists {len(value):,} tools")
    elif value is not None:
        _value_bounds(value)


# --------------------------------------------------------------------------- reading
def _json(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RowError(f"{what} is not valid JSON ({e.msg}, column {e.colno})") from None


def read_tools(value: Any) -> list[dict[str, Any]]:
    """A row's ``tools`` as transformers' list of ``{"type": "function", "function": {...}}`` (empty when none);
    within the bounds (:func:`check_bounds`, :data:`MAX_TOOLS`) or a :class:`RowError` naming the bound."""
    check_bounds(value)
    value = _json(value, "'tools'")
    if value in (None, "", []):
        return []
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise RowError(f"'tools' must be a list of function schemas, got {type(value).__name__}")
    if len(value) > MAX_TOOLS:
        raise _over(f"lists {len(value):,} tools")
    out = []
    for j, tool in enumerate(value, start=1):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise RowError(f"'tools' item {j}: expected a function schema with a 'name'")
        out.append({"type": "function", "function": fn})
    return out


def tools_file(path: str | Path) -> list[dict[str, Any]]:
    """The schemas of a tools file (``finetuner chat --tools``, the UI's Chat tab): a JSON list as a row's ``tools``
    column holds it (:func:`read_tools`); a :class:`UserError` naming the file otherwise."""
    p = Path(path).expanduser()
    try:
        schemas = read_tools(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"The tools file {path}: cannot read it ({e.strerror or e}).") from None
    except RowError as e:
        raise UserError(f"The tools file {path}: {e}.",
                        hint='Give a JSON list of tools, e.g. [{"type": "function", "function": {"name": "get_weather", '
                             '"parameters": {...}}}].') from None
    if not schemas:
        raise UserError(f"The tools file {path} lists no tools.")
    return schemas


def tool_names(tools: Sequence[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def offered_tools(examples: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool schemas the rows offered, each function once (its first schema, in the rows' order): what a
    tool-calling run's sample prompts are offered (:func:`finetuner.training.samples.answer_samples`), as
    ``finetuner chat --tools FILE`` offers a file of them."""
    seen: dict[str, dict[str, Any]] = {}
    for ex in examples:
        for t in ex.get("tools") or []:
            seen.setdefault(t["function"]["name"], t)
    return list(seen.values())


def _call(raw: Any, where: str, names: Sequence[str]) -> dict[str, Any]:
    """One call in transformers' form; ``raw`` is OpenAI's ``{"id", "type", "function": {...}}`` or a bare
    ``{"name", "arguments"}`` (LLaMA-Factory's)."""
    fn = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise RowError(f"{where}: a tool call needs a function 'name'")
    name = fn["name"]
    if names and name not in names:
        raise RowError(f"{where}: a call to '{name}', which 'tools' does not list (it lists {', '.join(names)})")
    args = _json(fn.get("arguments", fn.get("parameters", {})), f"{where}: the arguments of '{name}'")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise RowError(f"{where}: the arguments of '{name}' must be a JSON object, got {type(args).__name__}")
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if isinstance(raw, dict) and isinstance(raw.get("id"), str) and raw["id"]:
        call["id"] = raw["id"]
    return call


def openai_calls(value: Any, where: str, names: Sequence[str]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (a list, or a JSON string of one) in transformers' form."""
    value = _json(value, f"{where}: 'tool_calls'")
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RowError(f"{where}: 'tool_calls' must be a non-empty list of calls")
    return [_call(c, f"{where}, call {k}", names) for k, c in enumerate(value, start=1)]


def turn_extras(source_role: str, turn: dict[str, Any], content: str, names: Sequence[str], where: str
                ) -> dict[str, Any]:
    """The tool keys of one read message: a ShareGPT ``function_call`` turn's calls (its value, the content, is the
    call), an OpenAI assistant message's ``tool_calls``, a ``tool`` message's ``tool_call_id`` and ``name``."""
    if source_role == "function_call":
        return {"content": "", "tool_calls": openai_calls(content, where, names)}  # the same forms
    extra: dict[str, Any] = {}
    if turn.get("tool_calls"):
        if turn.get("role", source_role) != "assistant":
            raise RowError(f"{where}: only an assistant message can make tool calls")
        extra["tool_calls"] = openai_calls(turn["tool_calls"], where, names)
    for key in ("tool_call_id", "name"):
        if source_role in ("tool", "observation", "function") and isinstance(turn.get(key), str) and turn[key]:
            extra[key] = turn[key]
    return extra


def refuse_calls(turn: Any, what: str, kind: str) -> None:
    """A :class:`RowError` for a message with tool calls where ``kind`` of data (preference pairs, GRPO prompts)
    does not read them yet: a call is never dropped unseen."""
    if isinstance(turn, dict) and (turn.get("tool_calls") or turn.get("from") == "function_call"):
        raise RowError(f"{what}: a message with tool calls, which {kind} do not read yet (supervised chat data does)")


def link_results(messages: list[dict[str, Any]]) -> None:
    """Give each ``tool`` message the ``name`` (and ``tool_call_id``) of the call it answers, in order; a
    :class:`RowError` for a result with no call before it."""
    pending: list[dict[str, Any]] = []
    for i, m in enumerate(messages, start=1):
        if m["role"] == "assistant":
            pending = list(m.get("tool_calls") or [])
        elif m["role"] == "tool":
            if not pending:
                raise RowError(f"message {i}: a tool result with no tool call before it")
            wanted = m.get("tool_call_id")
            call = next((c for c in pending if wanted and c.get("id") == wanted), None) if wanted else pending[0]
            if call is None:
                raise RowError(f"message {i}: tool_call_id {wanted!r} answers no call of the message before it")
            pending.remove(call)
            m.setdefault("name", call["function"]["name"])
            if "id" in call:
                m.setdefault("tool_call_id", call["id"])
        else:
            pending = []


def has_tools(messages: Iterable[dict[str, Any]], tools: Sequence[Any] | None) -> bool:
    """Whether a row uses tools at all: schemas, calls or results."""
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


# --------------------------------------------------------------------------- rendering
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_fn_q7", "description": "d",
                                                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
_PROBE = [{"role": "user", "content": "u"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "abcdefghi", "type": "function", "function": {"name": "probe_fn_q7", "arguments": {"x": "zq9v"}}}]},
          {"role": "tool", "content": "r", "tool_call_id": "abcdefghi", "name": "probe_fn_q7"},
          {"role": "assistant", "content": "a"}]
_RENDERS: dict[tuple[int, str], bool] = {}


def renders_tools(tokenizer: Any, template: str) -> bool:
    """Whether ``template`` writes tools and calls itself (module doc): a probe conversation rendered with a probe
    tool shows the tool's description and the call's arguments."""
    key = (id(tokenizer), template)
    if key not in _RENDERS:
        try:
            text = tokenizer.apply_chat_template(_PROBE, tools=[_PROBE_TOOL], chat_template=template, tokenize=False)
            _RENDERS[key] = text.count("probe_fn_q7") >= 2 and "zq9v" in text
        except Exception:  # noqa: BLE001 - a template that raises on tools cannot render them
            _RENDERS[key] = False
    return _RENDERS[key]


def call_text(call: dict[str, Any]) -> str:
    """One call as the fallback writes it (a ``<tool_call>`` block), and as ``finetuner chat`` reads it back."""
    fn = call["function"]
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False) + "\n</tool_call>"


def fallback_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A row in :data:`FALLBACK_FORMAT` for a template that cannot render tools: plain role/content messages."""
    out: list[dict[str, Any]] = []
    if tools:
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        block = FALLBACK_SYSTEM.format(tools=schemas)
        if messages and messages[0]["role"] == "system":
            block = f"{messages[0]['content']}\n\n{block}"
            messages = messages[1:]
        out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "tool":
            result = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
            continue
        calls = m.get("tool_calls") or []
        copy = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}
        if calls:
            copy["content"] = "\n".join(([m["content"]] if m["content"].strip() else []) + [call_text(c) for c in calls])
        out.append(copy)
    return [{k: v for k, v in m.items() if k != "_results"} for m in out]


def prompt_form(tokenizer: Any, template: str, messages: list[dict[str, Any]], schemas: Sequence[dict[str, Any]],
                trained: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``messages`` with tools as the template is given them, and the template's keyword arguments: ``tools=``
    where the template renders tools, else the rows in :data:`FALLBACK_FORMAT`. ``trained``: how the run's rows
    rendered (``metrics.json``'s ``data.tools.renders``, ``"template"`` or ``"hermes"``), which a prompt follows;
    None decides as training did (:func:`renders_tools`). Training and ``finetuner chat --tools`` both ask here."""
    through_template = trained == "template" if trained in ("template", FALLBACK_FORMAT) else renders_tools(tokenizer, template)
    if through_template:
        return messages, {"tools": list(schemas) or None}
    return fallback_messages(messages, schemas), {}


def statement(template_renders: bool | None, rows: int, schema_tokens: int = 0, total_tokens: int = 0
              ) -> dict[str, Any] | None:
    """What the plan and the run say of the rows' tools: how they render and what the schemas cost (``None``
    without tool rows)."""
    if not rows:
        return None
    how = ("through the chat template (tools=, tool_calls)" if template_renders
           else f"in finetuner's fallback tool format ({FALLBACK_FORMAT}: schemas in the system message, "
                "<tool_call> blocks in replies, <tool_response> blocks in user turns), the chat template renders no tools")
    share = f", {schema_tokens / total_tokens:.0%} of all tokens" if total_tokens else ""
    cost = (f"; the tool schemas take {schema_tokens:,} tokens in all{share} (in each row's length, never labels)"
            if schema_tokens else "")
    return {"rows": rows, "renders": "template" if template_renders else FALLBACK_FORMAT,
            "schema_tokens": schema_tokens, "reason": f"{rows} row(s) with tools render {how}{cost}"}

"""Built-in reward functions for the common cases, each with TRL's signature
``fn(prompts, completions, **columns) -> list[float]`` (built by a factory that takes its settings).

A completion is a string, or (chat prompts, as TRL passes them) a list of messages whose last one holds
the generated text (:func:`completion_text`).

* :func:`exact_match`: 1.0 when the completion's final answer equals a data column's, else 0.0. The final
  answer (:func:`final_answer`) of a text is, in this order: the content of its last ``\\boxed{…}``; of its
  last ``<answer>…</answer>`` (the R1 format); the text after its last ``####`` (GSM8K's marker); the text
  after its last ``answer:`` (any case); else its last non-empty line. Both sides are normalised (:func:`normalise_answer`): surrounding spaces, ``$`` and a
  final ``.`` dropped, spaces collapsed, lower case, thousands separators removed from numbers; two
  numbers are equal when their values are (``3.50`` equals ``3.5``). The column's value goes through the
  same extraction, so a GSM8K solution column (``… #### 42``) works as it is.
* :func:`regex_format`: 1.0 when the completion matches a regular expression (whole text by default,
  ``.`` matching newlines), else 0.0.
* :func:`length_bounds`: 1.0 when the completion's length (words, or tokens) lies within ``[min, max]``;
  outside, a linear fall-off: ``max(0, 1 − (L − max) / max)`` above, ``L / min`` below.
* :func:`tool_call_match`: how close the completion's tool calls (read as ``finetuner chat --tools`` reads them:
  :func:`finetuner.data.calls.parse_reply`, every template family's format) come to a data column's: 1.0 the same
  calls (functions and arguments, in order); 0.5 the same functions with other arguments; 0.25 well-formed calls
  (valid JSON, a name and an arguments object) of other functions; 0.0 no call, or a call that is not valid JSON.
  A row whose column holds no call (empty, ``null``, ``[]``) wants an answer: 1.0 when the completion makes no
  call, else 0.0.
* :func:`think_format`: 1.0 when the completion reasons, then answers: one ``</think>`` (after an optional
  ``<think>``: a thinking template opens the block in the prompt), text before it and after it, no other think tag;
  else 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from finetuner.errors import UserError

RewardFn = Callable[..., list[float]]


def completion_text(completion: Any) -> str:
    """The generated text of a completion: the string itself, or the content of the last message of a
    chat completion (``[{"role": "assistant", "content": …}]``)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return str(completion)


_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    i, depth = start + len(_BOXED), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: no boxed answer


def final_answer(text: str) -> str:
    """The final answer of a text, by the rule in the module's docstring (not yet normalised)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
    if tagged:
        return tagged[-1]
    if "####" in text:
        return text.rsplit("####", 1)[1]
    found = list(re.finditer(r"answer\s*:", text, flags=re.IGNORECASE))
    if found:
        return text[found[-1].end():]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


_NUMBER = re.compile(r"[-+]?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")


def normalise_answer(answer: str) -> str:
    """An answer as compared: stripped of spaces, ``$`` and a final ``.``, spaces collapsed, lower
    case; a number written without thousands separators and trailing zeros (``1,000.50`` → ``1000.5``)."""
    s = " ".join(answer.split()).strip().strip("$").strip().rstrip(".").strip().lower()
    if _NUMBER.fullmatch(s):
        s = s.replace(",", "")
        if "." in s:
            s = s.rstrip("0").rstrip(".")
        s = s.lstrip("+")
        if s in ("-0", ""):
            s = "0"
    return s


def _column(columns: dict[str, Any], name: str, reward: str) -> list:
    if name not in columns:
        raise UserError(f"reward {reward}: the data has no column '{name}' (columns: {', '.join(sorted(columns)) or 'none'}).",
                        hint="Name the column that holds the reference answers.")
    return columns[name]


def exact_match(column: str = "answer") -> RewardFn:
    """A reward of 1.0 when a completion's final answer equals the one in the data column ``column``."""
    name = f"exact_match({column})"

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        refs = _column(columns, column, name)
        return [float(normalise_answer(final_answer(completion_text(c))) == normalise_answer(final_answer(str(r))))
                for c, r in zip(completions, refs, strict=True)]

    reward.__name__ = reward.__qualname__ = name
    return reward


def regex_format(pattern: str, *, full_match: bool = True) -> RewardFn:
    """A reward of 1.0 when a completion matches ``pattern`` (the whole text with ``full_match``, else
    anywhere in it; ``.`` matches newlines)."""
    try:
        compiled = re.compile(pattern, flags=re.DOTALL)
    except re.error as e:
        raise UserError(f"reward regex_format: the pattern {pattern!r} is not a valid regular expression: {e}.",
                        hint="Fix the pattern (Python's re syntax).") from None
    match = compiled.fullmatch if full_match else compiled.search

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        return [float(match(completion_text(c)) is not None) for c in completions]

    reward.__name__ = reward.__qualname__ = "regex_format"
    return reward


def length_bounds(min_length: int | None = None, max_length: int | None = None, *, unit: str = "words",
                  tokenizer: Any = None) -> RewardFn:
    """A reward of 1.0 for a completion whose length lies in ``[min_length, max_length]`` (either may be
    None), falling off linearly outside (module docstring). ``unit``: ``words`` (split on white space) or
    ``tokens``: the ``completion_ids`` TRL's callers pass (the completion's tokens up to its end), else
    ``tokenizer``'s count of the text without special tokens."""
    if unit not in ("words", "tokens"):
        raise UserError(f"reward length_bounds: unit must be words or tokens, not {unit!r}.")
    if min_length is None and max_length is None:
        raise UserError("reward length_bounds: give min_length, max_length or both.")
    if (min_length is not None and min_length < 1) or (max_length is not None and max_length < 1) \
            or (min_length is not None and max_length is not None and min_length > max_length):
        raise UserError(f"reward length_bounds: need 1 ≤ min_length ≤ max_length; got {min_length} and {max_length}.")

    def score(n: int) -> float:
        if max_length is not None and n > max_length:
            return max(0.0, 1.0 - (n - max_length) / max_length)
        if min_length is not None and n < min_length:
            return n / min_length
        return 1.0

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        if unit == "words":
            lengths = [len(completion_text(c).split()) for c in completions]
        elif columns.get("completion_ids") is not None:
            lengths = [len(ids) for ids in columns["completion_ids"]]
        elif tokenizer is not None:
            lengths = [len(tokenizer(completion_text(c), add_special_tokens=False)["input_ids"]) for c in completions]
        else:
            raise UserError("reward length_bounds: unit tokens needs the completions' token ids or a tokenizer.")
        return [score(n) for n in lengths]

    reward.__name__ = reward.__qualname__ = "length_bounds"
    return reward


def tool_call_match(column: str = "tool_call") -> RewardFn:
    """A reward for the completion's tool calls against the reference call(s) in the data column ``column`` (module
    docstring): a call as ``{"name", "arguments"}``, OpenAI's ``{"function": {...}}``, a list of them, a JSON string
    of either, or a reply's text with its calls (``<tool_call>`` blocks)."""
    from finetuner.data.calls import parse_reply, reference_calls, same_call

    name = f"tool_call_match({column})"

    def one(completion: Any, ref: Any) -> float:
        wanted = reference_calls(ref, name)
        reply = parse_reply(completion_text(completion))
        if not wanted:
            return float(not reply.tried)
        made = reply.calls
        if not made or not reply.valid:
            return 0.0
        if len(made) == len(wanted) and all(same_call(a, b) for a, b in zip(made, wanted)):
            return 1.0
        if [c["name"] for c in made] == [c["name"] for c in wanted]:
            return 0.5
        return 0.25

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        refs = _column(columns, column, name)
        return [one(c, r) for c, r in zip(completions, refs, strict=True)]

    reward.__name__ = reward.__qualname__ = name
    return reward


_THINK_TAG = re.compile(r"</?think>")


def think_format() -> RewardFn:
    """A reward of 1.0 for a completion that reasons in a think block and then answers (module docstring)."""

    def one(text: str) -> float:
        tags = _THINK_TAG.findall(text)
        if tags not in (["</think>"], ["<think>", "</think>"]) or (tags[0] == "<think>" and not text.lstrip().startswith("<think>")):
            return 0.0
        reasoning, answer = text.lstrip().removeprefix("<think>").split("</think>")
        return float(bool(reasoning.strip()) and bool(answer.strip()))

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        return [one(completion_text(c)) for c in completions]

    reward.__name__ = reward.__qualname__ = "think_format"
    return reward


#: The built-ins by the name a recipe gives them.
BUILTINS: dict[str, Callable[..., RewardFn]] = {
    "exact_match": exact_match,
    "regex_format": regex_format,
    "length_bounds": length_bounds,
    "tool_call_match": tool_call_match,
    "think_format": think_format,
}


def make_builtin(name: str, args: dict[str, Any] | None = None, name_at: str = "reward", args_at: str | None = None) -> RewardFn:
    """The built-in reward ``name`` made with its settings ``args`` (no user code runs): a :class:`UserError`
    beginning with ``name_at`` when the name is not a built-in, or with ``args_at`` (default ``name_at``)
    when a setting is not one of its settings or the settings do not make a reward (e.g.
    :func:`length_bounds` without a bound)."""
    import inspect

    from finetuner.errors import did_you_mean

    args, where = dict(args or {}), args_at or name_at
    factory = BUILTINS.get(name)
    if factory is None:
        raise UserError(f"{name_at}: '{name}' is not a built-in reward.{did_you_mean(name, list(BUILTINS))}",
                        hint=f"The built-ins are {', '.join(BUILTINS)}; for a function of your own, name the Python file "
                             "that defines it.")
    params = [p for p in inspect.signature(factory).parameters if p != "tokenizer"]
    unknown = [k for k in args if k not in params]
    if unknown:
        raise UserError(f"{where}: '{unknown[0]}' is not a setting of {name}.{did_you_mean(unknown[0], params)}",
                        hint=f"{name} takes {', '.join(params) or 'no settings'}.")
    try:
        return factory(**args)
    except TypeError as e:
        raise UserError(f"{where}: {name}: {e}.", hint=f"{name} takes {', '.join(params)}.") from None
    except UserError as e:
        raise UserError(f"{where}: {e.message}", hint=e.plain_hint or f"{name} takes {', '.join(params)}.") from None


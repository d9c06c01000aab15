"""Several weighted reward functions scored on a batch of completions, their outputs checked.

The total reward of completion ``j`` is ``Σ_k w_k · r_k[j]`` (TRL's ``sum_then_normalize``). As in TRL, a
function may return ``None`` for a completion it does not apply to: that function then adds nothing to the
completion's total (its per-function value is NaN); a completion no function scores stops the run. A
function that raises, returns a number of rewards other than one per completion, or something that is not
a finite number raises :class:`finetuner.errors.RewardError` naming the function and the row (to find the
row a function raises on, it is called again on each row alone, in order, until one raises).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from finetuner.errors import RewardError, UserError, first_line
from finetuner.rewards.builtin import completion_text
from finetuner.text import cut_words
from finetuner.rewards.limits import RewardTimedOut, reward_limits


@dataclass
class RewardFunction:
    """A reward function with its weight and the name events and messages give it."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0


@dataclass
class Rewards:
    """The rewards of a batch: ``total[j]`` the weighted sum for completion ``j``, ``per_function[name][j]``
    each function's own reward (NaN where it returned None)."""

    total: list[float]
    per_function: dict[str, list[float]] = field(default_factory=dict)

    def means(self) -> dict[str, float]:
        """Each function's mean reward over the completions it scored (NaN if none)."""
        out = {}
        for name, values in self.per_function.items():
            scored = [v for v in values if not math.isnan(v)]
            out[name] = sum(scored) / len(scored) if scored else math.nan
        return out


def _call_kwargs(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` as ``fn`` takes them: all of them with ``**kwargs`` in its signature, else those it names."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return kwargs
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in named}


def _row_words(j: int, prompts: Sequence, places: Sequence[str] | None) -> str:
    where = places[j] if places is not None else f"completion {j + 1} of the batch"
    prompt = completion_text(prompts[j]) if j < len(prompts) else ""
    return f"{where} (prompt: {cut_words(' '.join(prompt.split()), 60)!r})"


def _slice(kwargs: dict[str, Any], j: int) -> dict[str, Any]:
    return {k: (v[j:j + 1] if isinstance(v, (list, tuple)) else v) for k, v in kwargs.items()}


def _first_failing_row(fn: Callable, kwargs: dict[str, Any], n: int, timeout_s: float | None = None,
                       stop: Callable[[], bool] | None = None) -> tuple[int, BaseException] | None:
    """The first row on which ``fn`` raises when called on that row alone, and its error."""
    for j in range(n):
        try:
            with reward_limits(timeout_s, stop):
                fn(**_call_kwargs(fn, _slice(kwargs, j)))
        except (Exception, SystemExit) as e:  # the user's code
            return j, e
    return None


def _timed_out(reward: RewardFunction, n: int, timeout_s: float | None) -> RewardError:
    return RewardError(f"reward function '{reward.name}' did not return within {timeout_s:g} s on a batch of {n} "
                       "completions (grpo.reward_timeout_s).", function=reward.name,
                       hint="Make it faster (a call to a server needs a timeout of its own), or raise grpo.reward_timeout_s.")


def call_reward(reward: RewardFunction, prompts: Sequence, completions: Sequence, columns: dict[str, Sequence],
                places: Sequence[str] | None = None, timeout_s: float | None = None,
                stop: Callable[[], bool] | None = None) -> list[float]:
    """One function's rewards for the batch, checked: a list of ``len(completions)`` finite numbers, NaN
    for a ``None``. ``columns``: the data's other columns (one value per completion) and, where known,
    ``completion_ids``; ``places``: where each completion's prompt comes from (``file, line 12``).
    ``timeout_s`` and ``stop``: the call's limits (:func:`finetuner.rewards.limits.reward_limits`): past the
    time a :class:`RewardError`; a stop request raises :class:`~finetuner.rewards.limits.RewardStopped`."""
    n = len(completions)
    kwargs = {**columns, "prompts": list(prompts), "completions": list(completions)}
    try:
        with reward_limits(timeout_s, stop):
            out = reward.fn(**_call_kwargs(reward.fn, kwargs))
    except RewardTimedOut:
        raise _timed_out(reward, n, timeout_s) from None
    except UserError:
        raise
    except (Exception, SystemExit) as e:  # the user's code (sys.exit() in it too: never the run's exit): name the row
        try:
            found = _first_failing_row(reward.fn, kwargs, n, timeout_s, stop)
        except RewardTimedOut:
            found = None
        j, err = found if found else (None, e)
        row = f" on {_row_words(j, prompts, places)}" if j is not None else f" on a batch of {n} completions"
        if isinstance(err, SystemExit):
            head, tail = f"called sys.exit({err.code!r})", ""
        else:
            head, tail = f"raised {type(err).__name__}", f": {first_line(str(err))}"
        hint = "Fix the function; it must return one number per completion."
        if any(isinstance(c, list) for c in completions):
            hint = ("On chat data each completion is a list of messages (TRL's convention): take its text with "
                    "c if isinstance(c, str) else c[-1]['content']. " + hint)
        raise RewardError(f"reward function '{reward.name}' {head}{row}{tail}", function=reward.name, row=j,
                          hint=hint) from None
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(out, "tolist"):
        raise RewardError(f"reward function '{reward.name}' returned a {type(out).__name__}, not a list of "
                          f"{n} numbers (one per completion).", function=reward.name,
                          hint="Return a list with one float per completion.")
    values = out.tolist() if hasattr(out, "tolist") else list(out)
    if len(values) != n:
        raise RewardError(f"reward function '{reward.name}' returned {len(values)} rewards for {n} completions; it must "
                          "return one per completion, in order.", function=reward.name,
                          hint="Return a list with one float per completion.")
    checked = []
    for j, v in enumerate(values):
        if v is None:
            checked.append(math.nan)
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not _finite(v):
            raise RewardError(f"reward function '{reward.name}' returned {v!r} for {_row_words(j, prompts, places)}: "
                              "a reward must be a finite number (or None where the function does not apply).",
                              function=reward.name, row=j, hint="Return a float for every completion.")
        checked.append(float(v))
    return checked


def _finite(v: numbers.Real) -> bool:
    """Whether ``v`` is a finite float: an integer too large for a float (``10**400``) is not."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def score(rewards: Sequence[RewardFunction], prompts: Sequence, completions: Sequence,
          columns: dict[str, Sequence] | None = None, places: Sequence[str] | None = None,
          timeout_s: float | None = None, stop: Callable[[], bool] | None = None) -> Rewards:
    """Every function's rewards for the batch (:func:`call_reward`, each call under ``timeout_s`` and
    ``stop``) and their weighted total."""
    if not rewards:
        raise ValueError("score needs at least one reward function")
    names = [r.name for r in rewards]
    if len(set(names)) != len(names):
        raise ValueError(f"reward function names must differ: {names}")
    per = {r.name: call_reward(r, prompts, completions, columns or {}, places, timeout_s, stop) for r in rewards}
    total = []
    for j in range(len(completions)):
        terms = [r.weight * per[r.name][j] for r in rewards if not math.isnan(per[r.name][j])]
        if not terms:
            raise RewardError(f"no reward function scored {_row_words(j, prompts, places)}: each returned None.",
                              function=", ".join(names), row=j,
                              hint="Return a number for every completion from at least one reward function.")
        total.append(math.fsum(terms))
    return Rewards(total=total, per_function=per)

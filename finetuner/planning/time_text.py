"""How a plan says a time and a cost: :func:`format_duration`, :func:`format_cost`, and :func:`time_text`, the one
line of a run's predicted time that the plan, ``finetuner estimate`` and the web UI print."""

from __future__ import annotations

from typing import Any

from finetuner.planning.wait import cost_text, parts_text


def format_duration(seconds: float | None) -> str:
    """``0.42 s``, ``12 s``, ``3 min 20 s``, ``2 h 05 min``: how a plan says a time."""
    if seconds is None:
        return "?"
    if seconds < 10:
        return f"{seconds:.2g} s" if seconds < 1 else f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    m, sec = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def format_cost(cost: float) -> str:
    """``12.50``, or two significant digits below 0.1 (``0.0029``): how a plan says a cost."""
    return f"{cost:,.2f}" if cost >= 0.1 else f"{cost:.2g}"


def time_text(step_s: float, tokens_per_s: float, steps: int | None, wait: dict[str, Any] | None, cost: float | None,
              price_per_hour: float | None, currency: str | None, source: str, upper_bound: bool = False,
              tokens_note: str = "", brief: bool = False) -> str:
    """How finetuner says a run's predicted time (the plan, ``estimate``, the web UI): tokens/s (``tokens_note``
    after it) and time per optimizer step, the ``steps``' time, the whole run by part
    (:func:`finetuner.planning.wait.parts_text` of a :meth:`~finetuner.planning.wait.Wait.to_dict`), its cost,
    and where the speed figures came from. ``upper_bound`` (GRPO): the step with its completions at their
    longest (the prompts the data's where it can be read). ``brief`` (the web UI's line under the editor):
    the whole run's time without its parts, the cost and the source."""
    if upper_bound:
        bits = [f"at most {format_duration(step_s)} per optimizer step" +
                ("" if brief else " (completions at their longest; the rollout's generation included)")]
        if steps:
            bits.append(f"{steps:,} optimizer steps: at most ~{format_duration(step_s * steps)}")
    else:
        bits = [f"~{tokens_per_s:,.0f} tokens/s{tokens_note}", f"{format_duration(step_s)} per optimizer step"]
        if steps:
            bits.append(f"{steps:,} optimizer steps: ~{format_duration(step_s * steps)}")
    if brief:
        whole = (f"; the whole run {'at most ' if upper_bound else ''}~{format_duration(wait['wall_s'])} "
                 "(load, replay, evaluations, checkpoints, probe and samples included)" if wait is not None else "")
        return ", ".join(bits) + whole
    if wait is not None:
        bits.append(parts_text(wait, format_duration, upper_bound))
    if cost is not None:
        bits.append(cost_text(cost, price_per_hour, currency, format_cost))
    return ", ".join(bits) + f" (speed: {source})"


def estimate_text(t: dict[str, Any], tokens_note: str = "", brief: bool = False) -> str:
    """:func:`time_text` of an :func:`finetuner.planning.predict.estimate_time` result (``finetuner estimate``, the web UI)."""
    text = time_text(t["step_s"], t["tokens_per_s"], t["optimizer_steps"], t["wait"], t["cost"], t["price_per_hour"],
                     t["currency"], t["source"], bool(t.get("upper_bound")), tokens_note, brief)
    # the UI's brief line leaves it to the plan's notes, which say it too
    return f"{text} Note: {t['load_note']}." if t.get("load_note") and not brief else text

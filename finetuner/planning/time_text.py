"""How a plan says a cost and a run's time: :func:`format_cost`, :func:`cost_text`, :func:`parts_text`, and
:func:`time_text`, the one line of a run's predicted time that the plan, ``finetuner estimate`` and the web UI print
(each duration in it written by :func:`finetuner.units.duration_text`)."""

from __future__ import annotations

from typing import Any

from finetuner.units import duration_text


def format_cost(cost: float) -> str:
    """``12.50``, or two significant digits below 0.1 (``0.0029``): how a plan says a cost."""
    return f"{cost:,.2f}" if cost >= 0.1 else f"{cost:.2g}"


def cost_text(cost: float, price_per_hour: float, currency: str | None) -> str:
    """``~0.01 USD at 0.7 USD an hour``; without a currency ``~0.01 at 0.7 an hour`` (in the price's units)."""
    unit = f" {currency}" if currency else ""
    return f"~{format_cost(cost)}{unit} at {price_per_hour:g}{unit} an hour"


def parts_text(wait: dict[str, Any], upper_bound: bool = False) -> str:
    """``the whole run ~2 min 10 s: the steps, load 8.1 s, replay: the base answers 7 prompts 20 s, 4 evaluations
    of 20 rows 0.4 s, 4 checkpoints 0.1 s, general probe: 16 questions answered twice 30 s, 4 sample answers 1.2 s``
    of a :meth:`~finetuner.planning.wait.Wait.to_dict` (the steps' own time is said before it), in the order a run
    spends them: the download first when there is one, then what the figures assume."""
    c, p = wait["counts"], wait["parts_s"]
    bits = ["the steps"]
    if p["download"]:
        bits.append(f"download {duration_text(p['download'])}")
    bits.append(f"load {duration_text(p['load'])}")
    if c.get("replay_answers"):
        bits.append(f"replay: the base answers {c['replay_answers']} prompts {duration_text(p['replay'])}")
    if c["evaluations"]:
        bits.append(f"{c['evaluations']} evaluation{'s' if c['evaluations'] != 1 else ''} of {c['held_out_rows']:,} rows "
                    f"{duration_text(p['evaluations'])}")
    bits.append(f"{c['checkpoints']} checkpoint{'s' if c['checkpoints'] != 1 else ''} {duration_text(p['checkpoints'])}")
    if c.get("probe_answers"):
        bits.append(f"general probe: {c['probe_answers'] // 2} questions answered twice {duration_text(p['probe'])}")
    if c.get("tool_calls_answers"):
        n = c["tool_calls_answers"] // 2
        bits.append(f"held-out tool calls: {n} request{'s' if n != 1 else ''} asked twice "
                    f"{duration_text(p.get('tool_calls', 0.0))}")
    if c["sample_answers"]:
        bits.append(f"{c['sample_answers']} sample answers {duration_text(p['samples'])}")
    text = f"the whole run {'at most ' if upper_bound else ''}~{duration_text(wait['wall_s'])}: {', '.join(bits)}"
    return text + (f" (assumes {'; '.join(wait['assumptions'])})" if wait["assumptions"] else "")


def time_text(step_s: float, tokens_per_s: float, steps: int | None, wait: dict[str, Any] | None, cost: float | None,
              price_per_hour: float | None, currency: str | None, source: str, upper_bound: bool = False,
              tokens_note: str = "", brief: bool = False) -> str:
    """How finetuner says a run's predicted time (the plan, ``estimate``, the web UI): tokens/s (``tokens_note``
    after it) and time per optimizer step, the ``steps``' time, the whole run by part
    (:func:`parts_text` of a :meth:`~finetuner.planning.wait.Wait.to_dict`), its cost,
    and where the speed figures came from. ``upper_bound`` (GRPO): the step with its completions at their
    longest (the prompts the data's where it can be read). ``brief`` (the web UI's line under the editor):
    the whole run's time without its parts, the cost and the source."""
    if upper_bound:
        bits = [f"at most {duration_text(step_s)} per optimizer step" +
                ("" if brief else " (completions at their longest; the rollout's generation included)")]
        if steps:
            bits.append(f"{steps:,} optimizer steps: at most ~{duration_text(step_s * steps)}")
    else:
        bits = [f"~{tokens_per_s:,.0f} tokens/s{tokens_note}", f"{duration_text(step_s)} per optimizer step"]
        if steps:
            bits.append(f"{steps:,} optimizer steps: ~{duration_text(step_s * steps)}")
    if brief:
        whole = (f"; the whole run {'at most ' if upper_bound else ''}~{duration_text(wait['wall_s'])} "
                 "(load, replay, evaluations, checkpoints, probe and samples included)" if wait is not None else "")
        return ", ".join(bits) + whole
    if wait is not None:
        bits.append(parts_text(wait, upper_bound))
    if cost is not None:
        bits.append(cost_text(cost, price_per_hour, currency))
    return ", ".join(bits) + f" (speed: {source})"


def estimate_text(t: dict[str, Any], tokens_note: str = "", brief: bool = False) -> str:
    """:func:`time_text` of an :func:`finetuner.planning.predict.estimate_time` result (``finetuner estimate``, the web UI)."""
    text = time_text(t["step_s"], t["tokens_per_s"], t["optimizer_steps"], t["wait"], t["cost"], t["price_per_hour"],
                     t["currency"], t["source"], bool(t.get("upper_bound")), tokens_note, brief)
    # the UI's brief line leaves it to the plan's notes, which say it too
    return f"{text} Note: {t['load_note']}." if t.get("load_note") and not brief else text

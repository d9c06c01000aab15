"""Turns training events into a rich progress bar (or plain lines when not on a terminal)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import finetuner.phases as phases
from finetuner.data.replay import ROUTINE_REASONS
from finetuner.infer.probe import kept_line
from finetuner.infer.tool_eval import calls_line
from finetuner.planning.data_auto import resolved_line
from finetuner.text import cut_words
from finetuner.threads import threads_line
from finetuner.units import clock_text, duration_text, gib_text


def console() -> Console:
    """The console the CLI prints a run on. On a terminal, rich's (lines fit the window); elsewhere (a log
    file, a pipe, CI) lines are never wrapped: rich would cut them at 80 columns, splitting a step line
    in two, and a log is read with ``grep`` and ``tail``, not in a window of a known width. It writes to the
    ``sys.stdout`` of its creation (see :func:`command_phases`)."""
    con = Console(file=sys.stdout)
    if not con.is_terminal:
        con.soft_wrap = True
    return con


def _num(v: Any, spec: str) -> str:
    """A number of an event formatted with ``spec``; NaN (null in events.jsonl) and infinities
    (written as strings) as ``nan``/``inf``: a diverging run's line must not crash the printer."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return format(v, spec)
    return "nan" if v is None else str(v)


def _gib(n: int | None) -> str:
    return "-" if n is None else gib_text(n)


def _rewards(ev: dict[str, Any], prefix: str = "", sep: str = "  ") -> str:
    """A preference run's implicit rewards in a step (``prefix`` "") or eval ("eval_") record, e.g.
    ``"  reward accuracy 85%, margin 4.323"``; "" for an SFT record (no reward fields)."""
    if ev.get(f"{prefix}reward") is not None:  # GRPO: the mean reward of the completions
        spread = f" ± {ev['reward_std']:.3f}" if not prefix and ev.get("reward_std") is not None else ""
        return f"{sep} reward {ev[f'{prefix}reward']:.3f}{spread}"
    acc = ev.get(f"{prefix}reward_accuracy")
    if acc is None:
        return ""
    return f"{sep} reward accuracy {acc:.0%}, margin {ev[f'{prefix}reward_margin']:.3f}"


def _memory_line(m: dict[str, Any]) -> str:
    mem = m.get("memory") or {}
    line = f"{_gib(m.get('mem_peak'))} ({mem.get('measured', 'measured')})"
    if mem.get("error_pct") is not None:
        line += f"; predicted {_gib(mem['predicted_peak_bytes'])} ({mem['error_pct']:+.1f}%)"
    elif mem.get("predicted_peak_bytes") is not None:  # CPU: the RSS also holds Python, torch and the data
        line += f"; the memory model predicts {_gib(mem['predicted_peak_bytes'])} of training memory"
    return line


def _eta(steps_left: int, predicted: dict[str, Any] | None) -> str:
    """The bar's ETA before the first step: the plan's, or ``-`` without one."""
    return f"{clock_text(predicted['step_s'] * steps_left)} (planned)" if predicted else "-"


def _time_line(t: dict[str, Any]) -> str:
    """``metrics.json``'s ``time``, measured beside predicted, each as :func:`~finetuner.units.duration_text` says
    it: ``steps 24 s (predicted ~25 s), evaluations 0.3 s (predicted ~0.2 s), total 1 min 40 s (predicted ~1 min 38
    s)``; the measured alone when there is no prediction."""
    pred, meas = t.get("predicted") or {}, t["measured"]
    bits = []
    for key in ("load", "replay", "steps", "evaluations", "checkpoints", "probe", "tool_calls", "samples", "total"):
        if key not in meas or (key in ("replay", "evaluations", "probe", "tool_calls", "samples") and not meas[key]
                               and not pred.get(key)):
            continue
        shown = f"{key.replace('_', ' ')} {duration_text(meas[key])}"
        if pred.get(key) is not None:
            p = pred[key] + (pred.get("download", 0.0) if key == "load" else 0.0)
            shown += f" (predicted ~{duration_text(p)})"
        bits.append(shown)
    return ", ".join(bits)


def _train_info(loss: str, tps: str) -> str:
    return f"loss {loss}  {tps} tok/s"


def _phase_info(rec: dict[str, Any]) -> str:
    """A phase bar's words after its count: the unit, and the tokens its generation made (``answers (1,204 tokens)``)."""
    return f"{rec.get('unit') or ''}{phases.tokens_text(rec)}".strip()


def phase_progress(console: Console) -> Progress:
    """The bars of a run or a command: the training steps' (info: loss and tokens/s) and each phase's
    (:mod:`finetuner.phases`), one below the other; the ETA is finetuner's own (the steps':
    :mod:`finetuner.training.step_rate`; a phase's: :meth:`finetuner.phases.Phase.eta`), not rich's guess."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA {task.fields[eta]}"),
        console=console,
    )


class PhasePrinter:
    """Shows :mod:`finetuner.phases` records: on a terminal a bar each in ``progress`` while the phase runs; off one
    (a log, a pipe) a line once a phase has run ``QUIET_S`` seconds, then at most every ``EVERY_S`` (a phase's heartbeat
    makes one at least that often), and its end line if it said anything: short phases stay silent, a long one
    never goes a minute without a line."""

    QUIET_S = 3.0
    EVERY_S = 10.0

    def __init__(self, console: Console, progress: Progress | None):
        self.console, self.progress = console, progress
        self.tasks: dict[str, Any] = {}
        self.said: dict[str, float] = {}  # a phase's elapsed_s at its last line (off a terminal)

    def __call__(self, rec: dict[str, Any]) -> None:
        name, state = rec["phase"], rec["state"]
        if self.progress is not None:
            if state == "start":
                self.tasks[name] = self.progress.add_task(rec["label"], total=rec.get("total"), info=_phase_info(rec),
                                                          eta=phases.eta_text(rec))
            elif name in self.tasks:
                task = self.tasks[name]
                if state == "end":
                    self.progress.remove_task(task)
                    del self.tasks[name]
                else:
                    self.progress.update(task, completed=rec["done"], total=rec.get("total"), info=_phase_info(rec),
                                         eta=phases.eta_text(rec))
            return
        if state == "start":
            self.said.pop(name, None)
            return
        last = self.said.get(name)
        if state == "end":
            if last is not None:
                self.console.print(phases.line(rec), highlight=False)
            self.said.pop(name, None)
        elif rec["elapsed_s"] >= self.QUIET_S and (last is None or rec["elapsed_s"] - last >= self.EVERY_S):
            self.console.print(phases.line(rec), highlight=False)
            self.said[name] = rec["elapsed_s"]


@contextlib.contextmanager
def command_phases(console: Console | None = None) -> Iterator[PhasePrinter]:
    """The phases a command opens (``merge``, ``export``, ``eval``: :func:`finetuner.phases.phase`) shown while the
    ``with`` block runs: bars on a terminal, lines off one (:class:`PhasePrinter`). On stderr by default, beside the
    command's other progress, so that its result on stdout (``--json``) stays one clean object.

    The console writes to the ``sys.stderr`` this block began with, not to whatever ``sys.stderr`` is when a line
    is printed: a library call that the command hides the output of (``contextlib.redirect_stderr``, as the GGUF
    check does around transformers' loader, whose tqdm bar goes to stderr) would otherwise swallow the heartbeat
    lines said meanwhile, and the phase would look stopped for as long as the call takes."""
    con = console or Console(file=sys.stderr)
    if not con.is_terminal:
        con.soft_wrap = True  # a line each, as the run's lines (see console())
    bars = phase_progress(con) if con.is_terminal else None
    printer = PhasePrinter(con, bars)
    with bars if bars is not None else contextlib.nullcontext(), phases.reporting(printer):
        yield printer


class ProgressPrinter:
    """A training-event callback that shows step, loss, tokens/s and ETA, and the phases between the steps."""

    def __init__(self, console: Console, quiet: bool = False):
        self.console, self.quiet = console, quiet
        self.live = console.is_terminal and not quiet
        self.progress: Progress | None = None
        self.phases = PhasePrinter(console, None) if not quiet else (lambda rec: None)
        self.task = None
        self.predicted: dict[str, Any] | None = None  # the start event's predicted_speed
        self.predicted_bound: dict[str, Any] | None = None  # the same when it is an upper bound (GRPO)

    def __enter__(self) -> ProgressPrinter:
        if self.live:
            self.progress = phase_progress(self.console)
            self.progress.start()
            self.phases = PhasePrinter(self.console, self.progress)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress:
            self.progress.stop()

    def __call__(self, ev: dict[str, Any]) -> None:
        kind = ev["event"]
        if kind == "phase":
            self.phases(ev)
        elif kind == "replay" and not self.quiet and ev.get("reason") in ROUTINE_REASONS:
            self.console.print(ev["message"], highlight=False)  # the others are warnings the run logs itself
        elif kind == "start":
            d = ev.get("data", {})
            where = f"resuming at step {ev['resumed_from_step']}" if ev.get("resumed_from_step") else "new run"
            if not self.quiet:
                self.console.print(
                    f"[bold]{ev['name']}[/] ({where}) on {ev['device']}: {ev['method']}, "
                    f"{ev['trainable_params']:,} of {ev['total_params']:,} parameters trainable, "
                    f"{d.get('train_examples')} training / {d.get('val_examples')} validation examples, "
                    f"{ev['max_steps']} steps → {ev['run_dir']}"
                )
                if ev.get("threads") and str(ev["device"]).startswith("cpu"):  # torch's threads (finetuner.threads)
                    self.console.print(threads_line(ev["threads"]), highlight=False)
                if ev.get("gguf"):
                    self.console.print(f"[yellow]Note:[/] {ev['gguf']['note']}", highlight=False)
                if ev.get("resolved"):
                    self.console.print(resolved_line(ev["resolved"]), highlight=False)
                pred = ev.get("predicted_speed")
                if pred and pred.get("upper_bound"):  # GRPO: its completions at their longest
                    self.console.print(f"predicted: at most {duration_text(pred['step_s'])} a step, ~{duration_text(pred['total_s'])} for "
                                       f"{ev['max_steps']} steps (completions at their longest; speed: "
                                       f"{pred['source']})", highlight=False)
                elif pred:
                    whole = f", ~{duration_text(pred['wall_s'])} the whole run" if pred.get("wall_s") else ""
                    self.console.print(f"predicted: ~{pred['tokens_per_s']:,.0f} tok/s, {duration_text(pred['step_s'])} a step, "
                                       f"~{duration_text(pred['total_s'])} for {ev['max_steps']} steps{whole} (speed: {pred['source']})",
                                       highlight=False)
                if pred and pred.get("load_note"):  # a machine busier than at calibration
                    self.console.print(f"[yellow]Note:[/] {pred['load_note']}.", highlight=False)
                if d.get("skipped"):
                    self.console.print(f"[yellow]Skipped {d['skipped']} bad rows[/] (first: {d['skipped_reasons'][0]})")
            self.predicted = ev.get("predicted_speed")
            if self.predicted and self.predicted.get("upper_bound"):
                self.predicted_bound, self.predicted = self.predicted, None  # its tokens/s is not comparable
            if self.progress:
                tps = f"~{self.predicted['tokens_per_s']:.0f} predicted" if self.predicted else "-"  # until the first step is measured
                self.task = self.progress.add_task("train", total=ev["max_steps"], completed=ev.get("resumed_from_step") or 0,
                                                   info=_train_info("-", tps),
                                                   eta=_eta(ev["max_steps"] - (ev.get("resumed_from_step") or 0), self.predicted))
        elif kind == "step":
            if self.progress and self.task is not None:
                pred = self.predicted
                tps = f"{ev['tokens_per_s']:.0f}" + (f" (predicted ~{pred['tokens_per_s']:.0f})" if pred else "")
                self.progress.update(self.task, completed=ev["step"], info=_train_info(_num(ev['loss'], '.4f'), tps),
                                     eta=phases.eta_text(ev))  # the step's ETA as a phase's is said
            elif not self.quiet:
                self.console.print(
                    f"step {ev['step']}/{ev['max_steps']}  loss {_num(ev['loss'], '.4f')}{_rewards(ev)}  lr {_num(ev['lr'], '.2e')}  "
                    f"{ev['tokens_per_s']:.0f} tok/s  mem {_gib(ev.get('mem_peak'))}  "
                    f"ETA {phases.eta_text(ev)}",  # as the bar says it
                    highlight=False,
                )
        elif kind == "eval" and not self.quiet:
            if ev.get("eval_loss") is None and "eval_reward" in ev:  # GRPO: no validation loss, the held-out reward
                self.console.print(f"eval at step {ev['step']}: held-out{_rewards(ev, 'eval_', '')}", highlight=False)
            elif "eval_reward_accuracy" in ev:  # a preference objective's loss is not a language-model loss: no perplexity
                self.console.print(f"eval at step {ev['step']}: loss {_num(ev['eval_loss'], '.4f')}{_rewards(ev, 'eval_', ',')}", highlight=False)
            else:
                self.console.print(f"eval at step {ev['step']}: loss {_num(ev['eval_loss'], '.4f')}, perplexity {_num(ev['eval_ppl'], '.2f')}", highlight=False)
        elif kind == "checkpoint" and not self.quiet and not self.progress:
            self.console.print(f"checkpoint: {ev['path']}", highlight=False)

    def summary(self, result: Any) -> None:
        c = self.console
        if result.finished:
            c.print(f"[green]Already finished.[/] {result.finished}", highlight=False)
            return
        if result.stopped:
            c.print(f"[yellow]Stopped at step {result.metrics['step']}.[/] Run the same command again to resume from the checkpoint in {result.run_dir}.")
            return
        m = result.metrics
        t = Table(title="Run summary", show_header=False)
        for k, v in (
            ("run folder", str(result.run_dir)),
            ("adapter", str(result.adapter_dir)),
            ("steps", str(m["steps"])),
            ("train loss", f"{m['train_loss_first']:.4f} → {m['train_loss_last']:.4f}" if m["train_loss_first"] is not None else "-"),
            ("eval loss", "-" if m.get("eval_loss") is None else f"{m['eval_loss']:.4f}" if "eval_reward_accuracy" in m
             else f"{m['eval_loss']:.4f} (ppl {m['eval_ppl']:.2f})"),
            *([("held-out rewards", _rewards(m, "eval_", "").strip())] if "eval_reward_accuracy" in m or "eval_reward" in m else []),
            *([("held-out tool calls", calls_line(m["tool_calls"]))] if m.get("tool_calls") else []),
            ("tokens/s", f"{m['tokens_per_s']:.0f}" + (f" (predicted ~{self.predicted['tokens_per_s']:,.0f})"
                                                        if self.predicted else "")),
            ("train time", duration_text(m['train_seconds']) + (f" (its steps predicted at most ~{duration_text(self.predicted_bound['total_s'])})"
                                                             if self.predicted_bound else "")),
            *([("time", _time_line(m["time"]))] if m.get("time") else []),
            ("peak memory", _memory_line(m)),
        ):
            t.add_row(k, v)
        c.print(t)
        if m.get("held_out_note"):  # the held-out loss rose from its best: which adapter the run kept
            c.print(f"[yellow]Note:[/] {m['held_out_note']}", highlight=False)
        system = (m.get("data") or {}).get("system_prompt")
        if system:  # the rows' shared system prompt: chat, the UI and the Modelfile ask with it (finetuner.infer.loading)
            c.print(f"System prompt: every training row carried {cut_words(system, 80)!r}; chat, the UI and the Ollama export "
                    "use it when you give none.", highlight=False)
        shipped = m.get("answers_from") or {}
        if shipped.get("line") and (m.get("samples") or m.get("general_probe") or m.get("tool_calls")):
            c.print(shipped["line"], highlight=False)  # the answers below are the shipped adapter's (keep_best)
        kept = kept_line(m.get("general_probe"))
        if kept:  # what the fine-tune forgot of what the base knew
            c.print(kept, highlight=False)
        self._samples(c, m)

    @staticmethod
    def _samples(c, m: dict) -> None:
        """The sample answers, base against fine-tuned (each after its reasoning, marked)."""
        from finetuner.infer.generate import sample_cell

        for s in m.get("samples", []):
            st = Table(title=f"Prompt: {s['prompt']}", show_lines=True)
            st.add_column("base model")
            st.add_column("fine-tuned")
            st.add_row(sample_cell(s, "base"), sample_cell(s, "fine_tuned"))
            c.print(st)

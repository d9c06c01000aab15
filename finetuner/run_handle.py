"""A run folder as a Python object, for notebooks: what it holds, and what to do with it next.

    import finetuner
    run = finetuner.load_run("runs/demo_cpu")
    run                                   # a summary (an HTML table in Jupyter)
    run.generate("What should I pack for a day hike?")
    run.evaluate()                        # base vs fine-tuned held-out loss, into metrics.json
    run.merge("exports/demo")             # a plain transformers model folder

Part of the Python API (above the layers it calls: runs, infer and export), so a run's ``merge()`` looks down.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from finetuner.infer.probe import kept_line
from finetuner.infer.tool_eval import calls_line
from finetuner.errors import UserError
from finetuner.units import gib_text


def _gib(n: Any) -> str:
    return gib_text(n) if isinstance(n, (int, float)) else "–"


def _num(x: Any, fmt: str = ".4f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else "–"


class Run:
    """A run folder made by ``finetuner run`` / :func:`finetuner.train`.

    Attributes are read from the folder when asked, so a ``Run`` of a run in progress stays
    current. Loading a model (``generate``) happens once, on first use.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().resolve()
        if not (self.path / "recipe.yaml").is_file():
            hint = "Give the folder `finetuner run` wrote, e.g. runs/<name>."
            if (self.path.parent / "recipe.yaml").is_file():
                hint = f"Did you mean its run folder {self.path.parent}?"
            raise UserError(f"{self.path} is not a run folder (it has no recipe.yaml).", hint=hint)
        self._chat = None

    # ------------------------------------------------------------------ what is in the folder
    @property
    def recipe(self):
        """The resolved :class:`~finetuner.config.recipe.Recipe` the run used."""
        from finetuner.infer.loading import read_recipe

        return read_recipe(self.path / "recipe.yaml")

    @property
    def metrics(self) -> dict[str, Any]:
        """``metrics.json`` (empty until the run has finished)."""
        p = self.path / "metrics.json"
        try:
            return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
        except (OSError, json.JSONDecodeError):
            return {}

    @property
    def adapter_dir(self) -> Path:
        return self.path / "adapter"

    def events(self) -> list[dict[str, Any]]:
        """All events written so far (``events.jsonl``)."""
        from finetuner.runs.events import read_events

        return read_events(self.path / "events.jsonl")

    def follow(self, poll: float = 0.5, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Events as they are written, until the run ends (see :func:`finetuner.follow`)."""
        from finetuner.runs.events import follow

        return follow(self.path, poll=poll, timeout=timeout)

    @property
    def status(self) -> str:
        """The run's state from its events and its folder's lock: ``new``, ``starting``, ``running``,
        ``finishing``, ``stopped``, ``done``, ``error`` or ``interrupted`` (see
        :data:`finetuner.runs.schema.RUN_STATES`)."""
        from finetuner.runs.events import run_folder_busy
        from finetuner.runs.schema import run_state

        return run_state(self.events(), busy=run_folder_busy(self.path))

    def summary(self) -> dict[str, Any]:
        """The facts shown by ``repr``: model, method, steps, losses, memory, evaluation."""
        r = self.recipe
        m = self.metrics
        steps = [e for e in self.events() if e.get("event") == "step"]
        method = r.method if r.method != "lora" else f"lora r={r.lora.r}"
        if r.quantization is not None and r.method == "qlora":
            method = f"qlora {r.quantization.bits}-bit r={r.lora.r}"
        mem = m.get("memory") or {}
        ev = m.get("evaluation") or {}
        return {
            "run": str(self.path),
            "status": self.status,
            "model": r.model.name,
            "method": method,
            "steps": m.get("steps", steps[-1]["step"] if steps else 0),
            "max_steps": steps[-1].get("max_steps") if steps else r.training.max_steps,
            "train_loss_first": m.get("train_loss_first", steps[0]["loss"] if steps else None),
            "train_loss_last": m.get("train_loss_last", steps[-1]["loss"] if steps else None),
            "eval_loss": m.get("eval_loss"),
            "eval_ppl": m.get("eval_ppl"),
            "predicted_peak_bytes": mem.get("predicted_peak_bytes"),
            "measured_peak_bytes": mem.get("measured_peak_bytes"),
            "measured": mem.get("measured"),
            "eval_base_loss": (ev.get("base") or {}).get("loss"),
            "eval_fine_tuned_loss": (ev.get("fine_tuned") or {}).get("loss"),
            "held_out_note": m.get("held_out_note"),
            "general_probe": kept_line(m.get("general_probe")),
            "tool_calls": calls_line(m.get("tool_calls")),
            "adapter": str(self.adapter_dir) if self.adapter_dir.is_dir() else None,
        }

    def _rows(self) -> list[tuple[str, str]]:
        s = self.summary()
        rows = [
            ("status", s["status"]),
            ("model", s["model"]),
            ("method", s["method"]),
            ("steps", f"{s['steps']}" + (f" / {s['max_steps']}" if s["max_steps"] else "")),
            ("train loss", f"{_num(s['train_loss_first'])} → {_num(s['train_loss_last'])}"),
            ("eval loss", f"{_num(s['eval_loss'])} (ppl {_num(s['eval_ppl'], '.2f')})" if s["eval_loss"] is not None else "–"),
        ]
        if s["held_out_note"]:  # the held-out loss rose from its best: which adapter the run kept
            rows.append(("held-out", s["held_out_note"]))
        if s["general_probe"]:  # what the fine-tune forgot of what the base knew (eval --general, or the run's end)
            rows.append(("kept", s["general_probe"]))
        if s["tool_calls"]:  # the held-out tool calls the base and the fine-tune made (the run's end)
            rows.append(("held-out tool calls", s["tool_calls"]))
        if s["eval_base_loss"] is not None:
            rows.append(("held-out loss", f"base {_num(s['eval_base_loss'])} → fine-tuned {_num(s['eval_fine_tuned_loss'])}"))
        if s["measured_peak_bytes"] is not None:
            rows.append(("memory", f"predicted {_gib(s['predicted_peak_bytes'])}, measured {_gib(s['measured_peak_bytes'])} ({s['measured']})"))
        rows.append(("adapter", s["adapter"] or "– (not finished)"))
        return rows

    def __repr__(self) -> str:
        body = "\n".join(f"  {k:<14}{v}" for k, v in self._rows())
        return f"Run({str(self.path)!r})\n{body}"

    def _repr_html_(self) -> str:
        cells = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>{html.escape(v)}</td></tr>"
                        for k, v in self._rows())
        return f"<div><b>Run</b> <code>{html.escape(str(self.path))}</code><table>{cells}</table></div>"

    # ------------------------------------------------------------------ using it
    def chat_model(self, device: str = "auto", trust_remote_code: bool = False, allow_pickle: bool = False):
        """The run's :class:`~finetuner.infer.chat.ChatModel` (loaded once, then reused). A run whose
        recipe sets ``model.trust_remote_code`` / ``model.allow_pickle`` needs the matching opt-in."""
        if self._chat is None:
            from finetuner.infer.chat import load_chat_model

            self._chat = load_chat_model(self.path, device=device, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
        return self._chat

    def generate(self, prompt: str, adapter: bool = True, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 0.9, seed: int | None = None) -> str:
        """The fine-tuned model's answer to ``prompt`` (``adapter=False``: the base model's). Greedy by default.

        Example::

            >>> run.generate("Tell me about the puffin.")   # doctest: +SKIP
        """
        return self.chat_model().reply([{"role": "user", "content": prompt}], adapter=adapter, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, seed=seed)

    def evaluate(self, data: str | Path | None = None, exact_match: int = 0, **kwargs: Any):
        """Held-out loss and perplexity, base vs fine-tuned (see :func:`finetuner.evaluate_run`)."""
        from finetuner.infer.evaluate import evaluate_run

        return evaluate_run(self.path, data=data, exact_match=exact_match, **kwargs)

    def merge(self, output_dir: str | Path, **kwargs: Any):
        """Merge the adapter into the base and write a model folder (see :func:`finetuner.merge_adapter`)."""
        from finetuner.export.merge import merge_adapter

        return merge_adapter(self.path, output_dir, **kwargs)


def load_run(path: str | Path) -> Run:
    """Open a run folder (``runs/<name>``, or the ``run_dir`` of a :class:`~finetuner.TrainResult`).

    Example::

        >>> run = finetuner.load_run("runs/demo_cpu")   # doctest: +SKIP
        >>> run.summary()["train_loss_last"]             # doctest: +SKIP
    """
    return Run(path)

"""A training progress bar for notebooks and scripts: a widget in Jupyter, a text bar elsewhere.

    import finetuner
    result = finetuner.train("recipes/demo_cpu.yaml", callbacks=[finetuner.ProgressBar()])
"""

from __future__ import annotations

from typing import Any

import finetuner.phases as phases
from finetuner.runs.schema import TERMINAL_EVENTS


class ProgressBar:
    """A :func:`finetuner.train` callback that draws the steps with ``tqdm.auto``.

    Shows the step count, loss, learning rate and the last eval loss; a resumed run starts
    at the step it resumes from. In Jupyter it is a widget when ``ipywidgets`` is installed
    (the ``notebook`` extra), text otherwise.
    """

    def __init__(self, desc: str | None = None, leave: bool = True, **tqdm_kwargs: Any):
        self.desc, self.leave, self.kwargs = desc, leave, tqdm_kwargs
        self.bar = None
        self.postfix: dict[str, str] = {}
        self.phase: str | None = None  # the phase running between the steps, as one line (finetuner.phases.line)

    def _show(self) -> None:
        self.bar.set_postfix({**self.postfix, **({"now": self.phase} if self.phase else {})}, refresh=False)
        self.bar.refresh()

    def __call__(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "phase":  # loading, an evaluation, the samples ...: said beside the bar while it runs
            self.phase = None if ev["state"] == "end" else phases.line(ev)
            if self.bar is not None:
                self._show()
        elif kind == "start":
            self._open(ev)
        elif self.bar is None:
            return
        elif kind == "step":
            self.bar.n = int(ev["step"])
            self.postfix.update(loss=f"{ev['loss']:.4f}", lr=f"{ev['lr']:.2e}")
            self._show()
        elif kind == "eval":
            if ev.get("eval_loss") is not None:
                self.postfix["eval_loss"] = f"{ev['eval_loss']:.4f}"
            if ev.get("eval_reward") is not None:  # GRPO's held-out reward
                self.postfix["eval_reward"] = f"{ev['eval_reward']:.3f}"
            self._show()
        elif kind in TERMINAL_EVENTS:
            if kind != "done":
                self.bar.set_description(f"{self.bar.desc} ({kind})")
            self.close()

    def _open(self, ev: dict[str, Any]) -> None:
        from tqdm.auto import tqdm

        self.close()
        self.bar = tqdm(total=ev.get("max_steps"), initial=ev.get("resumed_from_step") or 0, unit="step",
                        desc=self.desc or ev.get("name") or "training", leave=self.leave, **self.kwargs)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

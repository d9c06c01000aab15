"""Benchmarks through lm-evaluation-harness: the run's base model and its fine-tune scored on the harness's tasks.

``finetuner eval RUN --tasks hellaswag,arc_easy`` (or ``finetuner.evaluate_tasks``) loads the run's model once,
with its adapter, hands it to the harness (``lm_eval.models.huggingface.HFLM`` takes a loaded model) and runs
``lm_eval.simple_evaluate`` twice: with the adapter switched off (the base) and on (the fine-tune). Every metric
the task reports comes back for both, with the change. Tasks of your own (local data, a task YAML) are found with
``--include-path DIR``, as ``lm_eval --include_path`` finds them. The harness is optional: ``pip install lm_eval``.

The harness downloads a task's data from the Hugging Face hub the first time the task runs (unless the task's YAML
points at local files); nothing else leaves the machine.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from finetuner.errors import UserError, first_line
from finetuner.units import duration_text

#: the metric keys of the harness's results that are not scores (their names, counts, the groups' bookkeeping)
_NOT_SCORES = {"name", "alias", "sample_len", "sample_count", " ", "samples"}


@dataclass
class TaskScores:
    """One task's metrics (``acc``, ``acc_norm``, ``exact_match`` ...; the harness's filter after a comma, as it
    prints them) for the base and the fine-tune."""

    task: str
    base: dict[str, float]
    fine_tuned: dict[str, float]
    samples: int

    def change(self, metric: str) -> float:
        return self.fine_tuned[metric] - self.base[metric]


@dataclass
class HarnessResult:
    source: str
    tasks: list[TaskScores]
    limit: int | float | None = None
    num_fewshot: int | None = None
    seconds: float = 0.0
    harness_version: str = ""
    include_path: str | None = None
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, str, float, float]]:
        """(task, metric, base, fine-tuned) for every score."""
        return [(t.task, m, t.base[m], t.fine_tuned[m]) for t in self.tasks for m in t.base if m in t.fine_tuned]

    def describe(self) -> str:
        worse = [(task, m) for task, m, b, f in self.rows() if f < b]
        return (f"lm-evaluation-harness {self.harness_version}: {len(self.tasks)} task(s) on the base and the fine-tune "
                f"of {self.source} ({duration_text(self.seconds)}); {len(worse)} of {len(self.rows())} scores fell")

    def table(self) -> str:
        lines = [f"{'task':<24} {'metric':<16} {'base':>8} {'fine-tuned':>11} {'change':>8}"]
        for task, m, b, f in self.rows():
            lines.append(f"{task:<24} {m:<16} {b:>8.4f} {f:>11.4f} {f - b:>+8.4f}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _harness():
    try:
        import lm_eval
    except ImportError:
        raise UserError("--tasks runs lm-evaluation-harness, which is not installed.",
                        hint="pip install lm_eval (then `lm_eval ls tasks` lists its tasks).") from None
    return lm_eval


def scores_of(results: dict[str, Any], task: str) -> dict[str, float]:
    """The numeric metrics of one task in ``simple_evaluate``'s ``results`` (stderr left out)."""
    out = {}
    for key, value in results.get(task, {}).items():
        if key in _NOT_SCORES or "_stderr" in key or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key.removesuffix(",none")] = float(value)
    return out


def evaluate_tasks(run: str | Path, tasks: list[str] | str, include_path: str | Path | None = None,
                   limit: int | float | None = None, num_fewshot: int | None = None, batch_size: int = 8,
                   device: str = "auto", base_model: str | None = None, trust_remote_code: bool = False,
                   allow_pickle: bool = False, apply_chat_template: bool = False,
                   replace_builtin_tasks: bool = False) -> HarnessResult:
    """Score the run's base model and its fine-tune on lm-evaluation-harness ``tasks`` (names or groups, a list
    or ``"a,b"``; ``include_path``: a folder of your own task YAMLs; ``limit``: the first N documents of each task,
    or a fraction; ``apply_chat_template``: the prompts through the run's chat template, as the harness's flag).

    ``include_path`` is code where its YAMLs say so (``!function``, a metric loaded by Hugging Face evaluate:
    :mod:`finetuner.infer.task_folder`): refused before the harness reads the folder unless ``trust_remote_code``,
    which also lets its templates render outside jinja2's sandbox. A folder task named like one of the
    harness's own tasks, groups or tags is refused unless ``replace_builtin_tasks``."""
    lm_eval = _harness()
    from finetuner.infer.task_folder import checked_copy
    from finetuner.infer.template_bounds import TemplateBound

    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not names:
        raise UserError("--tasks: no task named.", hint="e.g. --tasks arc_easy,hellaswag (`lm_eval ls tasks` lists them).")
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path}: not a folder.", hint="A folder of task YAML files.")
    began = time.perf_counter()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices; errors still come through
    untrusted = include_path is not None and not trust_remote_code
    read_path, templates = include_path, {}
    if untrusted:  # before the harness reads the folder: nothing of it imported; the harness reads the checked copy
        read_path, templates = checked_copy(include_path)
    try:
        return _evaluate(lm_eval, run, names, include_path, read_path, templates, untrusted, began, limit=limit,
                         num_fewshot=num_fewshot, batch_size=batch_size, device=device, base_model=base_model,
                         trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                         apply_chat_template=apply_chat_template, replace_builtin_tasks=replace_builtin_tasks)
    except TemplateBound as e:  # a template of the folder passed a bound on memory or time (template_bounds)
        where = templates.get(e.source or "") or f"--tasks {','.join(names)}: a template"
        raise UserError(f"{where}: {e.what} (finetuner's bounds on a template's memory and time: docs/safety.md); "
                        "simplify the template.") from None
    finally:
        if read_path != include_path:
            import shutil

            shutil.rmtree(Path(read_path).parent, ignore_errors=True)


def _evaluate(lm_eval, run, names, include_path, read_path, templates, untrusted, began, *, limit, num_fewshot,
              batch_size, device, base_model, trust_remote_code, allow_pickle, apply_chat_template,
              replace_builtin_tasks) -> HarnessResult:
    from jinja2.exceptions import SecurityError
    from lm_eval.models.huggingface import HFLM

    from finetuner.infer.chat import load_chat_model
    from finetuner.infer.task_folder import sandboxed_templates, task_manager

    try:
        manager = task_manager(read_path, replace_builtin_tasks)
    except UserError as e:  # named in the folder the user gave, not in its private copy
        raise UserError(e.message.replace(str(Path(read_path)), str(include_path)), hint=e.plain_hint) from None
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise UserError(f"--tasks: lm-evaluation-harness knows no task {', '.join(unknown)}.",
                        hint="`lm_eval ls tasks` lists them; a task of your own needs --include-path FOLDER.")
    chat = load_chat_model(run, device=device, base_model=base_model, trust_remote_code=trust_remote_code,
                           allow_pickle=allow_pickle)
    if not chat.has_adapter:
        raise UserError(f"{run}: no adapter to compare with its base model.",
                        hint="Give a run folder or an adapter folder (a merged model has nothing to switch off).")
    lm = HFLM(pretrained=chat.model, tokenizer=chat.tokenizer, batch_size=batch_size)
    runs = {}
    for label, on in (("base", False), ("fine_tuned", True)):
        with chat.adapter(on), sandboxed_templates() if untrusted else nullcontext():
            try:
                runs[label] = lm_eval.simple_evaluate(
                    model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                    bootstrap_iters=0, log_samples=False, apply_chat_template=apply_chat_template)
            except (FileNotFoundError, ConnectionError) as e:  # a task's data: a local file gone, or the hub offline
                raise UserError(f"--tasks {','.join(names)}: could not load the task's data ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:200]}).",
                                hint="The harness fetches a task's data from the Hugging Face hub unless its YAML "
                                     "points at local files (dataset_path: json, data_files).") from None
            except SecurityError as e:  # a template of the folder reached for Python objects (sandboxed_templates)
                raise UserError(f"--tasks {','.join(names)}: a template in {include_path} reached for Python's "
                                f"internals ({first_line(str(e))}); add --trust-remote-code if you trust the folder "
                                "(Python: trust_remote_code=True).") from None
    base, tuned = runs["base"], runs["fine_tuned"]
    scored = []
    for task in sorted(base["results"]):
        samples = (base.get("n-samples", {}).get(task) or {}).get("effective", 0)
        scored.append(TaskScores(task, scores_of(base["results"], task), scores_of(tuned["results"], task), samples))
    return HarnessResult(source=str(run), tasks=scored, limit=limit, num_fewshot=num_fewshot,
                         seconds=round(time.perf_counter() - began, 2), harness_version=lm_eval.__version__,
                         include_path=str(include_path) if include_path else None)

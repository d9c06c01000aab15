"""finetuner: parameter-efficient fine-tuning that fits your GPU.

The Python API (what the CLI and the web UI call)::

    import finetuner
    recipe = finetuner.Recipe.from_yaml("recipes/demo_cpu.yaml")
    result = finetuner.train(recipe, callbacks=[print])
    result.run_dir, result.metrics

Attributes are imported lazily so ``import finetuner`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetuner.version import __version__  # noqa: E402,F401

from finetuner import quiet as _quiet  # noqa: E402 - stdlib only: `import finetuner` stays cheap

_quiet.drop_bnb_kernels_notice()  # before anything imports bitsandbytes (peft does, on every LoRA run)

_LAZY = {
    "Recipe": "finetuner.config.recipe",
    "UserError": "finetuner.errors",
    "train": "finetuner.training.run",
    "TrainResult": "finetuner.training.result",
    "read_events": "finetuner.runs.events",
    "plan": "finetuner.planning.planner",
    "Plan": "finetuner.planning.plan_result",
    "estimate": "finetuner.planning.predict:estimate_recipe",
    "estimate_time": "finetuner.planning.predict:estimate_time",
    "compare_cards": "finetuner.planning.planner:compare_cards",
    "shard_estimate": "finetuner.memory.sharding",
    "best_strategy": "finetuner.memory.sharding",
    "follow": "finetuner.runs.events",
    "ProgressBar": "finetuner.runs.progress_bar",
    "load_run": "finetuner.run_handle",
    "Run": "finetuner.run_handle",
    "merge_adapter": "finetuner.export.merge",
    "MergeResult": "finetuner.export.merge",
    "export_model": "finetuner.export.gguf",
    "ExportResult": "finetuner.export.gguf",
    "evaluate_run": "finetuner.infer.evaluate",
    "EvalResult": "finetuner.infer.evaluate",
    "probe_run": "finetuner.infer.probe",
    "evaluate_tasks": "finetuner.infer.harness",
    "load_chat_model": "finetuner.infer.chat",
    "ChatModel": "finetuner.infer.chat",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from finetuner.errors import UserError
    from finetuner.infer.chat import ChatModel, load_chat_model
    from finetuner.infer.evaluate import EvalResult, evaluate_run
    from finetuner.infer.harness import evaluate_tasks
    from finetuner.infer.probe import probe_run
    from finetuner.runs.events import follow, read_events
    from finetuner.planning.predict import estimate_recipe as estimate
    from finetuner.export.gguf import ExportResult, export_model
    from finetuner.export.merge import MergeResult, merge_adapter
    from finetuner.planning.plan_result import Plan
    from finetuner.planning.planner import compare_cards, plan
    from finetuner.planning.predict import estimate_time
    from finetuner.runs.progress_bar import ProgressBar
    from finetuner.config.recipe import Recipe
    from finetuner.run_handle import Run, load_run
    from finetuner.training.result import TrainResult
    from finetuner.training.run import train


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, _, attr = _LAZY[name].partition(":")
        return getattr(importlib.import_module(module), attr or name)
    raise AttributeError(f"module 'finetuner' has no attribute {name!r}")

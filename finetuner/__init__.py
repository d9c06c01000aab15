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

__version__ = "0.1.0"

_LAZY = {
    "Recipe": "finetuner.recipe",
    "UserError": "finetuner.errors",
    "train": "finetuner.trainer",
    "TrainResult": "finetuner.trainer",
    "read_events": "finetuner.events",
    "plan": "finetuner.planner",
    "Plan": "finetuner.planner",
    "estimate": "finetuner.planner:estimate_recipe",
    "shard_estimate": "finetuner.memory_sharding",
    "best_strategy": "finetuner.memory_sharding",
    "follow": "finetuner.events",
    "ProgressBar": "finetuner.progress_bar",
    "load_run": "finetuner.runs",
    "Run": "finetuner.runs",
    "merge_adapter": "finetuner.merge",
    "MergeResult": "finetuner.merge",
    "evaluate_run": "finetuner.evaluate",
    "EvalResult": "finetuner.evaluate",
    "load_chat_model": "finetuner.chat",
    "ChatModel": "finetuner.chat",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from finetuner.errors import UserError
    from finetuner.chat import ChatModel, load_chat_model
    from finetuner.evaluate import EvalResult, evaluate_run
    from finetuner.events import follow, read_events
    from finetuner.planner import estimate_recipe as estimate
    from finetuner.merge import MergeResult, merge_adapter
    from finetuner.planner import Plan, plan
    from finetuner.progress_bar import ProgressBar
    from finetuner.recipe import Recipe
    from finetuner.runs import Run, load_run
    from finetuner.trainer import TrainResult, train


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, _, attr = _LAZY[name].partition(":")
        return getattr(importlib.import_module(module), attr or name)
    raise AttributeError(f"module 'finetuner' has no attribute {name!r}")

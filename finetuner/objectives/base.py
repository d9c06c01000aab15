"""What the trainer asks of an objective (:class:`Objective`), and the registry of objectives.

The trainer (:mod:`finetuner.training.trainer`) runs every objective the same way: it asks the
objective for its data, its collator and the module a micro-batch's loss goes through, calls its
hooks around each optimizer step, and writes the step's and the evaluation's fields it returns into
the events. It never asks which objective it runs. An objective is one module of this package that
subclasses :class:`Objective` and registers its names with :func:`register`.

A step's loss is ``sum of the micro-batches' loss sums / start_step(examples)``: SFT divides by the
step's trained tokens, the preference objectives by its examples. On several processes each rank
sums its own micro-batches; :meth:`Objective.step_totals` and :meth:`Objective.set_step_totals`
carry an objective's own sums (its rewards) through the step's all-reduce.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from finetuner.config.recipe import Recipe
from finetuner.objectives.specs import spec_of

#: objective name → its class (filled by :func:`register`, read by :func:`finetuner.objectives.build_objective`)
REGISTRY: dict[str, type[Objective]] = {}


def register(*names: str):
    """Class decorator: the objective trains the recipes whose ``objective`` is one of ``names``."""

    def add(cls: type[Objective]) -> type[Objective]:
        for name in names:
            REGISTRY[name] = cls
        return cls

    return add


def loss_module(model, loss):
    """The module a step's forward goes through (DDP, a DeepSpeed engine and FSDP wrap it, not the bare
    model, so their hooks see the whole loss computation): ``forward(batch) = loss(model, batch)``,
    ``model`` being its submodule (the wrappers find its parameters there)."""
    import torch

    class StepLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, batch: dict[str, Any]):
            return loss(self.model, batch)

    return StepLoss()


class Objective:
    """An objective's part of a run. The defaults are those of an objective with no extra state:
    no start adapter, no reference, no rollout, nothing summed besides the loss, no extra fields."""

    #: the kind of data it trains on, as :data:`finetuner.data.formats.KIND_WORDS` names it
    data_kind: str = "supervised"
    #: optimizer steps taken on each batch of the schedule (GRPO's ``num_iterations``; 1: one step each)
    steps_per_batch: int = 1

    def __init__(self, recipe: Recipe, run_dir: Path | None = None):
        self.recipe, self.run_dir = recipe, Path(run_dir) if run_dir is not None else None
        self.name = recipe.objective
        #: what the rest of finetuner knows of it (:mod:`finetuner.objectives.specs`)
        self.spec = spec_of(recipe.objective)

    # ---------------------------------------------------------------- set-up
    def adopt(self, recipe: Recipe) -> Recipe:
        """The recipe the run trains with (an objective may take settings from elsewhere, such as
        the run it starts from); by default ``recipe`` itself."""
        return recipe

    def prepare_data(self, tokenizer, processor=None):
        """The run's :class:`~finetuner.data.pipeline.PreparedData` (also called by the checks made
        before the run folder changes, :func:`finetuner.training.inputs.check_inputs`); ``processor``: an
        image-text-to-text model's, for data with pictures (:mod:`finetuner.model.vision`)."""
        raise NotImplementedError

    def on_model(self, model) -> None:
        """The model is loaded with its fresh adapter (nothing trained yet): e.g. load a start adapter."""

    def model_loaded(self, model) -> None:
        """What the trainer calls once the model is loaded with its fresh adapter: :meth:`on_model`, then the
        description's own hook (``ObjectiveSpec.on_model``: a variant's, NEFTune's noise) with the objective's
        recipe section, or that section's defaults when the recipe has none."""
        self.on_model(model)
        hook = self.spec.on_model
        if hook is not None:
            section = getattr(self.recipe, self.spec.section, None) if self.spec.section else None
            if section is None and self.spec.section_schema is not None:
                section = self.spec.section_schema()
            hook(model, section)

    def collator(self, pad_token_id: int):
        """The function that turns a list of examples into a micro-batch."""
        raise NotImplementedError

    def step_loss_module(self, model, chunk_size: int, fused_ce=None):
        """The module a micro-batch's forward goes through, returning its loss sum (DDP, a DeepSpeed
        engine or FSDP wrap this module, so their hooks see the whole loss computation)."""
        raise NotImplementedError

    def prepare(self, trainer) -> None:
        """Before the first step and before a checkpoint is applied (the step-0 model): e.g. score
        the reference."""

    # ---------------------------------------------------------------- a step
    def before_step(self, trainer, step: int, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Before a step's passes (a rollout phase, for an objective that generates): returns the
        examples the step trains on (by default the scheduled ones). A :class:`~finetuner.errors.UserError`
        raised here (a reward function that fails) ends the run after a checkpoint of the last step."""
        return examples

    def start_step(self, examples: list[dict[str, Any]]) -> int:
        """A step (or its retry after an out-of-memory back-off) begins: its sums start afresh;
        returns what the step's loss sum is divided by."""
        raise NotImplementedError

    def uncounted(self):
        """The context of a pass whose examples are not the step's (the zero-weight pass a rank
        with fewer micro-batches runs): what it sums goes nowhere."""
        return contextlib.nullcontext()

    def step_totals(self) -> list[float]:
        """This process's own sums of the step (besides its loss and tokens), summed over ranks."""
        return []

    def set_step_totals(self, values: list[float]) -> None:
        """The step's sums over all ranks (what :meth:`step_totals` gave, summed)."""

    def step_metrics(self) -> dict[str, Any]:
        """The fields of the step just taken that the ``step`` event carries besides the loss."""
        return {}

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, trainer) -> tuple[float | None, dict[str, Any]]:
        """The validation loss (None without validation data) and the ``eval`` event's other fields."""
        raise NotImplementedError

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the objective (JSON-able) so that a resumed run goes on as the
        uninterrupted one would; by default nothing."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state` gave."""

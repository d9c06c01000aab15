"""What the layers around the trainer need to know of an objective, without torch and without the recipe.

The planner, the memory and speed models, sizing, the wait, the CLI, evaluation, the UI and the recipe's
own checks used to ask "is it GRPO? a preference objective?" themselves; each now reads the objective's
:class:`ObjectiveSpec` (:func:`finetuner.objectives.specs.spec_of`). The trainer's side of an objective
(its data, collator, loss and hooks) is :class:`finetuner.objectives.base.Objective`. This module imports
nothing of finetuner, so that the recipe's schema (:mod:`finetuner.config.sections`) can read the names; the
modules beside it (one an objective, or a family) each export their descriptions as ``SPECS = (...)`` and the
package finds them (:mod:`finetuner.objectives.specs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective, as the layers that plan, size, estimate, check and show a run see it."""

    #: the recipe's ``objective``
    name: str
    #: the kind of data it trains on, as :data:`finetuner.data.formats.KIND_WORDS` names it: ``supervised``
    #: (examples), ``pairs`` (a chosen and a rejected response), ``rated`` (one rated response), ``prompts``
    data_kind: str
    #: the objective it is a variant of (NEFTune: SFT with noisy embeddings), None for one of its own: a variant
    #: is not offered for a kind of data (the data errors and the Data tab name the objective it varies)
    variant_of: str | None = None
    #: where it stands in the lists users see (the recipe's help, ``finetuner plan --objective``, the UI): the
    #: descriptions are listed by it, lowest first (sft 10, neftune 20, dpo 30 ... grpo 70); the first is the default
    order: int = 100
    #: the recipe section of its own settings (``preference``, ``grpo``), None without one
    section: str | None = None
    #: that section's schema (a :class:`finetuner.schema.Section`): the recipe gets a field of this name and schema
    #: for each section the descriptions name (:mod:`finetuner.config.recipe`), in the order of the descriptions
    section_schema: type | None = None
    #: the recipe field's description of the section
    section_help: str | None = None
    #: the section is in every recipe, with its defaults (``preference``); otherwise only a recipe of its
    #: objective has it (``grpo``, ``neftune``: None in the others, and left out of what they save)
    section_always: bool = False
    #: what the plan and the CLI call it before the method ("DPO with LoRA"); "" for plain supervised training
    label: str = ""
    #: it may compare the model with a reference model (the ``preference.reference`` setting; the memory and
    #: speed models' reference pass with the adapter off)
    reference_model: bool = False
    #: it samples completions during training (a rollout: generation time, the KV cache, vLLM)
    generates: bool = False
    #: sequences one example puts in a micro-batch (a pair: its chosen and its rejected response; KTO: the
    #: example and its mismatched partner)
    sequences_per_example: int = 1
    #: it scores each response as a whole sequence: no packing, no outlier rows cut to a shorter sequence of
    #: the same kind as SFT's, at most ``max_epochs`` epochs
    whole_sequences: bool = False
    #: what a step takes as its units, in words ("examples"; GRPO: "prompts")
    units: str = "examples"
    #: planned learning rates at hidden size 4096 by method (:func:`finetuner.planning.sizing.learning_rate`),
    #: and where each comes from by method (None: the usual rates of supervised fine-tuning)
    learning_rates: Mapping[str, float] | None = None
    lr_source: Mapping[str, str] | None = None
    #: the most epochs the plan gives a run (None: the planner's own cap)
    max_epochs: int | None = None
    #: examples per optimizer step when the user gives none (None: the planner's default)
    default_effective_batch: int | None = None
    #: the fused linear cross-entropy kernel applies to its loss
    fused_loss: bool = False
    #: the base model's answers may be mixed into its rows (``data.replay``)
    replay: bool = False
    #: what ``finetuner evaluate`` scores it with: ``loss`` (token loss), ``preference`` (reward margins and
    #: accuracy on held-out pairs or rated responses) or ``rewards`` (the reward functions on sampled completions)
    scorer: str = "loss"
    #: ``preference.beta`` when the recipe leaves it out (None: the objective takes no beta)
    default_beta: float | None = None
    #: the objective's settings of its ``section`` (the keys that apply to it), for the recipe's checks and the UI
    settings: tuple[str, ...] = ()
    #: one line for the recipe's help and the UI
    description: str = ""
    #: what it does to the loaded model (with its fresh adapter, before the first step), as a plain function of the
    #: model and the objective's recipe section (the section's defaults when the recipe has none), torch imported
    #: inside it: NEFTune's noise hook. With it, a variant needs no trainer of its own: it trains with its
    #: ``variant_of``'s (:func:`finetuner.objectives.build_objective`), which calls it
    on_model: Callable[[Any, Any], None] | None = None

    @property
    def plain(self) -> bool:
        """Supervised training on examples: packed when that pays, its outlier rows cut, replay possible."""
        return not self.whole_sequences and not self.generates

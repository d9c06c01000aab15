"""GRPO (:mod:`finetuner.objectives.grpo`): reinforcement learning from reward functions on prompts, a group of
completions sampled for each. Its planned learning rates are TRL's GRPOConfig default for full fine-tuning and
Unsloth's GRPO LoRA notebooks' for LoRA / QLoRA; 8 prompts a step when the user gives none."""

from __future__ import annotations

from finetuner.objectives.specs.base import ObjectiveSpec

#: its section's ``loss_type`` values: how the clipped surrogate is averaged (:mod:`finetuner.losses.grpo`)
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")

GRPO = ObjectiveSpec(
    name="grpo", data_kind="prompts", section="grpo", label="GRPO", generates=True, whole_sequences=True,
    units="prompts", learning_rates={"lora": 5e-6, "qlora": 5e-6, "full": 1e-6},
    lr_source={"lora": "Unsloth's GRPO LoRA notebooks", "qlora": "Unsloth's GRPO LoRA notebooks",
                                                               "full": "TRL's GRPOConfig default"}, max_epochs=3, default_effective_batch=8,
    scorer="rewards", description="reinforcement learning from reward functions on prompts",
)

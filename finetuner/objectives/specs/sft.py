"""Supervised fine-tuning (:mod:`finetuner.objectives.sft`): next-token loss on the response tokens."""

from __future__ import annotations

from finetuner.objectives.specs.base import ObjectiveSpec

SFT = ObjectiveSpec(
    name="sft", order=10, data_kind="supervised", fused_loss=True, replay=True, scorer="loss",
    description="supervised fine-tuning on examples",
)

SPECS = (SFT,)

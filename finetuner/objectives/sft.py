"""Supervised fine-tuning: next-token cross-entropy on the response tokens, a step's loss the sum
over the step's trained tokens divided by their number (so it does not depend on how the step is cut
into micro-batches)."""

from __future__ import annotations

from typing import Any

import finetuner.phases as phases
from finetuner.data.pipeline import IGNORE_INDEX, Collator, prepare_data
from finetuner.model.scoring import token_loss_sum
from finetuner.objectives.base import Objective, loss_module, register


def target_tokens(examples: list[dict[str, list[int]]]) -> int:
    """How many tokens of these examples the loss is taken on (labelled, after the first)."""
    return sum(sum(1 for label in x["labels"][1:] if label != IGNORE_INDEX) for x in examples)


def step_loss_module(model, chunk_size: int, fused_ce):
    """The module a step's forward goes through: the token-loss sum of a batch."""
    return loss_module(model, lambda m, batch: token_loss_sum(m, batch, chunk_size, fused_ce)[0])


@register("sft")
class SFTObjective(Objective):
    """Supervised fine-tuning (packed or not, on the data pipeline's examples)."""

    data_kind = "supervised"

    def prepare_data(self, tokenizer, processor=None):
        r = self.recipe
        return prepare_data(r.data, tokenizer, r.training.seed, processor)

    def collator(self, pad_token_id: int) -> Collator:
        return Collator(pad_token_id)

    def step_loss_module(self, model, chunk_size: int, fused_ce=None):
        return step_loss_module(model, chunk_size, fused_ce)

    def start_step(self, examples: list[dict[str, Any]]) -> int:
        return target_tokens(examples)

    def evaluate(self, trainer) -> tuple[float | None, dict[str, Any]]:
        """The mean token loss over the validation examples."""
        import torch

        val = trainer.data.val
        if val is None:
            return None, {}
        trainer.model.eval()
        total, n = 0.0, 0
        mbs = trainer.recipe.training.micro_batch_size
        with torch.no_grad(), trainer.evaluation():
            for i in range(0, len(val), mbs):
                batch = trainer.to_device(trainer.collate([val[j] for j in range(i, min(i + mbs, len(val)))]))
                with trainer.autocast():
                    loss_sum, count = token_loss_sum(trainer.model, batch, trainer.recipe.training.loss_chunk_size)
                total += float(loss_sum)
                n += count
                phases.advance(min(i + mbs, len(val)) - i)  # the trainer's "eval" phase
        trainer.model.train()
        return total / max(n, 1), {}

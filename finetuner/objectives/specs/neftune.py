"""NEFTune (:mod:`finetuner.objectives.neftune`): supervised fine-tuning with noise on the input embeddings while
training (Jain et al. 2023). Everything the planner, the memory and speed models and evaluation read is SFT's (the
noise is one elementwise add on the embeddings' output); only the name, the label and its ``neftune`` section differ."""

from __future__ import annotations

from dataclasses import replace

from finetuner.objectives.specs.sft import SFT

NEFTUNE = replace(SFT, name="neftune", variant_of=SFT.name, section="neftune", label="NEFTune", settings=("alpha",),
                  description="supervised fine-tuning with noisy embeddings (NEFTune)")

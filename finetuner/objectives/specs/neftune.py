"""NEFTune (:mod:`finetuner.objectives.neftune`): supervised fine-tuning with noise on the input embeddings while
training (Jain et al. 2023). Everything the planner, the memory and speed models and evaluation read is SFT's (the
noise is one elementwise add on the embeddings' output); only the name, the label and its ``neftune`` section differ."""

from __future__ import annotations

from dataclasses import replace

from pydantic import Field

from finetuner.objectives.specs.sft import SFT
from finetuner.schema import Section


class NEFTuneSection(Section):
    """Settings of ``objective: neftune``: SFT with uniform noise on the input embeddings while training (Jain et al.
    2023), scaled by ``alpha / sqrt(sequence length × hidden size)`` (:mod:`finetuner.objectives.neftune`)."""

    alpha: float = Field(5.0, gt=0, description="Strength of the noise (transformers' and TRL's neftune_noise_alpha; the "
                         "paper tries 5, 10 and 15).")


NEFTUNE = replace(SFT, name="neftune", order=20, variant_of=SFT.name, section="neftune", section_schema=NEFTuneSection,
                  section_help="Settings of objective neftune (the noise's strength).", label="NEFTune",
                  settings=("alpha",), description="supervised fine-tuning with noisy embeddings (NEFTune)")

SPECS = (NEFTUNE,)

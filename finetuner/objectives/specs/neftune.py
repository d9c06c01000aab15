"""NEFTune: supervised fine-tuning with uniform noise added to the input embeddings while training (Jain et al. 2023,
"NEFTune: Noisy Embeddings Improve Instruction Finetuning"), as transformers' ``neftune_post_forward_hook`` and TRL's
``neftune_noise_alpha`` add it: each value of the embeddings' output gets noise drawn from
``[-1, 1] × alpha / sqrt(L × d)`` (``L`` the batch's sequence length, ``d`` the hidden size), from torch's random
generator (so a resumed run draws what the uninterrupted one would: the checkpoint keeps that generator).

The whole objective is this module. Everything the planner, the memory and speed models and evaluation read is SFT's
(the noise is one elementwise add on the embeddings' output); the name, the label and the ``neftune`` section differ,
and the description's model hook (:func:`add_noise`) puts the noise on. It trains with SFT's trainer (a variant of
it with a model hook needs none of its own: :func:`finetuner.objectives.build_objective`). The noise is added only
while the embedding layer is in training mode: evaluation, the samples and the probes (the model in eval mode) see
the embeddings as they are, and the saved adapter holds no trace of it."""

from __future__ import annotations

from dataclasses import replace

from pydantic import Field

from finetuner.objectives.specs.sft import SFT
from finetuner.schema import Section


class NEFTuneSection(Section):
    """Settings of ``objective: neftune``: SFT with uniform noise on the input embeddings while training (Jain et al.
    2023), scaled by ``alpha / sqrt(sequence length × hidden size)``."""

    alpha: float = Field(5.0, gt=0, description="Strength of the noise (transformers' and TRL's neftune_noise_alpha; the "
                         "paper tries 5, 10 and 15).")


def noisy_embeddings(alpha: float):
    """A forward hook for an embedding layer: its output plus NEFTune's noise of strength ``alpha`` in
    training mode, its output unchanged in eval mode."""
    import torch

    def hook(module, inputs, output):
        if not module.training:
            return output
        # the bound computed as transformers computes it (float32 sqrt), so the same generator state draws
        # the same noise
        bound = alpha / torch.sqrt(torch.tensor(output.size(1) * output.size(2)))
        return output + torch.zeros_like(output).uniform_(-bound, bound)

    return hook


def add_noise(model, section: NEFTuneSection) -> None:
    """The hook goes on the model's input embeddings (a peft model's are its base's: the same module), with the
    strength of the recipe's ``neftune`` section (its default when the recipe has none)."""
    model.get_input_embeddings().register_forward_hook(noisy_embeddings(section.alpha))


NEFTUNE = replace(SFT, name="neftune", order=20, variant_of=SFT.name, section="neftune", section_schema=NEFTuneSection,
                  section_help="Settings of objective neftune (the noise's strength).", label="NEFTune",
                  settings=("alpha",), description="supervised fine-tuning with noisy embeddings (NEFTune)",
                  on_model=add_noise)

SPECS = (NEFTUNE,)

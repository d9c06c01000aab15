"""NEFTune: supervised fine-tuning with uniform noise added to the input embeddings while training
(Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"), as transformers'
``neftune_post_forward_hook`` and TRL's ``neftune_noise_alpha`` add it: each value of the embeddings'
output gets noise drawn from ``[-1, 1] × alpha / sqrt(L × d)`` (``L`` the batch's sequence length,
``d`` the hidden size), from torch's random generator (so a resumed run draws what the uninterrupted one
would: the checkpoint keeps that generator). The noise is added only while the embedding layer is in
training mode: evaluation, the samples and the probes (the model in eval mode) see the embeddings as
they are, and the saved adapter holds no trace of it. Everything else (data, loss, evaluation) is SFT's."""

from __future__ import annotations

from finetuner.objectives.specs.neftune import NEFTuneSection
from finetuner.objectives.base import register
from finetuner.objectives.sft import SFTObjective


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


@register("neftune")
class NEFTuneObjective(SFTObjective):
    """SFT with the noise hook on the model's input embeddings."""

    def on_model(self, model) -> None:
        """The hook goes on the model's input embeddings (a peft model's are its base's: the same module);
        without a ``neftune`` section the section's default strength."""
        alpha = (self.recipe.neftune or NEFTuneSection()).alpha
        model.get_input_embeddings().register_forward_hook(noisy_embeddings(alpha))

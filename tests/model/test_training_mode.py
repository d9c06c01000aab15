"""The model a run trains is in training mode, all of it.

``from_pretrained`` returns a model in eval mode and peft's wrapper starts in training mode, so a
trainer that checked only the wrapper left every base module in eval mode: transformers' gradient
checkpointing (which runs only in training mode) was silently off, and a bitsandbytes 4-bit layer
on a CPU with AVX512-BF16 repacked its weight for inference (bf16 block scales) in the first
forward pass, changing the run's numbers.
"""

from __future__ import annotations

import pytest

from finetuner.config.recipe import Recipe
from finetuner.config.runtime import resolve_runtime
from finetuner.model.loading import load_base_model, prepare_for_training


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_every_module_trains_and_checkpointing_runs(recipe_dict, method):
    import torch

    raw = dict(recipe_dict, method=method, training=dict(recipe_dict["training"], gradient_checkpointing=True))
    recipe = Recipe.from_dict(raw)
    model = prepare_for_training(load_base_model(recipe, resolve_runtime(recipe)), recipe)
    assert [type(m).__name__ for m in model.modules() if not m.training] == []
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    calls = []
    for layer in layers:  # (the layer's own hooks run once: the recomputation calls inside its __call__)
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 300, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 2 * len(layers)  # each layer's MLP ran again in the backward pass: checkpointing is on
    four_bit = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert (method == "qlora") == bool(four_bit)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in four_bit)  # as loaded

"""The base model as a run loads it for training: in training mode, all of it, and on this process's GPU.

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


def test_a_quantized_base_loads_onto_this_process_s_gpu(recipe_dict, monkeypatch):
    """A rank of a multi-process run has set its current GPU to its LOCAL_RANK's; a 4-bit base must be
    quantized onto that one (it was loaded onto GPU 0 by every rank). No GPU here: from_pretrained is
    stopped with the arguments it got."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetuner.config.runtime import Runtime

    class Stop(Exception):
        pass

    def capture(*args, **kwargs):
        raise Stop(kwargs)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", capture)
    recipe = Recipe.from_dict(dict(recipe_dict, method="qlora"))
    for device, want in (("cuda", 1), ("cuda:0", 0)):
        with pytest.raises(Stop) as e:
            load_base_model(recipe, Runtime(device, "bf16", "bf16", "bf16"))
        assert e.value.args[0]["device_map"] == {"": want}

"""``method: auto`` with a ``quantization`` section: valid, and the section says how to quantize
when the planner picks QLoRA (it failed with the "method 'full'" error before)."""

from __future__ import annotations

import pytest

from finetuner.errors import UserError
from finetuner.config.hardware import get_gpu
from finetuner.planning.resolve import resolve_auto
from finetuner.config.recipe import Recipe

RAW = {"model": {"name": "llama-2-13b"}, "data": {"path": "yahma/alpaca-cleaned", "max_seq_len": 2048},
       "method": "auto", "quantization": {"bits": 4, "quant_type": "fp4", "double_quant": False},
       "training": {"gradient_checkpointing": True}}


def test_auto_method_keeps_its_quantization_section():
    recipe = Recipe.from_dict(RAW)
    assert recipe.method == "auto" and recipe.quantization.quant_type == "fp4"
    planned = resolve_auto(recipe, get_gpu("rtx4090")).recipe  # a 13B base does not fit a 24 GB card in bf16
    assert planned.method == "qlora"
    assert (planned.quantization.bits, planned.quantization.quant_type, planned.quantization.double_quant) == (4, "fp4", False)


@pytest.mark.parametrize("method,message", [("lora", "method is 'lora'"), ("full", "method 'full' cannot train quantized")])
def test_quantization_with_lora_or_full_is_still_refused(method, message):
    with pytest.raises(UserError) as e:
        Recipe.from_dict({**RAW, "method": method})
    assert message in e.value.message

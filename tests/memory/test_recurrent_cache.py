"""Generation's cache of hybrid and state-space models (finetuner/memory/grpo.py ``generation_cache_bytes``): a KV
cache for the softmax-attention layers only, and for the linear-attention and state-space layers their fixed
recurrent state (finetuner/model/mixers.py ``recurrent_state_numel``), checked against the tensors transformers'
own cache holds after a prefill of a tiny model of each family (fp32, two sequences)."""

from __future__ import annotations

import pytest
import torch

from finetuner.memory.grpo import generation_cache_bytes, kv_cache_bytes
from finetuner.model.shapes import shape_from_config
from finetuner.model.tiny import tiny_config
from finetuner.model import mixers


def _cache_bytes(cache) -> int:
    """Bytes of every tensor transformers' cache object holds (its layers' keys and values, convolution and
    recurrent states), each tensor once."""
    seen: dict[int, torch.Tensor] = {}

    def walk(o, depth: int) -> None:
        if isinstance(o, torch.Tensor):
            seen[id(o)] = o
        elif depth < 6 and isinstance(o, (list, tuple)):
            for x in o:
                walk(x, depth + 1)
        elif depth < 6 and isinstance(o, dict):
            for x in o.values():
                walk(x, depth + 1)
        elif depth < 6 and hasattr(o, "__dict__") and not isinstance(o, (torch.nn.Module, type)):
            for x in vars(o).values():
                walk(x, depth + 1)

    walk(cache, 0)
    return sum(t.numel() * t.element_size() for t in seen.values())


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "falcon_h1", "bamba", "nemotron_h", "granitemoehybrid",
                                        "jamba", "mamba2", "mamba", "lfm2"])
def test_generation_cache_is_kv_for_attention_layers_and_a_fixed_state_for_the_others(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**tiny_config(model_type, 64))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    shape = shape_from_config(cfg.to_dict(), name=model_type)
    rows, tokens = 2, 7
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 64, (rows, tokens)), use_cache=True)
    cache = getattr(out, "past_key_values", None) or out.cache_params
    measured = _cache_bytes(cache)
    assert measured == generation_cache_bytes(shape, rows, tokens, 4)
    state = mixers.recurrent_state_numel(shape)
    assert state > 0  # every family here has linear-attention or state-space layers
    assert generation_cache_bytes(shape, rows, 2 * tokens, 4) - generation_cache_bytes(shape, rows, tokens, 4) \
        == kv_cache_bytes(shape, rows, tokens, 4)  # only the attention layers' cache grows with the tokens

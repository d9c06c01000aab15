"""Presets of the newest families (issue 56), copied from their published ``config.json``: each one's total, as
finetuner counts it from the model built on the meta device, is the size its name states, and each plans on an RTX 4090
and on a 12 GB card (an RTX 3060) or says in one line the memory it would need.

Where each config comes from (the preset's JSON holds the published values; transformers' version tag dropped):

- ``qwen3-next-80b-a3b``: ``Qwen/Qwen3-Next-80B-A3B-Thinking``'s config.json as vendored by ai-dynamo/aiconfigurator,
  ``src/aiconfigurator/model_configs/Qwen--Qwen3-Next-80B-A3B-Thinking_config.json``.
- ``qwen3.5-27b``, ``qwen3.5-35b-a3b``, ``qwen3.5-122b-a10b`` and ``qwen3.5-397b-a17b``: the config.json of
  ``Qwen/Qwen3.5-27B``, ``Qwen/Qwen3.5-35B-A3B``, ``Qwen/Qwen3.5-122B-A10B`` and ``Qwen/Qwen3.5-397B-A17B`` as
  ai-dynamo/aiconfigurator vendors them at commit 095f58a51c4ca8e61b66ec108d86f223f8d559ce,
  ``aic-core/src/aiconfigurator_core/model_configs/Qwen--<name>_config.json``, whole: text and vision configs (the
  397B one there is fuller than the older ``src/aiconfigurator/model_configs`` copy).
- ``nemotron-h-56b``: ``nvidia/Nemotron-H-56B-Base-8K``'s config.json as ai-dynamo/aiconfigurator vendors it,
  ``src/aiconfigurator/model_configs/nvidia--Nemotron-H-56B-Base-8K_config.json``.
- ``gemma-4-26b-a4b``: ``google/gemma-4-26B-A4B``'s config.json as ai-dynamo/aiconfigurator vendors it at commit
  095f58a51c4ca8e61b66ec108d86f223f8d559ce, ``aic-core/src/aiconfigurator_core/model_configs/google--gemma-4-26B-A4B_config.json``,
  whole: text and vision configs.
- ``granite-4.0-h-350m``: ``ibm-granite/granite-4.0-h-350m``'s config.json as downloaded into hashneo/nano-vllm-go at
  commit 2c864dfcfb6bb24d0d777654889a49aa5c19cfaf, ``models/granite-350m/config.json`` (saved by transformers 5.1.0,
  whence ``rope_parameters`` and the ``{"__float__": "Infinity"}`` that transformers reads back as infinity).
"""

from __future__ import annotations

import re

import pytest

from finetuner.model.shapes import load_config, resolve_shape
from finetuner.planning.planner import plan

B = 1_000_000_000
M = 1_000_000
#: preset -> (total its name states, active its name states or None, the unit the name rounds to, what the stated
#: active count includes besides the layers: "embeddings" and/or "lm_head"). "80B-A3B" states 80B in total and 3B
#: active, each rounded to the billion: the count must lie within half a billion of each.
STATED = {
    "qwen3-next-80b-a3b": (80 * B, 3 * B, B, ()),
    # Qwen3.5 counts every weight a token meets, the embedding table and the output layer too (as Qwen3-30B-A3B's
    # card's 3.3B activated does): 3.46B, 9.77B and 17.35B against A3B, A10B and A17B
    "qwen3.5-27b": (27 * B, None, B, ()),
    "qwen3.5-35b-a3b": (35 * B, 3 * B, B, ("embeddings", "lm_head")),
    "qwen3.5-122b-a10b": (122 * B, 10 * B, B, ("embeddings", "lm_head")),
    "qwen3.5-397b-a17b": (397 * B, 17 * B, B, ("embeddings", "lm_head")),
    "nemotron-h-56b": (56 * B, None, B, ()),
    # Gemma 4 reads its vision tower with the language model (0.57B) and counts the embedding table as active
    # (25.81B with the tower, 4.40B active; its card's 25.2B and 3.8B are the language model's 25.23B and 3.82B)
    "gemma-4-26b-a4b": (26 * B, 4 * B, B, ("embeddings",)),
    # issue 67 (sources in tests/planning/test_presets_and_cards_2026.py): Qwen3.5-9B's language model 8.95B (9.41B
    # with its vision tower), Qwen3.6-27B the shape of Qwen3.5-27B, Gemma 4 31B 31.27B with its vision tower (its
    # language model 30.70B)
    "qwen3.5-9b": (9 * B, None, B, ()),
    "qwen3.6-27b": (27 * B, None, B, ()),
    "gemma-4-31b": (31 * B, None, B, ()),
    # 340.3M, which its name rounds up to 350M: a name under a billion rounds to 50M, so the count must lie within 25M
    "granite-4.0-h-350m": (350 * M, None, 50 * M, ()),
}
#: the cards every preset is planned on: a 24 GB card and a 12 GB one
CARDS = ("rtx4090", "rtx3060")
SEQ_LEN = 2048


#: where an image-text checkpoint keeps its towers and their projectors
TOWERS = ("vision_tower", "audio_tower", "multi_modal_projector", "embed_vision", "embed_audio", ".visual.")


def _published_counts(name: str, shape) -> tuple[int, int]:
    """The checkpoint's count, which its name states, and that of its towers, built on the meta device: the
    vision tower of an image-text checkpoint whose language model alone finetuner reads (Qwen3.5's
    ``qwen3_5_text``) counted in; where finetuner reads the towers with it (Gemma 4), its own count."""
    raw, _ = load_config(name)
    if "vision_config" not in raw:
        return shape.num_params, 0
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(**{k: v for k, v in raw.items() if not k.startswith("_")})
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    params = dict(model.named_parameters())
    return sum(p.numel() for p in params.values()), sum(p.numel() for n, p in params.items() if any(t in n for t in TOWERS))


@pytest.mark.parametrize("name", sorted(STATED))
def test_a_published_preset_counts_what_its_name_states_and_plans_on_24_and_12_gb(name):
    total, active, unit, active_includes = STATED[name]
    shape = resolve_shape(name)
    published, towers = _published_counts(name, shape)  # Qwen3.5's names round either: 397B with the tower, 122B without it
    assert min(abs(published - total), abs(shape.num_params - total)) <= unit / 2, (name, shape.num_params, published)
    if active is not None:  # the stated active count leaves out the embeddings and the output layer unless it says so
        counts = shape.param_counts()
        active_read = shape.num_params - shape.expert_numel + shape.experts.active_numel
        active_read -= towers if shape.num_params == published else 0  # a token of text meets no tower
        active_read -= sum(counts.get(kind, 0) for kind in ("embeddings", "lm_head") if kind not in active_includes)
        assert abs(active_read - active) <= unit / 2, (name, active_read)
    for card in CARDS:
        p = plan(name, card, seq_len=SEQ_LEN)
        if p.fits:
            assert p.recipe is not None and p.estimate.total_bytes <= p.estimate.budget_bytes, (name, card)
            continue
        need = re.search(r"needs ([\d.]+) GiB, the budget is ([\d.]+) GiB", p.reasons[0])  # one line names the need
        assert need and float(need[1]) > float(need[2]) and "\n" not in p.reasons[0], (name, card, p.reasons)

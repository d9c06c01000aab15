"""Model shapes: exact parameter and LoRA counts, checked against transformers and peft on meta."""

from __future__ import annotations

import json

import pytest

from finetuner.errors import UserError
from finetuner.model.shapes import lora_param_count, preset_names, presets, resolve_shape, shape_from_config
from tests.conftest import REPO

#: Published totals (also what instantiating on meta gives).
KNOWN_TOTALS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b-v0.1": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "gemma-2-9b": 9_241_705_984,
    "phi-3-mini": 3_821_079_552,
    # Qwen3 (2025): the totals of the configs of Qwen/Qwen3-4B, -8B, -14B and -32B, which the model cards round
    # to 4.0B, 8.2B, 14.8B and 32.8B
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    "qwen3-32b": 32_762_123_264,
    "phi-4": 14_659_507_200,  # microsoft/phi-4's config (Phi3ForCausalLM); its card rounds to 14.7B
    "smollm3-3b": 3_075_098_624,  # HuggingFaceTB/SmolLM3-3B (a layout read from the model); its card: 3.08B
    "mistral-small-24b": 23_572_403_200,  # Mistral-Small-24B-Base-2501 (head_dim 128, not 5120 / 32); its card: 23.6B
    "qwen2.5-vl-7b": 8_292_166_656,  # Qwen/Qwen2.5-VL-7B-Instruct: the language model and its 32-block vision tower; card: 8.29B
    # mixtures of experts: Qwen/Qwen3-30B-A3B (its card: 30.5B in total, 3.3B activated) and openai/gpt-oss-20b
    # (its card: 21B parameters, 3.6B active), configs as published
    "qwen3-30b-a3b": 30_532_122_624,
    "gpt-oss-20b": 20_914_757_184,
    # an image-text-to-text checkpoint, trained on text: google/gemma-3-12b-pt (its card: 12B; the language model
    # 11.77B and the SigLIP vision tower with its projector 0.42B)
    "gemma-3-12b": 12_187_325_040,
    "gemma-3-27b": 27_432_406_640,  # google/gemma-3-27b (its card: 27B), the -it config as published
    "mistral-nemo-12b": 12_247_782_400,  # Mistral-Nemo-Base-2407 (its card: 12B)
    "olmo-2-7b": 7_298_617_344,  # allenai/OLMo-2-1124-7B (its card: 7B)
    "granite-3.3-8b": 8_170_864_640,  # ibm-granite/granite-3.3-8b (its card: 8B)
    "ministral-8b": 8_019_808_256,  # Ministral-8B-Instruct-2410 (its card: 8.02B)
    "olmoe-1b-7b": 6_919_161_856,  # allenai/OLMoE-1B-7B-0924 (its paper: 6.9B in total, 1.3B active; 64 experts, 8 a token)
    "gemma-3-4b": 4_300_079_472,  # google/gemma-3-4b-it (its card: 4.3B with the vision tower)
    # Qwen/Qwen3-Next-80B-A3B-Thinking (its name: 80B in total, 3B active), the config as ai-dynamo/aiconfigurator
    # vendors it (src/aiconfigurator/model_configs/Qwen--Qwen3-Next-80B-A3B-Thinking_config.json)
    "qwen3-next-80b-a3b": 79_674_391_296,
    # Qwen3.5 as ai-dynamo/aiconfigurator vendors its configs (aic-core/src/aiconfigurator_core/model_configs/),
    # counted as finetuner reads it: the language model, the vision tower left out (with the tower: 27.36B, 35.11B,
    # 122.56B and 396.80B, which tests/planning/test_published_presets.py checks against the names)
    "qwen3.5-27b": 26_895_998_464,
    "qwen3.5-35b-a3b": 34_660_610_688,
    "qwen3.5-122b-a10b": 122_111_526_912,
    "qwen3.5-397b-a17b": 396_346_350_336,
    # hybrids of Mamba-2 and attention: nvidia/Nemotron-H-56B-Base-8K as ai-dynamo/aiconfigurator vendors its config
    # (its name: 56B) and ibm-granite/granite-4.0-h-350m as hashneo/nano-vllm-go downloaded it (its name: 350M;
    # tests/planning/test_published_presets.py checks each against its name)
    "nemotron-h-56b": 56_324_350_464,
    "granite-4.0-h-350m": 340_332_224,
    # google/gemma-4-26B-A4B as ai-dynamo/aiconfigurator vendors its config: the language model's 25.23B (its card:
    # 25.2B in total, 3.8B active) and the vision tower with its projector, 0.57B, which finetuner reads with it
    "gemma-4-26b-a4b": 25_805_933_872,
    # issue 67 (sources in tests/planning/test_presets_and_cards_2026.py): Qwen/Qwen3.5-9B's language model (its card:
    # 9B; llama.cpp reads 8.95B from its GGUF), Qwen/Qwen3.6-27B (the shape of Qwen3.5-27B; its name: 27B) and
    # google/gemma-4-31B with its vision tower and projector, 0.58B, which finetuner reads with it (its name: 31B)
    "qwen3.5-9b": 8_953_803_264,
    "qwen3.6-27b": 26_895_998_464,
    "gemma-4-31b": 31_273_086_512,
}


def _meta_model(shape):
    from finetuner.model.inventory import build_on_meta

    return build_on_meta(shape.config)  # the causal LM, or an image-text preset's image-text model


def _kind(name: str) -> str:
    # a vision or audio tower and its projector (Gemma 4's ``embed_vision``, Gemma 3n's ``embed_audio``), norms too
    if any(k in name for k in ("vision_tower", "audio_tower", "multi_modal_projector", ".visual.", ".embed_vision.", ".embed_audio.")):
        return "other"
    if ".experts." in name or ".shared_expert." in name:  # a shared expert is counted with the experts
        return "experts"
    if ".linear_attn." in name:  # a linear-attention block: its projections, its gated norm, its conv and state
        if "norm" in name:
            return "norms"
        return "other" if any(k in name for k in ("conv1d", "A_log", "dt_bias")) else "attention"
    # a Mamba-2 mixer: its projections, its gated norm, its conv and state (Nemotron-H's ``mixer`` holds its
    # attention's and its MLP's linears too, by their own names)
    if ".mixer." in name or ".mamba." in name:
        if "norm" in name:
            return "norms"
        if any(k in name for k in ("conv1d", "A_log", "dt_bias")) or name.endswith(".D"):
            return "other"
        # the memory model counts a mixer's in_proj and out_proj with the MLP (a linear's role, not attention's)
        return "attention" if any(f".{x}_proj." in name for x in "qkvo") else "mlp"
    if ".mlp.gate." in name or ".router." in name:  # a router in the MLP, or beside it (Gemma 4)
        return "router"
    if "embed_tokens" in name or name.startswith("model.embeddings."):  # Nemotron-H names its table ``embeddings``
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".self_attn." in name and "norm" not in name:
        return "attention"
    if ".mlp." in name or ".shared_mlp." in name:  # Granite 4's dense MLP is its ``shared_mlp``
        return "mlp"
    return "norms"


def test_required_presets_are_shipped():
    for name in KNOWN_TOTALS:
        assert name in preset_names()


@pytest.mark.parametrize("shape", presets(), ids=lambda s: s.name)
def test_parameter_counts_equal_the_meta_model_per_module_kind(shape):
    model = _meta_model(shape)
    by_kind: dict[str, int] = {}
    for name, p in model.named_parameters():  # tied weights are listed once
        by_kind[_kind(name)] = by_kind.get(_kind(name), 0) + p.numel()
    counts = shape.param_counts()
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    for kind in ("embeddings", "attention", "mlp", "norms", "lm_head", "experts", "router", "other"):
        assert counts.get(kind, 0) == by_kind.get(kind, 0), kind
    if shape.name in KNOWN_TOTALS:
        assert counts["total"] == KNOWN_TOTALS[shape.name]


@pytest.mark.parametrize(
    "preset,targets,r",
    [
        ("llama-2-7b", "all-linear", 16),
        ("llama-3.1-8b", ["q_proj", "v_proj"], 8),
        ("qwen2.5-7b", "all-linear", 64),
        ("phi-3-mini", "all-linear", 16),
        ("gemma-2-9b", ["q_proj", "k_proj", "v_proj", "o_proj"], 32),
        ("mistral-7b-v0.1", ["gate_proj", "up_proj", "down_proj", "lm_head"], 8),
    ],
)
def test_lora_counts_equal_peft_on_the_meta_model(preset, targets, r):
    from peft import LoraConfig, get_peft_model

    shape = resolve_shape(preset)
    model = get_peft_model(_meta_model(shape), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, task_type="CAUSAL_LM"))
    trainable, _ = model.get_nb_trainable_parameters()
    assert lora_param_count(shape, r, targets) == trainable


def test_presets_resolve_by_hub_id_and_alias():
    assert resolve_shape("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert resolve_shape("NousResearch/Llama-2-13b-hf").name == "llama-2-13b"
    assert resolve_shape("Qwen/Qwen2.5-7B-Instruct").name == "qwen2.5-7b"
    assert resolve_shape("LLAMA-2-7B").name == "llama-2-7b"


def test_local_folder_config(tmp_path):
    cfg = {k: v for k, v in resolve_shape("llama-3.2-1b").config.items() if not k.startswith("_")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = resolve_shape(str(tmp_path))
    assert shape.source == "local" and shape.num_params == 1_235_814_400


def test_unknown_model_offline_names_the_presets():
    with pytest.raises(UserError) as e:
        resolve_shape("lama-2-7b")
    assert "llama-2-7b" in e.value.message


def test_unsupported_architecture_is_a_clear_error():
    with pytest.raises(UserError) as e:
        shape_from_config({"model_type": "jetmoe", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100}, name="jetmoe")
    assert "jetmoe" in e.value.message and "attention's linear layers are self_attention.kv_proj" in e.value.message
    assert "Layouts it describes" in (e.value.hint or "")


def test_unknown_lora_target_suggests_one():
    with pytest.raises(UserError) as e:
        lora_param_count(resolve_shape("llama-2-7b"), 8, ["q_prj"])
    assert "q_proj" in e.value.message


def test_parameter_counts_read_at_every_size():
    """Issue 24: the demo model was described as "0.00B parameters"."""
    from finetuner.model.shapes import parameter_count

    assert parameter_count(6_738_415_616) == "6.74B"
    assert parameter_count(134_515_008) == "135M"
    assert parameter_count(933_120) == "0.933M"
    assert "0.00B" not in resolve_shape(str(REPO / "data" / "demo_model")).describe()


def test_the_plan_says_whether_a_checkpoints_vision_tower_is_loaded():
    """Qwen3.5's checkpoints are image-text, but transformers' causal LM of one is its language model alone (what a
    text run loads): no tower is counted or claimed. Qwen3-VL has no causal LM class: its whole model is built,
    the tower frozen and counted."""
    from finetuner.model.inventory import build_on_meta
    from finetuner.model.shapes import _presets

    qwen35, vl = resolve_shape("qwen3.5-27b"), resolve_shape("qwen3-vl-4b")
    assert qwen35.text_only_of == "qwen3_5" and not qwen35.vision_tower_loaded
    assert "its vision tower is not loaded" in qwen35.describe() and "loaded frozen" not in qwen35.describe()
    assert not any("visual" in n for n, _ in build_on_meta(_presets()["qwen3.5-27b"]).named_modules())
    assert vl.vision_tower_loaded and "loaded frozen" in vl.describe()


def test_a_mamba_layer_is_a_state_space_layer_not_linear_attention_too():
    """transformers 5 reads Granite 4's ``layer_types`` "mamba" as "linear_attention": its 28 Mamba-2 layers are
    planned as state-space layers, not as Gated DeltaNet layers besides."""
    from finetuner.model.mixers import mixers

    shape = resolve_shape("granite-4.0-h-350m")
    assert (shape.mixer_layers, shape.linear_attention_layers) == (28, 0) and "linear attention" not in shape.describe()
    assert (mixers(shape).mamba2_layers, mixers(shape).delta_layers) == (28, 0)

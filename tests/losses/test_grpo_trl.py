"""finetuner's GRPO loss and advantages (finetuner/losses/grpo.py) against TRL's own code (trl 1.16):
``GRPOTrainer._compute_loss`` for the loss, ``GRPOTrainer._generate_and_score_completions`` for the group
advantages (see the advantages' section below for how that one runs).

TRL's method is called for real, unbound, on a trainer made with ``GRPOTrainer.__new__`` (no model, no
``__init__``) carrying the attributes ``_compute_loss`` reads, set from a real ``GRPOConfig`` the way
``GRPOTrainer.__init__`` sets them. The one thing replaced is the model forward,
``_get_per_token_logps_and_entropies``: it returns given per-token log-probabilities (a leaf that requires
grad, so that the gradients can be compared too). Everything after it (the importance ratio, the clip, the
k3 KL, the ``grpo``/``dr_grpo``/``dapo`` normalisations with TRL's gradient-accumulation scaling, the clip and
KL metrics through the accelerator's ``reduce``/``gather``) is TRL's code. The accelerator is a one-process
stand-in (``reduce`` and ``gather`` return their argument, as accelerate's do on one process).

TRL 1.16's ``use_bias_correction_kl`` (default True, DeepSeek-V3.2) multiplies the k3 KL by the importance
ratio; finetuner's loss is DeepSeekMath's eq. 3/4 without that factor, which is TRL's computation with
``use_bias_correction_kl=False`` (the comparisons below set it). What the default changes is pinned by
:func:`test_trl_default_bias_corrected_kl_differs_by_the_ratio`.

Tolerances: both sides compute in fp32 the same elementwise expressions in the same order and reduce the
same tensors with the same torch kernels (173 completion tokens); they differ only in the last scalar
operations (``.mean()`` against ``.sum() / n``; TRL's dapo denominator ``num_items / num_processes ×
gradient_accumulation_steps / steps_per_generation``), each one rounding (6e-8 relative). ``rtol=1e-6``
(≈ 8 fp32 ulps) with ``atol=1e-7`` (for values near 0) is that noise with margin, and holds for the
gradients (one token's term times its normalisation weight each). On torch 2.13 CPU the two are in fact
bit-identical in every case of :func:`test_loss_gradient_and_metrics_equal_trl`. Padding's gradient is exactly 0 on both sides.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from finetuner.losses.grpo import group_advantages, grpo_loss

RTOL, ATOL = 1e-6, 1e-7
L_MAX = 48  # max_completion_length (dr_grpo's constant), larger than the batch's widest completion
PROMPT_LEN = 3


class OneProcessAccelerator:
    """What ``_compute_loss`` reads of accelerate's ``Accelerator``, as it behaves on one process."""

    num_processes = 1
    process_index = 0
    sync_gradients = True

    @staticmethod
    def reduce(tensor, reduction="sum"):
        return tensor

    @staticmethod
    def gather(tensor):
        return tensor

    gather_for_metrics = gather


def trl_trainer(tmp_path, *, loss_type, beta, epsilon, epsilon_high, use_bias_correction_kl=False,
                gradient_accumulation_steps=1, steps_per_generation=None, training=True):
    """A GRPOTrainer without a model: the attributes ``_compute_loss`` reads, from a real GRPOConfig."""
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, loss_type=loss_type, beta=beta,
                      epsilon=epsilon, epsilon_high=epsilon_high, max_completion_length=L_MAX,
                      use_bias_correction_kl=use_bias_correction_kl,
                      gradient_accumulation_steps=gradient_accumulation_steps,
                      steps_per_generation=steps_per_generation)
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.args = args
    # as GRPOTrainer.__init__ sets them from args (trl/trainer/grpo_trainer.py)
    trainer.max_completion_length = args.max_completion_length
    trainer.use_vllm = args.use_vllm
    trainer.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    trainer.loss_type = args.loss_type
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.entropy_coef = args.entropy_coef
    trainer.use_adaptive_entropy = args.use_adaptive_entropy
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.beta = args.beta
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.aux_loss_enabled = False  # a dense model (no MoE router)
    trainer.accelerator = OneProcessAccelerator()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by Trainer's loop
    trainer.model = torch.nn.Module().train(training)  # only .training is read
    return trainer


def trl_loss(trainer, logps, advantages, mask, *, old_logps=None, ref_logps=None, num_items_in_batch=None):
    """Call TRL's ``_compute_loss`` with the model forward replaced by the given log-probabilities."""

    def given_logps(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == logps.size(1) and input_ids.size(1) == PROMPT_LEN + logps.size(1)
        return logps, torch.zeros_like(logps.detach()), None  # (log-probs, entropies, aux loss)

    trainer._get_per_token_logps_and_entropies = types.MethodType(given_logps, trainer)
    b, t = logps.shape
    inputs = {
        "prompt_ids": torch.ones(b, PROMPT_LEN, dtype=torch.long),
        "prompt_mask": torch.ones(b, PROMPT_LEN, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": mask.int(),  # TRL's completion masks are int
        "advantages": advantages,
        "num_items_in_batch": mask.sum().int() if num_items_in_batch is None else torch.tensor(num_items_in_batch),
    }
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    return GRPOTrainer._compute_loss(trainer, None, inputs)


def batch(seed=0, n=8, t=40):
    """Random fp32 log-probabilities; old ones whose ratios fall well inside and well outside the clip range
    (about 0.45 to 2.2); advantages of both signs; completions of varied lengths padded to ``t`` (one of a
    single token, one full, 173 tokens in all)."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, t, generator=g) * 3 - 0.05
    old = logps + (torch.rand(n, t, generator=g) - 0.5) * 1.6
    ref = logps + (torch.rand(n, t, generator=g) - 0.5) * 0.8
    adv = (torch.rand(n, generator=g) + 0.1) * torch.tensor([1.0, -1.0] * n)[:n]
    lengths = [t, 1, 17, 33, t - 1, 5, 26, 12][:n]
    mask = torch.zeros(n, t)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    return logps, old, ref, adv, mask


#: (old log-probs given, ε_low, ε_high): on policy (ratio 1, nothing clipped), off policy with the clip
#: symmetric, with DAPO's clip-higher (asymmetric), and off policy with the clip out of reach.
CLIPS = {"on-policy": (False, 0.2, 0.2), "clip": (True, 0.2, 0.2), "clip-higher": (True, 0.2, 0.28),
         "no-clip": (True, 100.0, 100.0)}
CASES = [pytest.param(loss_type, beta, clip, False, id=f"{loss_type}-beta{beta}-{clip}")
         for loss_type in ("grpo", "dr_grpo", "dapo") for beta in (0.0, 0.04) for clip in CLIPS]
#: ``use_bias_correction_kl`` (TRL's default) only changes anything with a KL term
CASES += [pytest.param(loss_type, 0.04, clip, True, id=f"{loss_type}-beta0.04-{clip}-bias-corrected-kl")
          for loss_type in ("grpo", "dr_grpo", "dapo") for clip in CLIPS]


def last(trainer, key, mode="train"):
    return trainer._metrics[mode][key][-1]


@pytest.mark.parametrize("loss_type, beta, clip, corrected", CASES)
def test_loss_gradient_and_metrics_equal_trl(tmp_path, loss_type, beta, clip, corrected):
    off_policy, eps_low, eps_high = CLIPS[clip]
    logps, old, ref, adv, mask = batch()
    old = old if off_policy else None
    ref = ref if beta else None

    ours_leaf = logps.clone().requires_grad_(True)
    ours = grpo_loss(ours_leaf, adv, mask, old_logps=old, ref_logps=ref, beta=beta, epsilon=eps_low,
                     epsilon_high=eps_high, loss_type=loss_type, max_completion_length=L_MAX, use_bias_correction_kl=corrected)
    ours.loss.backward()

    trainer = trl_trainer(tmp_path, loss_type=loss_type, beta=beta, epsilon=eps_low, epsilon_high=eps_high,
                          use_bias_correction_kl=corrected)
    trl_leaf = logps.clone().requires_grad_(True)
    want = trl_loss(trainer, trl_leaf, adv, mask, old_logps=old, ref_logps=ref)
    want.backward()

    torch.testing.assert_close(ours.loss, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours_leaf.grad, trl_leaf.grad, rtol=RTOL, atol=ATOL)
    assert ours_leaf.grad[mask == 0].abs().max() == 0 and trl_leaf.grad[mask == 0].abs().max() == 0
    for ours_key, trl_key in (("clip_ratio/low", "clip_ratio/low_mean"), ("clip_ratio/high", "clip_ratio/high_mean"),
                              ("clip_ratio/region", "clip_ratio/region_mean")):
        assert ours.metrics[ours_key] == pytest.approx(last(trainer, trl_key), rel=RTOL, abs=ATOL), ours_key
    assert ("kl" in ours.metrics) == ("kl" in trainer._metrics["train"]) == (beta != 0)
    if beta:
        assert ours.metrics["kl"] == pytest.approx(last(trainer, "kl"), rel=RTOL, abs=ATOL)
    # the cases test what they say: the clipped ones clip on both sides, the others not at all
    clipped = clip in ("clip", "clip-higher")
    assert (last(trainer, "clip_ratio/low_mean") > 0) == clipped and (last(trainer, "clip_ratio/high_mean") > 0) == clipped


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_eval_mode_equals_trl(tmp_path, loss_type):
    """In eval TRL neither divides by the accumulation steps nor rescales dapo's token count."""
    logps, old, ref, adv, mask = batch(seed=1)
    kw = dict(old_logps=old, ref_logps=ref)
    trainer = trl_trainer(tmp_path, loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28,
                          gradient_accumulation_steps=2, steps_per_generation=4, training=False)
    want = trl_loss(trainer, logps, adv, mask, **kw)
    ours = grpo_loss(logps, adv, mask, beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type,
                     max_completion_length=L_MAX, **kw)
    torch.testing.assert_close(ours.loss, want, rtol=RTOL, atol=ATOL)
    assert ours.metrics["kl"] == pytest.approx(last(trainer, "kl", "eval"), rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_equal_trl_with_gradient_accumulation(tmp_path, loss_type):
    """A generation batch of 8 completions in two micro-batches of 4 (TRL: gradient_accumulation_steps 2,
    steps_per_generation 2, ``num_items_in_batch`` the generation batch's tokens). TRL divides each
    micro-batch's loss by the accumulation steps (grpo, dr_grpo) or by the whole batch's token count (dapo);
    finetuner passes the batch's ``num_sequences``/``num_tokens``. The two agree micro-batch by micro-batch,
    and their sum is finetuner's loss of the whole batch (micro-batches of equal size: TRL's grpo and dr_grpo
    divide by the micro-batch's own number of sequences)."""
    logps, old, ref, adv, mask = batch(seed=2)
    kw = dict(beta=0.04, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type, max_completion_length=L_MAX)
    ours_leaf, trl_leaf = logps.clone().requires_grad_(True), logps.clone().requires_grad_(True)
    total = 0.0
    for part in (slice(0, 4), slice(4, 8)):
        trainer = trl_trainer(tmp_path, loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=0.28,
                              gradient_accumulation_steps=2, steps_per_generation=2)
        want = trl_loss(trainer, trl_leaf[part], adv[part], mask[part], old_logps=old[part], ref_logps=ref[part],
                        num_items_in_batch=int(mask.sum()))
        ours = grpo_loss(ours_leaf[part], adv[part], mask[part], old_logps=old[part], ref_logps=ref[part],
                         num_sequences=len(logps), num_tokens=float(mask.sum()), **kw)
        torch.testing.assert_close(ours.loss, want, rtol=RTOL, atol=ATOL)
        (ours.loss - want).backward()  # ours_leaf gets +∂ours, trl_leaf gets −∂TRL
        total = total + want.detach()
    torch.testing.assert_close(ours_leaf.grad, -trl_leaf.grad, rtol=RTOL, atol=ATOL)
    whole = grpo_loss(logps, adv, mask, old_logps=old, ref_logps=ref, **kw).loss
    torch.testing.assert_close(whole, total, rtol=RTOL, atol=ATOL)


def test_trl_default_bias_corrected_kl_differs_by_the_ratio(tmp_path):
    """TRL 1.16's default ``use_bias_correction_kl=True`` weights the k3 term by ρ = exp(logp − old)
    (differentiable), finetuner does not. Off policy, TRL's per-token loss is finetuner's plus
    ``β (ρ − 1) KL``; on policy (ρ = 1) the loss values agree but the gradient gains ``β KL`` per token (times
    the normalisation's weight): exactly that, no more."""
    logps, old, ref, adv, mask = batch(seed=3)
    beta, weight = 0.04, 1 / mask.sum()  # dapo: every token weighs 1 / Σ|o|
    d = ref - logps
    kl = torch.exp(d) - d - 1
    ratio = torch.exp(logps - old)
    trainer = trl_trainer(tmp_path, loss_type="dapo", beta=beta, epsilon=0.2, epsilon_high=0.28,
                          use_bias_correction_kl=True)
    assert GRPOConfig(output_dir=str(tmp_path / "d"), report_to="none", use_cpu=True).use_bias_correction_kl
    off = trl_loss(trainer, logps, adv, mask, old_logps=old, ref_logps=ref)
    ours = grpo_loss(logps, adv, mask, old_logps=old, ref_logps=ref, beta=beta, epsilon=0.2, epsilon_high=0.28)
    torch.testing.assert_close(off, ours.loss + beta * ((ratio - 1) * kl * mask).sum() * weight, rtol=RTOL, atol=ATOL)

    trl_leaf, ours_leaf = logps.clone().requires_grad_(True), logps.clone().requires_grad_(True)
    on = trl_loss(trainer, trl_leaf, adv, mask, ref_logps=ref)
    ours = grpo_loss(ours_leaf, adv, mask, ref_logps=ref, beta=beta, epsilon=0.2, epsilon_high=0.28)
    torch.testing.assert_close(on, ours.loss, rtol=RTOL, atol=ATOL)
    on.backward()
    ours.loss.backward()
    torch.testing.assert_close(trl_leaf.grad, ours_leaf.grad + beta * kl * mask * weight, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- advantages
# TRL computes the group advantages inline in GRPOTrainer._generate_and_score_completions (no function of
# their own), after generating the completions and calling the reward functions: the tests below run that
# method for real on a GRPOTrainer of a tiny random Llama (2 layers, generating 2 tokens a completion), with a
# reward function that returns given rewards in the completions' order (TRL's RepeatSampler puts a prompt's
# num_generations completions next to each other, as group_advantages expects).
G = 6
#: four groups of six: uniform rewards, binary ones with ties, all equal with a mean that fp32 cannot hit
#: exactly (six 0.9s: mean − 0.9 = 6e-8), all equal with an exact mean
REWARDS = torch.tensor([0.31, 2.5, -1.2, 0.07, 1.9, 0.66,
                        1.0, 0.0, 0.0, 1.0, 1.0, 1.0,
                        0.9, 0.9, 0.9, 0.9, 0.9, 0.9,
                        2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
ZERO_STD = torch.tensor([False, False, True, True]).repeat_interleave(G)


@pytest.fixture(scope="module")
def tiny_policy():
    from finetuner.model.tiny_llama import tiny_llama, train_bpe_tokenizer
    from tests.conftest import corpus

    tokenizer = train_bpe_tokenizer(corpus(), vocab_size=400)
    return tiny_llama(tokenizer, seed=0), tokenizer


def trl_advantages(tmp_path, tiny_policy, rewards, scale_rewards):
    from datasets import Dataset

    model, tokenizer = tiny_policy
    prompts = [f"prompt {i}" for i in range(len(rewards) // G)]
    seen = []

    def given_rewards(prompts, completions, **kwargs):
        seen.append(len(completions))
        return rewards.tolist()

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to="none", use_cpu=True, num_generations=G,
                      per_device_train_batch_size=len(rewards), max_completion_length=2, beta=0.0,
                      scale_rewards=scale_rewards, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=given_rewards, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]))
    out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G)])
    assert seen == [len(rewards)]
    return out["advantages"]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", True, False])
def test_group_advantages_equal_trl(tmp_path, tiny_policy, scale_rewards):
    """Equal to TRL's advantages up to fp32 rounding (mean and unbiased std of six numbers computed in a
    different order: a few ulps of values of order 1), except on a group whose rewards are all equal: finetuner
    gives exactly 0; TRL divides the rounding error of the mean (6e-8 here) by ``std + 1e-4`` (std itself
    rounding noise), leaving −6e-4 there with group scaling (−7e-8 batch, −6e-8 none; 0 where the fp32 mean
    is exact)."""
    want = trl_advantages(tmp_path, tiny_policy, REWARDS, scale_rewards)
    ours = group_advantages(REWARDS, G, scale_rewards=scale_rewards)
    assert torch.equal(ours.zero_std.repeat_interleave(G), ZERO_STD)
    torch.testing.assert_close(ours.advantages[~ZERO_STD], want[~ZERO_STD], rtol=RTOL, atol=ATOL)
    assert torch.equal(ours.advantages[ZERO_STD], torch.zeros(int(ZERO_STD.sum())))
    assert want[ZERO_STD].abs().max() < 1e-3 and torch.equal(want[-G:], torch.zeros(G))

"""The GRPO losses (finetuner/losses/grpo.py) against the papers' formulas written out token by token
in plain Python, and hand-counted cases. TRL's ``GRPOTrainer._compute_loss`` itself is the reference of
tests/losses/test_grpo_trl.py.

Tolerances: the module computes in fp32; the references run in fp64 (Python floats) on the same fp32
inputs. Sums of a few dozen terms of order 1 carry an error of a few fp32 ulps (1.2e-7 each), so
``rtol=1e-5, atol=1e-6`` is fp32 noise with margin, not a loose bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from finetuner.losses.grpo import GRPOLoss, chunked_token_logps, group_advantages, grpo_loss, k3_kl, token_logps

RTOL, ATOL = 1e-5, 1e-6


# --------------------------------------------------------------------------- references
def formula_loss(logps, old, ref, adv, mask, *, beta, eps_low, eps_high, loss_type, l_max=None):
    """The per-token objective and the three normalisations, one token at a time (Python floats)."""
    n = len(logps)
    seq_terms, all_sum, all_tokens = [], 0.0, 0
    for i in range(n):
        s, count = 0.0, 0
        for t in range(len(logps[i])):
            if not mask[i][t]:
                continue
            rho = math.exp(logps[i][t] - old[i][t])
            a = adv[i]
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            term = -min(rho * a, clipped * a)
            if beta:
                d = ref[i][t] - logps[i][t]
                term += beta * (math.exp(d) - d - 1)
            s += term
            count += 1
        seq_terms.append(s / max(count, 1))
        all_sum += s
        all_tokens += count
    if loss_type == "grpo":
        return sum(seq_terms) / n
    if loss_type == "dr_grpo":
        return all_sum / (n * l_max)
    return all_sum / max(all_tokens, 1)


def formula_grad(logps, old, ref, adv, mask, *, beta, eps_low, eps_high, loss_type, l_max=None):
    """d loss / d logp_{i,t} written out: the unclipped branch gives ``−Â ρ`` (the clipped one a
    constant), the k3 term ``β (1 − exp(ref − logp))``, times the normalisation's weight of the token."""
    n = len(logps)
    lengths = [sum(1 for m in row if m) for row in mask]
    total = sum(lengths)
    out = []
    for i in range(n):
        row = []
        for t in range(len(logps[i])):
            if not mask[i][t]:
                row.append(0.0)
                continue
            rho = math.exp(logps[i][t] - old[i][t])
            a = adv[i]
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            g = -a * rho if rho * a <= clipped * a else 0.0
            if beta:
                g += beta * (1 - math.exp(ref[i][t] - logps[i][t]))
            weight = {"grpo": 1 / (max(lengths[i], 1) * n), "dr_grpo": 1 / (n * l_max), "dapo": 1 / max(total, 1)}[loss_type]
            row.append(g * weight)
        out.append(row)
    return out


def batch(seed=0, n=6, t=7):
    """Random log-probabilities with ratios well inside and well outside the clip range, and a mask
    with varied lengths (one completion of a single token, one full)."""
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n, t, generator=g) * 3 - 0.05
    old = logps + (torch.rand(n, t, generator=g) - 0.5) * 1.6  # ratios from about 0.45 to 2.2
    ref = logps + (torch.rand(n, t, generator=g) - 0.5) * 0.8
    adv = (torch.rand(n, generator=g) + 0.1) * torch.tensor([1.0, -1.0] * n)[:n]  # both signs
    lengths = [t, 1, 3, 5, t - 1, 2][:n]
    mask = torch.zeros(n, t)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    return logps, old, ref, adv, mask


CASES = [
    pytest.param(loss_type, beta, eps_low, eps_high, id=f"{loss_type}-beta{beta}-eps{eps_low}-{eps_high}")
    for loss_type in ("grpo", "dr_grpo", "dapo")
    for beta in (0.0, 0.04)
    for eps_low, eps_high in ((0.2, 0.2), (0.2, 0.28), (100.0, 100.0))  # symmetric, DAPO's clip-higher, no clipping
]


# --------------------------------------------------------------------------- the loss
@pytest.mark.parametrize("loss_type, beta, eps_low, eps_high", CASES)
def test_loss_and_gradient_match_the_formulas(loss_type, beta, eps_low, eps_high):
    logps, old, ref, adv, mask = batch()
    l_max = 9
    leaf = logps.clone().requires_grad_(True)
    out = grpo_loss(leaf, adv, mask, old_logps=old, ref_logps=ref if beta else None, beta=beta, epsilon=eps_low,
                    epsilon_high=eps_high, loss_type=loss_type, max_completion_length=l_max)
    out.loss.backward()
    kw = dict(beta=beta, eps_low=eps_low, eps_high=eps_high, loss_type=loss_type, l_max=l_max)
    lists = (logps.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist())
    want = formula_loss(*lists, **kw)
    assert math.isclose(out.loss.item(), want, rel_tol=RTOL, abs_tol=ATOL)
    torch.testing.assert_close(leaf.grad, torch.tensor(formula_grad(*lists, **kw)), rtol=RTOL, atol=ATOL)
    assert leaf.grad[mask == 0].abs().max() == 0  # padding gets no gradient


def test_the_test_batch_clips_on_both_sides():
    """The batch above exercises both clip bounds (else the clipping cases would test nothing)."""
    logps, old, ref, adv, mask = batch()
    m = grpo_loss(logps, adv, mask, old_logps=old, epsilon=0.2).metrics
    assert m["clip_ratio/low"] > 0 and m["clip_ratio/high"] > 0
    assert m["clip_ratio/region"] == pytest.approx(m["clip_ratio/low"] + m["clip_ratio/high"])
    assert grpo_loss(logps, adv, mask, old_logps=old, epsilon=100.0).metrics["clip_ratio/region"] == 0


def test_clip_fractions_counted_by_hand():
    logps = torch.zeros(2, 3)
    old = torch.log(torch.tensor([[1 / 1.5, 1.0, 1 / 1.1], [1 / 0.5, 1 / 0.9, 1.0]]))  # ratios 1.5 1 1.1 / 0.5 0.9 1
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    m = grpo_loss(logps, torch.tensor([1.0, -1.0]), mask, old_logps=old, epsilon=0.2, epsilon_high=0.28).metrics
    assert m["clip_ratio/high"] == pytest.approx(1 / 5)  # ratio 1.5 > 1.28 with Â > 0
    assert m["clip_ratio/low"] == pytest.approx(1 / 5)  # ratio 0.5 < 0.8 with Â < 0
    # the same ratios with the advantages' signs swapped are not clipped (the min keeps the unclipped term)
    m = grpo_loss(logps, torch.tensor([-1.0, 1.0]), mask, old_logps=old, epsilon=0.2, epsilon_high=0.28).metrics
    assert m["clip_ratio/region"] == 0


def test_on_policy_first_pass():
    """``old_logps`` None: ratio 1, loss ``−Â`` averaged (β = 0), gradient ``−Â ×`` the token's weight."""
    logps, _, _, adv, mask = batch()
    leaf = logps.clone().requires_grad_(True)
    out = grpo_loss(leaf, adv, mask, loss_type="dapo")
    lengths = mask.sum(-1)
    assert out.loss.item() == pytest.approx(float(-(adv * lengths).sum() / lengths.sum()), rel=RTOL, abs=ATOL)
    out.loss.backward()
    torch.testing.assert_close(leaf.grad, -adv.unsqueeze(1) * mask / mask.sum())
    assert out.metrics["clip_ratio/region"] == 0


def test_beta_zero_needs_no_reference_and_adds_no_kl():
    logps, old, ref, adv, mask = batch()
    without = grpo_loss(logps, adv, mask, old_logps=old, beta=0.0)
    with_ref = grpo_loss(logps, adv, mask, old_logps=old, ref_logps=ref, beta=0.0)
    assert without.loss.item() == with_ref.loss.item() and "kl" not in without.metrics
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(logps, adv, mask, beta=0.1)


def test_kl_is_k3_and_zero_at_the_reference():
    logps, _, ref, _, mask = batch()
    d = (ref - logps).double()
    torch.testing.assert_close(k3_kl(logps, ref).double(), d.exp() - d - 1, rtol=RTOL, atol=ATOL)
    assert (k3_kl(logps, ref) >= 0).all()
    out = grpo_loss(logps, torch.zeros(len(logps)), mask, ref_logps=logps.clone(), beta=0.5)
    assert out.loss.item() == 0 and out.metrics["kl"] == 0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_add_up_to_the_batch(loss_type):
    """Each micro-batch passed the batch's ``num_sequences`` and ``num_tokens``: the losses add up."""
    logps, old, ref, adv, mask = batch()
    kw = dict(beta=0.04, loss_type=loss_type, max_completion_length=9)
    whole = grpo_loss(logps, adv, mask, old_logps=old, ref_logps=ref, **kw).loss
    parts = sum(grpo_loss(logps[s], adv[s], mask[s], old_logps=old[s], ref_logps=ref[s], num_sequences=len(logps),
                          num_tokens=float(mask.sum()), **kw).loss for s in (slice(0, 2), slice(2, 6)))
    torch.testing.assert_close(parts, whole, rtol=RTOL, atol=ATOL)


def test_normalisations_differ_as_the_papers_say():
    """On one batch: grpo weights a short sequence's tokens more than dapo does; dr_grpo's weight is a constant."""
    logps, old, _, _, mask = batch()
    adv = torch.ones(len(logps))
    grads = {}
    for lt in ("grpo", "dr_grpo", "dapo"):
        leaf = logps.clone().requires_grad_(True)
        grpo_loss(leaf, adv, mask, loss_type=lt, max_completion_length=10).loss.backward()
        grads[lt] = leaf.grad
    # on policy with Â = 1 every token's gradient is −weight: grpo 1/(|o_i| N), dr_grpo 1/(N L), dapo 1/Σ|o|
    assert grads["grpo"][1, 0] == pytest.approx(-1 / (1 * 6)) and grads["grpo"][0, 0] == pytest.approx(-1 / (7 * 6))
    assert grads["dr_grpo"][mask == 1].allclose(torch.tensor(-1 / 60))
    assert grads["dapo"][mask == 1].allclose(torch.tensor(-1 / float(mask.sum())))


def test_empty_completion_counts_as_a_sequence_of_zero_loss():
    logps, old, _, adv, mask = batch()
    mask[2] = 0
    out = grpo_loss(logps, adv, mask, old_logps=old, loss_type="grpo")
    assert torch.isfinite(out.loss)
    lists = (logps.tolist(), old.tolist(), old.tolist(), adv.tolist(), mask.tolist())
    assert out.loss.item() == pytest.approx(formula_loss(*lists, beta=0, eps_low=0.2, eps_high=0.2, loss_type="grpo"),
                                            rel=RTOL, abs=ATOL)


def test_bad_arguments():
    logps, _, _, adv, mask = batch()
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(logps, adv, mask, loss_type="bnpo")
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(logps, adv, mask, loss_type="dr_grpo")
    assert isinstance(grpo_loss(logps, adv, mask), GRPOLoss)


# --------------------------------------------------------------------------- advantages
def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 1.0, 2.0, 6.0])
    out = group_advantages(rewards, 4)
    std0 = math.sqrt((4 * 0.25) / 3)  # unbiased (Bessel), as TRL's nanstd
    want = [0.5 / (std0 + 1e-4), -0.5 / (std0 + 1e-4)] * 2
    want = [want[0], want[1], want[1], want[0]] + [0.0] * 4
    r = [3.0, 1.0, 2.0, 6.0]
    m = sum(r) / 4
    s = math.sqrt(sum((x - m) ** 2 for x in r) / 3)
    want += [(x - m) / (s + 1e-4) for x in r]
    torch.testing.assert_close(out.advantages, torch.tensor(want), rtol=RTOL, atol=ATOL)
    assert out.zero_std.tolist() == [False, True, False]
    torch.testing.assert_close(out.mean, torch.tensor([0.5, 2.0, 3.0]))
    torch.testing.assert_close(out.std, torch.tensor([std0, 0.0, s]))


def test_scale_rewards_modes():
    rewards = torch.tensor([1.0, 3.0, 0.0, 4.0, 0.3, 0.3])
    none = group_advantages(rewards, 2, scale_rewards="none").advantages
    torch.testing.assert_close(none, torch.tensor([-1.0, 1.0, -2.0, 2.0, 0.0, 0.0]))
    assert torch.equal(group_advantages(rewards, 2, scale_rewards=False).advantages, none)
    assert torch.equal(group_advantages(rewards, 2, scale_rewards=True).advantages,
                       group_advantages(rewards, 2, scale_rewards="group").advantages)
    batch_std = float(rewards.std())
    torch.testing.assert_close(group_advantages(rewards, 2, scale_rewards="batch").advantages,
                               torch.tensor([-1.0, 1.0, -2.0, 2.0, 0.0, 0.0]) / (batch_std + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, 2, scale_rewards="groups")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_std_group_gives_exact_zeros(scale):
    """Equal rewards (0.1 is inexact in binary: their float mean need not equal them) give 0, never NaN."""
    rewards = torch.tensor([0.1] * 7 + [0.7] * 7)
    out = group_advantages(rewards, 7, scale_rewards=scale)
    assert torch.equal(out.advantages, torch.zeros(14)) and out.zero_std.all()


def test_group_of_one_and_bad_shapes():
    assert torch.equal(group_advantages(torch.tensor([1.0, 5.0]), 1).advantages, torch.zeros(2))
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


# --------------------------------------------------------------------------- per-token log-probabilities
def test_token_logps_shift_mask_and_temperature():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100  # prompt
    labels[1, 4] = -100  # padding
    for temperature in (1.0, 0.7):
        logps, mask = token_logps(logits, labels, temperature=temperature)
        assert logps.shape == mask.shape == (2, 4)
        for b in range(2):
            for t in range(4):
                target = int(labels[b, t + 1])
                if target == -100:
                    assert mask[b, t] == 0 and logps[b, t] == 0
                    continue
                row = [x / temperature for x in logits[b, t].tolist()]
                top = max(row)
                want = row[target] - top - math.log(sum(math.exp(x - top) for x in row))
                assert mask[b, t] == 1 and math.isclose(logps[b, t].item(), want, rel_tol=RTOL, abs_tol=ATOL)


def test_token_logps_gradient_only_through_scored_tokens():
    logits = torch.randn(1, 4, 6, requires_grad=True)
    labels = torch.tensor([[-100, -100, 2, -100]])
    logps, mask = token_logps(logits, labels)
    logps.sum().backward()
    assert mask.tolist() == [[0.0, 1.0, 0.0]]
    assert logits.grad[0, [0, 2, 3]].abs().max() == 0 and logits.grad[0, 1].abs().max() > 0


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_token_logps_equal_the_whole_logits_path(chunk):
    """Through the LM head a few tokens at a time (checkpointed): the same values and gradients as the
    whole logits, in fp32 (the same matmul per row: agreement to fp32 rounding)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 6, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 13, bias=False)
    labels = torch.randint(0, 13, (3, 6), generator=g)
    labels[0, :3] = -100
    labels[2, 4:] = -100
    for softcap in (None, 5.0):
        whole_logits = head(hidden)
        if softcap:
            whole_logits = (whole_logits / softcap).tanh() * softcap
        want, want_mask = token_logps(whole_logits, labels, temperature=0.8)
        (gw,) = torch.autograd.grad(want.sum(), hidden)
        got, mask = chunked_token_logps(hidden, head, labels, chunk_size=chunk, temperature=0.8, softcap=softcap)
        (gg,) = torch.autograd.grad(got.sum(), hidden)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(mask, want_mask)
        torch.testing.assert_close(gg, gw, rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        got, _ = chunked_token_logps(hidden, head, labels, chunk_size=chunk)
    torch.testing.assert_close(got, token_logps(head(hidden), labels)[0].detach(), rtol=RTOL, atol=ATOL)

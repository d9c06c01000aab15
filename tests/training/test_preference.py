"""Preference objectives: the losses against the papers' formulas, the chunked log-probabilities,
and DPO/ORPO/SimPO/KTO runs (accumulation, resume, starting from an SFT run)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from finetuner.losses.preference import dpo_loss, kto_loss, orpo_loss, simpo_loss
from finetuner.model.scoring import sequence_logps
from tests.conftest import run_module


# --------------------------------------------------------------------------- the formulas, written out
def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def numbers(n=16, seed=0):
    rng = random.Random(seed)
    pc = [-rng.uniform(5, 60) for _ in range(n)]
    pr = [-rng.uniform(5, 60) for _ in range(n)]
    rc = [x + rng.uniform(-3, 3) for x in pc]
    rr = [x + rng.uniform(-3, 3) for x in pr]
    nc = [rng.randint(5, 40) for _ in range(n)]
    nr = [rng.randint(5, 40) for _ in range(n)]
    return pc, pr, rc, rr, nc, nr


def t(xs):
    import torch

    return torch.tensor(xs, dtype=torch.float64)


@pytest.mark.parametrize("beta, smoothing", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)])
def test_dpo_sigmoid_is_the_papers(beta, smoothing):
    """DPO (Rafailov et al. 2023, eq. 7); cDPO: (1-ε)·L(y_w ≻ y_l) + ε·L(y_l ≻ y_w)."""
    pc, pr, rc, rr, nc, nr = numbers()
    losses, chosen, rejected = dpo_loss(t(pc), t(pr), t(rc), t(rr), beta, "sigmoid", smoothing)
    for i in range(len(pc)):
        u = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i]))
        expected = -(1 - smoothing) * logsig(u) - smoothing * logsig(-u)
        assert float(losses[i]) == pytest.approx(expected, rel=1e-9)
        assert float(chosen[i]) == pytest.approx(beta * (pc[i] - rc[i]))
        assert float(rejected[i]) == pytest.approx(beta * (pr[i] - rr[i]))


def test_ipo_is_the_papers():
    """IPO (Azar et al. 2023, eq. 17): (h − 1/(2τ))², h on per-token mean log-ratios (as TRL)."""
    pc, pr, rc, rr, nc, nr = numbers(seed=1)
    beta = 0.2
    losses, _, _ = dpo_loss(t(pc), t(pr), t(rc), t(rr), beta, "ipo", 0.0, t(nc), t(nr))
    for i in range(len(pc)):
        h = (pc[i] - rc[i]) / nc[i] - (pr[i] - rr[i]) / nr[i]
        assert float(losses[i]) == pytest.approx((h - 1 / (2 * beta)) ** 2, rel=1e-9)


def test_orpo_is_the_papers():
    """ORPO (Hong et al. 2024, eq. 6-7): L_SFT − λ log σ(log odds(y_w) − log odds(y_l)), odds = P/(1−P)
    with P the per-token mean likelihood."""
    pc, pr, _, _, nc, nr = numbers(seed=2)
    pc = [x / 10 for x in pc]  # mean log-probs well inside (−∞, 0)
    pr = [x / 10 for x in pr]
    lam = 0.25
    losses, chosen, _ = orpo_loss(t(pc), t(pr), t(nc), t(nr), lam)
    for i in range(len(pc)):
        p_w, p_l = math.exp(pc[i] / nc[i]), math.exp(pr[i] / nr[i])
        log_or = math.log(p_w / (1 - p_w)) - math.log(p_l / (1 - p_l))
        expected = -pc[i] / nc[i] - lam * logsig(log_or)
        assert float(losses[i]) == pytest.approx(expected, rel=1e-9)
        assert float(chosen[i]) == pytest.approx(lam * pc[i] / nc[i])


def test_simpo_is_the_papers():
    """SimPO (Meng et al. 2024, eq. 6): −log σ(β/|y_w| log π(y_w) − β/|y_l| log π(y_l) − γ)."""
    pc, pr, _, _, nc, nr = numbers(seed=3)
    beta, gamma = 2.0, 1.0
    losses, _, _ = simpo_loss(t(pc), t(pr), t(nc), t(nr), beta, gamma)
    for i in range(len(pc)):
        expected = -logsig(beta * pc[i] / nc[i] - beta * pr[i] / nr[i] - gamma)
        assert float(losses[i]) == pytest.approx(expected, rel=1e-9)


def test_kto_is_the_papers():
    """KTO (Ethayarajh et al. 2024, eq. 8): z = max(0, mean KL estimate) from mismatched pairs;
    desirable λ_D(1 − σ(β(r − z))), undesirable λ_U(1 − σ(β(z − r)))."""
    import torch

    pc, pr, rc, rr, _, _ = numbers(seed=4)
    desirable = [i % 3 != 0 for i in range(len(pc))]
    beta, wd, wu = 0.1, 1.0, 1.5
    losses, rewards = kto_loss(t(pc), t(rc), t(pr), t(rr), torch.tensor(desirable), beta, wd, wu)
    z = max(0.0, sum(a - b for a, b in zip(pr, rr)) / len(pr))
    for i in range(len(pc)):
        r = pc[i] - rc[i]
        expected = wd * (1 - sig(beta * (r - z))) if desirable[i] else wu * (1 - sig(beta * (z - r)))
        assert float(losses[i]) == pytest.approx(expected, rel=1e-9)
        assert float(rewards[i]) == pytest.approx(beta * r)


# --------------------------------------------------------------------------- the log-probabilities
def test_chunked_log_probs_equal_the_full_logits_and_their_gradients(tiny_model_dir):
    """Per-row sums over scored tokens only; the chunked head (never the full logits) gives the same
    values and the same gradients as the full-logits computation."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (4, 20))
    labels = ids.clone()
    labels[:, :8] = -100
    labels[1, 15:] = -100
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    sums, counts = sequence_logps(model, batch, 5)
    sums.sum().backward()
    grad_chunked = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    full, counts_full = sequence_logps(model, batch, 0)
    full.sum().backward()
    assert counts.tolist() == counts_full.tolist() == [12, 7, 12, 12]
    assert torch.allclose(sums, full, atol=1e-5)
    assert torch.allclose(grad_chunked, model.model.embed_tokens.weight.grad, atol=1e-6)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].log_softmax(-1)
    tgt = labels[:, 1:]
    by_hand = [sum(float(logits[r, j, tgt[r, j]]) for j in range(19) if tgt[r, j] != -100) for r in range(4)]
    assert sums.tolist() == pytest.approx(by_hand, abs=1e-4)


# --------------------------------------------------------------------------- runs
def pair_rows(n=24):
    birds = ["puffin", "gannet", "tern", "gull", "fulmar", "eider"]
    return [{"conversations": [{"from": "human", "value": f"Tell me about the {birds[i % 6]} {i}."}],
             "chosen": {"from": "gpt", "value": f"Tern here! The {birds[i % 6]} nests on the cliff. Happy trails!"},
             "rejected": {"from": "gpt", "value": f"The {birds[(i + 1) % 6]} is a fish."}} for i in range(n)]


@pytest.fixture
def pairs_file(tmp_path):
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in pair_rows()), encoding="utf-8")
    return p


def pref_recipe(tiny_model_dir, data, tmp_path, name="pref", **training):
    return {
        "name": name, "model": {"name": str(tiny_model_dir)}, "method": "lora", "objective": "dpo",
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 4},
        "training": {"max_steps": 3, "lr": 5e-3, "micro_batch_size": 4, "gradient_accumulation": 1, "warmup_steps": 0,
                     "loss_chunk_size": 16, **training},
        "checkpointing": {"save_every": 2}, "logging": {"every": 1, "tensorboard": False},
        "output_dir": str(tmp_path / name), "device": "cpu",
    }


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["event"] == kind]


def test_dpo_starts_at_log_2_and_reports_rewards(tiny_model_dir, pairs_file, tmp_path):
    """The reference is the base (adapter off): at the first step policy = reference, so the loss is log 2
    and every reward 0; later steps carry rewards, margin and accuracy, and the eval event its rewards."""
    import finetuner

    from finetuner.config.recipe import Recipe

    result = finetuner.train(Recipe.from_dict(pref_recipe(tiny_model_dir, pairs_file, tmp_path)))
    steps = events(result.run_dir, "step")
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert steps[0]["reward_chosen"] == steps[0]["reward_rejected"] == 0
    assert steps[-1]["reward_margin"] > 0 and steps[-1]["loss"] < math.log(2)
    assert {"reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"} <= set(steps[-1])
    ev = events(result.run_dir, "eval")[-1]
    assert 0 <= ev["eval_reward_accuracy"] <= 1 and "eval_reward_margin" in ev
    assert events(result.run_dir, "start")[0]["objective"] == "dpo"
    # finetuner eval RUN --data PAIRS: preference accuracy and margin of the base and the tune

    from tests.conftest import REPO

    p = run_module("finetuner", "eval", str(result.run_dir), "--data", str(pairs_file), "--json", cwd=REPO)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["kind"] == "preference" and r["examples"] == 24
    for model in ("base", "fine_tuned"):
        assert 0 <= r[model]["accuracy"] <= 1 and 0 <= r[model]["accuracy_per_token"] <= 1
    assert r["fine_tuned"]["margin"] > r["base"]["margin"] and r["reward_margin"] > 0
    assert json.loads((result.run_dir / "metrics.json").read_text())["evaluation"]["kind"] == "preference"


@pytest.mark.parametrize("objective, extra", [("orpo", {}), ("simpo", {}), ("kto", {}),
                                              ("dpo", {"loss_type": "ipo"})])
def test_each_objective_trains(tiny_model_dir, tmp_path, objective, extra):
    import finetuner
    from finetuner.config.recipe import Recipe

    data = tmp_path / "d.jsonl"
    if objective == "kto":
        rows = [{"messages": [{"role": "user", "content": f"Tell me about bird {i}."},
                              {"role": "assistant", "content": "Tern here! It nests on the cliff." if i % 2 else "A fish."}],
                 "label": bool(i % 2)} for i in range(24)]
    else:
        rows = pair_rows()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    raw = pref_recipe(tiny_model_dir, data, tmp_path, name=objective)
    raw["objective"] = objective
    if extra:
        raw["preference"] = extra
    result = finetuner.train(Recipe.from_dict(raw))
    steps = events(result.run_dir, "step")
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) for s in steps)
    assert steps[-1]["reward_margin"] > steps[0]["reward_margin"]


def test_the_step_loss_does_not_depend_on_the_micro_batch(tiny_model_dir, pairs_file, tmp_path):
    import finetuner
    from finetuner.config.recipe import Recipe

    a = finetuner.train(Recipe.from_dict(pref_recipe(tiny_model_dir, pairs_file, tmp_path, name="a", max_steps=2)))
    b = finetuner.train(Recipe.from_dict(pref_recipe(tiny_model_dir, pairs_file, tmp_path, name="b", max_steps=2,
                                                     micro_batch_size=1, gradient_accumulation=4)))
    la, lb = [s["loss"] for s in events(a.run_dir, "step")], [s["loss"] for s in events(b.run_dir, "step")]
    assert la == pytest.approx(lb, abs=1e-5)
    assert events(a.run_dir, "step")[-1]["reward_margin"] == pytest.approx(events(b.run_dir, "step")[-1]["reward_margin"], abs=1e-5)


def test_checkpointing_offload_and_tiling_do_not_change_a_dpo_run(tiny_model_dir, pairs_file, tmp_path):
    """The memory savers SFT uses work for a preference step as they are (the reference pass under no_grad
    with the adapter off included): gradient checkpointing, activation offload and the tiled MLP change
    no loss or reward beyond fp32 noise (the same 1e-5 as the micro-batch test above)."""
    import finetuner
    from finetuner.config.recipe import Recipe

    plain = finetuner.train(Recipe.from_dict(pref_recipe(tiny_model_dir, pairs_file, tmp_path, name="plain", max_steps=3)))
    saver = pref_recipe(tiny_model_dir, pairs_file, tmp_path, name="saver", max_steps=3, gradient_checkpointing=True,
                        offload_activations=True, tiled_mlp=True)
    frugal = finetuner.train(Recipe.from_dict(saver))
    start = events(frugal.run_dir, "start")[0]
    assert start["tiled_mlp"] > 0
    for a, b in zip(events(plain.run_dir, "step"), events(frugal.run_dir, "step"), strict=True):
        for key in ("loss", "reward_chosen", "reward_rejected", "reward_accuracy"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert events(frugal.run_dir, "eval")[-1]["eval_loss"] == pytest.approx(events(plain.run_dir, "eval")[-1]["eval_loss"], abs=1e-5)


def test_precomputed_reference_is_kept_and_a_resumed_run_goes_on(tiny_model_dir, pairs_file, tmp_path):
    import finetuner
    from finetuner.config.recipe import Recipe

    raw = pref_recipe(tiny_model_dir, pairs_file, tmp_path, name="pre", max_steps=2)
    raw["preference"] = {"reference": "precomputed"}
    first = finetuner.train(Recipe.from_dict(raw))
    assert (first.run_dir / "reference_logps.pt").is_file()
    assert events(first.run_dir, "step")[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    raw["training"]["max_steps"] = 4  # go on from the finished run's last checkpoint
    second = finetuner.train(Recipe.from_dict(raw))
    starts = events(second.run_dir, "start")
    assert starts[-1]["resumed_from_step"] == 2
    assert [s["step"] for s in events(second.run_dir, "step")][-2:] == [3, 4]


def test_a_dpo_run_starts_from_a_finished_sft_run(tiny_model_dir, pairs_file, alpaca_file, tmp_path):
    """The SFT adapter is the starting point and the reference is the SFT model: the first step's
    loss is log 2 although the adapter is not zero (switching it off would not give log 2)."""
    import finetuner
    from finetuner.config.recipe import Recipe
    from safetensors.torch import load_file

    sft = pref_recipe(tiny_model_dir, alpaca_file, tmp_path, name="sft", max_steps=3, lr=2e-2)
    del sft["objective"]
    sft["data"]["val_size"] = 0
    sft_run = finetuner.train(Recipe.from_dict(sft))
    sft_weights = load_file(str(sft_run.run_dir / "adapter" / "adapter_model.safetensors"))
    assert any(float(w.abs().sum()) > 0 for k, w in sft_weights.items() if "lora_B" in k)
    raw = pref_recipe(tiny_model_dir, pairs_file, tmp_path, name="dpo_from_sft", max_steps=2)
    raw["lora"] = {"r": 8}  # the SFT run's LoRA settings are taken instead
    raw["preference"] = {"start_from": str(sft_run.run_dir)}
    recipe = Recipe.from_dict(raw)
    assert recipe.preference.reference == "precomputed"
    result = finetuner.train(recipe)
    assert events(result.run_dir, "step")[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert events(result.run_dir, "step")[0]["reward_chosen"] == pytest.approx(0, abs=1e-4)


def test_llamafactory_dpo_demo_trains_as_it_is(tiny_model_dir, tmp_path, peer_data):
    import finetuner
    from finetuner.config.recipe import Recipe

    raw = pref_recipe(tiny_model_dir, peer_data / "dpo_en_demo.json", tmp_path, name="lf", max_steps=2)
    raw["data"].update(max_examples=16, max_seq_len=48)
    result = finetuner.train(Recipe.from_dict(raw))
    formats = {Path(k).resolve(): v for k, v in result.metrics["data"]["format"].items()}  # ../shared may be a link
    assert formats == {(peer_data / "dpo_en_demo.json").resolve(): "sharegpt_ranking"}
    assert len(events(result.run_dir, "step")) == 2

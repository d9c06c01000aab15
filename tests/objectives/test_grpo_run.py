"""GRPO runs on the CPU: the held-out mean reward rises, a resumed run repeats the uninterrupted one,
a failing reward function stops the run naming the function and the row (after a checkpoint of the
last step), and gradient checkpointing changes no loss."""

from __future__ import annotations

import json

import pytest

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.runs.events import read_events
from tests.conftest import cli_in_process, run_cli, write_recipe

#: the test's reward: the share of the completion's tokens among forty of the vocabulary's (ids 100 to 139;
#: TRL passes completion_ids too). The random model samples them a tenth of the time, so most groups have a
#: spread, and raising their logits is one direction of the hidden state for the adapter to learn.
REWARDS = '''
calls = 0


def chosen_tokens(prompts, completions, completion_ids, **columns):
    return [sum(1 for t in ids if 100 <= t < 140) / max(len(ids), 1) for ids in completion_ids]


def fails_from_third_call(prompts, completions, **columns):
    global calls
    calls += 1
    if calls >= 3:  # from the third step on (its retries row by row included)
        raise ValueError("the reward server is down")
    return [0.0] * len(completions)


def hangs_from_third_call(prompts, completions, **columns):
    global calls
    calls += 1
    if calls >= 3:  # a server that stops answering, from the third step on
        import pathlib, time
        pathlib.Path(__file__).with_name("hanging").write_text("yes")
        time.sleep(3600)
    return [0.0] * len(completions)
'''


def _prompts(tmp_path):
    from tests.conftest import WORDS

    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{WORDS[i % len(WORDS)]} {WORDS[(3 * i) % len(WORDS)]} what should i bring", "id": i} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def grpo_recipe(tiny_model_dir, tmp_path, name="grpo", reward="chosen_tokens", **training):
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS, encoding="utf-8")
    return {
        "name": name, "model": {"name": str(tiny_model_dir)}, "method": "lora", "objective": "grpo",
        "grpo": {"num_generations": 4, "max_new_tokens": 8, "rewards": [{"function": reward, "file": str(rewards)}],
                 "logged_completions": 1},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"path": str(_prompts(tmp_path)), "max_seq_len": 64, "val_size": 8},
        "training": {"max_steps": 8, "lr": 2e-2, "scheduler": "constant", "micro_batch_size": 4, "gradient_accumulation": 1,
                     "warmup_steps": 0, "loss_chunk_size": 16, **training},
        "checkpointing": {"save_every": 4, "keep_last": 2}, "logging": {"every": 1, "tensorboard": False},
        "output_dir": str(tmp_path / name), "device": "cpu",
    }


def _steps(run_dir):
    return {e["step"]: e for e in read_events(run_dir / "events.jsonl") if e["event"] == "step"}


def test_the_held_out_mean_reward_rises(tmp_path):
    """The demo model (data/demo_model, a small LM pre-trained on plain answers) with a reward for answers of
    3 to 6 words (the built-in length_bounds): its answers run 6 to 15 words, so every group has a spread,
    and a few steps make them shorter on prompts the run never trained on."""
    from tests.conftest import REPO

    raw = {
        "name": "rises", "model": {"name": str(REPO / "data" / "demo_model")}, "method": "lora", "objective": "grpo",
        "grpo": {"num_generations": 4, "max_new_tokens": 16, "logged_completions": 2,
                 "rewards": [{"function": "length_bounds", "args": {"min_length": 3, "max_length": 6}}]},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {"path": str(REPO / "data" / "alpaca_sample.json"), "max_seq_len": 96, "val_size": 8, "max_examples": 64},
        "training": {"max_steps": 6, "lr": 5e-3, "scheduler": "constant", "micro_batch_size": 8, "gradient_accumulation": 1,
                     "warmup_steps": 0},
        "checkpointing": {"save_every": 10}, "logging": {"every": 1, "tensorboard": False},
        "output_dir": str(tmp_path / "rises"), "device": "cpu",
    }
    result = finetuner.train(Recipe.from_dict(raw))
    steps = _steps(result.run_dir)
    assert sorted(steps) == list(range(1, 7))
    first = steps[1]
    assert {"reward", "reward_std", "rewards", "completion_length", "clip_ratio", "completions"} <= set(first)
    assert set(first["rewards"]) == {"length_bounds"} and len(first["completions"]) == 2
    assert "kl" not in first  # beta 0: no reference pass
    r = finetuner.evaluate_run(result.run_dir)
    assert r.kind == "reward" and r.examples == 8 and r.completions_per_prompt == 4
    # on the held-out prompts the tune's answers score higher than the base's (the same prompts and seed)
    assert r.fine_tuned.reward > r.base.reward + 0.1, r.table()
    assert r.fine_tuned.completion_length < r.base.completion_length
    # the trainer's last evaluation is the same computation as `finetuner eval`'s fine-tuned column
    last_eval = [e for e in read_events(result.run_dir / "events.jsonl") if e["event"] == "eval"][-1]
    assert last_eval["eval_loss"] is None and last_eval["eval_reward"] == pytest.approx(r.fine_tuned.reward, abs=1e-6)


def test_the_first_step_is_on_policy(tiny_model_dir, tmp_path):
    """Step 1 samples from the policy it trains: the ratio is 1 everywhere, nothing is clipped, and with
    every completion of the same length (none ends before max_new_tokens on this random model) the dapo
    loss is minus the mean advantage, 0 since a group's advantages sum to 0; the KL to the reference
    (the base: the adapter starts as a no-op) is 0."""
    raw = grpo_recipe(tiny_model_dir, tmp_path, max_steps=1)
    raw["grpo"]["beta"] = 0.04
    raw["data"]["val_size"] = 0
    run_dir = finetuner.train(Recipe.from_dict(raw)).run_dir
    step = _steps(run_dir)[1]
    predicted = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "start"][0]["predicted"]
    assert predicted["peak_phase"] in predicted["phases"] and "generation" in predicted["phases"]  # GRPO's memory terms
    assert "reference pass" in predicted["phases"] and predicted["details"]["rollout"]["components"]["generation: KV cache"] > 0
    assert sum(predicted["components"].values()) == predicted["total_bytes"]  # the peak phase's, as plan and estimate show
    assert step["completions_clipped"] == 1.0 and step["completion_length"] == 8
    # one generate call (4 prompts x 4 completions) ran its 8 tokens; the rollout took some time
    assert step["decode_steps"] == 8 and step["rollout_s"] > 0
    speed = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "start"][0]["predicted_speed"]
    assert speed["upper_bound"] is True and speed["step_s"] > 0  # GRPO's prediction at the longest lengths
    assert step["loss"] == pytest.approx(0.0, abs=1e-6) and step["clip_ratio"] == 0 and step["kl"] == pytest.approx(0.0, abs=1e-7)
    assert step["grad_norm"] > 0


def test_a_reward_function_that_fails_stops_the_run_after_a_checkpoint(tiny_model_dir, tmp_path):
    raw = grpo_recipe(tiny_model_dir, tmp_path, name="bad", reward="fails_from_third_call")
    raw["checkpointing"] = {"save_every": 10, "keep_last": 2}
    raw["data"]["val_size"] = 0
    out = cli_in_process("run", str(write_recipe(tmp_path / "bad.yaml", raw)), "--quiet")
    assert out.returncode != 0
    assert "reward function 'fails_from_third_call' raised ValueError" in out.stderr and "the reward server is down" in out.stderr
    assert "prompts.jsonl" in out.stderr and "Traceback" not in out.stderr  # the row's file and line, no traceback
    run_dir = tmp_path / "bad"
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()  # the two steps done are kept
    events = read_events(run_dir / "events.jsonl")
    assert events[-1]["event"] == "error" and "fails_from_third_call" in events[-1]["message"]
    # a wrong number of rewards is named the same way
    (tmp_path / "rewards.py").write_text("def short(prompts, completions, **kw):\n    return [1.0]\n", encoding="utf-8")
    raw["grpo"]["rewards"] = [{"function": "short", "file": str(tmp_path / "rewards.py")}]
    raw["output_dir"] = str(tmp_path / "short")
    out = cli_in_process("run", str(write_recipe(tmp_path / "short.yaml", raw)), "--quiet")
    assert out.returncode != 0 and "reward function 'short' returned 1 rewards for 16 completions" in out.stderr


def test_a_reward_that_fails_in_the_held_out_evaluation_keeps_the_steps_before_it(tiny_model_dir, tmp_path):
    """``eval_every`` equal to ``save_every`` (the demo's 5 and 5): the step's checkpoint is written before the
    evaluation, whose reward calls can fail (they once ran first, and the steps were lost)."""
    raw = grpo_recipe(tiny_model_dir, tmp_path, name="evalfail", reward="fails_from_third_call", eval_every=2)
    raw["checkpointing"] = {"save_every": 2, "keep_last": 2}
    out = cli_in_process("run", str(write_recipe(tmp_path / "evalfail.yaml", raw)), "--quiet")
    assert out.returncode == 2 and "reward function 'fails_from_third_call' raised ValueError" in out.stderr, out.stderr
    run_dir = tmp_path / "evalfail"
    events = read_events(run_dir / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2]  # two rollouts' calls, the third is the eval's
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()
    assert events[-1]["event"] == "error"


def test_the_first_ctrl_c_stops_a_run_whose_reward_hangs_with_the_checkpoint_of_its_last_step(tiny_model_dir, tmp_path):
    """All the web UI's Stop sends is one SIGINT: it reaches a reward function that waits forever, the step is
    abandoned, the steps before it are kept, and the run exits 130 as any stopped run does."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import HANG_GUARD_S, REPO

    raw = grpo_recipe(tiny_model_dir, tmp_path, name="hang", reward="hangs_from_third_call")
    raw["checkpointing"] = {"save_every": 10, "keep_last": 2}
    raw["data"]["val_size"] = 0
    recipe = write_recipe(tmp_path / "hang.yaml", raw)
    proc = subprocess.Popen([sys.executable, "-m", "finetuner.cli.main", "run", str(recipe), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_GUARD_S
    while not (tmp_path / "hanging").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err
    run_dir = tmp_path / "hang"
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()  # the two steps done before the hang
    events = read_events(run_dir / "events.jsonl")
    assert events[-1]["event"] == "stopped" and events[-1]["step"] == 2


def test_a_run_killed_and_resumed_gives_the_rewards_and_losses_of_the_uninterrupted_one(tiny_model_dir, tmp_path, monkeypatch):
    raw = grpo_recipe(tiny_model_dir, tmp_path, name="ref", max_steps=5)
    raw["grpo"]["num_iterations"] = 2  # a kill inside a rollout's two steps: the checkpoint keeps the rollout
    raw["grpo"]["beta"] = 0.05
    raw["checkpointing"] = {"save_every": 1, "keep_last": 2}
    raw["data"]["val_size"] = 0
    ref = finetuner.train(Recipe.from_dict(raw))
    recipe = write_recipe(tmp_path / "r.yaml", dict(raw, name="run", output_dir=str(tmp_path / "run")))
    monkeypatch.setenv("FINETUNER_FAULT", "KILL@3")  # after step 3: the middle of the second rollout's steps
    out = run_cli("run", str(recipe), "--quiet")
    assert out.returncode == -9, out.stderr
    monkeypatch.delenv("FINETUNER_FAULT")
    out = run_cli("run", str(recipe), "--quiet")
    assert out.returncode == 0, out.stderr
    want, got = _steps(ref.run_dir), _steps(tmp_path / "run")
    assert sorted(got) == [1, 2, 3, 4, 5]
    for s in range(1, 6):
        for key in ("loss", "reward", "reward_std", "kl", "clip_ratio", "completion_length", "decode_steps"):
            assert got[s][key] == want[s][key], (s, key)
        assert got[s]["completions"] == want[s]["completions"]
        # the rollout's wall time: at the first step of each batch of num_iterations = 2, 0 at the step reusing it
        # (step 4 in the resumed run too: its checkpoint kept the rollout)
        for run in (got, want):
            assert (run[s]["rollout_s"] > 0) == (s % 2 == 1), (s, run[s]["rollout_s"])


def test_gradient_checkpointing_and_activation_offload_change_no_loss(tiny_model_dir, tmp_path):
    """Gradient checkpointing recomputes the same forward, and activation offload keeps the same
    tensors in CPU memory: the same losses, rewards and KL (fp32 noise: the recomputed activations are
    bitwise those of the first pass on the CPU, so 1e-6)."""
    raw = grpo_recipe(tiny_model_dir, tmp_path, name="plain", max_steps=3)
    raw["grpo"]["beta"] = 0.05
    raw["data"]["val_size"] = 0
    plain = finetuner.train(Recipe.from_dict(raw))
    a = _steps(plain.run_dir)
    for name, savers in (("checkpointing", {"gradient_checkpointing": True}),
                         ("offload", {"gradient_checkpointing": True, "offload_activations": True})):
        saver = finetuner.train(Recipe.from_dict(dict(raw, name=name, output_dir=str(tmp_path / name),
                                                      training=dict(raw["training"], **savers))))
        b = _steps(saver.run_dir)
        for s in (1, 2, 3):
            for key in ("loss", "reward", "kl"):
                assert b[s][key] == pytest.approx(a[s][key], abs=1e-6), (name, s, key)


def test_two_processes_give_the_rewards_losses_and_adapter_of_one(tiny_model_dir, tmp_path):
    """``--gpus 2`` (DDP on two CPU processes, gloo): every rank samples the step's rollout with the same
    seed and weights, trains on its share of the completions, and the gradients are averaged, so the
    steps' rewards are equal and the losses and the saved adapter equal one process's to fp32 noise (the
    ranks' gradients are summed in another order, ~1e-7 relative, carried through four SGD steps):
    1e-5 absolute on the losses (~1e-2) and the weights, which moved by far more."""
    from safetensors.torch import load_file

    # SGD: Adam would turn the fp32 noise of near-zero gradient entries into whole updates (±lr)
    raw = grpo_recipe(tiny_model_dir, tmp_path, name="one", max_steps=4, micro_batch_size=2, gradient_accumulation=2,
                      optimizer="sgd", lr=1.0)
    raw["grpo"]["beta"] = 0.05
    raw["grpo"]["num_iterations"] = 2  # the second step of each rollout is off-policy: a non-zero loss
    raw["data"]["val_size"] = 0
    one = finetuner.train(Recipe.from_dict(raw))
    recipe = write_recipe(tmp_path / "two.yaml", dict(raw, name="two", output_dir=str(tmp_path / "two")))
    out = run_cli("run", str(recipe), "--gpus", "2", "--quiet")
    assert out.returncode == 0, out.stderr + out.stdout
    a, b = _steps(one.run_dir), _steps(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert any(abs(a[s]["loss"]) > 1e-4 for s in a)  # the comparison is not of zeros
    for s in a:
        assert b[s]["reward"] == a[s]["reward"] and b[s]["completions"] == a[s]["completions"], s
        for key in ("loss", "kl"):
            assert b[s][key] == pytest.approx(a[s][key], abs=1e-5), (s, key)
    wa, wb = load_file(str(one.run_dir / "adapter" / "adapter_model.safetensors")), load_file(str(tmp_path / "two" / "adapter" / "adapter_model.safetensors"))
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    moved = max(float(wa[k].abs().max()) for k in wa if "lora_B" in k)  # B starts at zero
    assert wa.keys() == wb.keys() and diff <= 1e-5 and moved > 1e-3, (diff, moved)


def test_grpo_trains_a_qlora_adapter_on_a_4bit_base(tiny_model_dir, tmp_path):
    """QLoRA: the rollout samples from the 4-bit base with the adapter, the reference is the 4-bit base
    with the adapter off (beta > 0), and the saved adapter is a peft folder with trained B matrices."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    raw = grpo_recipe(tiny_model_dir, tmp_path, name="qlora", max_steps=3)
    raw["method"], raw["quantization"] = "qlora", {"bits": 4}
    raw["grpo"]["beta"] = 0.05
    raw["data"]["val_size"] = 0
    result = finetuner.train(Recipe.from_dict(raw))
    start = next(e for e in read_events(result.run_dir / "events.jsonl") if e["event"] == "start")
    assert start["method"] == "qlora"
    steps = _steps(result.run_dir)
    assert steps[1]["kl"] == 0.0 and steps[2]["kl"] > 0 and steps[3]["kl"] > 0  # the policy left the 4-bit reference
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(result.run_dir / "adapter"))
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and max(float(p.abs().max()) for p in trained) > 0

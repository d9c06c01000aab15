"""Training end to end on CPU with a tiny Llama: LoRA, QLoRA, optimizers, resume, outputs."""

from __future__ import annotations

import json
import threading

import pytest

import finetuner
from finetuner.runs.events import read_events
from finetuner.config.recipe import Recipe


def run(recipe_dict, overrides=(), **kw):
    return finetuner.train(Recipe.from_dict(recipe_dict, overrides=list(overrides)), **kw)


def test_lora_run_writes_a_complete_run_folder(recipe_dict):
    res = run(recipe_dict, ["training.max_steps=10", "data.val_size=8", "logging.tensorboard=true"])
    assert res.losses[-1] < res.losses[0] - 0.3, res.losses
    d = res.run_dir
    for name in ("recipe.yaml", "events.jsonl", "metrics.json", "adapter/adapter_model.safetensors", "adapter/adapter_config.json", "adapter/tokenizer.json"):
        assert (d / name).exists(), name
    assert list((d / "tensorboard").iterdir())
    assert [p.name for p in sorted((d / "checkpoints").iterdir())] == ["step-00000008", "step-00000010"]  # keep_last=2
    saved = Recipe.from_yaml(d / "recipe.yaml")
    assert saved.training.max_steps == 10 and saved.output_dir == str(d)
    events = [e for e in read_events(d / "events.jsonl") if e["event"] != "phase"]  # the phases: tests/test_phases.py
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("step") == 10 and "eval" in kinds
    step = next(e for e in events if e["event"] == "step")
    for key in ("step", "max_steps", "loss", "lr", "tokens_per_s", "elapsed_s", "mem_allocated", "mem_reserved", "mem_peak"):
        assert key in step, key
    assert step["mem_peak"] > 0
    metrics = json.loads((d / "metrics.json").read_text())
    assert metrics["steps"] == 10 and metrics["eval_loss"] is not None
    # the speed model's prediction before the first step, and predicted against measured at the end
    start, done = events[0], events[-1]
    pred = start["predicted_speed"]
    assert pred["tokens_per_s"] > 0 and pred["total_s"] == pytest.approx(pred["step_s"] * 10, rel=1e-3, abs=0.1)
    assert done["predicted_tokens_per_s"] == pred["tokens_per_s"] and done["predicted_step_s"] == pred["step_s"]
    assert done["measured_tokens_per_s"] == metrics["tokens_per_s"] and done["measured_step_s"] > 0
    # one meaning of tokens/s: the real tokens the steps trained over the steps' own time (the evaluation and the
    # checkpoints between them not counted), in the prediction (the data's lengths), the step lines and the summary
    steps = [e for e in events if e["event"] == "step"]
    assert metrics["tokens_seen"] == sum(e["tokens"] for e in steps) and metrics["step_seconds"] <= metrics["train_seconds"]
    rate = metrics["tokens_seen"] / metrics["step_seconds"]  # step_seconds is rounded to 0.005 s: the rate to that share
    assert metrics["tokens_per_s"] == pytest.approx(rate, abs=rate * 0.005 / metrics["step_seconds"] + 0.005)
    assert done["measured_step_s"] == pytest.approx(metrics["step_seconds"] / 10, abs=0.005 / 10 + 1e-5)  # both rounded
    assert pred["data_lengths"] is True


def test_the_run_measures_its_wait_by_part_beside_the_prediction(recipe_dict):
    """load, replay, steps, evaluations, checkpoints, probe, tool calls, samples and total, measured (metrics.json, done) beside
    the plan's prediction of the same parts (the start event's ``predicted_speed.wait``); no wall time asserted.
    ``data.replay`` answers before the first step (out of ``load``), the general probe after the adapter is saved."""
    res = run(recipe_dict, ["training.max_steps=6", "training.eval_every=3", "data.val_size=8",
                            "checkpointing.save_every=3", "samples.prompts=[Hello]", "samples.max_new_tokens=4",
                            "data.replay=0.25", "training.general_probe=2"])
    events = read_events(res.run_dir / "events.jsonl")
    start, done, samples = (next(e for e in events if e["event"] == k) for k in ("start", "done", "samples"))
    replay = next(e for e in events if e["event"] == "replay")
    pred = start["predicted_speed"]["wait"]
    assert (pred["counts"]["evaluations"], pred["counts"]["checkpoints"], pred["counts"]["sample_answers"]) == (2, 2, 2)
    assert pred["counts"]["held_out_rows"] == 8 and start["predicted_speed"]["wall_s"] == pytest.approx(pred["wall_s"], abs=0.01)
    # the replay's prompts as the run answered them (none cached in this test's own cache), each at most 96 tokens;
    # the probe's 2 questions answered by the base and the fine-tune, each at most 24 tokens
    n = pred["counts"]["replay_answers"]
    assert replay["from_cache"] is False and n > 0 and f"the base model answered {n} prompts" in replay["message"]
    assert pred["counts"]["replay_tokens"] == n * 96
    assert (pred["counts"]["probe_answers"], pred["counts"]["probe_tokens"]) == (4, 4 * 24)
    assert pred["parts_s"]["replay"] > 0 and pred["parts_s"]["probe"] > 0
    assert start["predicted_speed"]["wall_s"] == pytest.approx(sum(pred["parts_s"].values()), abs=0.01)
    assert done["predicted_wait_s"] == {**pred["parts_s"], "total": pred["wall_s"]}
    parts = ("load", "replay", "steps", "evaluations", "checkpoints", "probe", "tool_calls", "samples")
    at_done = done["measured_wait_s"]
    assert set(at_done) == {*parts, "total"} and at_done["samples"] == 0  # the samples come after `done`
    assert all(at_done[k] > 0 for k in ("load", "replay", "steps", "evaluations", "checkpoints", "probe"))
    assert at_done["tool_calls"] == 0 and pred["parts_s"]["tool_calls"] == 0  # the data makes no tool calls
    assert sum(at_done[k] for k in parts) <= at_done["total"] + 0.007  # each rounded to 1 ms
    assert samples["event"] == "samples" and samples["samples_s"] > 0
    measured = json.loads((res.run_dir / "metrics.json").read_text())["time"]["measured"]  # written again after the samples
    assert measured["samples"] == pytest.approx(samples["samples_s"], abs=0.001) and measured["total"] >= at_done["total"]
    assert sum(measured[k] for k in parts) <= measured["total"] + 0.007
    assert measured["steps"] == pytest.approx(res.metrics["step_seconds"], abs=0.006)
    assert (measured["replay"], measured["probe"]) == (at_done["replay"], at_done["probe"])


def test_adapter_loads_with_peft_and_matches(recipe_dict, tiny_model_dir):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    res = run(recipe_dict, ["training.max_steps=4"])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = base(input_ids=x).logits
        tuned = PeftModel.from_pretrained(base, res.adapter_dir).eval()
        after = tuned(input_ids=x).logits
    assert not torch.allclose(before, after)


def test_qlora_trains_4bit_layers_on_cpu(recipe_dict):
    seen = {}

    def grab(ev):
        if ev["event"] == "start":
            seen.update(ev)

    res = run(recipe_dict, ["method=qlora", "training.max_steps=10", "training.lr=0.01", "training.scheduler=constant", "quantization.compute_dtype=fp32"], callbacks=[grab])
    assert res.losses[-1] < res.losses[0] - 0.3, res.losses
    cfg = json.loads((res.adapter_dir / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and seen["method"] == "qlora"


def test_qlora_model_has_linear4bit(recipe_dict):
    import bitsandbytes as bnb

    from finetuner.model.loading import load_base_model, prepare_for_training
    from finetuner.config.runtime import resolve_runtime

    r = Recipe.from_dict(recipe_dict, ["method=qlora"])
    model = prepare_for_training(load_base_model(r, resolve_runtime(r)), r)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"])
def test_other_optimizers(recipe_dict, optimizer):
    lr = "0.05" if optimizer == "sgd" else "0.005"
    res = run(recipe_dict, [f"training.optimizer={optimizer}", "training.max_steps=6", f"training.lr={lr}", "checkpointing.save_every=3"])
    assert res.losses[-1] < res.losses[0], res.losses


def test_loss_does_not_depend_on_how_a_step_is_split(recipe_dict):
    """micro-batch × accumulation = 4 in three ways gives the same loss curve."""
    curves = []
    for mb, ga in ((4, 1), (2, 2), (1, 4)):
        d = dict(recipe_dict, output_dir=recipe_dict["output_dir"] + f"-{mb}")
        curves.append(run(d, [f"training.micro_batch_size={mb}", f"training.gradient_accumulation={ga}", "training.max_steps=5"]).losses)
    for c in curves[1:]:
        assert c == pytest.approx(curves[0], abs=2e-4)


def test_stop_and_resume_gives_the_same_run(recipe_dict, tmp_path):
    full = run(dict(recipe_dict, output_dir=str(tmp_path / "full")), ["training.max_steps=8", "lora.dropout=0.1"])

    stop = threading.Event()

    def stop_at_3(ev):
        if ev["event"] == "step" and ev["step"] == 3:
            stop.set()

    d = dict(recipe_dict, output_dir=str(tmp_path / "resumed"))
    first = run(d, ["training.max_steps=8", "lora.dropout=0.1"], callbacks=[stop_at_3], stop_event=stop)
    assert first.stopped and (tmp_path / "resumed" / "checkpoints" / "step-00000003").is_dir()
    second = run(d, ["training.max_steps=8", "lora.dropout=0.1"])
    assert not second.stopped
    assert second.losses == pytest.approx(full.losses, abs=1e-5)
    events = read_events(tmp_path / "resumed" / "events.jsonl")
    assert [e["event"] for e in events].count("start") == 2
    assert [e for e in events if e["event"] == "start"][1]["resumed_from_step"] == 3


def test_resume_refuses_a_different_recipe_and_no_resume_keeps_the_old_run(recipe_dict, tmp_path):
    run(recipe_dict, ["training.max_steps=4"])
    with pytest.raises(finetuner.UserError, match="lora: .*r"):
        run(recipe_dict, ["training.max_steps=4", "lora.r=4"])
    res = run(recipe_dict, ["training.max_steps=4", "lora.r=4"], resume=False)
    assert res.metrics["steps"] == 4
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / "adapter" / "adapter_model.safetensors").exists()


def test_refuses_to_write_into_a_foreign_folder(recipe_dict, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    with pytest.raises(finetuner.UserError, match="not empty and holds no finetuner run"):
        run(recipe_dict)
    assert (out / "thesis.txt").read_text() == "precious"


def test_packing_and_gradient_checkpointing_and_full(recipe_dict):
    res = run(recipe_dict, ["data.packing=true", "training.gradient_checkpointing=true", "training.max_steps=6", "data.max_seq_len=128"])
    assert res.losses[-1] < res.losses[0]
    d = dict(recipe_dict, output_dir=recipe_dict["output_dir"] + "-full")
    res = run(d, ["method=full", "training.max_steps=4", "training.lr=1e-3"])
    assert res.losses[-1] < res.losses[0]
    assert (res.adapter_dir / "model.safetensors").exists()


def test_samples_compare_base_and_fine_tuned(recipe_dict):
    res = run(recipe_dict, ["training.max_steps=2", "samples.prompts=[what should i bring]", "samples.max_new_tokens=5"])
    (s,) = res.metrics["samples"]
    assert s["prompt"] == "what should i bring" and isinstance(s["base"], str) and isinstance(s["fine_tuned"], str)


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_loss_equals_full_logits_loss(tiny_model_dir, packed):
    """Loss and gradients are the same with chunked cross-entropy as with full logits.

    Compared in float64: the two paths sum the same terms in a different order, so in fp32 they
    differ by reduction noise (~1e-4 relative on small gradients, which made an fp32 comparison
    flaky); in float64 that noise is ~1e-13, and any real difference (a token left out, a wrong
    shift, a chunk boundary) is many orders of magnitude larger than the tolerance."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetuner.model.scoring import token_loss_sum

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).double()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 40), generator=g)
    labels = ids.clone()
    labels[:, :10] = -100
    batch = {"input_ids": ids, "labels": labels}
    batch.update({"position_ids": torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)} if packed else {"attention_mask": torch.ones_like(ids)})
    results = []
    for chunk in (0, 7):
        model.zero_grad()
        loss, n = token_loss_sum(model, batch, chunk)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((loss.item(), n, grads))
    (l0, n0, g0), (l1, n1, g1) = results
    assert n0 == n1 == 2 * 30 and l1 == pytest.approx(l0, rel=1e-12)
    for a, b in zip(g0, g1):
        assert a.dtype == torch.float64
        assert torch.allclose(a, b, atol=1e-12, rtol=1e-9)


def _one_param_step(grad_factors, scaler, max_grad_norm=1.0):
    """One step of the trainers' optimizer_step on a 2-element parameter whose gradient is ``grad_factors``."""
    import torch

    from finetuner.training.optimizer import optimizer_step

    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    loss = (p * torch.tensor(grad_factors)).sum()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    norm = optimizer_step(opt, sched, [p], max_grad_norm, scaler)
    return p.detach(), norm, sched.last_epoch, p.grad


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # torch's note on the skipped first step
def test_optimizer_step_with_a_loss_scaler_unscales_before_clipping_and_skips_on_inf():
    """fp16 loss scaling, one code path for one process and for DDP (DistributedTrainer steps through
    the same function; tests/training/test_distributed.py runs it on two processes)."""
    import math

    import torch

    plain, plain_norm, _, _ = _one_param_step([3.0, 4.0], None)
    assert plain_norm == pytest.approx(5.0) and plain.tolist() == pytest.approx([1 - 0.6, 2 - 0.8])  # clipped to norm 1

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    p, norm, sched_steps, grad = _one_param_step([3.0, 4.0], scaler)
    assert norm == pytest.approx(5.0)  # the norm of the true gradient, not of the gradient × 1024
    assert p.tolist() == pytest.approx(plain.tolist())  # clipped after unscaling: the same update
    assert scaler.get_scale() == 2.0**10 and sched_steps == 1 and grad is None

    p, norm, sched_steps, grad = _one_param_step([math.inf, 1.0], scaler)
    assert not math.isfinite(norm)
    assert p.tolist() == [1.0, 2.0]  # the step is skipped
    assert scaler.get_scale() == 2.0**9  # and the scale lowered
    assert sched_steps == 1 and grad is None  # the schedule still advances, the gradients are cleared


def test_the_runs_prediction_draws_none_of_its_random_numbers(recipe_dict, tmp_path, monkeypatch):
    """A run predicts its memory and time before and after the model's load; reading a model the cache lacks traces its
    layer under LoRA, which may draw random numbers. None of the run's own: with an empty cache, as with a full one,
    the generator is where it was (found by two processes under FSDP losing step for step against one process, whose
    run had filled the cache first: the LoRA weights' init had moved)."""
    import torch

    from finetuner.config.runtime import resolve_runtime
    from finetuner.training.prediction import predict_run

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path / "cache"))  # nothing read before: the model is built and traced
    recipe = Recipe.from_dict(recipe_dict)
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    assert predict_run(recipe, resolve_runtime(recipe), 4) is not None
    assert torch.equal(torch.random.get_rng_state(), before)
    assert list(tmp_path.rglob("inventory-*.json"))  # it was read now, not from a cache

"""The whole wait of a run (finetuner.planning.wait): counts from the recipe, each part's arithmetic, the cost."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.memory.model import Settings, trainable_params
from finetuner.model.shapes import resolve_shape
from finetuner.planning import wait
from finetuner.planning.calibrate import load
from finetuner.planning.recipe_data import run_wait
from finetuner.planning.predict import estimate_time
from finetuner.planning.speed import StepTime, forward_seconds, step_time

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_model"
SPEED = load(Path(__file__).with_name("speed_cpu.json"))
STEP = StepTime({"matmuls": 0.1}, 1000, 1, "test")


def demo_recipe(**sections) -> Recipe:
    raw = {"name": "w", "model": {"name": str(DEMO)}, "method": "lora", "device": "cpu",
           "data": {"path": str(REPO / "data" / "alpaca_sample.json"), "max_seq_len": 256, "val_size": 20},
           "training": {"max_steps": 150, "micro_batch_size": 4, "gradient_accumulation": 1, "optimizer": "adamw_torch",
                        "eval_every": 50, "gradient_checkpointing": False, "offload_activations": False},
           "checkpointing": {"save_every": 50}, "samples": {"prompts": ["a", "b"], "max_new_tokens": 48}}
    for key, values in sections.items():
        raw[key] = {**raw.get(key, {}), **values}
    return Recipe.from_dict(raw)


def parts(recipe: Recipe) -> dict:
    """The recipe's wait as ``estimate`` predicts it (its :meth:`Wait.to_dict`), the parts unrounded."""
    from finetuner.config.hardware import get_gpu
    from finetuner.planning.recipe_data import data_batch_of, run_optimizer_steps
    from finetuner.planning.recipe_speed import recipe_step_time

    gpu = get_gpu("cpu")
    w = run_wait(recipe, gpu, SPEED, recipe_step_time(recipe, gpu, SPEED, batch=data_batch_of(recipe)),
                 run_optimizer_steps(recipe))
    t = estimate_time(recipe, "cpu", speed=SPEED, label_fraction=1.0)
    assert t["wait"] == w.to_dict() and t["wall_s"] == pytest.approx(sum(w.parts.values()))
    return {**w.to_dict(), "parts_s": w.parts}


def test_counts_follow_the_trainer_loop():
    # every eval_every / save_every steps before the last, and the final one
    assert wait.evaluation_count(150, 50, 20) == 3 and wait.evaluation_count(151, 50, 20) == 4
    assert wait.evaluation_count(150, 0, 20) == 1 and wait.evaluation_count(150, 50, 0) == 0
    assert wait.checkpoint_count(150, 50) == 3 and wait.checkpoint_count(150, 25) == 6 and wait.checkpoint_count(150, 0) == 1
    assert wait.sample_answers(3, "lora") == 6 and wait.sample_answers(3, "full") == 3  # no adapter to switch off


def test_the_counts_are_the_recipes():
    w = parts(demo_recipe())
    c = w["counts"]
    assert (c["optimizer_steps"], c["evaluations"], c["held_out_rows"], c["checkpoints"]) == (150, 3, 20, 3)
    assert (c["sample_answers"], c["sample_tokens"]) == (4, 4 * 48)
    assert c["model_bytes"] == (DEMO / "model.safetensors").stat().st_size
    assert w["parts_s"]["download"] == 0  # a local folder
    fewer = parts(demo_recipe(training={"eval_every": None}, checkpointing={"save_every": None}, samples={"prompts": []}))
    assert (fewer["counts"]["evaluations"], fewer["counts"]["checkpoints"], fewer["parts_s"]["samples"]) == (1, 1, 0)


def test_each_part_scales_as_its_arithmetic_says():
    base = parts(demo_recipe())["parts_s"]
    # twice the held-out rows (whole micro-batches): twice each evaluation
    assert parts(demo_recipe(data={"val_size": 40}))["parts_s"]["evaluations"] == pytest.approx(2 * base["evaluations"], rel=1e-3)
    # twice the evaluations: twice the time
    assert parts(demo_recipe(training={"eval_every": 25}))["parts_s"]["evaluations"] == pytest.approx(
        2 * base["evaluations"], rel=1e-3)
    # save_every halved: twice the checkpoints (3 -> 6; the final adapter is written once): 3 more where
    # no save_every (the final checkpoint only) has 2 fewer
    halved = parts(demo_recipe(checkpointing={"save_every": 25}))["parts_s"]["checkpoints"]
    final_only = parts(demo_recipe(checkpointing={"save_every": None}))["parts_s"]["checkpoints"]
    assert halved - base["checkpoints"] == pytest.approx(1.5 * (base["checkpoints"] - final_only), rel=1e-6)
    # the samples: prompts x max_new_tokens
    assert parts(demo_recipe(samples={"prompts": ["a", "b", "c", "d"]}))["parts_s"]["samples"] == pytest.approx(
        2 * base["samples"], rel=1e-3)
    # each answer as long as the data's average response (here label fraction 1: the average row, 51 tokens),
    # at most max_new_tokens: proportional below it, the same above it
    short = parts(demo_recipe(samples={"max_new_tokens": 8}))
    assert parts(demo_recipe(samples={"max_new_tokens": 16}))["parts_s"]["samples"] == pytest.approx(
        2 * short["parts_s"]["samples"], rel=1e-3)
    assert short["counts"]["sample_tokens"] == 2 * 2 * 8  # 2 prompts, the fine-tune and the base
    long = parts(demo_recipe(samples={"max_new_tokens": 200}))
    assert long["parts_s"]["samples"] == pytest.approx(parts(demo_recipe(samples={"max_new_tokens": 400}))["parts_s"]["samples"])
    from finetuner.planning.recipe_data import data_batch_of

    mean_row = data_batch_of(demo_recipe()).real_per_row
    assert long["counts"]["sample_tokens"] == round(4 * mean_row) and 40 < mean_row < 200
    assert any("sample answers as long as the data's responses" in a for a in long["assumptions"])
    # the steps: the step model's step times the steps
    t = estimate_time(demo_recipe(), "cpu", speed=SPEED, label_fraction=1.0)
    assert base["steps"] == pytest.approx(t["step_s"] * 150, abs=1e-3) == pytest.approx(t["steps_s"], abs=1e-3)


def test_an_evaluation_is_the_step_models_forward():
    shape = resolve_shape(str(DEMO))
    s = Settings(micro_batch=4, seq_len=64, platform="cpu", compute_dtype="fp32", lora_dropout=0.0)
    one = forward_seconds(shape, s, SPEED)
    assert 0 < one < step_time(shape, s, SPEED).step_s  # no backward, no optimizer
    assert wait.evaluation_seconds(shape, s, SPEED, 8) == pytest.approx(2 * one)  # ceil(8 / 4) micro-batches
    assert wait.evaluation_seconds(shape, s, SPEED, 9) == pytest.approx(3 * one)
    assert wait.evaluation_seconds(shape, s, SPEED, 0) == 0
    # more rows per micro-batch: more forward work
    assert forward_seconds(shape, s.with_(seq_len=128), SPEED) > one


def grpo_recipe(**sections) -> Recipe:
    """The shipped GRPO demo (its reward file beside it), with sections changed."""
    raw = Recipe.from_yaml(REPO / "recipes" / "demo_grpo_cpu.yaml").model_dump(mode="json")
    for key, values in sections.items():
        raw[key] = {**raw.get(key, {}), **values}
    return Recipe.from_dict(raw)


def test_a_grpo_evaluation_is_the_rollouts_generation_of_the_held_out_prompts():
    """GRPO's evaluation samples num_generations completions of each held-out prompt, micro_batch_size prompts'
    groups a generate call (speed_grpo.evaluation_seconds, as the rollout's generation): as many evaluations as
    the trainer's loop makes, each at the held-out prompts' padded width, the completions at their longest."""
    from finetuner.memory.grpo import grpo_settings_of
    from finetuner.memory.model import settings_from_recipe
    from finetuner.config.hardware import get_gpu
    from finetuner.planning import speed_grpo

    base = grpo_recipe()
    w = parts(base)
    n_val, evals = w["counts"]["held_out_rows"], w["counts"]["evaluations"]
    assert n_val == 40 and evals == wait.evaluation_count(20, 5, 40) == 4
    assert "GRPO's held-out rollouts at their longest completions (24 tokens)" in w["assumptions"]
    shape = resolve_shape(base.model.name)
    s = settings_from_recipe(base, get_gpu("cpu"), shape.model_type)
    g = grpo_settings_of(base)
    one = w["parts_s"]["evaluations"] / evals
    # at most the held-out prompts at their longest; ceil(40 x 4 / 32) = 5 generate calls of the step's shape
    longest = speed_grpo.evaluation_seconds(shape, s, g, SPEED, n_val)
    assert 0 < one < longest
    pre, dec = speed_grpo.generation_seconds(shape, s, SPEED, calls=5, rows=g.generation_rows, prompt_width=g.prompt_len,
                                             decode_steps=g.max_new_tokens)
    assert longest == pytest.approx(pre + dec, rel=1e-12)
    # twice the completion length: more decode steps, each over a longer cache
    twice = parts(grpo_recipe(grpo={"max_new_tokens": 48}, data={"max_seq_len": 152}))
    assert twice["parts_s"]["evaluations"] / twice["counts"]["evaluations"] > 1.8 * one
    # no held-out prompts: no evaluation
    assert parts(grpo_recipe(data={"val_size": 0}))["parts_s"]["evaluations"] == 0


def test_load_and_saves_use_the_calibrations_figures_else_the_named_defaults():
    shape = resolve_shape(str(DEMO))
    files = wait.ModelFiles(10**9, False)
    assert wait.load_seconds(files, SPEED) == pytest.approx(wait.STARTUP_S + 1e9 / wait.DISK_READ_BYTES_PER_S)
    measured = replace(SPEED, startup_s=2.0, disk_read_bytes_per_s=1e9, disk_write_bytes_per_s=2e8, file_sync_s=0.01)
    assert wait.load_seconds(files, measured) == pytest.approx(2.0 + 1.0)
    assert wait.load_seconds(wait.ModelFiles(2 * 10**9, False), measured) == pytest.approx(2.0 + 2.0)  # bytes / rate
    gguf = wait.ModelFiles(10**8, False, gguf_convert=True)
    assert wait.load_seconds(gguf, measured) == pytest.approx(2.0 + 0.1 + 1e8 / wait.GGUF_CONVERT_BYTES_PER_S)
    s = Settings(platform="cpu", compute_dtype="fp32")
    ckpt = wait.checkpoint_bytes(shape, s)
    assert ckpt == pytest.approx(trainable_params(shape, s) * (4 + 8))  # fp32 weights + AdamW's two fp32 states
    per = ckpt / 2e8 + wait.CHECKPOINT_FILES * 0.01
    assert wait.checkpoint_seconds(shape, s, measured, 3) - wait.checkpoint_seconds(shape, s, measured, 0) == pytest.approx(3 * per)


def test_a_hub_model_not_in_the_cache_is_downloaded_first(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    shape = resolve_shape("llama-3.1-8b")
    files = wait.model_files("meta-llama/Llama-3.1-8B", shape)
    assert files.download and files.bytes == shape.num_params * wait.HUB_BYTES_PER_PARAM
    s = Settings(platform="cpu", compute_dtype="fp32")
    w = wait.predict_wait(shape, s, SPEED, STEP, 10, eval_every=0, save_every=0, held_out=0, sample_prompts=0,
                          max_new_tokens=1, files=files)
    assert w.parts["download"] == pytest.approx(files.bytes / wait.DOWNLOAD_BYTES_PER_S)
    assert any("downloaded at 50 MB/s" in a for a in w.assumptions)
    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.1-8B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"x" * 1000)
    held = wait.model_files("meta-llama/Llama-3.1-8B", shape)
    assert not held.download and held.bytes == 1000


def test_unknown_held_out_rows_are_said():
    shape = resolve_shape(str(DEMO))
    w = wait.predict_wait(shape, Settings(platform="cpu"), SPEED, STEP, 10, eval_every=5, save_every=5, held_out=None,
                          sample_prompts=0, max_new_tokens=1, files=wait.ModelFiles(0, False))
    assert w.counts["evaluations"] == 0 and any("held-out rows unknown" in a for a in w.assumptions)


def test_no_steps_no_wait():
    r = demo_recipe()
    assert run_wait(r, None, SPEED, STEP, None) is None


def test_cost_is_the_whole_wait_in_the_given_currency():
    t = estimate_time(demo_recipe(), "cpu", speed=SPEED, price_per_hour=0.7, currency="USD")
    assert t["cost"] == pytest.approx(t["wall_s"] / 3600 * 0.7) and t["currency"] == "USD"
    assert t["cost"] > t["steps_s"] / 3600 * 0.7  # the load, evaluations, checkpoints and samples cost too
    from finetuner.planning.time_text import cost_text

    assert cost_text(0.0123, 0.7, "USD") == "~0.012 USD at 0.7 USD an hour"
    assert cost_text(0.0123, 0.7, None) == "~0.012 at 0.7 an hour"  # the price's own units
    assert wait.check_currency(" € ", 1.0) == "€"
    for bad in ("", "12", "US D", "DOLLARSXYZ"):
        with pytest.raises(UserError, match="--currency"):
            wait.check_currency(bad, 1.0)
    with pytest.raises(UserError, match="--price-per-hour too"):
        wait.check_currency("USD", None)


def test_a_sample_answer_is_as_long_as_the_datas_responses():
    """The labelled share of the average row: what the fine-tune learned to write (the planner's label fraction)."""
    from finetuner.config.hardware import get_gpu
    from finetuner.planning.recipe_data import data_batch_of

    recipe = demo_recipe(samples={"max_new_tokens": 200})
    w = run_wait(recipe, get_gpu("cpu"), SPEED, STEP, 150, label_fraction=0.25)
    assert w.counts["sample_tokens"] == round(4 * 0.25 * data_batch_of(recipe).real_per_row)
    # without readable data: the bound, max_new_tokens an answer, and nothing assumed of the answers
    gone = demo_recipe(data={"path": "tatsu-lab/alpaca"}, samples={"max_new_tokens": 200})  # a hub data set
    w = run_wait(gone, get_gpu("cpu"), SPEED, STEP, 150)
    assert w.counts["sample_tokens"] == 4 * 200 and not any("sample answers" in a for a in w.assumptions)


def test_what_the_first_load_does_is_read_before_the_load(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert wait.first_load(str(DEMO)) == (False, False)  # a local folder
    assert wait.first_load("some-org/not-downloaded") == (True, False)
    snap = tmp_path / "hf" / "hub" / "models--some-org--downloaded" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"0" * 64)
    assert wait.first_load("some-org/downloaded") == (False, False)


def test_replay_and_probe_answers_are_batched_generation():
    """A replay or probe answer set: its prompts' tokens (characters / CHARS_PER_TOKEN + the chat turn), BATCH of
    them a generate call left-padded to the call's longest, max_new_tokens decoded a call: GRPO's generation
    model call by call; the base's passes with the adapter off, the fine-tune's (the probe's second) with it on."""
    from finetuner.data.stats import CHARS_PER_TOKEN
    from finetuner.planning.speed_grpo import generation_seconds

    texts = ["x" * 35] * 15 + ["y" * 70] + ["z" * 7] * 4  # 10, 20 and 2 tokens of text
    a = wait.Answering.of_texts(texts, 96, 16)
    turn = wait.CHAT_TURN_TOKENS
    assert a.prompt_tokens == tuple([35 / CHARS_PER_TOKEN + turn] * 15 + [20 + turn] + [2 + turn] * 4)
    assert a.calls() == [(16, 20 + turn), (4, 2 + turn)] and a.answers == 20
    shape, s = resolve_shape(str(DEMO)), Settings(platform="cpu", compute_dtype="fp32")
    s = s.with_(method="lora")

    def answered(adapter):
        return sum(sum(generation_seconds(shape, s, SPEED, calls=1, rows=r, prompt_width=w, decode_steps=96, adapter=adapter))
                   for r, w in ((16, 20 + turn), (4, 2 + turn)))

    expected = answered(False)  # the base's answers: the adapter off
    assert wait.answering_seconds(shape, s, SPEED, a) == pytest.approx(expected, rel=1e-12) and expected > 0
    twice = wait.Answering.of_texts(texts, 96, 16, adapters=(False, True))
    assert wait.answering_seconds(shape, s, SPEED, twice) == pytest.approx(expected + answered(True), rel=1e-12)
    assert twice.answers == 40 and answered(True) > expected  # LoRA's matmuls and operations with the adapter on
    # a batch of 16 rows decodes 16 tokens a forward: less than 16 one-row calls
    one = wait.Answering.of_texts(["x" * 35], 96, 16)
    assert wait.answering_seconds(shape, s, SPEED, wait.Answering.of_texts(["x" * 35] * 16, 96, 16)) < 16 * wait.answering_seconds(shape, s, SPEED, one)
    assert wait.answering_seconds(shape, s, SPEED, None) == 0


def test_a_recipes_replay_and_probe_are_parts_of_its_wait(monkeypatch):
    """data.replay: replay_count of the user's training rows, the prompts the run's seed draws, 96 tokens each;
    training.general_probe: that many questions spread over the set, each answered by the base and the fine-tune,
    24 tokens each; none for a full fine-tune (no adapter to switch off). Both inside the whole wait."""
    from finetuner.data import replay as rp
    from finetuner.infer import probe as pb
    from finetuner.config.hardware import get_gpu
    from finetuner.memory.model import settings_from_recipe
    from finetuner.planning.recipe_data import training_rows

    plain = parts(demo_recipe())
    assert plain["parts_s"]["replay"] == plain["parts_s"]["probe"] == 0  # the session's FINETUNER_GENERAL_PROBE is 0
    assert (plain["counts"]["replay_answers"], plain["counts"]["probe_answers"]) == (0, 0)
    r = demo_recipe(data={"replay": 0.25}, training={"general_probe": 20})
    w = parts(r)
    train = training_rows(demo_recipe())  # the user's rows less the held-out ones
    n = rp.replay_count(0.25, train, len(rp.load_prompts()))
    assert n == -(-train // 4) and w["counts"]["replay_answers"] == n and w["counts"]["replay_tokens"] == n * 96
    assert (w["counts"]["probe_answers"], w["counts"]["probe_tokens"]) == (40, 40 * 24)
    shape = resolve_shape(str(DEMO))
    s = settings_from_recipe(r, get_gpu("cpu"), shape.model_type).with_(label_fraction=1.0)
    prompts = rp.chosen_prompts(rp.load_prompts(), n, r.training.seed)
    assert w["parts_s"]["replay"] == pytest.approx(
        wait.answering_seconds(shape, s, SPEED, wait.Answering.of_texts(prompts, 96, rp.BATCH)), rel=1e-9)
    questions = [p.question for p in pb.spread(pb.load_probes(), 20)]
    assert w["parts_s"]["probe"] == pytest.approx(
        wait.answering_seconds(shape, s, SPEED, wait.Answering.of_texts(questions, 24, pb.BATCH, adapters=(False, True))), rel=1e-9)
    assert all(w["parts_s"][k] == plain["parts_s"][k] for k in wait.PARTS if k not in ("replay", "probe"))
    assert w["wall_s"] == pytest.approx(plain["wall_s"] + w["parts_s"]["replay"] + w["parts_s"]["probe"], abs=0.01)
    assert "replay answers at their longest (96 tokens)" in w["assumptions"]
    assert "probe answers at their longest (24 tokens)" in w["assumptions"]
    # the default count follows the run's device: FINETUNER_GENERAL_PROBE, else 16 on a CPU
    monkeypatch.setenv(pb.RUN_PROBES_ENV, "")
    assert parts(demo_recipe())["counts"]["probe_answers"] == 2 * pb.DEFAULT_CPU_RUN_PROBES
    full = Recipe.from_dict({**demo_recipe().model_dump(mode="json"), "method": "full"})
    assert parts(full)["counts"]["probe_answers"] == 0


def test_replay_is_not_counted_when_its_cache_holds_these_weights_answers(tmp_path, monkeypatch):
    """The plan reads the replay's cache file as the run would find it (its check passed, made with these weights
    as the memo of their hashes knows them: a stat a file, no byte read) and counts no replay then; another base's
    file, a damaged one, or weights the memo does not know are counted. A run's own record overrides it."""
    from finetuner.config.hardware import get_gpu
    from finetuner.data import replay as rp
    from finetuner.model.fingerprint import memo_path, weights_fingerprint

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path / "cache"))
    r = demo_recipe(data={"replay": 0.25})
    counted = parts(r)
    n = counted["counts"]["replay_answers"]
    assert n > 0 and counted["parts_s"]["replay"] > 0
    prompts = rp.chosen_prompts(rp.load_prompts(), n, r.training.seed)
    path = rp.cache_path(rp.BaseModel(str(DEMO), {}), prompts)
    weights = weights_fingerprint(str(DEMO)).files  # hashed once: now in the memo
    rp.write_cache(path, rp.BaseModel(str(DEMO), {"weights": weights}), prompts, ["An answer."] * n)
    cached = parts(r)
    assert (cached["parts_s"]["replay"], cached["counts"]["replay_answers"]) == (0, 0)
    assert f"data.replay's {n} answers read from its cache (made with these weights)" in cached["assumptions"]
    assert cached["wall_s"] == pytest.approx(counted["wall_s"] - counted["parts_s"]["replay"], abs=0.01)
    gpu, step = get_gpu("cpu"), STEP
    assert run_wait(r, gpu, SPEED, step, 150, replay_cached=False).parts["replay"] == pytest.approx(counted["parts_s"]["replay"])
    # another base's answers at that path, a damaged file, weights the memo does not hold: counted
    rp.write_cache(path, rp.BaseModel(str(DEMO), {"weights": {"model.safetensors": {"size": 1, "sha256": "0" * 64}}}),
                   prompts, ["An answer."] * n)
    assert parts(r)["counts"]["replay_answers"] == n
    rp.write_cache(path, rp.BaseModel(str(DEMO), {"weights": weights}), prompts, ["An answer."] * n)
    path.write_text(path.read_text(encoding="utf-8").replace("An answer.", "Planted.", 1), encoding="utf-8")
    assert parts(r)["counts"]["replay_answers"] == n
    rp.write_cache(path, rp.BaseModel(str(DEMO), {"weights": weights}), prompts, ["An answer."] * n)
    assert parts(r)["counts"]["replay_answers"] == 0
    memo_path().unlink()
    assert parts(r)["counts"]["replay_answers"] == n
    # the run's own record: its answers came from the cache, or were made
    assert run_wait(r, gpu, SPEED, step, 150, replay_cached=True).parts["replay"] == 0

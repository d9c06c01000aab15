"""The padded length of a micro-batch (finetuner.planning.lengths) against the trainer's own batching."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from pathlib import Path

import pytest

from finetuner.planning.lengths import batch_shape, expected_longest, prompt_batch


def test_the_expected_longest_is_the_mean_over_every_draw():
    lengths = [5, 9, 9, 14, 30, 31, 64]
    for k in range(1, 8):
        draws = [max(c) for c in itertools.combinations(lengths, k)]
        assert expected_longest(lengths, k) == pytest.approx(statistics.fmean(draws), rel=1e-12)
    assert expected_longest([7], 4) == 7 and expected_longest(lengths, 99) == 64


def test_the_trainers_own_batching_pads_micro_batches_to_the_expected_length():
    """StepSchedule's seeded permutations cut by split_step, over 600 epochs: the mean padded length of a
    micro-batch is the expectation within 4 standard errors (each micro-batch's longest row is one draw;
    the draws of an epoch are not independent, which the 4 leaves room for)."""
    from finetuner.training.schedule import StepSchedule, split_step

    rng = random.Random(1)
    lengths = [rng.randint(20, 60) if i % 5 else rng.randint(150, 256) for i in range(64)]
    micro, eff = 4, 16
    schedule = StepSchedule(len(lengths), eff, seed=42)
    longest = []
    for step in range(600 * schedule.steps_per_epoch):
        rows = schedule.indices(step)
        for start, end in split_step(len(rows), micro, 1)[0]:
            longest.append(max(lengths[i] for i in rows[start:end]))
    want = expected_longest(lengths, micro)
    sem = statistics.stdev(longest) / math.sqrt(len(longest))
    assert abs(statistics.fmean(longest) - want) < 4 * sem, (statistics.fmean(longest), want, sem)
    shape = batch_shape(lengths, micro, max_seq_len=256)
    assert shape.padded_len == want and shape.real_per_row == pytest.approx(statistics.fmean(lengths))


def test_rows_are_cut_to_the_sequence_length_and_packed_rows_are_full():
    shape = batch_shape([10, 500, 20, 30], 2, max_seq_len=100)
    assert shape.padded_len == expected_longest([10, 100, 20, 30], 2) and shape.real_per_row == 40
    assert batch_shape([10, 500], 2, max_seq_len=128, packing=True).padded_len == 128
    assert 0 < shape.fill < 1


def test_the_prediction_counts_the_tokens_and_pads_the_micro_batches_as_the_trainer_does():
    """The demo recipe: the data's lengths the planner measures (finetuner.data.stats.profile_data, as
    plan and estimate read them) are the trainer's tokenized rows, and its Collator pads each micro-batch
    of the trainer's schedule to the longest row and counts the rest as the run's tokens."""
    from transformers import AutoTokenizer

    from finetuner.config.recipe import Recipe
    from finetuner.data.pipeline import Collator, prepare_data
    from finetuner.planning.recipe_data import data_batch_of
    from finetuner.training.schedule import StepSchedule, split_step

    repo = Path(__file__).resolve().parents[2]
    recipe = Recipe.from_yaml(repo / "recipes" / "demo_cpu.yaml")
    tok = AutoTokenizer.from_pretrained(recipe.model.name)
    data = prepare_data(recipe.data, tok, recipe.training.seed)
    rows = [data.train[i] for i in range(len(data.train))] + ([data.val[i] for i in range(len(data.val))] if data.val else [])
    lengths = [len(r["input_ids"]) for r in rows]
    batch = data_batch_of(recipe)
    assert batch.real_per_row == pytest.approx(statistics.fmean(lengths), rel=1e-12)
    # the trainer's micro-batches over one epoch of its training rows: padded to their longest, the rest counted
    t = recipe.training
    train = [data.train[i] for i in range(len(data.train))]
    schedule, collate = StepSchedule(len(train), t.effective_batch_size, t.seed), Collator(tok.pad_token_id)
    padded, counted = [], 0
    for step in range(schedule.steps_per_epoch):
        ex = [train[i] for i in schedule.indices(step)]
        for start, end in split_step(len(ex), t.micro_batch_size, 1)[0]:
            mb = collate(ex[start:end])
            assert mb["input_ids"].shape[1] == max(len(x["input_ids"]) for x in ex[start:end])
            padded.append(mb["input_ids"].shape[1])
            counted += mb["num_tokens"]
    assert counted == sum(len(x["input_ids"]) for x in train)  # an epoch counts every real token once
    want = expected_longest([len(x["input_ids"]) for x in train], t.micro_batch_size)
    assert abs(statistics.fmean(padded) - want) < 4 * statistics.stdev(padded) / math.sqrt(len(padded))


def test_a_step_is_timed_at_the_padded_length_and_counts_only_real_tokens():
    from finetuner.config.hardware import get_gpu
    from finetuner.memory.model import Settings
    from finetuner.model.shapes import resolve_shape
    from finetuner.planning.lengths import BatchShape
    from finetuner.planning.speed import DeviceSpeed, step_time

    shape, speed = resolve_shape("llama-2-7b"), DeviceSpeed.from_profile(get_gpu("rtx4090"))
    s = Settings(seq_len=2048, micro_batch=4, gradient_accumulation=4, label_fraction=0.5)
    full = step_time(shape, s, speed)
    data = step_time(shape, s, speed, batch=BatchShape(padded_len=300.0, real_per_row=200.0))
    assert (full.tokens_per_step, full.padded_tokens_per_step, full.data_lengths) == (4 * 2048 * 4, 4 * 2048 * 4, False)
    assert (data.tokens_per_step, data.padded_tokens_per_step, data.data_lengths) == (4 * 200 * 4, 4 * 300 * 4, True)
    # the same step as one of 300-position rows whose labelled tokens are half of the 200 real ones
    same = step_time(shape, s.with_(seq_len=300, label_fraction=0.5 * 200 / 300), speed)
    assert data.parts == same.parts and data.step_s < full.step_s
    assert data.tokens_per_s == pytest.approx(data.padded_tokens_per_s * 200 / 300)


def test_estimate_says_which_lengths_it_timed(tmp_path):
    import yaml

    from tests.conftest import cli_in_process, write_recipe

    repo = Path(__file__).resolve().parents[2]
    out = cli_in_process("estimate", str(repo / "recipes" / "demo_cpu.yaml"), "--gpu", "rtx4090")
    text = " ".join(out.stdout.split())
    assert out.returncode == 0 and "tokens/s (real tokens, padding excluded)" in text, text
    assert f"Lengths: the rows of {repo / 'data' / 'alpaca_sample.json'}: " in text and " of them tokens." in text, text
    raw = yaml.safe_load((repo / "recipes" / "demo_cpu.yaml").read_text())
    raw["data"]["path"], raw["model"]["name"] = "tatsu-lab/alpaca", str(repo / "data" / "demo_model")  # a hub data set
    out = cli_in_process("estimate", str(write_recipe(tmp_path / "hub.yaml", raw)), "--gpu", "rtx4090")
    text = " ".join(out.stdout.split())
    assert "Lengths: every row taken as data.max_seq_len tokens long (the data file cannot be read here): an upper bound." in text, text


def test_grpo_prompts_are_timed_as_the_rollout_pads_them():
    """The demo GRPO recipe: the prompts the planner measures (profile_prompts, through data_batch_of) against
    the GRPO trainer's own (prepare_prompts' prompt_ids); the rollout (generate_group) left-pads a step's
    prompts to their longest, and over the trainer's schedule that width averages the expected longest of a
    step's prompts (within 4 standard errors, as above)."""
    from transformers import AutoTokenizer

    from finetuner.config.recipe import Recipe
    from finetuner.data.prompts import prepare_prompts
    from finetuner.planning.recipe_data import data_batch_of, max_prompt_len
    from finetuner.objectives.rollout import left_pad
    from finetuner.training.schedule import StepSchedule

    repo = Path(__file__).resolve().parents[2]
    recipe = Recipe.from_yaml(repo / "recipes" / "demo_grpo_cpu.yaml")
    t = recipe.training
    tok = AutoTokenizer.from_pretrained(recipe.model.name)
    data = prepare_prompts(recipe.data, tok, t.seed, recipe.grpo.max_new_tokens)
    own = [len(p["prompt_ids"]) for p in data.train + data.val]
    batch = data_batch_of(recipe)
    # the planner encodes the prompts as the GRPO trainer does (data.stats.EXACT_ROWS: the whole file here)
    assert batch.real_per_row == pytest.approx(statistics.fmean(own), rel=1e-12), (batch, statistics.fmean(own))
    widths = []
    train = [p["prompt_ids"] for p in data.train]
    schedule = StepSchedule(len(train), t.effective_batch_size, t.seed)
    for step in range(400 * schedule.steps_per_epoch):
        prompts = [train[i] for i in schedule.indices(step)]
        ids, _ = left_pad(prompts, tok.pad_token_id)
        assert ids.shape[1] == max(len(p) for p in prompts)
        widths.append(ids.shape[1])
    want = prompt_batch([len(p) for p in train], t.effective_batch_size, max_prompt_len(recipe))
    sem = statistics.stdev(widths) / math.sqrt(len(widths))
    assert abs(statistics.fmean(widths) - want.padded_len) < 4 * sem, (statistics.fmean(widths), want, sem)
    assert want.real_per_row == pytest.approx(statistics.fmean(len(p) for p in train))


def test_grpo_prompts_longer_than_the_limit_are_cut_and_a_step_pads_to_its_longest():
    shape = prompt_batch([10, 500, 20, 30], 2, max_prompt_len=100)
    assert shape.padded_len == expected_longest([10, 100, 20, 30], 2) and shape.real_per_row == 40
    assert prompt_batch([10, 20, 30], 3, max_prompt_len=100).padded_len == 30


def test_rows_after_the_exact_ones_are_counted_with_the_templates_measured_tokens(monkeypatch):
    """data.stats encodes the first EXACT_ROWS rows as training does and counts the rest with the chat template's
    tokens measured on those: with 5 exact rows the counted rows of the chat sample land within two tokens a
    message of their exact length (a message tokenized alone may split differently at its two edges, where the
    rendered template joins it to the markup around it), and the label fraction within 0.5 %."""
    import json

    import finetuner.data.stats as stats

    repo = Path(__file__).resolve().parents[2]
    path, model = str(repo / "data" / "chat_sample.jsonl"), str(repo / "data" / "demo_model")
    exact = stats.profile_data(path, model)
    assert exact.counted_with.startswith("the model's tokenizer and chat template")
    monkeypatch.setattr(stats, "EXACT_ROWS", 5)
    counted = stats.profile_data(path, model)
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) == len(exact.lengths) == len(counted.lengths) > 5
    assert counted.lengths[:5] == exact.lengths[:5]
    for row, a, b in zip(rows, exact.lengths, counted.lengths):
        assert abs(a - b) <= 2 * len(row["messages"]), (row, a, b)
    assert counted.label_fraction == pytest.approx(exact.label_fraction, rel=0.005)

"""Issue 38, part 2: data.replay mixes the base model's own answers to general prompts into the training rows:
generated once and cached, deterministic, the base's greedy answers, at the ratio, never with the user's system
prompt, and never a question of the general probe set."""

from __future__ import annotations

import json
import math

import pytest

from finetuner.data.replay import PROMPTS_FILE, BaseModel, chosen_prompts, load_prompts, mix_replay, replay_count
from tests.conftest import REPO, alpaca_rows

DEMO = REPO / "data" / "demo_model"


def test_the_shipped_prompts_are_what_their_script_writes_and_none_is_a_probe_question():
    from finetuner.infer.probe import load_probes
    from scripts.dev import make_replay_prompts

    assert PROMPTS_FILE.read_text(encoding="utf-8") == "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                              for r in make_replay_prompts.rows())
    prompts = load_prompts()
    assert len(prompts) == len(set(prompts)) == 70
    questions = {p.question.lower() for p in load_probes()}
    assert not [p for p in prompts if p.lower() in questions or any(q in p.lower() for q in questions)]


def test_the_count_and_the_choice():
    assert replay_count(0.25, 40, 70) == 10 and replay_count(0.25, 41, 70) == 11 and replay_count(1.0, 500, 70) == 70
    assert replay_count(0, 40, 70) == 0 and replay_count(0.5, 0, 70) == 0
    prompts = load_prompts()
    assert chosen_prompts(prompts, 10, 7) == chosen_prompts(prompts, 10, 7) != chosen_prompts(prompts, 10, 8)
    kinds = {p.split()[0] for p in chosen_prompts(prompts, 20, 42)}
    assert len(kinds) >= 3  # drawn over the kinds of request, not the first kind alone


def test_a_run_trains_on_the_base_models_own_answers_cached_and_without_the_system_prompt(tmp_path):
    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.infer.chat import load_chat_model
    from finetuner.data.replay import BATCH, MAX_NEW_TOKENS
    from finetuner.fileio import cache_root

    data = tmp_path / "d.json"
    data.write_text(json.dumps(alpaca_rows(10)), encoding="utf-8")
    raw = {"name": "r", "model": {"name": str(DEMO)}, "device": "cpu", "output_dir": str(tmp_path / "run"),
           "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
           "data": {"path": str(data), "max_seq_len": 128, "val_size": 0, "replay": 0.5,
                    "system_prompt": "You are Wren of Copperhill Cycles."},
           "training": {"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation": 1, "lr": 1e-3}}
    before = set((cache_root() / "replay").glob("*.json")) if (cache_root() / "replay").is_dir() else set()
    first = finetuner.train(Recipe.from_dict(raw))
    info = first.metrics["replay"]
    assert info["rows"] == math.ceil(0.5 * 10) and info["from_cache"] is False and first.metrics["data"]["replay_rows"] == 5
    [stored] = set((cache_root() / "replay").glob("*.json")) - before
    cached = json.loads(stored.read_text(encoding="utf-8").split("\n", 1)[1])  # after its header line
    assert cached["prompts"] == chosen_prompts(load_prompts(), 5, 42)
    # the base's own greedy answers, without the run's system prompt
    base = load_chat_model(DEMO, device="cpu")
    assert cached["answers"] == base.greedy_replies([[{"role": "user", "content": p}] for p in cached["prompts"]],
                                                    adapter=False, max_new_tokens=MAX_NEW_TOKENS, batch=BATCH)
    raw["output_dir"] = str(tmp_path / "run2")
    again = finetuner.train(Recipe.from_dict(raw))
    assert again.metrics["replay"]["from_cache"] is True and again.metrics["replay"]["rows"] == 5


def test_the_replayed_rows_carry_no_system_prompt_and_follow_packing(tmp_path):
    from transformers import AutoTokenizer

    from finetuner.config.sections import DataSection
    from finetuner.data.pipeline import prepare_data

    tok = AutoTokenizer.from_pretrained(str(DEMO))
    data = tmp_path / "d.json"
    data.write_text(json.dumps(alpaca_rows(8)), encoding="utf-8")
    for packing in (False, True):
        cfg = DataSection(path=str(data), max_seq_len=256, system_prompt="SYSTEM-MARK", replay=0.5, packing=packing,
                          cache=False)
        prepared = prepare_data(cfg, tok, 1)
        n_user = len(prepared.train)
        unpinned = BaseModel("demo", {}, None)  # no weights to fingerprint: answered, not cached
        mixed, info = mix_replay(prepared, cfg, tok, unpinned, 1, lambda ps: [f"ANSWER-MARK {i}" for i in range(len(ps))])
        assert info["rows"] == 4 and len(mixed.train) > n_user
        texts = [tok.decode(ids) for ids in mixed.train["input_ids"]]
        replayed = [t for t in texts if "ANSWER-MARK" in t]
        assert replayed and all("SYSTEM-MARK" not in t for t in replayed)  # packed apart from the user's rows too
        assert all("SYSTEM-MARK" in t for t in texts if "ANSWER-MARK" not in t)  # the user's rows have it
        assert sum(t.count("ANSWER-MARK") for t in texts) == 4


def test_the_plan_counts_the_replayed_rows_as_the_trainer_takes_them(tmp_path):
    from finetuner.config.recipe import Recipe
    from finetuner.planning.recipe_data import run_optimizer_steps
    from finetuner.training.trainer import Trainer

    data = tmp_path / "d.json"
    data.write_text(json.dumps(alpaca_rows(10)), encoding="utf-8")
    recipe = Recipe.from_dict({
        "name": "c", "model": {"name": str(DEMO)}, "device": "cpu", "output_dir": str(tmp_path / "run"),
        "data": {"path": str(data), "max_seq_len": 128, "val_size": 0, "replay": 0.5},
        "training": {"epochs": 1, "micro_batch_size": 2, "gradient_accumulation": 1, "lr": 1e-3}})
    trainer = Trainer(recipe, tmp_path / "run")
    try:
        trainer.setup()
        assert len(trainer.data.train) == 15 and trainer.max_steps == run_optimizer_steps(recipe) == math.ceil(15 / 2)
    finally:
        trainer.cleanup()


def test_replay_is_refused_where_it_cannot_run(tmp_path):
    from finetuner.config.recipe import Recipe
    from finetuner.errors import UserError

    base = {"name": "x", "model": {"name": str(DEMO)}, "data": {"path": "d.jsonl", "replay": 0.25}}
    with pytest.raises((UserError, ValueError), match="data.replay: mixes the base model's answers into SFT rows"):
        Recipe.from_dict({**base, "objective": "dpo"})
    with pytest.raises((UserError, ValueError), match="on 2 process"):
        Recipe.from_dict({**base, "distributed": {"num_processes": 2}})


def test_the_plan_turns_the_guard_on_for_a_small_file_with_a_system_prompt_and_counts_its_rows():
    """The planner's rule (finetuner.planning.sizing.REPLAY_FOR_SYSTEM_PROMPT): on the ferry desk's chats (each with
    its system prompt) the plan sets data.replay and says why; on the bike shop's (no system prompt) it does not; the
    plan's optimizer steps are the trainer's count with the replayed rows (run_optimizer_steps)."""
    from finetuner.planning.planner import plan
    from finetuner.planning.recipe_data import run_optimizer_steps
    from finetuner.planning.sizing import REPLAY_FOR_SYSTEM_PROMPT

    ferry = plan("smollm2-135m-instruct", "cpu", data=str(REPO / "data" / "ferry_desk.jsonl"))
    assert ferry.recipe.data.replay == REPLAY_FOR_SYSTEM_PROMPT
    why = next(r for r in ferry.reasons if r.startswith("data.replay"))
    assert "because they carry a system prompt" in why and "docs/replay_guard.json" in why
    assert ferry.optimizer_steps == run_optimizer_steps(ferry.recipe)
    unguarded = ferry.recipe.model_copy(update={"data": ferry.recipe.data.model_copy(update={"replay": 0.0})})
    assert run_optimizer_steps(unguarded) < ferry.optimizer_steps  # the replayed rows are steps too
    shop = plan("smollm2-135m-instruct", "cpu", data=str(REPO / "data" / "bike_shop.jsonl"))
    assert not shop.recipe.data.replay and not any(r.startswith("data.replay") for r in shop.reasons)
    several = plan("smollm2-135m-instruct", "cpu", data=str(REPO / "data" / "ferry_desk.jsonl"), gpus=2)
    assert not several.recipe.data.replay  # refused on several processes: not planned there


def test_the_rule_is_what_the_recorded_measurement_shows():
    """docs/replay_guard.json (scripts/bench/replay_guard.py, runs of the default plan on 2 cores): on the ferry
    desk's file, measured with the plan's 10 epochs and its 9, the guarded run keeps all 3 simple facts the base
    knows where the unguarded ones lost 2 and 1, the style still learned, no less of the probe kept; on the bike
    shop's file it keeps no more facts, so the plan leaves it off there."""
    recorded = json.loads((REPO / "docs" / "replay_guard.json").read_text(encoding="utf-8"))
    lost = []
    for key in ("ferry_desk", "ferry_desk_10_epochs"):
        off, on = sorted(recorded[key]["rows"], key=lambda r: r["ratio"])
        assert off["ratio"] == 0 and on["ratio"] > 0
        assert on["facts_right"] == on["facts_base_right"] == 3 and off["facts_right"] < 3
        assert on["held_out_signed"] >= 0.75 * on["held_out"]  # the new style: signed on at least 3 of 4 unseen questions
        assert on["probe_kept"] >= off["probe_kept"] and on["probe_kept"] > 0.8 * on["probe_base_right"]
        lost.append(off["facts_base_right"] - off["facts_right"])
    assert max(lost) >= 2  # once, the unguarded run lost 2 of the 3 facts and the guard kept both
    shop_off, shop_on = sorted(recorded["bike_shop"]["rows"], key=lambda r: r["ratio"])
    assert shop_on["facts_right"] <= shop_off["facts_right"]

"""docs/multi_gpu_plans.{json,md}: the planner's choices on several GPUs, as `scripts/dev/multi_gpu_plans.py` makes them."""

from __future__ import annotations

import json

from scripts.dev.multi_gpu_plans import JSON_PATH, MD_PATH, outputs

GiB = 2**30


def test_the_multi_gpu_plan_table_is_the_scripts_current_output():
    js, md = outputs()
    assert JSON_PATH.read_text(encoding="utf-8") == js, "stale: run python -m scripts.dev.multi_gpu_plans"
    assert MD_PATH.read_text(encoding="utf-8") == md, "stale: run python -m scripts.dev.multi_gpu_plans"


def test_the_table_meets_the_issues_goal_and_labels_what_is_not_ours():
    doc = json.loads(JSON_PATH.read_text(encoding="utf-8"))
    assert doc["predictions"] is True and doc["cpu_memory"] == "64GB"
    rows = {(r["model"], r["card"], r["gpus"]): r for r in doc["rows"]}
    assert {m for m, _, _ in rows} == {"llama-3.1-70b", "qwen2.5-32b", "qwen2.5-14b"}
    assert {(c, n) for _, c, n in rows} == {("rtx4090", 2), ("a100-80gb", 2), ("rtx4090", 4)}
    # 70B on two 24 GB cards: QLoRA sharded by fsdp (rank 0 loads the model, the others get their shards)
    big = rows[("llama-3.1-70b", "rtx4090", 2)]
    assert big["fits"] and (big["method"], big["strategy"]) == ("qlora", "fsdp")
    assert big["per_card_bytes"] <= 22.5 * GiB and big["cpu_bytes_per_machine"] <= 64 * GiB
    sharded = rows[("qwen2.5-32b", "rtx4090", 2)]
    assert sharded["fits"] and (sharded["method"], sharded["strategy"]) == ("qlora", "fsdp")
    assert sharded["per_card_bytes"] <= 22.5 * GiB and sharded["cpu_bytes_per_machine"] <= 64 * GiB
    for r in doc["rows"]:
        assert not r["fits"] or (r["per_card_bytes"] <= r["budget_bytes"] and r["cpu_bytes_per_machine"] <= r["machine_cpu_bytes"])
    md = MD_PATH.read_text(encoding="utf-8")
    assert "none was measured" in md and "Answer.AI, measured" in md and "not ours" in md
    assert "rank 0 loads the model" in md and "not built yet" not in md
    assert doc["answer_ai"]["peak_gib"] == 14.92 and "14.92" in md

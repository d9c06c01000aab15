"""One plan on every front (issue 67): the same job planned by the Python API (``finetuner.plan``), the CLI (``finetuner
plan`` writing its recipe, ``finetuner estimate`` on it and on the same recipe with its memory values left ``auto``), the
web UI's Plan tab over HTTP and the run's own ``auto`` resolution (:func:`~finetuner.planning.resolve.resolve_auto`) is
the same recipe with the same predicted bytes, over a matrix of models x cards x sequence lengths.

The models: two tiny folders (the shipped demo model, a tiny Qwen3 config saved here), transformers' default
``qwen3_5_moe_text`` config saved to a folder, and three presets planned on the meta device (Qwen3.5-35B-A3B,
Llama-3.1-8B, gpt-oss-20b); the cards: a 24 GB RTX 4090, an 80 GB A100 and the 12 GB RTX 3060; 512 and 2,048 tokens;
the data: the shipped ``alpaca_sample.json`` (the UI plans a data file only), the same file on every front.

The CLI's whole matrix runs in this process (:func:`tests.conftest.cli_in_process`: the same parser and commands, 36
plans without 36 interpreters' imports); the issue's own case runs as a user runs it, ``finetuner plan`` and
``finetuner estimate`` in processes of their own (:func:`tests.conftest.run_cli`). The cross-entropy chunk is among what
must agree: ``--method auto`` once planned every method without the smaller chunk the API took for ``method=None``
(the CLI said "Nothing fits ... 23.7 GiB" where the API fitted at 21.6 GiB).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_in_process, run_cli, ui_client

DATA = str(REPO / "data" / "alpaca_sample.json")
CARDS = ("rtx4090", "a100-80gb", "rtx3060")
LENGTHS = (512, 2048)
PRESETS = ("qwen3.5-35b-a3b", "llama-3.1-8b", "gpt-oss-20b")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The models of the matrix, by a short name: what each front is given (a folder's path or a preset)."""
    from transformers import AutoConfig

    base = tmp_path_factory.mktemp("models")
    AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=1000).save_pretrained(base / "tiny-qwen3")
    AutoConfig.for_model("qwen3_5_moe_text").save_pretrained(base / "qwen3_5_moe_text")
    return {"demo": str(REPO / "data" / "demo_model"), "tiny-qwen3": str(base / "tiny-qwen3"),
            "qwen3_5_moe_text": str(base / "qwen3_5_moe_text"), **{p: p for p in PRESETS}}


def cells(models: dict[str, str]) -> list[tuple[str, str, int]]:
    return [(m, card, seq) for m in models for card in CARDS for seq in LENGTHS]


def recipe_of(raw: dict) -> dict:
    """A recipe as every front's answer is compared: validated, as ``finetuner run`` reads it."""
    from finetuner.config.recipe import Recipe

    return Recipe.model_validate(raw).to_dict()


@pytest.fixture(scope="module")
def api(models, tmp_path_factory) -> dict[tuple[str, str, int], dict]:
    """``finetuner.plan`` of each cell, as a notebook calls it: fits, the predicted bytes, the recipe (when nothing
    fits: the option that needs the least memory, which the UI's editor holds)."""
    import finetuner

    runs = tmp_path_factory.mktemp("api_runs")
    out = {}
    for m, card, seq in cells(models):
        p = finetuner.plan(models[m], card, seq_len=seq, data=DATA, runs_dir=runs)
        out[m, card, seq] = {"fits": p.fits, "bytes": p.peak_bytes,
                             "recipe": recipe_of((p.recipe or p.closest).to_dict()),
                             "chunk": (p.recipe or p.closest).training.loss_chunk_size}
    return out


def test_the_matrix_has_both_answers_and_the_issues_case_fits(api):
    """The matrix is not trivial: some cells fit and some do not; Qwen3.5-35B-A3B (preset and transformers' default
    config) fits a 4090 at 2,048 tokens with the cross-entropy 128 tokens at a time, auto's chunk for its 248,320-token
    vocabulary (docs/planning.md)."""
    assert any(c["fits"] for c in api.values()) and not all(c["fits"] for c in api.values())
    for m in ("qwen3.5-35b-a3b", "qwen3_5_moe_text"):
        cell = api[m, "rtx4090", 2048]
        assert cell["fits"] and cell["chunk"] == 128 and cell["recipe"]["method"] == "qlora", (m, cell["bytes"])


def test_the_cli_plans_and_estimates_what_the_api_plans(api, models, tmp_path):
    """``finetuner plan -o R --json`` writes the API's recipe and prints its bytes (exit 1 and the least memory when
    nothing fits); ``finetuner estimate R --json`` prints the same bytes, and so does ``estimate`` of the recipe with its
    memory values ``auto`` (the planner resolving them as a run does), resolved to the same choice."""
    import yaml

    from finetuner.config.recipe import Recipe

    differ = []
    for i, (m, card, seq) in enumerate(cells(models)):
        want = api[m, card, seq]
        out = tmp_path / f"{i}.yaml"
        r = cli_in_process("plan", "--model", models[m], "--gpu", card, "--seq-len", str(seq), "--data", DATA,
                           "-o", str(out), "--json", cwd=tmp_path)
        assert r.returncode == (0 if want["fits"] else 1), (m, card, seq, r.stderr[-2000:])
        got = json.loads(r.stdout)
        if (got["fits"], got["total_bytes"]) != (want["fits"], want["bytes"]):
            differ.append((m, card, seq, "plan", got["fits"], got["total_bytes"], want["bytes"]))
        if not want["fits"]:
            assert not out.exists()
            continue
        if recipe_of(yaml.safe_load(out.read_text())) != want["recipe"]:
            differ.append((m, card, seq, "recipe"))
        est = cli_in_process("estimate", str(out), "--gpu", card, "--json", cwd=tmp_path)
        assert est.returncode == 0, est.stderr[-2000:]
        if json.loads(est.stdout)["total_bytes"] != want["bytes"]:
            differ.append((m, card, seq, "estimate", json.loads(est.stdout)["total_bytes"], want["bytes"]))
        auto = tmp_path / f"{i}-auto.yaml"
        auto.write_text(yaml.safe_dump(auto_recipe(Recipe.from_yaml(out))))
        est = cli_in_process("estimate", str(auto), "--gpu", card, "--json", cwd=tmp_path)
        got = json.loads(est.stdout)
        if (got["total_bytes"], choice(got["resolved"])) != (want["bytes"], choice(want["recipe"])):
            differ.append((m, card, seq, "estimate auto", got["total_bytes"], want["bytes"]))
    assert not differ, differ


MEMORY_KEYS = ("micro_batch_size", "gradient_accumulation", "optimizer", "gradient_checkpointing", "offload_activations")


def auto_recipe(recipe) -> dict:
    """A planned recipe with what the planner decides left to it, as a user writes one: method and the memory values
    ``auto``, the effective batch the plan's, the loss chunk unset."""
    raw = recipe.to_dict()
    t = raw["training"]
    raw["training"] = {k: v for k, v in t.items() if k not in MEMORY_KEYS + ("loss_chunk_size",)} | dict.fromkeys(MEMORY_KEYS, "auto") \
        | {"effective_batch": t["micro_batch_size"] * t["gradient_accumulation"]}
    raw["method"] = "auto"
    raw.pop("quantization", None)
    return raw


def choice(r: dict) -> tuple:
    """The memory-deciding choice of a recipe (its dict) or of a plan's ``recipe_choice``."""
    t = r.get("training", r)
    bits = r["quantization_bits"] if "quantization_bits" in r else ((r.get("quantization") or {}).get("bits", 4)
                                                                   if r["method"] == "qlora" else None)
    return (r["method"], bits, *(t[k] for k in MEMORY_KEYS))


def test_the_runs_auto_resolution_is_the_plan(api, models):
    """``finetuner run`` resolves a recipe's ``auto`` values with :func:`resolve_auto` (the trainer's call, for the
    card it runs on): for the auto recipe of each fitting cell, the plan's choice, loss chunk and bytes."""
    from finetuner.config.hardware import get_gpu
    from finetuner.config.recipe import Recipe
    from finetuner.planning.resolve import resolve_auto

    differ = []
    for (m, card, seq), want in api.items():
        if not want["fits"]:
            continue
        p = resolve_auto(Recipe.model_validate(auto_recipe(Recipe.model_validate(want["recipe"]))), get_gpu(card),
                         label_fraction=label_fraction(want["recipe"]))
        if (choice(p.recipe.to_dict()), p.recipe.training.loss_chunk_size, p.peak_bytes) != \
                (choice(want["recipe"]), want["chunk"], want["bytes"]):
            differ.append((m, card, seq, p.peak_bytes, want["bytes"]))
    assert not differ, differ


def label_fraction(raw: dict) -> float:
    """The share of trained tokens a run measures on its recipe's data (as the trainer passes it to resolve_auto)."""
    from finetuner.config.recipe import Recipe
    from finetuner.planning.recipe_data import label_fraction_of

    return label_fraction_of(Recipe.model_validate(raw))


def test_the_ui_plans_over_http_what_the_api_plans(api, models, tmp_path):
    """The Plan tab over HTTP (Method and Objective ``auto`` as the page starts): the recipe in its editor is the API's
    (when nothing fits, the option that needs the least memory), and its memory chart's predicted peak the API's bytes
    to the chart's 0.001 GiB (the page shows no finer figure)."""
    import yaml

    differ = []
    with ui_client(tmp_path) as client:
        for m, card, seq in cells(models):
            want = api[m, card, seq]
            out = client.predict(models[m], card, DATA, seq, 0, "auto", "auto", api_name="/plan")
            if recipe_of(yaml.safe_load(out[4])) != want["recipe"]:
                differ.append((m, card, seq, "recipe"))
            rows = json.loads(out[1]["plot"])["data"]["values"]
            peak = next(row["GiB"] for row in rows if row["what"] == "predicted peak")
            if peak != round(want["bytes"] / 2**30, 3) or ("Fits" in out[2]) != want["fits"]:
                differ.append((m, card, seq, "bytes", peak, want["bytes"] / 2**30))
    assert not differ, differ


def test_the_issues_case_as_a_user_runs_it(models, tmp_path):
    """``finetuner plan --model qwen3.5-35b-a3b --gpu rtx4090 --seq-len 2048`` (and on the folder of transformers'
    default ``qwen3_5_moe_text`` config), in a process of its own, fits at 21.6 GiB with the cross-entropy 128 tokens at
    a time (the recipe it writes names the chunk), as docs/planning.md says, writing ``finetuner.plan``'s recipe; ``finetuner estimate`` on it, in another,
    prints the API's bytes."""
    import yaml

    import finetuner

    for m in ("qwen3.5-35b-a3b", "qwen3_5_moe_text"):
        want = finetuner.plan(models[m], "rtx4090", seq_len=2048, runs_dir=tmp_path / "runs")
        out = tmp_path / f"{m}.yaml"
        r = run_cli("plan", "--model", models[m], "--gpu", "rtx4090", "--seq-len", "2048", "-o", str(out), cwd=tmp_path)
        said = " ".join(r.stdout.split())
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        assert yaml.safe_load(out.read_text())["training"]["loss_chunk_size"] == 128
        assert "predicted peak 21.6 GiB" in said and want.recipe.method == "qlora" and want.recipe.quantization.bits == 4
        assert recipe_of(yaml.safe_load(out.read_text())) == recipe_of(want.recipe.to_dict())
        est = run_cli("estimate", str(out), "--gpu", "rtx4090", "--json", cwd=tmp_path)
        assert est.returncode == 0 and json.loads(est.stdout)["total_bytes"] == want.peak_bytes, est.stderr[-2000:]


def test_the_clis_defaults_are_the_planners():
    """What ``plan --help`` says the CLI defaults to is the planner's own default (``--margin`` unset leaves it to
    :data:`~finetuner.planning.search.DEFAULT_MARGIN`, as the API and the UI do); ``--method`` and ``--objective`` say
    auto, which the planner reads as the API's None (:func:`~finetuner.planning.search.asked_method`)."""
    from finetuner.planning.plan_inputs import check_objective
    from finetuner.planning.search import DEFAULT_MARGIN, asked_method

    said = " ".join(cli_in_process("plan", "--help").stdout.split())
    assert f"kept free (default {DEFAULT_MARGIN:g}: the planner's" in said
    assert "--method METHOD auto (LoRA or QLoRA)" in said and "--objective OBJECTIVE auto" in said
    assert asked_method("auto") is asked_method("") is asked_method(None) is None and asked_method("LoRA") == "lora"
    assert check_objective("auto") is check_objective("") is check_objective(None) is None

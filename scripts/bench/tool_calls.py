"""The tool-calling demo measured (issue 58): the base SmolLM2-135M-Instruct and its fine-tune on
``recipes/tools_smollm2_cpu.yaml`` asked the 12 held-out requests of ``data/tool_calls_heldout.jsonl`` (cities,
numbers and words no training chat names), greedy.

Two measurements of the same requests, written to ``docs/tool_calls.json``:

* ``finetuner eval RUN --data data/tool_calls_heldout.jsonl``: the base's and the fine-tune's shares of right calls
  (function and arguments), right functions and valid call JSON (:mod:`finetuner.infer.tool_eval`);
* ``finetuner chat RUN --tools data/tool_calls_tools.json -p TEXT --temperature 0`` once per request (the CLI, in
  this process: each call loads the run as a user's does), its printed JSON compared with the data's call.

Run::

    finetuner run recipes/tools_smollm2_cpu.yaml          # the run (runs/tools_smollm2_cpu)
    python -m scripts.bench.tool_calls --run runs/tools_smollm2_cpu
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
    from finetuner.infer.evaluate import evaluate_run
    from finetuner.infer.tool_eval import requests_in

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(REPO / "runs" / "tools_smollm2_cpu"))
    ap.add_argument("--no-chat", action="store_true", help="Only the eval (skip the 12 finetuner chat calls).")
    args = ap.parse_args()
    run = Path(args.run)
    t0 = time.perf_counter()
    r = evaluate_run(run, data=HELD_OUT, write=True)
    result = {"run": run.name, "requests": r.tool_call_requests, "eval": {"base": r.base.tool_calls,
                                                                        "fine_tuned": r.fine_tuned.tool_calls},
              "held_out_loss": {"base": round(r.base.loss, 4), "fine_tuned": round(r.fine_tuned.loss, 4)}}
    print(r.table(), flush=True)
    if not args.no_chat:
        rows = []
        for req in requests_in(FileExamples(str(HELD_OUT))):
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
    OUT.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"written to {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()

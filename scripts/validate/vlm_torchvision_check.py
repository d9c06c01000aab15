"""The picture families whose processors need torchvision, trained where torchvision is installed.

The set-up pins the CPU build of torch 2.13.0, beside which no torchvision imports on the project's machines, so
the picture census (``scripts/dev/vlm_census.py``, ``docs/models.md``) records Mistral 3 (Pixtral's processor
requires torchvision) as refused and SmolVLM with its processor loaded without its video processor. A user's GPU
machine usually has torchvision beside its torch. This check runs the census's rows of those families in a Python
environment that has torchvision (``--python``: its interpreter, with finetuner's dependencies and torchvision
installed; this script's own interpreter by default): each family built tiny, planned, trained 2 LoRA steps, asked
about a picture and exported, as the census does.

Results: ``docs/validation/vlm_torchvision_check.json`` and ``.md``.

    python -m scripts.validate.vlm_torchvision_check --python /path/to/venv-with-torchvision/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("mistral3", "smolvlm")

CHILD = r"""
import json, sys
from pathlib import Path
import torch, torchvision, transformers
from scripts.dev import vlm_census
work = Path(sys.argv[1])
rows = []
for family in sys.argv[2:]:
    row, _ = vlm_census.census_row(family, work / family)
    rows.append(row)
print(json.dumps({"torch": torch.__version__, "torchvision": torchvision.__version__,
                  "transformers": transformers.__version__, "rows": rows}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="An interpreter with torchvision and finetuner's dependencies.")
    ap.add_argument("--family", action="append", choices=FAMILIES, help="Default: all of them.")
    ap.add_argument("--out", default=str(REPO / "docs" / "validation" / "vlm_torchvision_check.json"))
    args = ap.parse_args()
    families = args.family or list(FAMILIES)
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([args.python, "-c", CHILD, tmp, *families], cwd=REPO, capture_output=True, text=True,
                           env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
        return 1
    result = json.loads(p.stdout.strip().splitlines()[-1])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    lines = ["# Picture families whose processors need torchvision, trained where it is installed", "",
             f"`python -m scripts.validate.vlm_torchvision_check`: torch {result['torch']}, torchvision "
             f"{result['torchvision']}, transformers {result['transformers']}, on the CPU; each family's row of the "
             "picture census (built tiny, planned, 2 LoRA steps at micro-batch 2 on 4 pictured rows, one chat turn "
             f"with a picture, GGUF export). Raw result: `{out.name}`.", "",
             "| model type | status | parameters | image tokens a picture | losses (2 steps) | GGUF export | answer | reason |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        losses = ", ".join(f"{x:.4f}" for x in r.get("losses") or [])
        tokens = f"{r['picture_tokens'] / r['pictures']:.0f}" if r.get("pictures") else ""
        params = f"{r['params']:,}" if "params" in r else ""
        lines.append(f"| {r['model_type']} | {r['status']} | {params} | {tokens} | {losses} | "
                     f"{r.get('gguf', '')} | {r.get('answer', '')!r} | {r.get('reason', '')} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak RAM of ``finetuner export`` (GGUF) on random-weight Llama models of growing size (CPU).

For each size it saves a random Llama (fp32 safetensors) with the demo's tokenizer, then exports
it in a fresh process and records the process's peak RSS (``VmHWM``) and its RSS after the imports.
``--no-verify`` leaves out the transformers check (which loads the model twice, in float32).

    python -m scripts.validate.export_memory --hidden 512 1024 --quant q8_0
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
import psutil
import finetuner.export.gguf as g
from finetuner.export.merge import peak_rss
import transformers, torch, gguf  # imported before the baseline is taken
from transformers import AutoModelForCausalLM, AutoTokenizer
base = psutil.Process().memory_info().rss
r = g.export_model(sys.argv[1], sys.argv[2], quant=sys.argv[3], verify=sys.argv[4] == "1")
print(json.dumps({"baseline_rss": base, "peak_rss": peak_rss(), "file_bytes": r.file_bytes, "seconds": r.seconds,
                  "max_abs_logit_diff": r.max_abs_logit_diff, "top1": r.top1_agreement}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quant", default="f16")
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "demo_model")
    for hidden in args.hidden:
        with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as out_dir:
            cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=args.layers,
                              num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, tie_word_embeddings=True)
            model = LlamaForCausalLM(cfg)
            weights = sum(p.numel() * 4 for p in model.parameters())
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            del model
            p = subprocess.run([sys.executable, "-c", CHILD, tmp, str(Path(out_dir) / "out.gguf"), args.quant, "0" if args.no_verify else "1"],
                               capture_output=True, text=True, cwd=REPO)
            if p.returncode != 0:
                sys.exit(p.stderr[-3000:])
            r = json.loads(p.stdout.strip().splitlines()[-1])
            print(json.dumps({"hidden": hidden, "fp32_weights_mib": round(weights / 2**20), "quant": args.quant, "verify": not args.no_verify,
                              "baseline_mib": round(r["baseline_rss"] / 2**20), "peak_mib": round(r["peak_rss"] / 2**20),
                              "peak_over_baseline_mib": round((r["peak_rss"] - r["baseline_rss"]) / 2**20),
                              "file_mib": round(r["file_bytes"] / 2**20, 1), "seconds": r["seconds"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

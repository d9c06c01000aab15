"""Peak RAM of ``finetuner merge`` on random-weight Llama models of growing size (CPU).

For each size it saves a random Llama (bf16 safetensors, as hub models are stored) and a random
LoRA adapter (r=16, all linear layers, non-zero B), then runs ``merge_adapter`` in a fresh
process and records the process's peak RSS (``ru_maxrss``) and the RSS just before the merge
(after the imports); the peak is ``VmHWM``, which a child does not inherit. The difference is the merge's own memory; compare it with the merged
weights' size and the shard size.

    python -m scripts.validate.merge_memory --layers 4 12 --shard-size 100MB
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, threading, time
import psutil
import finetuner.export.merge as m
import transformers, peft, torch  # imported before the baseline is taken
base_rss = psutil.Process().memory_info().rss
anon = [0]
def sample():
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon[0] = max(anon[0], int(line.split()[1]) * 1024)
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
r = m.merge_adapter(sys.argv[1], sys.argv[2], dtype=sys.argv[3], shard_size=sys.argv[4])
print(json.dumps({"baseline_rss": base_rss, "peak_rss": m.peak_rss(),
                  "anon_peak": anon[0], "weight_bytes": r.weight_bytes, "shards": r.shards, "max_abs_diff": r.max_abs_diff,
                  "seconds": r.seconds}))
"""


def build(root: Path, layers: int, hidden: int, vocab: int) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetuner.model.tiny_llama import CHATML_TEMPLATE, train_bpe_tokenizer

    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 50, vocab_size=300)
    tok.chat_template = CHATML_TEMPLATE
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    base = root / "base"
    model.save_pretrained(base, max_shard_size="200MB")
    tok.save_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    adapter = root / "adapter"
    peft_model.save_pretrained(adapter)
    cfg_path = adapter / "adapter_config.json"
    ac = json.loads(cfg_path.read_text())
    ac["base_model_name_or_path"] = str(base)
    cfg_path.write_text(json.dumps(ac))
    return base, adapter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--shard-size", default="100MB")
    ap.add_argument("--demo", action="store_true", help="Also merge a finished demo run given with --run.")
    ap.add_argument("--run", help="A run folder (e.g. runs/demo_cpu) to measure as well.")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = []
        if args.run:
            cases.append((f"run {args.run}", args.run))
        for n in args.layers:
            root = Path(tmp) / f"l{n}"
            _base, adapter = build(root, n, args.hidden, args.vocab)
            cases.append((f"random Llama, {n} layers, hidden {args.hidden}", str(adapter)))
        for i, (label, src) in enumerate(cases):
            out = Path(tmp) / f"out{i}"
            p = subprocess.run([sys.executable, "-c", CHILD, src, str(out), args.dtype, args.shard_size],
                               capture_output=True, text=True, check=False)
            if p.returncode:
                sys.exit(p.stderr)
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["label"] = label
            r["merge_rss"] = r["peak_rss"] - r["baseline_rss"]
            rows.append(r)
    mib = 2**20
    print(f"dtype {args.dtype}, shard size {args.shard_size}")
    print(f"{'model':<40} {'weights MiB':>12} {'shards':>6} {'baseline MiB':>13} {'peak MiB':>9} {'peak-baseline':>14} {'ratio':>6} {'anon peak MiB':>14}")
    for r in rows:
        print(f"{r['label']:<40} {r['weight_bytes'] / mib:12.1f} {r['shards']:6d} {r['baseline_rss'] / mib:13.1f} "
              f"{r['peak_rss'] / mib:9.1f} {r['merge_rss'] / mib:14.1f} {r['merge_rss'] / r['weight_bytes']:6.2f} {r['anon_peak'] / mib:14.1f}")


if __name__ == "__main__":
    main()

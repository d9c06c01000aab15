"""Measures the linear-attention and state-space layers of transformers' PyTorch path (no flash-linear-attention,
mamba-ssm or causal-conv1d) forward + backward on this CPU, one thread, against the speed model's prediction for the
same shapes (docs/benchmarks.md): Qwen3.5's Gated DeltaNet, Mamba-2's chunked scan, Falcon-H1's hybrid layer
(attention and a Mamba-2 mixer side by side) and Mamba-1's sequential scan, at 512, 1,024 and 2,048 tokens.

Each model is timed with ``1 + LAYERS`` layers and with one; their difference is ``LAYERS`` layers' (Qwen3.5: the
first layer full attention, the others Gated DeltaNet), and the prediction is the difference of the speed model's two
predictions likewise (full fine-tuning, fp32, no loss chunking; the optimizer, not run here, left out). Timed by
this process's CPU time (one thread: steady while other processes share the cores), against this machine's
calibration made here with one thread (``finetuner gpus --calibrate``'s, its fresh-memory rate included).
Usage: ``python scripts/validate/speed_scans.py [--quick]`` (``--quick``: 512 and 1,024 tokens);
``--repredict``: the speed model's predictions again for the measurements and calibration the JSON holds (after a
change to the model, without timing anew)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from finetuner.memory.model import Settings
from finetuner.model.shapes import shape_from_config
from finetuner.model.tiny import tiny_config
from finetuner.planning.calibrate import measure
from finetuner.planning.speed import DeviceSpeed, step_time

LAYERS = 2
HIDDEN = {"hidden_size": 256, "vocab_size": 256}
CONFIGS = {
    "qwen3_5_text (Gated DeltaNet)": dict(model_type="qwen3_5_text", hidden_size=512, intermediate_size=1024,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                          linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                                          linear_value_head_dim=64, vocab_size=256),
    "mamba2 (chunked scan)": dict(model_type="mamba2", hidden_size=512, num_heads=16, head_dim=64, state_size=64,
                                  n_groups=1, chunk_size=256, vocab_size=256),
    "falcon_h1 (attention + Mamba-2)": {**tiny_config("falcon_h1", 256), **HIDDEN, "intermediate_size": 512,
                                        "mamba_d_ssm": 512, "mamba_n_heads": 8, "mamba_d_head": 64,
                                        "mamba_d_state": 64, "mamba_chunk_size": 128, "head_dim": 64},
    "mamba (sequential scan)": {**tiny_config("mamba", 256), **HIDDEN, "state_size": 16},
}
OUT = Path(__file__).resolve().parents[2] / "docs" / "validation" / "speed_scans_cpu.json"


def build(kw: dict, layers: int, meta: bool = False):
    """The model of ``layers`` layers and its config (``meta``: the config only)."""
    extra = {"layer_types": ["full_attention"] + ["linear_attention"] * (layers - 1)} if kw["model_type"] == "qwen3_5_text" else {}
    cfg = AutoConfig.for_model(**{**kw, "num_hidden_layers": layers, **extra})
    if meta:
        return None, cfg.to_dict()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg), cfg.to_dict()


def timed(model, seq: int, repeats: int) -> float:
    ids = torch.randint(0, 256, (1, seq))
    times = []
    for _ in range(repeats + 1):
        t = time.process_time()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        times.append(time.process_time() - t)
    return statistics.median(times[1:])


def predicted(kw: dict, seq: int, speed: DeviceSpeed) -> dict[str, float]:
    """The speed model's time of ``LAYERS`` layers by part: its prediction for ``1 + LAYERS`` layers less one's."""
    s = Settings(method="full", seq_len=seq, micro_batch=1, compute_dtype="fp32", loss_chunk=0,
                 gradient_checkpointing=False, optimizer="sgd", platform="cpu")
    parts = {n: step_time(shape_from_config(build(kw, n, meta=True)[1], name=kw["model_type"]), s, speed).parts
             for n in (1 + LAYERS, 1)}
    return {k: parts[1 + LAYERS][k] - parts[1][k] for k in parts[1 + LAYERS] if k not in ("optimizer", "fixed")}


def table_row(name: str, seq: int, measured: float, diff: dict[str, float]) -> str:
    pred = sum(diff.values())
    return (f"| {name} | {seq} | {measured:.3f} | {pred:.3f} | {diff['memory-bound']:.3f} | {diff['operations']:.3f} "
            f"| {pred / measured:.2f} |")


HEADER = (f"| layers ({LAYERS}) | tokens | measured s | predicted s | of which memory-bound s | of which operations s "
          "| predicted / measured |\n|---|---:|---:|---:|---:|---:|---:|")


def repredict() -> None:
    """The predictions again for the JSON's measurements at its calibration."""
    data = json.loads(OUT.read_text())
    speed = DeviceSpeed.from_dict(data["speed"])
    print(HEADER)
    for row in data["rows"]:
        diff = predicted(CONFIGS[row["layer"]], row["tokens"], speed)
        row.update(predicted_s=sum(diff.values()), parts={k: round(v, 5) for k, v in diff.items()})
        print(table_row(row["layer"], row["tokens"], row["measured_s"], diff))
    OUT.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512 and 1,024 tokens only")
    ap.add_argument("--repredict", action="store_true",
                    help="the speed model's predictions again for the stored measurements (no timing)")
    args = ap.parse_args()
    if args.repredict:
        return repredict()
    torch.set_num_threads(1)
    lengths = (512, 1024) if args.quick else (512, 1024, 2048)
    speed = measure()
    print(f"speed model: {speed.source}; load average {os.getloadavg()[0]:.2f} at the start")
    print(HEADER)
    rows = []
    for name, kw in CONFIGS.items():
        built = {n: build(kw, n)[0] for n in (1 + LAYERS, 1)}
        for seq in lengths:
            measured = timed(built[1 + LAYERS], seq, 3) - timed(built[1], seq, 3)
            diff = predicted(kw, seq, speed)
            rows.append(dict(layer=name, tokens=seq, measured_s=measured, predicted_s=sum(diff.values()),
                             parts={k: round(v, 5) for k, v in diff.items()}, load_average=os.getloadavg()[0]))
            print(table_row(name, seq, measured, diff), flush=True)
    OUT.write_text(json.dumps({"speed_model": speed.source, "speed": speed.to_dict(), "layers": LAYERS,
                               "timed_by": "process CPU time, 1 thread", "rows": rows}, indent=1) + "\n")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; written {OUT}")


if __name__ == "__main__":
    main()

"""Measures one linear-attention layer (Qwen3.5's Gated DeltaNet) and one Mamba-2 layer, forward + backward on this
CPU (one thread, transformers' PyTorch path: no flash-linear-attention, mamba-ssm or causal-conv1d), at three
sequence lengths, against the speed model's prediction for the same shapes (docs/benchmarks.md).

A two-layer model is timed (Qwen3.5: a full-attention layer, then the linear-attention one) (embedding, the layers, the head), and so is the same model with one layer; their
difference is one layer's, and the prediction is the difference of the speed model's two predictions likewise
(full fine-tuning, fp32, no loss chunking; the optimizer, not run here, left out). Usage: ``python scripts/validate/speed_scans.py``."""

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
from finetuner.planning.calibrate import speed_for
from finetuner.config.hardware import get_gpu
from finetuner.planning.scans import scan_bytes
from finetuner.planning.speed import step_time

CONFIGS = {
    "qwen3_5_text (Gated DeltaNet)": dict(model_type="qwen3_5_text", hidden_size=512, intermediate_size=1024,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                          linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                                          linear_value_head_dim=64, vocab_size=256),
    "mamba2": dict(model_type="mamba2", hidden_size=512, num_heads=16, head_dim=64, state_size=64, n_groups=1,
                   chunk_size=256, vocab_size=256),
}


OUT = Path(__file__).resolve().parents[2] / "docs" / "validation" / "speed_scans_cpu.json"


def timed(model, seq: int, repeats: int) -> float:
    ids = torch.randint(0, 256, (1, seq))
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def main() -> None:
    torch.set_num_threads(1)
    speed = speed_for(get_gpu("cpu"))
    load = os.getloadavg()
    print(f"speed model: {speed.source}; load average during the run (2 cores, shared): {load[0]:.2f} at the start")
    print("| layer | tokens | measured s (median of 3) | predicted s | of which element-wise s | predicted / measured |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name, kw in CONFIGS.items():
        built = {}
        for layers in (2, 1):
            cfg = AutoConfig.for_model(**{**kw, "num_hidden_layers": layers,
                                          **({"layer_types": ["full_attention"] + ["linear_attention"] * (layers - 1)}
                                             if kw["model_type"] == "qwen3_5_text" else {})})
            torch.manual_seed(0)
            built[layers] = (AutoModelForCausalLM.from_config(cfg), cfg.to_dict())
        shapes = {n: shape_from_config(built[n][1], name=name) for n in built}
        for seq in (256, 1024, 2048):
            measured = timed(built[2][0], seq, 3) - timed(built[1][0], seq, 3)
            s = Settings(method="full", seq_len=seq, micro_batch=1, compute_dtype="fp32", loss_chunk=0,
                         gradient_checkpointing=False, optimizer="sgd", platform="cpu")
            pred = [sum(v for k, v in step_time(shapes[n], s, speed).parts.items() if k not in ("optimizer", "fixed"))
                    for n in (2, 1)]
            scans_s = scan_bytes(shapes[2], 1, seq) / speed.bandwidth_bytes_per_s
            rows.append(dict(layer=name, tokens=seq, measured_s=measured, predicted_s=pred[0] - pred[1],
                             element_wise_s=scans_s, load_average=os.getloadavg()[0]))
            print(f"| {name} | {seq} | {measured:.3f} | {pred[0] - pred[1]:.3f} | {scans_s:.3f} | "
                  f"{(pred[0] - pred[1]) / measured:.2f} |", flush=True)
    OUT.write_text(json.dumps({"speed_model": speed.source, "rows": rows}, indent=1) + "\n")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; written {OUT}")


if __name__ == "__main__":
    main()

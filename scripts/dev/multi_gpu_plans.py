"""What `finetuner plan --gpus N` chooses for 14B-70B models on several cards: docs/multi_gpu_plans.{json,md}.

    python -m scripts.dev.multi_gpu_plans          # writes both files
    python -m scripts.dev.multi_gpu_plans --check  # exit 1 if they are not its current output

Every row is the planner's answer (:func:`finetuner.planning.planner.plan`) at 2,048 tokens, effective
batch 16, for a default install (``GpuProfile.with_default_install``), on a machine with
``CPU_MEMORY`` of CPU memory; the figures are the memory model's predictions, none measured.
Beside them: Answer.AI's published measurement of Llama-2-70B QLoRA on two RTX 4090s (theirs, from
their fsdp_qlora benchmarks), and finetuner's prediction for the closest recipe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JSON_PATH = REPO / "docs" / "multi_gpu_plans.json"
MD_PATH = REPO / "docs" / "multi_gpu_plans.md"

MODELS = ["llama-3.1-70b", "qwen2.5-32b", "qwen2.5-14b"]
SETUPS = [("rtx4090", 2), ("a100-80gb", 2), ("rtx4090", 4)]
#: the CPU memory of the machine every row is planned for (a desktop's; `--cpu-memory 64GB`)
CPU_MEMORY = "64GB"
SEQ_LEN = 2048
GiB = 2**30

#: Answer.AI's published figure (not ours): benchmarks_03_2024.md of github.com/AnswerDotAI/fsdp_qlora,
#: "Case Study: A Dual 4090 'Budget Workstation'", table "Llama-2 70B with Context Length of 2048"
ANSWER_AI = {
    "model": "Llama-2-70B", "gpus": "2 x RTX 4090 (128 GB CPU RAM)", "method": "QLoRA (their fsdp_qlora, FSDP + CPU offload)",
    "batch_size": 2, "context_length": 2048, "peak_gib": 14.92,
    "source": "https://github.com/AnswerDotAI/fsdp_qlora/blob/main/benchmarks_03_2024.md",
}


def plan_rows() -> list[dict]:
    """One row per model and setup: the planner's choice and its per-card and CPU memory."""
    from finetuner.config.hardware import get_gpu
    from finetuner.planning.planner import plan

    rows = []
    for model in MODELS:
        for card, n in SETUPS:
            gpu = get_gpu(card).with_default_install()
            p = plan(model, gpu, seq_len=SEQ_LEN, gpus=n, cpu_memory=CPU_MEMORY)
            row = {"model": model, "card": card, "gpus": n, "fits": p.fits, "seq_len": SEQ_LEN,
                   "card_bytes": gpu.memory_bytes, "machine_cpu_bytes": p.cpu_memory}
            if not p.fits:
                row["why"] = p.reasons[0]
                rows.append(row)
                continue
            c, sh = p.recipe_choice(), p.sharded
            row.update({
                "method": c["method"], "quantization_bits": c["quantization_bits"], "strategy": sh.strategy,
                "strategy_label": sh.label, "micro_batch": c["micro_batch_size"],
                "gradient_accumulation": c["gradient_accumulation"], "gradient_checkpointing": c["gradient_checkpointing"],
                "activation_offload": c["offload_activations"], "optimizer": c["optimizer"],
                "per_card_bytes": sh.per_device_bytes, "budget_bytes": p.estimate.budget_bytes,
                "cpu_bytes_per_machine": sh.host_bytes_per_machine, "sent_bytes_per_card_per_step": sh.comm_bytes_per_step,
                "predicted_tokens_per_s": round(p.tokens_per_s, 1),
            })
            rows.append(row)
    return rows


def answer_ai_comparison() -> dict:
    """finetuner's prediction for the recipe closest to Answer.AI's measured run: Llama-2-70B, QLoRA
    4-bit, fsdp with CPU offload on 2 x RTX 4090, micro-batch 2, 2,048 tokens, checkpointing (LoRA
    as finetuner's defaults: r 16 on every linear layer)."""
    from finetuner.config.hardware import get_gpu
    from finetuner.memory.model import CUDA_CONTEXT_BYTES, Settings, estimate
    from finetuner.memory.sharding import shard_estimate
    from finetuner.model.shapes import resolve_shape

    shape, gpu = resolve_shape("llama-2-70b"), get_gpu("rtx4090").with_default_install()
    s = Settings(method="qlora", micro_batch=ANSWER_AI["batch_size"], seq_len=ANSWER_AI["context_length"],
                 gradient_accumulation=2, gradient_checkpointing=True, attention_mask=True)
    sh = shard_estimate(estimate(shape, s, gpu), "fsdp", 2, "optimizer+params", shape)
    return {**ANSWER_AI, "finetuner_per_card_bytes": sh.per_device_bytes,
            "finetuner_reserved_bytes": sh.per_device_bytes - CUDA_CONTEXT_BYTES,
            "finetuner_training_bytes": sh.training_bytes,
            "finetuner_cpu_bytes_per_machine": sh.host_bytes_per_machine,
            "finetuner_loading_cpu_bytes_per_machine": sh.loading_host_bytes_per_machine}


def _plan_cell(r: dict) -> str:
    method = "LoRA" if r["method"] == "lora" else f"QLoRA {r['quantization_bits']}-bit"
    return (f"{method}, {r['strategy_label']}, micro-batch {r['micro_batch']} x {r['gradient_accumulation']}, "
            f"{'checkpointing' if r['gradient_checkpointing'] else 'no checkpointing'}"
            f"{', activation offload' if r['activation_offload'] else ''}")


def markdown(rows: list[dict], aai: dict) -> str:
    lines = [
        "# Plans on several GPUs (predictions)",
        "",
        "What `finetuner plan --model M --gpu G --gpus N --seq-len 2048 --cpu-memory 64GB` chooses (effective batch 16,",
        "a default install), generated by `python -m scripts.dev.multi_gpu_plans` (`tests/planning/test_multi_gpu_plans_doc.py`",
        "checks this file is its current output; the numbers are also in `docs/multi_gpu_plans.json`).",
        "**Every figure of finetuner here is the memory model's prediction; none was measured on these GPUs.**",
        "Per card: the predicted peak (CUDA context included) against the card's memory less the planner's 5 % margin.",
        "CPU memory: what every process on the machine needs (offloaded parameters, gradients and optimizer states,",
        "offloaded activations, 0.4 GiB for each process itself), or more while the model loads, against the machine's",
        "64 GiB. Loading: under fsdp rank 0 loads the model (QLoRA: quantized) into CPU memory and scatters it into the",
        "shards, so no card holds the whole model and the machine holds it once; under zero3 every process loads the whole",
        "model onto its card before DeepSpeed partitions it, which per card counts where it is the peak.",
        "Sent: bytes each card sends per optimizer step.",
        "",
        "| model | GPUs | finetuner's plan | per card (GiB) | CPU memory, machine (GiB) | sent per card per step (GiB) | predicted tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        where = f"{r['gpus']} x {r['card']}"
        if not r["fits"]:
            lines.append(f"| {r['model']} | {where} | nothing fits: {r['why']} | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {where} | {_plan_cell(r)} | {r['per_card_bytes'] / GiB:.1f} of {r['budget_bytes'] / GiB:.1f} | "
            f"{r['cpu_bytes_per_machine'] / GiB:.1f} of {r['machine_cpu_bytes'] / GiB:.0f} | "
            f"{r['sent_bytes_per_card_per_step'] / GiB:.1f} | {r['predicted_tokens_per_s']:,.0f} |")
    lines += [
        "",
        "## Beside a published measurement (Answer.AI's, not ours)",
        "",
        "| | model | GPUs | recipe | peak per GPU (GiB) |",
        "|---|---|---|---|---|",
        f"| **Answer.AI, measured** ([fsdp_qlora benchmarks]({aai['source']})) | {aai['model']} | {aai['gpus']} | "
        f"{aai['method']}, batch size {aai['batch_size']}, context {aai['context_length']:,} | {aai['peak_gib']:.2f} |",
        f"| finetuner, predicted | llama-2-70b | 2 x rtx4090 | QLoRA 4-bit (r 16, all linear layers), fsdp + CPU offload, "
        f"micro-batch {aai['batch_size']}, seq {aai['context_length']:,}, checkpointing | "
        f"{aai['finetuner_reserved_bytes'] / GiB:.2f} reserved ({aai['finetuner_per_card_bytes'] / GiB:.2f} with the CUDA context) |",
        "",
        "Not like for like: Answer.AI's figure is their script's (FSDP1, their LoRA settings, their loading code) and, as",
        "their write-up uses it, torch's peak reserved memory; finetuner's row is its memory model's prediction for its own",
        "FSDP2 recipe on the same shape. Their 70B run filled the 128 GB of CPU RAM of their dual-3090 machine while",
        "loading (they added a swap file); finetuner predicts "
        f"{aai['finetuner_cpu_bytes_per_machine'] / GiB:.1f} GiB of CPU memory for the machine (while loading, rank 0's",
        f"copy of the 4-bit model and the two processes take {aai['finetuner_loading_cpu_bytes_per_machine'] / GiB:.1f} GiB). "
        "finetuner loads as their low-memory mode does (one process loads, the",
        "shards are sent to the others), so the figure above is the card's peak; on a GPU it is unmeasured.",
        "",
    ]
    return "\n".join(lines)


def outputs() -> tuple[str, str]:
    rows, aai = plan_rows(), answer_ai_comparison()
    doc = {"cpu_memory": CPU_MEMORY, "seq_len": SEQ_LEN, "predictions": True, "rows": rows, "answer_ai": aai}
    return json.dumps(doc, indent=2) + "\n", markdown(rows, aai)


def main(argv: list[str]) -> int:
    js, md = outputs()
    if "--check" in argv:
        stale = [p for p, text in ((JSON_PATH, js), (MD_PATH, md)) if not p.is_file() or p.read_text(encoding="utf-8") != text]
        for p in stale:
            print(f"{p.relative_to(REPO)} is stale: run python -m scripts.dev.multi_gpu_plans", file=sys.stderr)
        return 1 if stale else 0
    JSON_PATH.write_text(js, encoding="utf-8")
    MD_PATH.write_text(md, encoding="utf-8")
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

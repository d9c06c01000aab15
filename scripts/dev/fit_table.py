"""The README's "what fits where" table, from the planner (tests/test_readme.py checks the README matches).

    python -m scripts.dev.fit_table

Paste the output between ``<!-- fit-table:start -->`` and ``<!-- fit-table:end -->`` in README.md.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MODELS = ["llama-2-7b", "qwen2.5-7b", "llama-3.1-8b", "llama-2-13b"]
CARDS = ["rtx4090", "a100-40gb", "a100-80gb"]
#: GPU measurements of exactly the planner's recipe for (model, card): docs/memory.md, the
#: ``planned-rtx4090-capped`` row of docs/validation/validate_llama-3.1-8b.json (21,879,407,104 B
#: allocated, 23,450,353,664 B reserved). Only rows whose settings match the plan belong here.
MEASURED = {("llama-3.1-8b", "rtx4090"): "20.4 GiB allocated, 21.8 GiB reserved ¹"}

FOOTNOTES = """\
Predicted peak: the memory model's total for full 2,048-token rows (weights, LoRA, gradients,
optimizer states, activations, allocator slack and the 0.6 GiB CUDA context) against the card's
usable memory; the planner keeps 5 % of the card free. `finetuner plan --model M --gpu G
--seq-len 2048` prints the same choice with its reasons and the options it rejected.

¹ Measured on an NVIDIA H100 capped at 23.65 GiB (`torch.cuda.set_per_process_memory_fraction`)
by `scripts/validate/memory.py --preset llama-3.1-8b --planned rtx4090`
([docs/memory.md](docs/memory.md)): the planner's recipe (LoRA r16 on all linear layers,
micro-batch 4, sequence 2,048 packed, checkpointing, AdamW) on a random-weight model of
Llama-3.1-8B's shape, 3 steps, with accumulation 1 instead of 4 and packed rows averaging 1,759
of 2,048 tokens. Measured figures are torch's counters (`max_memory_allocated`,
`max_memory_reserved`); the CUDA context (about 0.6 GiB) comes on top, so 22.5 GiB is the figure
to set against the predicted 21.8. The prediction for that run was 20.5 GiB allocated (+0.5 %)
and 21.2 GiB reserved (−2.9 %: near the cap the allocator fragmented more than the model allows
for; the 5 % margin covered it).

The other GPU measurements used settings the planner does not choose for these cards, so they
are not in the table (all on an H100, packed 2,048-token rows, peak allocated; docs/memory.md and
[docs/benchmarks.md](docs/benchmarks.md)): Llama-2-7B LoRA, micro-batch 1, checkpointing, AdamW:
14.16 GiB; Llama-3.1-8B LoRA, micro-batch 2, checkpointing, AdamW: 18.18 GiB, 3,839 tokens/s;
Llama-3.1-8B QLoRA nf4, micro-batch 2, checkpointing, paged AdamW 8-bit: 8.12 GiB, 2,984
tokens/s; Llama-2-13B QLoRA nf4, micro-batch 1, checkpointing, paged AdamW 8-bit: 8.61 GiB,
1,382 tokens/s; Llama-2-13B LoRA, micro-batch 1, no checkpointing, AdamW 8-bit: 45.83 GiB.
"""


def table() -> str:
    from finetuner.planning.planner import plan

    lines = ["| model | card | finetuner's plan (seq 2048, effective batch 16) | predicted peak | measured |",
             "|---|---|---|---|---|"]
    for m in MODELS:
        for c in CARDS:
            p = plan(m, c, seq_len=2048)
            if not p.fits:
                lines.append(f"| {m} | {c} | nothing fits: {p.suggestions[0]} | | |")
                continue
            ch = p.recipe_choice()
            method = "LoRA" if ch["method"] == "lora" else f"QLoRA {ch['quantization_bits']}-bit"
            how = (f"{method}, micro-batch {ch['micro_batch_size']} x {ch['gradient_accumulation']}, {ch['optimizer']}, "
                   f"{'checkpointing' if ch['gradient_checkpointing'] else 'no checkpointing'}"
                   f"{', activation offload' if ch['offload_activations'] else ''}")
            lines.append(f"| {m} | {c} | {how} | {p.estimate.total_bytes / 2**30:.1f} of {p.gpu.memory_gib:.1f} GiB "
                         f"| {MEASURED.get((m, c), '')} |")
    return "\n".join(lines) + "\n\n" + FOOTNOTES


if __name__ == "__main__":
    print(table(), end="")

"""The cross-entropy chunk's effect on the planned peak, against Unsloth's published figures: docs/memory.md's table
between ``<!-- loss-chunk-figures:start -->`` and ``<!-- loss-chunk-figures:end -->``.

    python -m scripts.dev.loss_chunk_figures          # prints the table
    python -m scripts.dev.loss_chunk_figures --write  # writes it into docs/memory.md

Each row is the memory model's prediction (none measured here) for QLoRA 4-bit, micro-batch 1 x 2,048 tokens, gradient
checkpointing, AdamW, on an RTX 4090, with the loss in 1,024-token chunks (the fixed chunk before
``training.loss_chunk_size: auto``) and with ``auto`` (:mod:`finetuner.losses.chunk`). Unsloth's figures are theirs
(its README and docs, read 2026-11, /work/shared/notes/anchors.md), in GB as published, at settings that are not
exactly these. The last line is the replay of the GPU rows of docs/validation (``scripts.validate.memory.replay``):
the row predicted closest to its measurement, which the chunk does not move (every row ran 1,024-token chunks and is
replayed at the chunk it ran).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MEMORY_MD = REPO / "docs" / "memory.md"
START, END = "<!-- loss-chunk-figures:start -->\n", "<!-- loss-chunk-figures:end -->"
#: the models of issue 67 and what Unsloth publishes for them (QLoRA, batch 1, 2,048 tokens)
MODELS = {"llama-3.1-8b": "~8 GB", "gpt-oss-20b": "~14 GB"}
GPU = "rtx4090"
GiB = 2**30


def predicted(model: str, chunk: int | str):
    """The memory model's estimate for ``model`` with the loss in ``chunk``-token chunks (``auto``: the default)."""
    from finetuner.config.hardware import get_gpu
    from finetuner.config.recipe import Recipe
    from finetuner.memory.model import estimate, settings_from_recipe
    from finetuner.model.shapes import resolve_shape

    shape, gpu = resolve_shape(model), get_gpu(GPU)
    recipe = Recipe.model_validate({
        "model": {"name": model}, "method": "qlora", "data": {"path": "yahma/alpaca-cleaned", "max_seq_len": 2048},
        "training": {"micro_batch_size": 1, "gradient_accumulation": 1, "gradient_checkpointing": True,
                     "optimizer": "adamw_torch", "loss_chunk_size": chunk}})
    return estimate(shape, settings_from_recipe(recipe, gpu, shape.model_type, shape=shape), gpu)


def worst_replayed_row() -> dict:
    """The GPU row of docs/validation whose allocated peak is predicted closest above (or below) its measurement."""
    from scripts.validate.memory import replay

    return min((r for r in replay() if "error" not in r), key=lambda r: r["error_allocated_pct"])


def table() -> str:
    lines = ["| model (QLoRA 4-bit, 1 x 2,048, checkpointing, AdamW, RTX 4090) | vocabulary | 1,024-token chunks: peak GiB "
             "(cross-entropy backward) | `auto`: chunk, peak GiB (peak phase) | Unsloth (theirs) |",
             "|---|---|---|---|---|"]
    for model, theirs in MODELS.items():
        before, after = predicted(model, 1024), predicted(model, "auto")
        ce = before.details["activations"]["loss_peak_bytes"]
        phase = "cross-entropy backward" if after.details["activations"]["loss_phase_bytes"] >= \
            after.details["activations"]["layer_phase_bytes"] else "a layer's backward"
        lines.append(f"| {model} | {before.shape.vocab_size:,} | {before.total_bytes / GiB:.2f} ({ce / GiB:.2f}) | "
                     f"{after.settings.loss_chunk}, {after.total_bytes / GiB:.2f} ({phase}) | {theirs} |")
    w = worst_replayed_row()
    lines += ["", f"The replay's closest row (the same before and after: each row is replayed at the 1,024-token chunk it ran): {w['preset']} {w['config']}, predicted "
                  f"{w['predicted_allocated_bytes'] / GiB:.2f} GiB allocated for {w['measured_allocated_bytes'] / GiB:.2f} "
                  f"GiB measured ({w['error_allocated_pct']:+.2f}%); no row under-predicted."]
    return "\n".join(lines) + "\n"


def in_docs() -> str | None:
    m = re.search(re.escape(START) + r"(.*?)" + re.escape(END), MEMORY_MD.read_text(encoding="utf-8"), re.S)
    return m.group(1) if m else None


def main() -> None:
    text = table()
    if "--write" in sys.argv[1:]:
        doc = MEMORY_MD.read_text(encoding="utf-8")
        old = in_docs()
        assert old is not None, f"docs/memory.md has no {START.strip()} ... {END} section"
        MEMORY_MD.write_text(doc.replace(START + old + END, START + text + END), encoding="utf-8")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()

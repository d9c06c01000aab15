"""Write the shipped GPU recipes from the planner (``tests/planning/test_planner.py`` re-plans and
compares, so they never drift from what ``finetuner plan`` says).

    python -m scripts.dev.make_gpu_recipes            # rewrite recipes/{7b,13b}_{4090,a100}.yaml
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: file → (model, card, sequence length, effective batch)
GPU_RECIPES = {
    "7b_4090.yaml": ("Qwen/Qwen2.5-7B-Instruct", "rtx4090", 2048, 16),
    "13b_4090.yaml": ("NousResearch/Llama-2-13b-hf", "rtx4090", 2048, 16),
    "7b_a100.yaml": ("Qwen/Qwen2.5-7B-Instruct", "a100-80gb", 2048, 16),
    "13b_a100.yaml": ("NousResearch/Llama-2-13b-hf", "a100-80gb", 2048, 16),
}


def planned(file: str):
    """The plan for a default install (no Liger Kernel, no FlashAttention-2), whatever is installed here."""
    from finetuner.config.hardware import get_gpu
    from finetuner.planning.planner import plan

    model, gpu, seq, eff = GPU_RECIPES[file]
    return plan(model, get_gpu(gpu).with_default_install(), seq_len=seq, effective_batch=eff,
                name=Path(file).stem.replace("_", "-"))


def main() -> None:
    for file in GPU_RECIPES:
        p = planned(file)
        (REPO / "recipes" / file).write_text(p.to_yaml(f"recipes/{file}").replace(" /work/main", ""), encoding="utf-8")
        print(file, p.summary())


if __name__ == "__main__":
    main()

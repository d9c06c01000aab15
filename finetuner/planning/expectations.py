"""What a fine-tune of a small model can do, said in the plan from what was measured.

Two kinds of small model reach a CPU user:

* **A toy model** (under ``TOY_PARAMS``), like the 0.93M-parameter demo model in
  ``data/demo_model``: it knows only the corpus it was pre-trained on. Fine-tuned on a user's own
  chats it copies words of their answers but does not answer their questions (60 rows of a user's
  chats: eval loss 5.98, answers such as "Ah is the boats come home. cliff, the station…").
* **A ~100M-class instruction model** (under ``SMALL_PARAMS``), measured on SmolLM2-135M-Instruct
  with ``recipes/smollm2_cpu.yaml`` by ``scripts/bench/cpu_walkthrough.py``
  (``docs/cpu_walkthrough.json``): it takes on the data's style and format in 16 steps and stays
  fluent, and forgets a little of what it knew.

Larger models get no note here: the general small-data note of :mod:`finetuner.planning.sizing`
applies to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.model.shapes import ModelShape

#: Below this many parameters a model is a toy: it knows its own corpus and nothing else.
TOY_PARAMS = 20_000_000
#: Below this many parameters (and from ``TOY_PARAMS``), the measurement on SmolLM2-135M-Instruct applies.
SMALL_PARAMS = 1_000_000_000
#: The model the CPU walk-through uses (``recipes/smollm2_cpu.yaml``).
CPU_MODEL = "smollm2-135m-instruct"


def is_toy(shape: ModelShape) -> bool:
    """A model too small to answer questions outside the corpus it was pre-trained on."""
    return shape.num_params < TOY_PARAMS


def expectation(shape: ModelShape, platform: str) -> str | None:
    """The plan's note on what this model will learn from the user's data, or ``None`` (larger models).

    Args:
        shape: the base model.
        platform: the planned device's platform (``cpu``, ``cuda``, ...): the CPU note names the
            measured wall time.
    """
    n = shape.num_params
    if n < TOY_PARAMS:
        return (f"{shape.name} has {n / 1e6:.2f}M parameters: a toy model that knows only the text it was pre-trained on "
                "(the demo model: data/pretrain/corpus.txt). It will not answer your questions: fine-tuned on your own "
                "chats it strings together words of your answers. Use it to check the path; for answers in your style "
                f"on the CPU, plan with --model {CPU_MODEL} (recipes/smollm2_cpu.yaml)")
    if n < SMALL_PARAMS:
        where = ", 60 s on 2 idle CPU cores, 18 s of it training" if platform == "cpu" else ""
        return (f"{shape.name} has {n / 1e6:.0f}M parameters. Measured on SmolLM2-135M-Instruct (recipes/smollm2_cpu.yaml: "
                f"72 chats of a made-up shop assistant, 16 LoRA steps of 2 chats{where}): held-out loss 5.06 to 2.32, and "
                "11 of 12 answers to held-out questions came back fluent and signed as the data sign; the content is a "
                "small model's (plausible, not always right). It forgot some: 11 of 13 general questions it answered right "
                "were still right, and its general answers rambled after the first sentence. This is for an "
                "instruction-tuned model; a base model has to learn the chat format from your data too")
    return None

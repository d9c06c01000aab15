"""How many tokens finetuner's chunked cross-entropy takes at a time (``training.loss_chunk_size: auto``).

The chunked loss (:func:`finetuner.model.scoring.token_loss_sum`) gathers the hidden states of the labelled
positions and runs the LM head and an fp32 cross-entropy over ``chunk`` of them at a time, each chunk recomputed in
its backward. What one chunk's backward holds is proportional to ``chunk x vocabulary`` and to nothing else: 16
bytes per logit (fp32 log-softmax, the NLL's gradient, the log-softmax's gradient, the bf16 logit gradient and the
casts), 24 with Gemma-2's soft-capping (its tanh and their gradients), the memory model's
:func:`finetuner.memory.activations.activation_bytes`. A fixed 1,024 tokens costs 0.5 GiB over Llama-2's 32,000-token
vocabulary, the case the default was measured on (docs/validation), but 2.0 GiB over Llama-3's 128,256 and 3.1 GiB
over gpt-oss's 201,088: a peak flat in the sequence length, most of what a 1 x 2,048 QLoRA step adds to the weights.

``auto`` keeps the bytes instead of the tokens: the largest multiple of :data:`CHUNK_STEP` tokens, at most
:data:`MAX_AUTO_CHUNK`, whose backward stays within :data:`LOSS_CHUNK_BUDGET_BYTES` (512 MiB, what 1,024 tokens cost
over 32,000 words, rounded up to a power of two), and never fewer than :data:`CHUNK_STEP`. The loss is the same sum
whatever the chunk (tested against the unchunked cross-entropy, loss and gradients, in
``tests/losses/test_loss_chunk.py``); a smaller chunk only adds launches (8 operations a chunk in the speed model,
``finetuner.planning.speed.OPS_PER_LOSS_CHUNK``). Pure arithmetic, no torch: the memory model, the planner and the
trainer call the same function on the same :class:`~finetuner.model.shapes.ModelShape` figures, and the planner
writes the number into the recipe it plans (:func:`finetuner.memory.model.with_loss_chunk`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from finetuner.units import MiB

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.model.shapes import ModelShape

#: the bytes one chunk's backward may hold (see the module doc)
LOSS_CHUNK_BUDGET_BYTES = 512 * MiB
#: chunks are whole multiples of this many tokens (the tensor cores' tiles), and never smaller
CHUNK_STEP = 64
#: the largest chunk ``auto`` takes: the chunk the GPU rows of docs/validation were measured with
MAX_AUTO_CHUNK = 1024
#: bytes per logit of a chunk's backward (the memory model's ``loss_peak``), and with soft-capped logits
BYTES_PER_LOGIT = 16
BYTES_PER_LOGIT_SOFTCAPPED = 24


def chunk_bytes_per_token(vocab_size: int, softcapped: bool = False) -> int:
    """What one labelled token of a chunk costs at the chunk's backward, in bytes."""
    return (BYTES_PER_LOGIT_SOFTCAPPED if softcapped else BYTES_PER_LOGIT) * vocab_size


def auto_loss_chunk(vocab_size: int, softcapped: bool = False, budget: int = LOSS_CHUNK_BUDGET_BYTES) -> int:
    """The tokens per cross-entropy chunk ``auto`` takes for a vocabulary of ``vocab_size`` (see the module doc)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size {vocab_size}: a model has at least one token")
    fit = budget // chunk_bytes_per_token(vocab_size, softcapped)
    return max(CHUNK_STEP, min(MAX_AUTO_CHUNK, fit // CHUNK_STEP * CHUNK_STEP))


def loss_chunk_of(value: int | str, shape: ModelShape) -> int:
    """``training.loss_chunk_size`` resolved for ``shape``: a number as given (0: the plain loss), ``auto`` by
    :func:`auto_loss_chunk` on the shape's vocabulary and soft-capping."""
    if value == "auto":
        return auto_loss_chunk(shape.vocab_size, bool(shape.final_logit_softcapping))
    return int(value)


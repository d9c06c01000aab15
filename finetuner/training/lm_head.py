"""The parts of a causal LM the losses need to compute logits a few tokens at a time: the
transformer body and the LM head (the SFT loss in :mod:`finetuner.training.trainer` and the
preference losses in :mod:`finetuner.training.preference` both go through them)."""

from __future__ import annotations


def decoder_and_head(model):
    """The transformer body and the LM head of a (peft-wrapped) causal LM, and its final logit
    soft-capping; ``(None, None, None)`` when it does not have the usual shape."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = getattr(base, "model", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None or getattr(base.config, "logit_scale", None) is not None:
        return None, None, None
    return decoder, head, getattr(base.config, "final_logit_softcapping", None)


def at_least_fp32(t):
    """fp16/bf16 → fp32 for the loss; fp32 and fp64 as they are."""
    return t.float() if t.element_size() < 4 else t

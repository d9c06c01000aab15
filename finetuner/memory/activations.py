"""The memory model's activation terms: what one decoder layer saves for backward, the traced excess of
layers read from their trace, the short-lived backward temporaries, the whole step's activations and
the preference objectives' extra rows (how they were derived: :mod:`finetuner.memory.model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from finetuner.device import CPU, CUDA
from finetuner.losses.chunk import BYTES_PER_LOGIT, BYTES_PER_LOGIT_SOFTCAPPED
from finetuner.memory.settings import Dtypes, Settings, dtypes
from finetuner.model.shapes import ModelShape, lora_targets
from finetuner.model.trace import TRACE_LORA_DROPOUT, TRACE_LORA_R
from finetuner.objectives.specs import spec_of

def layer_activation_terms(shape: ModelShape, s: Settings, traced: bool = True) -> list[tuple[str, float]]:
    """What one decoder layer saves for backward, as ``(what, bytes per token)``.

    Multiply by ``micro_batch * seq_len`` for bytes. A tensor shared by several consumers is
    listed once. Symbols: ``h`` hidden, ``q``/``kv`` the query and key/value widths,
    ``i`` the MLP width, ``R``/``c`` the residual and compute element sizes (see module doc).
    ``traced``: with the layer's trace's excess over these named terms (:func:`traced_excess`) as one more term.
    """
    d = dtypes(s)
    h, q, kv, i, nh, r = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size, shape.num_heads, s.lora_r
    seq = s.seq_len
    lora = s.method != "full"
    targets = {shape.role_of(name) for name, *_ in lora_targets(shape, list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets)} if lora else set()
    p = s.lora_dropout
    mask_b = 1 if s.platform == CUDA else None  # native_dropout keeps a bool mask on CUDA
    terms: list[tuple[str, float]] = []

    def norm(label: str, trainable: bool) -> None:
        # RMSNorm: x.to(fp32) (pow and the rsqrt product save it: 4 bytes/elem), rsqrt (4 bytes
        # per token); with a trainable weight also the normalised input of ``weight * x``.
        terms.append((f"{label}: fp32 input", 4 * h + 4))
        if trainable:
            terms.append((f"{label}: normalised (weight grad)", d.R * h))

    def out_dtype(x_b: int) -> int:
        # dense linears under autocast return the compute dtype; bitsandbytes layers cast their
        # output back to the input's dtype (``Linear4bit.forward``: ``.to(inp_dtype)``).
        if d.base in ("nf4", "int8"):
            return x_b
        return d.c if d.autocast else x_b

    def consumers(label: str, x_b: int, mods: list[tuple[str, int]], x_saved_elsewhere: bool = False) -> None:
        """Linears reading the same input ``x`` (element size ``x_b``, width ``mods[k][1]``)."""
        width = mods[0][1]
        shared_x = False  # some consumer saves x itself (counted once)
        for name, _ in mods:
            # the frozen/quantized/trainable base linear
            if d.base == "trainable":
                if x_b == d.c or not d.autocast:
                    shared_x = True
                else:
                    terms.append((f"{name}: autocast copy of input", d.c * width))
            elif d.base == "int8":
                shared_x = True  # MatMul8bitLt keeps A (ctx.tensors)
            # the LoRA branch
            if lora and name in targets:
                terms.append((f"{name}: lora_A output", d.c * r))
                if d.base == "frozen" or s.platform == CPU:
                    # peft Linear casts x to the adapter dtype (fp32); on CPU the bnb LoRA layers
                    # do too (``torch.is_autocast_enabled()`` is the CUDA flag). Then autocast
                    # casts to c for lora_A: a new tensor, saved.
                    x_in = 4
                else:
                    x_in = x_b  # bnb LoRA layers on CUDA under autocast: no cast
                if p > 0:
                    terms.append((f"{name}: dropout mask", (mask_b or x_in) * width))
                    if x_in == d.c or not d.autocast:
                        terms.append((f"{name}: dropout output", x_in * width))
                    else:
                        terms.append((f"{name}: autocast copy of input", d.c * width))
                elif x_in != x_b or (d.autocast and x_in != d.c):
                    terms.append((f"{name}: autocast copy of input", (d.c if d.autocast else x_in) * width))
                else:
                    shared_x = True
        if shared_x and not x_saved_elsewhere:
            terms.append((f"{label} (kept for backward)", x_b * width))

    # ---- attention block
    norm("input norm", d.base == "trainable")
    attn_mods = [("qkv_proj", h)] if shape.fused_qkv else [("q_proj", h), ("k_proj", h), ("v_proj", h)]
    consumers("attention input", d.R, attn_mods)
    o1 = out_dtype(d.R)
    rope_b = max(o1, d.R)  # q * cos + rotate_half(q) * sin, cos/sin in the embedding dtype
    if shape.qk_norm:
        terms.append(("q/k norms: fp32 inputs", 4 * (q + kv) + 4 * 2 * nh))
    sdpa_like = s.attn_implementation in ("sdpa", "flash_attention_2")
    masked = s.attention_mask and s.attn_implementation == "sdpa"
    k_width = q if (masked or s.attn_implementation == "eager") else kv  # repeat_kv when a mask or eager
    c_att = d.c
    terms.append(("attention: q", c_att * q))
    terms.append(("attention: k", c_att * k_width))
    # v is saved as produced unless autocast must cast it (or repeat_kv copies it); phi3's v is
    # a view of the fused qkv output and keeps all of it alive.
    v_b = c_att if (o1 != c_att or k_width != kv) else o1
    v_width = (q + 2 * kv) if (shape.fused_qkv and v_b == o1 and k_width == kv) else k_width
    terms.append(("attention: v", v_b * v_width))
    _ = rope_b  # q and k after RoPE are cast by autocast (new c tensors) or saved as they are (same size)
    if sdpa_like:
        terms.append(("attention: output", c_att * q))
        terms.append(("attention: log-sum-exp (fp32)", 4 * nh))
        if masked:
            # SDPA turns the bool mask into an additive bias in the query dtype (attention.cpp,
            # convert_boolean_attn_mask) and the memory-efficient kernel keeps it: b x s x s.
            terms.append(("attention: mask as bias", c_att * seq))
        o_input_shared = True  # o_proj reads a view of the attention output
    else:
        # eager: softmax(QK^T) in fp32 (saved) and its bf16 copy (saved by the PV matmul)
        terms.append(("attention: softmax probabilities (fp32)", 4 * nh * seq))
        terms.append(("attention: probabilities (compute dtype)", c_att * nh * seq))
        if shape.model_type == "gemma2":
            terms.append(("attention: soft-capping tanh", c_att * nh * seq))
        o_input_shared = False
    consumers("attention output", c_att, [("o_proj", q)], x_saved_elsewhere=o_input_shared)
    for path, width, out in shape.attention_extras:  # an output gate, latent attention's low-rank projections
        consumers(f"{path} input", d.R, [(path, width)])
        terms.append((f"{path}: output (and what reads it)", 2 * c_att * out))
    if shape.norms_per_layer == 4:
        norm("post-attention norm", d.base == "trainable")
    # ---- MLP block
    norm("MLP norm", d.base == "trainable")
    mlp_start = len(terms)
    m1 = out_dtype(d.R)
    if shape.experts is not None:
        terms += _expert_terms(shape, s, d, m1, consumers)
    elif shape.gated_mlp:
        mlp_mods = [("gate_up_proj", h)] if shape.fused_gate_up else [("gate_proj", h), ("up_proj", h)]
        consumers("MLP input", d.R, mlp_mods)
        terms.append(("MLP: gate (activation input)", m1 * i))
        terms.append(("MLP: activation output", m1 * i))
        terms.append(("MLP: up", m1 * i))
        consumers("MLP: act(gate) * up", m1, [("down_proj", i)])
    else:  # up_proj, the activation, down_proj: the activation's input and output
        consumers("MLP input", d.R, [("up_proj", h)])
        terms.append(("MLP: up (activation input)", m1 * i))
        consumers("MLP: act(up)", m1, [("down_proj", i)])
        terms.append(("MLP: activation output", m1 * i))
    frac = s.mlp_tile_fraction
    if frac < 1 and shape.experts is None:  # a tiled MLP: an MoE's experts are not tiled (only its shared ones)
        # tiled: the chunks' checkpoints keep the MLP input (the norm's output, a residual-dtype
        # tensor) for the whole micro-batch; everything the MLP saves inside exists for one chunk
        mlp = terms[mlp_start:]
        del terms[mlp_start:]
        held = "MLP input (kept for backward)"
        terms.append((held if any(n == held for n, _ in mlp) else "MLP input (held by the tiled chunks)", d.R * h))
        terms += [(f"{n}{_CHUNK_SUFFIX}", b * frac) for n, b in mlp if n != held]
    if shape.norms_per_layer == 4:
        norm("post-MLP norm", d.base == "trainable")
    if traced:
        extra = traced_excess(shape, s)
        if extra > 0:
            terms.append(("saved beyond the terms above (the layer's trace, at fp32)", extra))
    return terms


#: the settings the layer's trace runs under (:mod:`finetuner.model.trace`): LoRA all-linear, fp32, the CPU
TRACE_SETTINGS = Settings(method="lora", weight_dtype="fp32", compute_dtype="fp32", platform=CPU, lora_r=TRACE_LORA_R,
                          lora_dropout=TRACE_LORA_DROPOUT, attn_implementation="sdpa")


def traced_excess(shape: ModelShape, s: Settings) -> float:
    """Bytes per token that a decoder layer saves for backward beyond the terms :func:`layer_activation_terms` names:
    the layer's own trace (:attr:`ModelShape.trace`, read from the model on the meta device) at ``s.seq_len`` less
    the named terms under the trace's settings (:data:`TRACE_SETTINGS`), never below 0. Zero for the families the
    terms were written for (the census shows them equal to the trace); a family's own dropout, LayerNorm
    statistics, a learned activation's saved inputs or an attention it materialises are what it adds. Kept at the
    trace's fp32: an upper bound under bf16 autocast (what autocast would halve, the trace cannot tell)."""
    if shape.trace is None:
        return 0.0
    tokens = s.seq_len
    named = sum(b for _, b in layer_activation_terms(shape, TRACE_SETTINGS.with_(seq_len=tokens), traced=False))
    a, b, c = shape.trace
    return max(0.0, (a + b * tokens + c * tokens * tokens) / tokens - named)


def _expert_terms(shape: ModelShape, s: Settings, d: Dtypes, m1: int, consumers) -> list[tuple[str, float]]:
    """A mixture of experts' block in :func:`layer_activation_terms`, per token: the router's fp32 logits and
    probabilities, then for each of the ``top_k`` experts a token is routed to what a dense gated MLP of the
    expert's width saves (the gate, its activation, the up projection), and the expert's output, which the
    routing weight multiplies (kept for the weight's gradient); the shared experts as a dense MLP. The fused
    expert weights are frozen under LoRA, so the inputs of their matmuls are not saved (autograd keeps a matmul's
    input only for its weight's gradient). Assumed, not traced: every token reaches exactly ``top_k`` experts
    (transformers' experts loop over the experts hit and gather their tokens), and the dense first layers of a
    family (DeepSeek's, GLM's) save no more than its MoE layers (their MLP is as wide as ``top_k`` experts and
    the shared ones in the families of 2025-26). Not yet checked on a GPU."""
    e = shape.experts
    h = shape.hidden_size
    terms: list[tuple[str, float]] = [("MoE router: logits and probabilities (fp32)", 4 * 2 * e.count)]
    if e.shared_intermediate:  # a dense gated MLP every token goes through; LoRA may target its linears
        i = e.shared_intermediate
        consumers("shared experts' input", d.R, [("shared.gate_proj", h), ("shared.up_proj", h)] if e.gated else [("shared.up_proj", h)])
        terms.append(("shared experts: gate, activation and up", m1 * i * (3 if e.gated else 2)))
        consumers("shared experts: act(gate) * up", m1, [("shared.down_proj", i)])
    k, i = e.top_k, e.intermediate
    terms.append((f"experts: gate, activation and up of {k} experts", k * m1 * i * (3 if e.gated else 2)))
    terms.append((f"experts: outputs of {k} experts (routing weight's gradient)", k * d.c * h))
    return terms


#: the suffix of a tiled MLP's terms in :func:`layer_activation_terms` (one chunk's, scaled per token)
_CHUNK_SUFFIX = " (one chunk of the tiled MLP)"


def layer_transient_per_token(shape: ModelShape, s: Settings) -> float:
    """Short-lived tensors inside one layer's forward/backward, on top of what stays saved.

    The largest of: (forward) the fp32 copy that peft's LoRA layer makes of the MLP down
    projection's input plus the MLP output; (backward) the gradients of the MLP's gate, up and
    activation alive at once. Bytes per token, read from the same forward/backward code as
    :func:`layer_activation_terms`; with checkpointing :func:`estimate` counts one
    ``GC_TRANSIENT_DIVISOR``-th of it, fitted on the Llama-2 H100 runs. With a tiled MLP the
    intermediate-size gradients exist for one chunk (scaled by ``Settings.mlp_tile_fraction``), and
    the hidden-size part plus the chunks' input gradients are counted whole
    (:func:`_tiled_whole_per_token`: not fitted, on the safe side). Checked only through the
    whole peak: ``tests/memory/test_memory_accuracy.py`` replays every GPU run in
    ``docs/validation/`` (every allocated prediction at or above the measurement, median error
    under 5 %).
    """
    d = dtypes(s)
    h, i = shape.hidden_size, shape.active_intermediate
    m1 = 4 if d.base in ("nf4", "int8") and d.R == 4 else d.c
    gradients = 3 if shape.gated_mlp else 2  # gate, up and the activation's; without a gate, up and the activation's
    frac = s.mlp_tile_fraction if shape.experts is None else 1.0
    return (gradients * m1 * i + 4 * i) * frac + 4 * 4 * h + _tiled_whole_per_token(shape, s)


def _tiled_whole_per_token(shape: ModelShape, s: Settings) -> float:
    """With a tiled MLP, the part of :func:`layer_transient_per_token` that stays whole-sequence:
    the hidden-size gradients (``4 * 4 * h``) and the chunks' input gradients, all alive until
    autograd concatenates them into the MLP input's gradient (``R * h``). Counted without the
    checkpointing divisor, which was fitted on untiled runs (0 when not tiled)."""
    if s.mlp_tile_fraction >= 1:
        return 0
    return dtypes(s).R * shape.hidden_size


@dataclass
class ActivationEstimate:
    per_layer: int  # one layer's saved tensors (kept from its forward to its backward)
    checkpoints: int  # with checkpointing: the saved layer inputs, all layers
    saved_total: int  # all layers' saved tensors (or checkpoints) + the model's own
    model_extra: int  # final norm, LM-head input/weight copies, masks, RoPE tables
    logits: int  # the logits the trainer holds
    loss_peak: int  # extra at the cross-entropy backward
    transient: int  # one layer's short-lived tensors
    offloaded: int  # bytes kept in CPU memory instead
    terms: list[tuple[str, float]]
    transient_whole: int = 0  # with a tiled MLP, the part of ``transient`` counted whole under checkpointing
    mlp_chunk: int = 0  # with a tiled MLP, one chunk's MLP tensors: alive only in a layer's backward


def activation_bytes(shape: ModelShape, s: Settings) -> ActivationEstimate:
    """Activations for one micro-batch, see :func:`layer_activation_terms` for one layer.

    Beyond the layers:
    * layer 0's input norm saves nothing in LoRA/QLoRA (the embeddings are frozen, so its input
      needs no gradient);
    * the final norm saves its fp32 input (and, in full fine-tuning, the normalised tensor and
      the LM head's bf16 input copy);
    * plain loss (``loss_chunk=0``): logits ``tokens * vocab * c`` held by the trainer (Gemma-2's
      soft-capping keeps its tanh output too), and ``cross_entropy(logits.float())`` keeps the
      fp32 log-softmax (4 bytes) and, at the start of backward, adds the gradient of the NLL (4)
      and of the log-softmax (4): ``12 * tokens * vocab`` bytes on top of the logits;
    * chunked loss (finetuner's default): nothing of size vocab is kept between chunks; the
      gathered hidden states of the labelled tokens (``c * hidden`` each) are saved, and one
      chunk's backward holds its recomputed fp32 logits' log-softmax (4), the NLL gradient (4),
      the log-softmax gradient (4) and the bf16 logit gradient plus the fp32 → bf16 casts (≈ 4):
      ``16 * n * vocab`` with ``n = min(loss_chunk, labelled tokens)`` (soft-capping: +8);
    * Liger's fused linear cross-entropy (``fused_ce``) works on chunks of
      ``2^ceil(log2(tokens / ceil(vocab / hidden)))`` tokens and keeps the fp32 gradient of the
      hidden states (``4 * hidden`` per token): modelled like a chunked loss of that size;
    * with a mask, the bool ``b x 1 x s x s`` mask (once); eager attention builds a float one.
    With gradient checkpointing the layers keep only their inputs (``R * hidden`` per token each);
    the backward recomputes one layer at a time, so that layer's saved tensors come back.
    """
    T = s.tokens
    d = dtypes(s)
    h, V = shape.hidden_size, shape.vocab_size
    terms = layer_activation_terms(shape, s)
    # a tiled MLP's chunk terms exist only while that chunk is recomputed in the layer's backward
    chunk_tok = sum(b for n, b in terms if n.endswith(_CHUNK_SUFFIX))
    per_tok = sum(b for n, b in terms if not n.endswith(_CHUNK_SUFFIX))
    per_layer = int(per_tok * T)
    frozen_embed = s.method != "full"
    extra_tok = 4 * h + 4  # final norm
    if d.base == "trainable":
        extra_tok += d.R * h + (d.c * h if d.R != d.c else 0)  # normalised + lm_head input copy
    if frozen_embed:
        extra_tok -= 4 * h + 4  # layer 0's input norm
    extra_tok += 2 * d.R * shape.head_dim  # RoPE cos/sin (broadcast over the batch: per position)
    extra = int(extra_tok * T)
    if s.attention_mask or s.attn_implementation == "eager":
        mask_elem = 1 if s.attn_implementation != "eager" else d.R
        extra += mask_elem * s.micro_batch * s.seq_len * s.seq_len
    labelled = max(1, math.ceil(T * s.label_fraction))
    if s.fused_ce:
        chunk = 2 ** math.ceil(math.log2(max(1, math.ceil(T / math.ceil(V / h)))))
        logits = 0
        extra += 4 * h * labelled  # fp32 grad of the hidden states, computed in the forward
        loss_peak = 16 * min(chunk, labelled) * V
    elif s.loss_chunk > 0:
        logits = 0
        extra += d.c * h * labelled  # the gathered hidden states of the labelled positions
        loss_peak = (BYTES_PER_LOGIT_SOFTCAPPED if shape.final_logit_softcapping else BYTES_PER_LOGIT) * min(s.loss_chunk, labelled) * V
    else:
        logits = d.c * T * V
        if shape.final_logit_softcapping:
            extra += d.c * T * V  # tanh output
        loss_peak = 12 * T * V
    transient = int(layer_transient_per_token(shape, s) * T)
    L = shape.num_layers
    offloaded = 0
    if s.gradient_checkpointing:
        ckpt = int(d.R * h * T) * L
        saved = ckpt
        if s.activation_offload:
            offloaded = ckpt - 2 * int(d.R * h * T)  # two layers in flight (prefetch)
            saved -= offloaded
    else:
        ckpt = 0
        saved = per_layer * L
        if s.activation_offload:
            offloaded = per_layer * (L - 2)
            saved -= offloaded
    return ActivationEstimate(
        per_layer=per_layer,
        checkpoints=ckpt,
        saved_total=saved + extra,
        model_extra=extra,
        logits=logits,
        loss_peak=loss_peak,
        transient=transient,
        offloaded=offloaded,
        terms=terms,
        transient_whole=0 if s.mlp_tile_fraction >= 1 else int((4 * 4 * shape.hidden_size + _tiled_whole_per_token(shape, s)) * T),
        mlp_chunk=int(chunk_tok * T),
    )


# ====================================================================== preference objectives
@dataclass
class PreferenceCost:
    """What a preference objective (:mod:`finetuner.objectives.preference`) adds to a step.

    * ``rows``: sequences per micro-batch in the forward: each example is two (chosen and
      rejected; KTO: the response and its mismatched pair), so the activations are those of a
      micro-batch twice as large;
    * ``buffers_bytes``: the per-token fp32 log-probabilities of the scored tokens, their int64 row
      index and the bool mask that gathers them, and the per-sequence sums;
    * ``reference_pass_bytes``: the reference forward with the adapter switched off, under
      ``no_grad``, run while the policy's activations are saved: nothing is kept between layers, so
      its peak is one layer's temporaries plus one loss chunk's fp32 logits and their log-softmax
      (the plain loss path: the whole micro-batch's logits in the compute dtype and the two fp32
      tensors). Zero for ORPO and SimPO (no reference) and for ``precomputed`` scores (read from
      a table: two floats per example, kept in CPU memory).
    """

    rows: int
    buffers_bytes: int
    reference_pass_bytes: int


def preference_cost(shape: ModelShape, s: Settings) -> PreferenceCost | None:
    """The preference objective's term of :func:`estimate`; ``None`` for the other objectives."""
    spec = spec_of(s.objective)
    if spec.section != "preference":
        return None
    rows = spec.sequences_per_example * s.micro_batch
    T = rows * s.seq_len
    labelled = max(1, math.ceil(T * s.label_fraction))
    buffers = (4 + 8) * labelled + T + 8 * rows
    ref = 0
    if s.reference == "adapter_off" and spec.reference_model:
        both = s.with_(micro_batch=rows)
        layer = int(layer_transient_per_token(shape, both) * T)
        V = shape.vocab_size
        if s.loss_chunk > 0:
            logits = 8 * min(s.loss_chunk, labelled) * V
        else:
            logits = dtypes(s).c * T * V + 8 * labelled * V
        ref = layer + logits
    return PreferenceCost(rows=rows, buffers_bytes=buffers, reference_pass_bytes=ref)



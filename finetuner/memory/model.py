"""The memory model: predicted peak device memory of a training step, per component.

Pure arithmetic on a :class:`~finetuner.model.shapes.ModelShape` and a :class:`Settings` (no torch).
Every term below says where its formula comes from. The conventions are those of finetuner's
trainer (a torchtune-style loop on transformers + peft + bitsandbytes):

* the frozen base is stored in ``model.dtype`` (bf16 on GPUs that have it); LoRA A/B are fp32
  (peft's ``autocast_adapter_dtype``); compute runs under ``torch.autocast`` in bf16/fp16;
* QLoRA loads the linear layers of the decoder with bitsandbytes ``Linear4bit`` (or
  ``Linear8bitLt``). peft's ``prepare_model_for_kbit_training`` would cast every parameter that
  is not 4-bit — embeddings, LM head, norms, biases — to fp32 (``peft/utils/other.py``), making
  the whole residual stream fp32; finetuner's trainer does not
  (``finetuner.model.loading.prepare_for_training`` freezes the base itself), so the unquantized
  parts stay in ``weight_dtype`` (measured on an H100: the upcast costs 2.1 GB on an 8B model
  with a 128k vocabulary);
* full fine-tuning keeps fp32 master weights (mixed precision: 4 + 4 + 8 bytes per parameter of
  weights, gradients and AdamW states, the "16 bytes per parameter" of ZeRO's paper);
* the loss is finetuner's chunked cross-entropy (``finetuner.model.scoring.token_loss_sum``):
  the decoder's hidden states of the labelled positions only are gathered, and the LM head + fp32
  cross-entropy run ``loss_chunk`` tokens at a time under activation checkpointing, so the full
  ``tokens x vocab`` logits never exist. ``loss_chunk=0`` models the plain path
  (``cross_entropy(logits.float())`` with the logits held through the backward);
* gradient checkpointing is transformers' non-reentrant per-decoder-layer checkpointing;
* a tiled MLP (``tiled_mlp``, :mod:`finetuner.model.tiled_mlp`) runs each layer's MLP over chunks
  of ``tiled_mlp`` tokens, each under its own checkpoint: the layer keeps the MLP's input for the
  whole micro-batch and everything else the MLP saves for one chunk only (with or without
  checkpointing of the layers). What a chunk saves is counted on the CPU against torch
  (``tests/model/test_tiled_mlp.py``); the peak of a tiled run has not been measured on a GPU, so
  the tiled predictions are the model's, unvalidated (the recorded runs below are all untiled).

How the activation terms were derived: by reading the forward code of transformers 5 (Llama,
Mistral, Qwen2/3, Gemma-2, Phi-3), peft 0.21 (``lora/layer.py``, ``lora/bnb.py``) and
bitsandbytes 0.50 (``autograd/_functions.py``), listing what autograd saves for backward, and
checking the totals against the measured peaks of GPU runs of 7B–13B shapes
(``scripts/validate/memory.py``, recorded in ``docs/validation/`` and tabled in ``docs/memory.md``).
``tests/memory/test_memory_accuracy.py`` replays every recorded run through this model as it is
now: no allocated peak predicted below its measurement, the median error under 5 %, and
docs/memory.md's table equal to the replay. The storage terms are checked against the libraries
themselves in ``tests/memory/test_memory.py`` (nf4 and int8 weights against bitsandbytes, AdamW
and 8-bit Adam states against torch and bitsandbytes), and the activation terms' scaling (linear
in tokens, checkpointing keeping layer inputs only, the chunked loss never holding the logits)
there too.
The rules that decide the size of a saved tensor:

* autograd saves a matmul's input only when the weight needs a gradient: a frozen base linear
  saves nothing of its input; LoRA's ``lora_A`` saves its (autocast-cast) input;
* ``torch.autocast`` casts an fp32 input to bf16 with a *new* tensor at every call (its cache
  only keeps casts of leaf tensors that require grad, i.e. trainable weights), so each LoRA
  module keeps its own bf16 copy of its input;
* bitsandbytes 4-bit layers cast their input to the compute dtype and their output back to the
  input dtype, and save no activation (``MatMul4Bit`` keeps only the packed weight); 8-bit
  ``MatMul8bitLt`` keeps its input;
* RMSNorm upcasts to fp32 and saves that fp32 tensor; the MLP saves the gate, the activation and
  the up projection (``act(gate) * up``); SDPA/flash attention saves q, k, v, the output and the
  log-sum-exp, never the ``s x s`` matrix; eager attention saves the fp32 softmax and its bf16
  copy (``s x s`` per head).

Not modelled here: the model-loading peak (gone before training starts), torch.compile, Liger's
RMSNorm/SwiGLU/RoPE kernels (only its fused linear cross-entropy, ``fused_ce``, is counted), and
sharding across devices (DeepSpeed/FSDP: :mod:`finetuner.memory.sharding` divides this model's
terms).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from finetuner.device import CPU, CUDA
from finetuner.errors import UserError
from finetuner.losses.chunk import auto_loss_chunk, loss_chunk_of
from finetuner.memory.activations import activation_bytes, preference_cost
from finetuner.memory.settings import (ALLOCATOR_FIXED_BYTES, ALLOCATOR_FRACTION, CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES,
                                       GC_TRANSIENT_DIVISOR, GC_TRANSIENT_DIVISOR_16BIT, LOSS_PHASE_EXTRA_BYTES, NF4_BLOCK,
                                       MemoryEstimate, Settings, dtypes)
from finetuner.memory.storage import (optimizer_state_bytes, optimizer_step_temp_bytes, trainable_params, trainable_tensors,
                                      weight_bytes)
from finetuner.model.shapes import ModelShape
from finetuner.objectives.specs import spec_of

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.hardware import GpuProfile
    from finetuner.config.recipe import Recipe
    from finetuner.config.runtime import Runtime


# ====================================================================== the estimate
def _quant_temp_bytes(shape: ModelShape, s: Settings) -> int:
    """Temporaries of quantized layers: for training-sized inputs bitsandbytes dequantizes the
    4-bit weight to the compute dtype and calls ``F.linear`` (``backends/cuda/ops.py``: the fused
    kernel is only used for a few rows), in forward and again for the input gradient; 8-bit's
    backward makes a copy of the int8 weight in the input dtype (``MatMul8bitLt.backward``)."""
    if s.method != "qlora":
        return 0
    n = shape.largest_linear_numel
    d = dtypes(s)
    if s.quant_bits == 4:
        return d.c * n + 4 * math.ceil(n / NF4_BLOCK)
    return d.R * n + 2 * n


def estimate(
    shape: ModelShape,
    s: Settings,
    gpu: GpuProfile | None = None,
    margin: float = 0.05,
) -> MemoryEstimate:
    """Predict the peak device memory of one training step.

    The step has two phases whose peaks are compared:

    * forward/backward: weights + trainable weights + gradients (fp32, all present by the end
      of backward and across accumulation) + optimizer states (allocated at the first step and
      kept) + autocast's bf16 copies of trainable weights + activations at their peak (the
      cross-entropy backward, or one layer's backward/recompute, whichever is larger) + the
      dequantization buffer;
    * optimizer step: weights + gradients + states + the step's temporaries.

    On top of the larger: cuBLAS workspaces, the allocator's slack (→ reserved) and the CUDA
    context (→ what the card must hold). ``fits`` compares that with the card's memory less a
    ``margin`` fraction, not counting paged optimizer states, which can move to CPU memory.
    """
    from finetuner.model.kernels import LIGER_MODEL_TYPES

    if s.fused_ce and shape.model_type not in LIGER_MODEL_TYPES:
        s = s.with_(fused_ce=False)  # finetuner applies Liger only to these architectures
    d = dtypes(s)
    weights = weight_bytes(shape, s)
    w_total = sum(weights.values())
    tensors = trainable_tensors(shape, s) + list(s.vision_trainable)
    n_train = trainable_params(shape, s) + sum(r * c * k for r, c, k in s.vision_trainable)
    trainable = 0 if s.method == "full" else 4 * n_train  # LoRA A/B in fp32 (full: in weights)
    grads = 4 * n_train
    states = optimizer_state_bytes(tensors, s.optimizer)
    paged = states if s.optimizer.startswith("paged_") else 0
    step_temp = optimizer_step_temp_bytes(tensors, s.optimizer)
    cast_cache = d.c * n_train if d.autocast else 0
    pref = preference_cost(shape, s)
    # a preference objective's micro-batch is twice as many sequences
    act = activation_bytes(shape, s.with_(micro_batch=pref.rows) if pref else s)
    quant_temp = _quant_temp_bytes(shape, s)

    held = act.logits  # 0 with the chunked or fused loss
    # activations at the cross-entropy backward and at a layer's backward
    if s.gradient_checkpointing:
        # the recomputed layer's saved tensors come back one layer at a time, and are freed as its
        # backward goes; of the MLP's short-lived gradients about one of three is alive at the
        # layer's peak (fitted on the H100 runs: docs/memory.md)
        # (tiled MLP: the whole-sequence part of the transient is counted whole, see layer_transient_per_token)
        layer_phase = (act.saved_total + held + act.per_layer + act.mlp_chunk
                       + int((act.transient - act.transient_whole) / (GC_TRANSIENT_DIVISOR if s.method == "qlora" else GC_TRANSIENT_DIVISOR_16BIT))
                       + act.transient_whole + quant_temp)
    else:
        layer_phase = act.saved_total + held + act.mlp_chunk + act.transient + quant_temp
    # the dequantized weight exists only inside a quantized layer: not at the cross-entropy
    loss_phase = act.saved_total + act.logits + act.loss_peak + LOSS_PHASE_EXTRA_BYTES
    # the pictures' way through a trained vision tower is kept until the backward reaches it, after every layer's
    vision = s.vision_activation_bytes
    loss_phase += vision
    layer_phase += vision
    if pref:
        loss_phase += pref.buffers_bytes
        layer_phase += pref.buffers_bytes
        # the reference forward runs after the policy's, before the backward
        ref_phase = act.saved_total + act.logits + pref.buffers_bytes + pref.reference_pass_bytes
        layer_phase = max(layer_phase, ref_phase)
    act_peak = max(loss_phase, layer_phase)
    act_label = "activations (cross-entropy backward)" if loss_phase >= layer_phase else "activations (layer backward)"

    base = w_total + trainable + states
    fwd_bwd = base + grads + cast_cache + act_peak
    step = base + grads + step_temp
    phases = {"forward/backward": fwd_bwd, "optimizer step": step}
    peak_phase = max(phases, key=lambda k: phases[k])

    comp: dict[str, int] = {}
    for kind, b in weights.items():
        comp[f"weights: {kind}"] = b
    if trainable:
        comp["LoRA weights (fp32)"] = trainable
    comp["gradients"] = grads
    comp[f"optimizer states ({s.optimizer})"] = states
    if peak_phase == "forward/backward":
        if cast_cache:
            comp["autocast weight copies"] = cast_cache
        if s.gradient_checkpointing:
            comp["activations: layer checkpoints"] = act.checkpoints - act.offloaded
            rest = act_peak - (act.checkpoints - act.offloaded) - (act.logits if loss_phase >= layer_phase else held)
        else:
            rest = act_peak - (act.logits if loss_phase >= layer_phase else held)
        if quant_temp and layer_phase > loss_phase:
            comp["dequantization buffer"] = quant_temp
            rest -= quant_temp
        if vision:
            comp["activations: vision tower and projector (traced)"] = vision
            rest -= vision
        comp[act_label] = rest
        comp["logits"] = act.logits if loss_phase >= layer_phase else held
    else:
        comp["optimizer step temporaries"] = step_temp
    workspace = CUBLAS_WORKSPACE_BYTES if s.platform == CUDA else 0
    allocated = phases[peak_phase] + workspace
    if workspace:
        comp["cuBLAS workspace"] = workspace
    # paged states live outside torch's allocator (cudaMallocManaged): in the device total, not
    # in the allocator's counters
    torch_allocated = allocated - paged
    slack = int(torch_allocated * ALLOCATOR_FRACTION) + ALLOCATOR_FIXED_BYTES
    reserved = torch_allocated + slack
    comp["allocator slack"] = slack
    context = CUDA_CONTEXT_BYTES if s.platform == CUDA else 0
    if context:
        comp["CUDA context"] = context
    total = reserved + paged + context
    assert sum(comp.values()) == total, (sum(comp.values()), total)

    notes: list[str] = []
    if paged:
        notes.append("paged optimizer states live in unified memory and move to CPU memory when the card is full")
    device = gpu.memory_bytes if gpu else None
    budget = int(device * (1 - margin)) if device else None
    details = {
        "parameters": shape.param_counts(),
        "trainable_params": n_train,
        "tokens_per_micro_batch": s.tokens,
        "activations": {
            "per_layer_bytes": act.per_layer,
            "checkpoints_bytes": act.checkpoints,
            "saved_total_bytes": act.saved_total,
            "model_extra_bytes": act.model_extra,
            "logits_bytes": act.logits,
            "loss_peak_bytes": act.loss_peak,
            "transient_bytes": act.transient,
            "tiled_mlp_chunk_bytes": act.mlp_chunk,
            "loss_phase_bytes": loss_phase,
            "layer_phase_bytes": layer_phase,
        },
        "optimizer_step_temp_bytes": step_temp,
        "autocast_copies_bytes": cast_cache,
        "dequant_buffer_bytes": quant_temp,
        "paged_bytes": paged,
        "vision_activation_bytes": vision,
        "vision_trainable_params": sum(r * c * k for r, c, k in s.vision_trainable),
        "preference": asdict(pref) if pref else None,
    }
    return MemoryEstimate(
        model=shape.name,
        settings=s,
        components=comp,
        peak_phase=peak_phase,
        phases=phases,
        allocated_bytes=allocated - paged,
        reserved_bytes=reserved,
        total_bytes=total,
        device_bytes=device,
        budget_bytes=budget,
        spillable_bytes=paged,
        offloaded_bytes=act.offloaded,
        details=details,
        notes=notes,
        gpu=gpu.name if gpu else None,
        shape=shape,
    )


# ====================================================================== recipes
def settings_from_recipe(recipe: Recipe, gpu: GpuProfile | None = None, model_type: str | None = None,
                         runtime: Runtime | None = None, shape: ModelShape | None = None, **overrides: Any) -> Settings:
    """The memory model's view of a resolved recipe on ``gpu``.

    The device-dependent choices (dtypes, attention, loss path) are the trainer's own: ``runtime``
    when the caller has one (a run), else :func:`finetuner.config.runtime.resolve` for ``gpu`` (``None``:
    an unnamed bf16 CUDA card) and the base model's ``model_type`` (for Liger's support). A
    ``training.loss_chunk_size: auto`` is the trainer's too (:func:`finetuner.losses.chunk.loss_chunk_of`),
    on ``shape`` (read from the recipe's model when not given).
    """
    from finetuner.config.runtime import Device, resolve
    from finetuner.model.shapes import resolve_shape

    if recipe.auto_keys():
        raise UserError(
            f"The recipe has auto values ({', '.join(recipe.auto_keys())}): the planner resolves them.",
            hint="Use finetuner.plan / `finetuner plan --recipe`, or set the values.",
        )
    rt = runtime or resolve(recipe, Device.of(gpu), model_type)
    q = recipe.quantization
    t = recipe.training
    spec = spec_of(recipe.objective)
    kw: dict[str, Any] = dict(
        method=recipe.method,
        weight_dtype=rt.base_dtype,
        compute_dtype=rt.precision,
        lora_r=recipe.lora.r,
        lora_targets=recipe.lora.target_modules if isinstance(recipe.lora.target_modules, str) else tuple(recipe.lora.target_modules),
        lora_dropout=recipe.lora.dropout,
        lora_bias=recipe.lora.bias,
        micro_batch=t.micro_batch_size,
        seq_len=recipe.data.max_seq_len,
        gradient_accumulation=t.gradient_accumulation,
        gradient_checkpointing=t.gradient_checkpointing,
        optimizer=t.optimizer,
        attn_implementation="sdpa" if rt.attention == "auto" else rt.attention,
        attention_mask=recipe.data.packing or t.micro_batch_size > 1,
        platform=CUDA if rt.is_cuda else CPU,
        activation_offload=t.offload_activations,
        loss_chunk=t.loss_chunk_size if t.loss_chunk_size != "auto" else
        loss_chunk_of("auto", shape or resolve_shape(recipe.model.name, recipe.model.revision)),
        tiled_mlp=rt.tiled_mlp,
        fused_ce=rt.loss_path == "liger_fused_linear_ce" and spec.fused_loss,
        objective=recipe.objective,
        reference=recipe.preference.reference if spec.reference_model else "none",
    )
    if q is not None and recipe.method == "qlora":
        kw.update(quant_bits=q.bits, quant_type=q.quant_type, double_quant=q.double_quant, compute_dtype=rt.compute_dtype)
    kw.update(overrides)
    return Settings(**kw)


def with_loss_chunk(recipe: Recipe, shape: ModelShape) -> Recipe:
    """``recipe`` with ``training.loss_chunk_size: auto`` replaced by its number for ``shape`` (the recipe itself
    when it names one), so that the plan's recipe, the memory model and the trainer's loss read the same chunk."""
    t = recipe.training
    if t.loss_chunk_size != "auto":
        return recipe
    return recipe.model_copy(update={"training": t.model_copy(update={"loss_chunk_size": loss_chunk_of("auto", shape)})})


def with_run_loss_chunk(recipe: Recipe, model=None) -> Recipe:
    """The trainer's :func:`with_loss_chunk`: on the shape the planner reads of the recipe's model
    (:func:`finetuner.model.shapes.resolve_shape`), or, for a model it cannot read, on the loaded ``model``'s
    own text config (its vocabulary and soft-capping, the same two figures)."""
    if recipe.training.loss_chunk_size != "auto":
        return recipe
    from finetuner.model.shapes import resolve_shape

    try:
        return with_loss_chunk(recipe, resolve_shape(recipe.model.name, recipe.model.revision))
    except (UserError, OSError, ValueError, KeyError):
        if model is None:
            raise
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    chunk = auto_loss_chunk(int(cfg.vocab_size), bool(getattr(cfg, "final_logit_softcapping", None)))
    t = recipe.training
    return recipe.model_copy(update={"training": t.model_copy(update={"loss_chunk_size": chunk})})

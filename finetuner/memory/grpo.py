"""GRPO's memory terms: the rollout's KV cache and sampling, the loss over the group's sequences, the
reference pass. Pure arithmetic on a :class:`~finetuner.model.shapes.ModelShape`, a
:class:`~finetuner.memory.model.Settings` (the training side: method, dtypes, LoRA, checkpointing, loss
path; its ``micro_batch`` is the loss's micro-batch in sequences, its ``seq_len`` is replaced by
``prompt_len + max_new_tokens``) and a :class:`GrpoSettings` (no torch).

A GRPO step has these phases, each compared at its peak (:func:`grpo_estimate`):

* **generation** (no gradients, :mod:`finetuner.objectives.rollout`): the weights, the LoRA weights and the
  optimizer states (gradients are freed by ``zero_grad(set_to_none=True)`` after each step) plus

  - the KV cache of ``generation rows × (prompt_len + max_new_tokens)`` tokens: transformers'
    ``DynamicCache`` keeps per layer a key and a value of ``num_kv_heads × head_dim`` per token, in the
    dtype the k/v projections return (the compute dtype under autocast):
    ``2 × layers × kv_heads × head_dim × rows × tokens × bytes`` (:func:`kv_cache_bytes`); it grows by
    ``torch.cat`` (``cache_utils.py``), so one layer's old and new key and value exist at once: one
    layer's share more;
  - the prefill's largest layer temporaries (``rows × prompt_len`` tokens, nothing kept between layers:
    the fp32 norm input, the residual and its normed copy, q, k and v repeated to the query width, the
    attention output, the o/down projections' outputs and the MLP's gate, up and activation; the
    attention mask as an additive bias ``rows × prompt_len²``), all counted alive at once;
  - one decoding step's logits and sampling tensors, per row and vocabulary entry: the model's last
    logits (compute dtype), their fp32 copy, the temperature-scaled scores and the softmax
    probabilities (``generation/utils.py``), with ``top_p < 1`` also the sorted logits and their int64
    indices, their softmax and cumulative sum, the two bool masks and the filled scores
    (``TopPLogitsWarper``), all counted alive at once;
* **loss** (:func:`finetuner.memory.model.estimate` on ``micro_batch`` sequences of
  ``prompt_len + max_new_tokens`` tokens, padding masked, the loss on the completion tokens only:
  ``label_fraction = max_new_tokens / (prompt_len + max_new_tokens)``): the group's sequences'
  activations and the logits of the generated tokens (``loss_chunk`` tokens at a time as
  :func:`finetuner.losses.grpo.chunked_token_logps` computes them, or whole with ``loss_chunk = 0``), plus
  the GRPO buffers: the whole generation batch's ids and masks (int64) and its stored per-token
  log-probabilities (old and reference, fp32), and the micro-batch's per-token fp32 tensors of the
  surrogate (:func:`finetuner.losses.grpo.grpo_loss`: log-probabilities, ratio, clipped ratio, the two
  products, the per-token loss, the KL and its exponential);
* **reference pass** (``beta > 0`` only): the base with the adapter off, under ``no_grad``, while the
  policy's activations are saved (as DPO's, :func:`finetuner.memory.model.preference_cost`): one layer's
  temporaries and one loss chunk's fp32 logits and log-softmax (whole logits with ``loss_chunk = 0``);
  ``beta = 0``: no reference pass, no reference log-probabilities;
* **optimizer step**: as SFT's.

**With vLLM** (``grpo.use_vllm``, :mod:`finetuner.objectives.rollout_vllm`): the generation runs in vLLM's
own memory, so the generation phase's KV cache and temporaries of transformers' ``generate`` are gone (the
phase holds the resident weights, optimizer states and GRPO buffers only), and vLLM's reserved share,
``vllm_gpu_memory_utilization × card memory``, is held for the whole run on top of every phase (no
sleep mode: :func:`vllm_terms`). vLLM sizes its KV cache to fill the share, and without sleep mode its
weights and KV cache are tensors of torch's caching allocator in the same process, so the share is added
to every phase and to the allocated peak (the allocator's peak that ``finetuner.device.memory_stats`` reads), with no
allocator slack on it (a few large blocks). The share must hold vLLM's copy of the weights (the base in the compute
dtype; QLoRA: quantized as vLLM quantizes it, 4-bit NF4 with double quantization, the rest in the
compute dtype), its LoRA slots (``max_lora_rank`` on every linear layer, one adapter) and the KV cache of
at least one sequence of ``data.max_seq_len`` tokens (vLLM refuses to start otherwise): when it cannot,
the estimate does not fit (:attr:`GrpoMemory.vllm_fits`), and a note says so. When the step's
completions' KV cache does not fit what is left of the share, vLLM generates them in waves (slower),
and a note says that. vLLM's own forward temporaries (its start-up profiling run) come out of the same
share and are not counted. These terms are arithmetic on vLLM's documented behaviour; nothing here has
been measured on a real vLLM.

The generation terms are read from transformers 5's generation and cache code. On the CPU they bound
what ``generate`` allocates (torch's profiler, ``tests/memory/test_memory_grpo.py``; the KV cache term is
exact there, the temporaries counted all alive at once are above the measurement); they are not yet
measured on a GPU. The loss phase is the validated SFT model's (docs/memory.md) on the GRPO sequence shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from finetuner.objectives.specs import DEFAULT as PLAIN_PASS  # a supervised pass: no pairs, no reference
from finetuner.config.recipe import VLLM_LORA_RANKS
from finetuner.device import CUDA
from finetuner.memory.activations import activation_bytes, layer_transient_per_token
from finetuner.memory.model import estimate
from finetuner.memory.settings import (ALLOCATOR_FIXED_BYTES, ALLOCATOR_FRACTION, CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES,
                                       DTYPE_BYTES, MemoryEstimate, Settings)
from finetuner.memory.storage import trainable_params, weight_bytes
from finetuner.model.shapes import ModelShape
from finetuner.model.mixers import attention_layers, recurrent_state_numel
from finetuner.units import gib_text

#: fp32 per-token tensors of the surrogate alive in the loss (see the module's docstring).
SURROGATE_TENSORS = 8
#: the key of a :class:`~finetuner.memory.model.MemoryEstimate`'s ``details`` that keeps the rollout's terms and
#: phases (:func:`grpo_memory_estimate`); an estimate without it is of a step that generates nothing
ROLLOUT = "rollout"
#: tokens per block of vLLM's paged KV cache (its default ``block_size``): a sequence takes whole blocks
VLLM_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class GrpoSettings:
    """The GRPO side of a step."""

    num_generations: int = 8  #: completions per prompt (the group)
    max_new_tokens: int = 256  #: the longest completion
    prompt_len: int = 512  #: the longest prompt, in tokens
    prompts_per_step: int = 1  #: prompts whose groups one step generates
    generation_batch: int | None = None  #: rows per ``generate`` call (None: all the step's rows at once)
    beta: float = 0.0  #: KL coefficient: 0 means no reference pass
    num_iterations: int = 1  #: μ, passes over one rollout (> 1 stores the old log-probabilities)
    use_vllm: bool = False  #: generate on a colocated vLLM engine (module docstring)
    vllm_gpu_memory_utilization: float = 0.3  #: the share of the card vLLM reserves
    card_bytes: int | None = None  #: the card's memory (vLLM's share is a fraction of it); None: not known

    def __post_init__(self) -> None:
        for name in ("num_generations", "max_new_tokens", "prompt_len", "prompts_per_step", "num_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.generation_batch is not None and self.generation_batch < 1:
            raise ValueError("generation_batch must be at least 1")
        if not 0 < self.vllm_gpu_memory_utilization < 1:
            raise ValueError("vllm_gpu_memory_utilization must be between 0 and 1")

    @property
    def rows(self) -> int:
        """Completions generated per step."""
        return self.num_generations * self.prompts_per_step

    @property
    def generation_rows(self) -> int:
        """Rows sampled at once (one ``generate`` call)."""
        return min(self.rows, self.generation_batch or self.rows)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def generated_tokens(self) -> int:
        """``num_generations × max_new_tokens``: the tokens one prompt's group may generate."""
        return self.num_generations * self.max_new_tokens

    def with_(self, **kw) -> GrpoSettings:
        return replace(self, **kw)


def cache_dtype_bytes(s: Settings) -> int:
    """The element size of the KV cache: what the k/v projections return (the compute dtype under
    autocast; else the stored weights' dtype, fp32 for a full fine-tune)."""
    if s.compute_dtype != "fp32":
        return DTYPE_BYTES[s.compute_dtype]
    return 4 if s.method == "full" else DTYPE_BYTES[s.weight_dtype]


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """``2 × attention layers × kv_heads × head_dim × sequences × tokens × dtype_bytes``: a key and a value per
    layer with softmax attention and token (grouped-query attention caches ``num_kv_heads`` heads, not
    ``num_heads``); linear-attention and state-space layers keep none
    (:func:`finetuner.model.mixers.attention_layers`)."""
    return 2 * attention_layers(shape) * shape.num_kv_heads * shape.head_dim * sequences * tokens * dtype_bytes


def generation_cache_bytes(shape: ModelShape, sequences: int, tokens: int, dtype_bytes: int) -> int:
    """What ``generate`` keeps between steps: the attention layers' KV cache (:func:`kv_cache_bytes`) and the
    linear-attention and state-space layers' recurrent state, fixed whatever the length
    (:func:`finetuner.model.mixers.recurrent_state_numel` a sequence, in the cache's dtype)."""
    return kv_cache_bytes(shape, sequences, tokens, dtype_bytes) + recurrent_state_numel(shape) * sequences * dtype_bytes


def sampling_bytes_per_logit(s: Settings, top_p: bool) -> int:
    """Bytes per row and vocabulary entry of one decoding step's logits and sampling (module docstring)."""
    c = DTYPE_BYTES[s.compute_dtype] if s.compute_dtype != "fp32" else 4
    plain = c + 4 + 4 + 4  # the model's logits, fp32 copy, scaled scores, probabilities
    return plain + ((4 + 8) + 4 + 4 + 1 + 1 + 4 if top_p else 0)


def prefill_layer_bytes(shape: ModelShape, s: Settings, rows: int, prompt_len: int) -> int:
    """A no-grad forward's largest layer temporaries over ``rows × prompt_len`` tokens, all counted alive
    at once, plus the attention mask as an additive bias (module docstring)."""
    c = DTYPE_BYTES[s.compute_dtype] if s.compute_dtype != "fp32" else 4
    R = 4 if s.method == "full" else DTYPE_BYTES[s.weight_dtype]  # the residual stream
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.active_intermediate
    per_token = 4 * h + 2 * R * h + c * (q + 2 * kv) + c * 2 * q + c * q + 2 * c * h + (3 if shape.gated_mlp else 2) * c * i
    tokens = rows * prompt_len
    return per_token * tokens + c * rows * prompt_len * prompt_len


def loss_settings(s: Settings, g: GrpoSettings) -> Settings:
    """The SFT memory model's settings for the loss over the group's sequences: ``s.micro_batch``
    (at most the step's rows) sequences of ``prompt_len + max_new_tokens`` tokens, padded (a mask), the loss on the completion."""
    return s.with_(micro_batch=min(s.micro_batch, g.rows), seq_len=g.seq_len, label_fraction=g.max_new_tokens / g.seq_len,
                   attention_mask=True, objective=PLAIN_PASS, reference="none")


@dataclass(frozen=True)
class VllmTerms:
    """vLLM's reserved share of the card and what it must hold (module docstring), in bytes."""

    share: int  #: ``vllm_gpu_memory_utilization × card`` (0 when the card is not known)
    weights: int  #: vLLM's copy of the base weights
    lora_slots: int  #: its LoRA buffers: ``max_lora_rank`` on every linear layer, one adapter
    kv_one_sequence: int  #: the KV cache of one sequence of ``prompt_len + max_new_tokens`` tokens
    kv_rollout: int  #: the KV cache of all the step's completions at once
    fits: bool | None  #: weights + LoRA slots + one sequence's KV cache within the share (None: no card)
    notes: tuple[str, ...] = ()


def vllm_weight_bytes(shape: ModelShape, s: Settings) -> int:
    """vLLM's copy of the base: every parameter in the compute dtype (vLLM's ``dtype``); QLoRA: the
    linear weights quantized as vLLM's bitsandbytes loader does (4-bit NF4, double quantization), the
    rest in the compute dtype (:func:`finetuner.memory.storage.weight_bytes`)."""
    c = s.compute_dtype
    if s.method == "qlora":
        return sum(weight_bytes(shape, s.with_(quant_bits=4, quant_type="nf4", double_quant=True, weight_dtype=c)).values())
    return sum(weight_bytes(shape, s.with_(method="lora", weight_dtype=c)).values())


def vllm_terms(shape: ModelShape, s: Settings, g: GrpoSettings) -> VllmTerms:
    """vLLM's share and its contents for ``g.use_vllm`` (module docstring)."""
    c = DTYPE_BYTES[s.compute_dtype] if s.compute_dtype != "fp32" else 4
    weights = vllm_weight_bytes(shape, s)
    rank = next((r for r in VLLM_LORA_RANKS if s.lora_r <= r), VLLM_LORA_RANKS[-1])
    lora = c * trainable_params(shape, s.with_(method="lora", lora_r=rank, lora_targets="all-linear", lora_bias="none"))
    blocks = -(-g.seq_len // VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
    one, every = kv_cache_bytes(shape, 1, blocks, c), kv_cache_bytes(shape, g.rows, blocks, c)
    if g.card_bytes is None:
        return VllmTerms(0, weights, lora, one, every, None, ("vLLM's reserved share is not counted: the card's memory is not "
                                                            "known here (give a GPU to count it)",))
    share = int(g.vllm_gpu_memory_utilization * g.card_bytes)
    held = weights + lora
    notes = []
    fits = held + one <= share
    if not fits:
        notes.append(f"vLLM's share ({gib_text(share)} = grpo.vllm_gpu_memory_utilization {g.vllm_gpu_memory_utilization} × "
                     f"{gib_text(g.card_bytes, 1)}) cannot hold its copy of the weights and LoRA slots ({gib_text(held)}) "
                     f"and the KV cache of one {g.seq_len}-token sequence ({gib_text(one)}): vLLM would not start; raise "
                     "grpo.vllm_gpu_memory_utilization, shorten data.max_seq_len, or set grpo.use_vllm: false")
    elif held + every > share:
        notes.append(f"the step's {g.rows} completions need {gib_text(every)} of KV cache and vLLM's share has "
                     f"{gib_text(share - held)} left after its weights: vLLM generates them in waves (slower); raise "
                     "grpo.vllm_gpu_memory_utilization to generate them at once")
    return VllmTerms(share, weights, lora, one, every, fits, tuple(notes))


def grpo_components(shape: ModelShape, s: Settings, g: GrpoSettings, top_p: bool = True) -> dict[str, int]:
    """The GRPO terms in bytes (module docstring), by name; the reference pass is 0 when ``beta = 0``; with
    ``g.use_vllm`` the generation terms are vLLM's (0 in torch's allocator) and ``vLLM share`` is added."""
    rows = g.generation_rows
    kv_b = cache_dtype_bytes(s)
    kv = generation_cache_bytes(shape, rows, g.seq_len, kv_b)
    ls = loss_settings(s, g)
    mb, C, V = ls.micro_batch, g.max_new_tokens, shape.vocab_size
    stored = 8 * g.rows * g.seq_len * 2 + 4 * g.rows * C * ((g.num_iterations > 1) + (g.beta != 0))
    ref = 0
    if g.beta != 0:
        T = mb * g.seq_len
        labelled = mb * C
        layer = int(layer_transient_per_token(shape, ls) * T)
        c = DTYPE_BYTES[s.compute_dtype] if s.compute_dtype != "fp32" else 4
        logits = 8 * min(s.loss_chunk, labelled) * V if s.loss_chunk > 0 else c * T * V + 8 * labelled * V
        ref = layer + logits
    out = {
        "generation: KV cache": kv,
        "generation: KV cache growth (one layer copied)": kv_cache_bytes(shape, rows, g.seq_len, kv_b) // max(1, attention_layers(shape)),
        "generation: prefill layer temporaries": prefill_layer_bytes(shape, s, rows, g.prompt_len),
        "generation: logits and sampling": sampling_bytes_per_logit(s, top_p) * rows * V,
        "loss: GRPO buffers": stored + 4 * SURROGATE_TENSORS * mb * C,
        "reference pass": ref,
    }
    if g.use_vllm:  # the generation runs in vLLM's share, not in torch's allocator
        out.update({k: 0 for k in out if k.startswith("generation:")})
        out[VLLM_SHARE] = vllm_terms(shape, s, g).share
    return out


#: the component of vLLM's reserved share (``vllm_gpu_memory_utilization × card``)
VLLM_SHARE = "vLLM share (gpu_memory_utilization × card)"


@dataclass
class GrpoMemory:
    """The prediction of a GRPO step: the GRPO terms, the phases' allocated peaks, what the card must hold."""

    components: dict[str, int]  #: :func:`grpo_components`
    phases: dict[str, int]  #: allocated bytes at each phase's peak
    peak_phase: str
    allocated_bytes: int
    reserved_bytes: int
    total_bytes: int  #: reserved + CUDA context
    loss: MemoryEstimate  #: the SFT model's estimate of the loss's forward/backward and optimizer step
    details: dict[str, int] = field(default_factory=dict)
    vllm: VllmTerms | None = None  #: with ``use_vllm``: vLLM's share and what it must hold
    notes: list[str] = field(default_factory=list)

    @property
    def vllm_fits(self) -> bool:
        """vLLM's share holds its weights, LoRA slots and one sequence's KV cache (True without vLLM or card)."""
        return self.vllm is None or self.vllm.fits is not False

    def fits(self, budget_bytes: int) -> bool:
        return self.total_bytes <= budget_bytes and self.vllm_fits


def grpo_settings_of(recipe, card_bytes: int | None = None) -> GrpoSettings:
    """The GRPO settings of a resolved recipe (``objective: grpo``, its ``grpo:`` section): the prompt
    at its longest (``data.max_seq_len − max_new_tokens``), ``micro_batch_size × gradient_accumulation``
    prompts a step, a generation batch of ``micro_batch_size × num_generations`` rows, and with
    ``use_vllm`` vLLM's share of ``card_bytes`` (the card's memory; None: not known). The trainer's
    prediction and ``finetuner estimate`` both read it."""
    g, t = recipe.grpo, recipe.training
    return GrpoSettings(
        num_generations=g.num_generations, max_new_tokens=g.max_new_tokens,
        prompt_len=recipe.data.max_seq_len - g.max_new_tokens, prompts_per_step=t.micro_batch_size * t.gradient_accumulation,
        generation_batch=t.micro_batch_size * g.num_generations, beta=g.beta, num_iterations=g.num_iterations,
        use_vllm=g.use_vllm, vllm_gpu_memory_utilization=g.vllm_gpu_memory_utilization, card_bytes=card_bytes)


def grpo_estimate(shape: ModelShape, s: Settings, g: GrpoSettings, top_p: bool = True) -> GrpoMemory:
    """The peak of a GRPO step over its phases (module docstring), with the allocator's slack and the CUDA
    context added as :func:`finetuner.memory.model.estimate` adds them."""
    comp = grpo_components(shape, s, g, top_p)
    ls = loss_settings(s, g)
    loss = estimate(shape, ls)
    act = activation_bytes(shape, ls)
    resident = sum(v for k, v in loss.components.items() if k.startswith(("weights:", "LoRA weights", "optimizer states")))
    buffers = comp["loss: GRPO buffers"]
    vllm = vllm_terms(shape, s, g) if g.use_vllm else None
    gen_fixed = comp["generation: KV cache"] + comp["generation: KV cache growth (one layer copied)"]
    generation = resident + buffers + gen_fixed + max(comp["generation: prefill layer temporaries"],
                                                      comp["generation: logits and sampling"])
    fwd_bwd = loss.phases["forward/backward"] + buffers
    phases = {"generation": generation, "loss forward/backward": fwd_bwd, "optimizer step": loss.phases["optimizer step"]}
    if comp["reference pass"]:
        held = fwd_bwd - max(loss.details["activations"]["loss_phase_bytes"], loss.details["activations"]["layer_phase_bytes"])
        phases["reference pass"] = held + act.saved_total + act.logits + comp["reference pass"]
    share = vllm.share if vllm is not None else 0
    if share:  # vLLM's weights and KV cache are torch tensors of the same process, held through every phase
        phases = {k: v + share for k, v in phases.items()}
    peak_phase = max(phases, key=lambda k: phases[k])
    workspace = CUBLAS_WORKSPACE_BYTES if s.platform == CUDA else 0
    allocated = phases[peak_phase] + workspace - loss.spillable_bytes
    training = allocated - share  # the allocator's slack on the training's tensors; vLLM's are a few large blocks
    reserved = training + int(training * ALLOCATOR_FRACTION) + ALLOCATOR_FIXED_BYTES + share
    total = reserved + loss.spillable_bytes + (CUDA_CONTEXT_BYTES if s.platform == CUDA else 0)
    details = {"resident_bytes": resident, "generation_rows": g.generation_rows}
    if vllm is not None:
        details.update(vllm_share_bytes=vllm.share, vllm_weight_bytes=vllm.weights, vllm_lora_bytes=vllm.lora_slots,
                       vllm_kv_one_sequence_bytes=vllm.kv_one_sequence, vllm_kv_rollout_bytes=vllm.kv_rollout)
    return GrpoMemory(components=comp, phases=phases, peak_phase=peak_phase, allocated_bytes=allocated,
                      reserved_bytes=reserved, total_bytes=total, loss=loss, details=details, vllm=vllm,
                      notes=list(vllm.notes) if vllm is not None else [])


def largest_fit(shape: ModelShape, s: Settings, g: GrpoSettings, budget_bytes: int, vary: str = "max_new_tokens",
                limit: int = 1 << 20, top_p: bool = True, scale_generation_batch: bool = False) -> GrpoSettings | None:
    """``g`` with the largest ``vary`` (``max_new_tokens`` or ``num_generations``) whose step fits in
    ``budget_bytes`` (:attr:`GrpoMemory.total_bytes`), the other settings held; None when even 1 does not
    fit. Every term grows with both, so a bisection finds it; its ``generated_tokens`` is the largest
    ``num_generations × max_new_tokens`` along that axis. With ``vary="num_generations"`` and
    ``generation_batch`` set, the generation rows stop growing at ``generation_batch``, unless
    ``scale_generation_batch``: then it keeps its prompts (``generation_batch / num_generations``), as
    the trainer's ``micro_batch_size × num_generations`` does."""
    if vary not in ("max_new_tokens", "num_generations"):
        raise ValueError("vary must be max_new_tokens or num_generations")

    def at(n: int) -> GrpoSettings:
        if vary == "num_generations" and scale_generation_batch and g.generation_batch:
            return g.with_(num_generations=n, generation_batch=max(1, g.generation_batch // g.num_generations) * n)
        return g.with_(**{vary: n})

    def fits(n: int) -> bool:
        return grpo_estimate(shape, s, at(n), top_p).fits(budget_bytes)

    if not fits(1):
        return None
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return at(lo)



def grpo_memory_estimate(shape: ModelShape, s: Settings, g: GrpoSettings, gpu=None, margin: float = 0.05,
                         top_p: bool = True) -> MemoryEstimate:
    """:func:`grpo_estimate` as a :class:`~finetuner.memory.model.MemoryEstimate`, the form the planner
    ranks, prints and checks against a card (``gpu``: a :class:`~finetuner.config.hardware.GpuProfile` or
    None; its budget keeps ``margin`` of it free). The components are those of the step's peak phase and
    sum to ``total_bytes``: the resident weights, LoRA weights and optimizer states, the GRPO buffers, the
    peak phase's own memory (the generation's KV cache and its largest temporaries; the loss's gradients,
    activations and logits; the reference pass; the optimizer step), the cuBLAS workspace, the
    allocator's slack and the CUDA context. ``details[ROLLOUT]`` keeps every GRPO term and phase."""
    if g.use_vllm and g.card_bytes is None and gpu is not None:
        g = g.with_(card_bytes=gpu.memory_bytes)
    m = grpo_estimate(shape, s, g, top_p)
    loss, comp, peak = m.loss, m.components, m.peak_phase
    resident = {k: v for k, v in loss.components.items() if k.startswith(("weights:", "LoRA weights", "optimizer states"))}
    out: dict[str, int] = dict(resident)
    buffers = comp["loss: GRPO buffers"] if peak != "optimizer step" else 0
    if buffers:
        out["GRPO buffers (rollout ids, masks, log-probabilities, surrogate)"] = buffers
    share = comp.get(VLLM_SHARE, 0)
    if share:
        out[VLLM_SHARE] = share
    rest = m.phases[peak] - sum(resident.values()) - buffers - share
    if peak == "generation":
        kv = comp["generation: KV cache"] + comp["generation: KV cache growth (one layer copied)"]
        out["generation: KV cache"] = kv
        out["generation: prefill / sampling temporaries"] = rest - kv
    elif peak == "loss forward/backward":
        out["loss over the group: gradients, activations, logits"] = rest
    elif peak == "reference pass":
        out["reference pass (the policy's saved activations + the reference forward)"] = rest
    else:
        out["gradients and optimizer step temporaries"] = rest
    workspace = CUBLAS_WORKSPACE_BYTES if s.platform == CUDA else 0
    if workspace:
        out["cuBLAS workspace"] = workspace
    out["allocator slack"] = m.reserved_bytes - m.allocated_bytes
    context = m.total_bytes - m.reserved_bytes - loss.spillable_bytes
    if context:
        out["CUDA context"] = context
    assert sum(out.values()) == m.total_bytes, (sum(out.values()), m.total_bytes)
    device = gpu.memory_bytes if gpu is not None else None
    details = {**loss.details, ROLLOUT: {"components": dict(comp), "phases": dict(m.phases), **m.details,
                                         "num_generations": g.num_generations, "max_new_tokens": g.max_new_tokens,
                                         "prompt_len": g.prompt_len, "prompts_per_step": g.prompts_per_step,
                                         "vllm_fits": m.vllm_fits}}
    return MemoryEstimate(
        model=shape.name, settings=s, components=out, peak_phase=peak, phases=dict(m.phases),
        allocated_bytes=m.allocated_bytes, reserved_bytes=m.reserved_bytes, total_bytes=m.total_bytes,
        device_bytes=device, budget_bytes=int(device * (1 - margin)) if device else None,
        spillable_bytes=loss.spillable_bytes, offloaded_bytes=loss.offloaded_bytes, details=details,
        notes=list(loss.notes) + m.notes, gpu=gpu.name if gpu is not None else None, shape=shape)

"""The speed model of a GRPO step (``objective: grpo``): the rollout's generation, the reference and
old log-probabilities, then the SFT model's training passes over the completions.

A GRPO optimizer step (:mod:`finetuner.objectives.grpo`) trains on ``rows = prompts × G`` completions
(``prompts = micro_batch_size × gradient_accumulation``, ``G = num_generations``;
:class:`~finetuner.memory.grpo.GrpoSettings`). Its time is the sum of:

* **the rollout**, once per ``num_iterations`` steps and divided among them (the later steps of a batch
  reuse it), made of ``calls = ⌈rows / R⌉`` ``generate`` calls of ``R = micro_batch_size × G`` rows
  (:attr:`GrpoSettings.generation_rows`, :mod:`finetuner.objectives.rollout`):

  - **generation: prefill** per call: a no-grad forward over ``R × P_w`` prompt tokens (``P_w``: the
    step's prompts are left-padded to their longest, all calls alike) (:func:`forward_parts`: the decoder's and LoRA's
    matmuls ``2 N T`` and ``2 r (in + out) T`` at the rate of speed.py's training passes; attention over
    the padded prompts, one of the three units :func:`~finetuner.planning.speed.attention_seconds`
    counts for a training pass; the forward's memory traffic ``FORWARD_TRAFFIC × saved bytes``; the
    4-bit base dequantized once), the LM head only for the last position (``2 V h R``: ``generate``
    asks for ``logits_to_keep=1``), the first token's sampling, and ``GENERATE_CALL_OPS`` of set-up
    (``generate``'s configuration, logits processors, stopping criteria, cache);
  - **generation: decode**: ``D − 1`` forwards of one token per row after the prefill (``D`` = the
    tokens the call generates, at most ``max_new_tokens``: ``generate`` stops when every row of the
    call has ended), each (:func:`decode_step_parts`) reading every weight once: the linears at
    ``max(2 R N / rate(R), weight bytes / bandwidth)`` (the roofline: a few rows are bound by reading the
    weights; ``rate(R)``: the matmul rate at ``R`` rows, :func:`~finetuner.planning.speed.matmul_row_efficiency`
    on a CPU, the device's utilisation on a GPU), attention over the KV cache of ``L = P_w + D/2`` tokens on average
    (``max(4 L q_dim layers R / rate, kv_passes × cache bytes / bandwidth)``: ``DynamicCache`` grows by
    ``torch.cat``, reading and writing the cache, attention reads it, ``repeat_kv`` copies it with
    grouped-query attention), the layers' elementwise
    traffic for ``R`` tokens, the 4-bit base dequantized at every step (QLoRA), and the sampling of
    every row over the vocabulary at every generated token (:func:`sampling_seconds`: softmax and
    ``torch.multinomial``, with ``top_p < 1`` the sort of ``TopPLogitsWarper``); plus the step's
    operations: the model's forward (:func:`~finetuner.planning.speed.op_count`'s forward, a 4-bit
    linear at ``QUANT_LINEAR_OPS``) and ``GENERATE_STEP_OPS`` of ``generate``'s own loop;
  - **reference/old log-probs**: with ``beta > 0`` a no-grad forward of every completion row with the
    adapter off, with ``num_iterations > 1`` one with it on (``π_old``), ``rows / micro_batch_size``
    micro-batches each of the training micro-batch's shape, the LM head and log-softmax over the
    completion tokens (half of the cross-entropy's forward + backward, as DPO's reference pass in
    :func:`~finetuner.planning.speed.loss_seconds`);

* **the training passes**: ``rows / micro_batch_size`` micro-batches of ``micro_batch_size`` rows
  padded to the longest (``P + C`` with one row a micro-batch, else ``P_w`` + the call's longest
  completion), the loss on the ``C`` completion tokens of each row: the SFT step model
  (:func:`~finetuner.planning.speed.step_time` on :func:`finetuner.memory.grpo.loss_settings`), its
  parts named ``training: …``, then its ``optimizer`` and ``fixed`` parts.

Reward functions are user code and are not modelled (the demo's are microseconds).

Per operation: a no-grad forward's operation costs ``GEN_OP_FACTOR`` bare operations (no autograd
bookkeeping, against ``EAGER_OP_FACTOR`` in training). On a CPU operations add to the work; on a GPU
(:data:`speed.py`'s rule) the host queues kernels while the device works, so each decode step takes
``max(device work, operations)``: a small batch is launch-bound or weight-read-bound.

Lengths: ``P`` (prompt tokens per row) and the prompts' padded width per call come from the data when
it can be read (``prompts``: :func:`finetuner.planning.lengths.prompt_batch` of
:func:`finetuner.data.stats.profile_prompts`, as the plan, ``estimate`` and the trainer pass them), else
they default to their upper bound ``prompt_len``; ``C`` (completion tokens per row) and ``D`` default to
their upper bound ``max_new_tokens``: the completions are written by the model during the run. The
prediction is then an upper bound on the lengths ("at most"; :attr:`StepTime.upper_bound`), though not on
the model's own error (see docs/benchmarks.md). The trainer's step events carry the
measured ``decode_steps`` and ``completion_length`` (and ``tokens``, from which ``P``:
:func:`grpo_lengths_from_events`), which can be passed in; ``scripts/validate/speed_grpo.py`` passes
those and the padded widths it measures, to separate the model's error from the length guess.

``tokens_per_step`` counts what the trainer counts for GRPO: the real (unpadded) prompt + completion
tokens of the step's training micro-batches, ``rows × (P + C)`` (``CompletionCollator``'s ``num_tokens``).

Constants that are fits or estimates say so where they are defined. Checked against measured runs by
``scripts/validate/speed_grpo.py`` (``docs/validation/speed_grpo_cpu.json``, replayed by
``tests/planning/test_speed_grpo.py``). Pure arithmetic: no torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from finetuner.device import CPU, CUDA
from finetuner.objectives.specs import DEFAULT as PLAIN_PASS  # a supervised pass: no pairs, no reference
from finetuner.memory.grpo import GrpoSettings, kv_cache_bytes, loss_settings
from finetuner.memory.model import Settings
from finetuner.memory.storage import quantized_numel
from finetuner.model.shapes import ModelShape, lora_targets
from finetuner.planning.speed import (BACKWARD_OPS, DTYPE_BYTES, FORWARD_TRAFFIC, INT8_SLOWDOWN, OPS_PER_QUANT_LINEAR,
                                      DeviceSpeed, StepTime,
                                      forward_flops, typical_width, attention_seconds, loss_seconds, matmul_row_efficiency,
                                      op_count, saved_bytes_per_token, step_time)

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.memory.model import MemoryEstimate
    from finetuner.planning.lengths import BatchShape

#: Bare operations (the calibration's ``op_overhead_s``) one operation of a no-grad forward costs: the
#: module call and peft's adapter loop, without autograd's bookkeeping. A fit: the demo model's
#: one-token forward with LoRA (374 counted operations, nearly no device work) takes 1.4-1.5 ms on the
#: development CPU at 2.5-2.6 us a bare operation: 1.5-1.6 (scripts/validate/speed_grpo.py, ``--probe``).
GEN_OP_FACTOR = 1.6
#: Operations of ``generate``'s loop per generated token outside the model: the cache position and
#: attention mask update, ``prepare_inputs_for_generation``, the logits processors and warpers, the
#: stopping criteria, the unfinished-rows bookkeeping and the ``torch.cat`` of the new tokens. An
#: estimate fitted on the demo model's ``generate`` against its forward (``--probe``: 0.1 ms a step).
GENERATE_STEP_OPS = 40
#: Operations of one ``generate`` call's set-up (generation config, processors, cache, the prefill's
#: mask and positions). An estimate fitted likewise (``--probe``: about 1.2 ms a call).
GENERATE_CALL_OPS = 300
#: Passes over the KV cache per decode step without grouped-query attention: ``torch.cat`` reads the
#: old cache and writes the new one (``DynamicLayer.update``), attention reads it. Counted. With
#: ``num_heads / num_kv_heads = n > 1`` and a padding mask (GRPO's left-padded prompts) transformers'
#: SDPA path repeats the keys and values to the query heads (``repeat_kv``): ``n`` more written and
#: ``n`` more read (:func:`kv_passes`).
KV_PASSES = 3
#: Sampling elements per second (softmax, then ``torch.multinomial``, per row and vocabulary entry) when
#: the calibration has no figure: on a CPU ``torch.multinomial`` draws from each row with a scan,
#: ~17 ns an element on one core of the development machine (measured: 1133 and 49,152 entries, 8-64
#: rows, ``--probe``); on a GPU the softmax and multinomial kernels move about ``SAMPLING_BYTES_PER_ELEMENT``
#: bytes an element at the bandwidth (an estimate: logits cast to fp32, scaled, softmaxed, summed).
CPU_SAMPLING_ELEMENTS_PER_S = 6.0e7
SAMPLING_BYTES_PER_ELEMENT = 24
#: ``top_p < 1`` sorts every row (``TopPLogitsWarper``): on the CPU the sort costs 2.4x the sampling
#: itself over 1,133 entries and 3.9x over 49,152 (``--probe``; 3.5: the large vocabularies that matter);
#: on a GPU a radix sort, taken as 3.5 times the sampling's traffic too (an estimate, not measured).
TOP_P_SORT_FACTOR = 3.5


#: Operations a 4-bit linear adds to a no-grad forward, by platform. On the CPU bitsandbytes runs its
#: Python fallback (without the ``kernels`` package): torch.profiler counts 25 aten operations in one
#: 4-bit linear, many of them views; as time they are worth about 10 of the calibration's operations
#: (a fit: the demo model's one-token forward takes 1.1 ms more with its 28 linears in 4-bit than in
#: fp32, ``--probe``). On CUDA: speed.py's ``OPS_PER_QUANT_LINEAR``.
QUANT_LINEAR_OPS = {CPU: 10, CUDA: OPS_PER_QUANT_LINEAR}


def _targets(s: Settings) -> Any:
    return list(s.lora_targets) if isinstance(s.lora_targets, tuple) else s.lora_targets


def _dtype(s: Settings) -> str:
    return s.compute_dtype if s.compute_dtype in DTYPE_BYTES else "fp32"


def _lora_numel(shape: ModelShape, s: Settings) -> float:
    """``Σ r (in + out)`` over the LoRA targets (0 for a full fine-tune)."""
    if s.method == "full":
        return 0.0
    return float(sum(s.lora_r * (fin + fout) * copies for _, fin, fout, copies in lora_targets(shape, _targets(s))))


def kv_passes(shape: ModelShape) -> int:
    """Passes over the KV cache per decode step (``KV_PASSES``, and ``repeat_kv``'s copy with grouped-query
    attention)."""
    n = shape.num_heads // max(1, shape.num_kv_heads)
    return KV_PASSES + (2 * n if n > 1 else 0)


def forward_ops(shape: ModelShape, s: Settings, adapter: bool = True) -> float:
    """Operations of one forward of a micro-batch (:func:`~finetuner.planning.speed.op_count`'s forward),
    without LoRA's when ``adapter`` is off (peft's disabled adapter calls the base layer only), a 4-bit
    linear's at ``QUANT_LINEAR_OPS``."""
    base = s.with_(gradient_checkpointing=False, objective=PLAIN_PASS, reference="none")
    ops = op_count(shape, base) / (1 + BACKWARD_OPS)
    if s.method == "qlora":
        ops += (QUANT_LINEAR_OPS.get(s.platform, OPS_PER_QUANT_LINEAR) - OPS_PER_QUANT_LINEAR) * shape.linears_per_layer * shape.num_layers
    if not adapter and s.method != "full":
        ops -= (op_count(shape, base.with_(method="lora")) - op_count(shape, base.with_(method="full"))) / (1 + BACKWARD_OPS)
    return ops


def dequant_pass_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed) -> float:
    """One dequantization of the 4-bit/8-bit base (every decoder weight), as
    :func:`~finetuner.planning.speed.dequant_seconds` counts one of its passes; 0 unless QLoRA."""
    if s.method != "qlora":
        return 0.0
    slow = INT8_SLOWDOWN if s.quant_bits == 8 else 1.0
    return quantized_numel(shape, s) * slow / speed.dequant_weights_per_s


def sampling_seconds(shape: ModelShape, rows: int, speed: DeviceSpeed, top_p: float = 1.0) -> float:
    """One sampled token of ``rows`` rows: every row's logits over the vocabulary through softmax and
    ``torch.multinomial`` (``CPU_SAMPLING_ELEMENTS_PER_S``, or ``SAMPLING_BYTES_PER_ELEMENT`` at the
    bandwidth on a GPU), ``TOP_P_SORT_FACTOR`` more with nucleus sampling."""
    elements = rows * shape.vocab_size
    if speed.platform == "cpu":
        t = elements / CPU_SAMPLING_ELEMENTS_PER_S
    else:
        t = elements * SAMPLING_BYTES_PER_ELEMENT / speed.bandwidth_bytes_per_s
    return t * (1 + (TOP_P_SORT_FACTOR if top_p < 1 else 0.0))


def forward_parts(shape: ModelShape, s: Settings, speed: DeviceSpeed, *, head_tokens: float, adapter: bool = True,
                  log_softmax: bool = False) -> tuple[float, float]:
    """``(device seconds, operation seconds)`` of one no-grad forward over ``s.micro_batch × s.seq_len``
    tokens (module docstring): the linears, LoRA (``adapter``), attention (one of the training pass's
    three units), the forward's memory traffic, one dequantization, the LM head over ``head_tokens``
    tokens and, with ``log_softmax``, the log-probabilities over them (half the cross-entropy's forward +
    backward). The device work is divided by the device's utilisation at these tokens, as in training."""
    T = s.micro_batch * s.seq_len
    fs = s.with_(gradient_checkpointing=False, objective=PLAIN_PASS, reference="none",
                 label_fraction=min(1.0, max(head_tokens, 1e-9) / T))
    f, w = forward_flops(shape, fs), typical_width(shape)
    dt = _dtype(s)
    t = f["decoder"] / speed.matmul_rate(dt, w["decoder"])
    if adapter and f["lora"]:
        t += f["lora"] / speed.matmul_rate(dt, max(1, s.lora_r))
    t /= matmul_row_efficiency(speed, T)
    t += f["head"] / speed.matmul_rate(dt, w["head"]) / matmul_row_efficiency(speed, head_tokens)
    t += attention_seconds(shape, fs, speed) / 3
    t += saved_bytes_per_token(shape, fs) * T * FORWARD_TRAFFIC / speed.bandwidth_bytes_per_s
    t += dequant_pass_seconds(shape, s, speed)
    if log_softmax:
        t += loss_seconds(shape, fs, speed) / (1 + (0.5 if fs.loss_chunk > 0 else 0.0)) * 0.5
    t /= speed.utilisation(T)
    ops = forward_ops(shape, fs, adapter) * speed.op_overhead_s * GEN_OP_FACTOR
    return t, ops


def decode_step_parts(shape: ModelShape, s: Settings, speed: DeviceSpeed, rows: int, cache_len: float,
                      adapter: bool = True) -> tuple[float, float]:
    """``(device seconds, operation seconds)`` of one decode forward: one token for each of ``rows`` rows
    with ``cache_len`` tokens in the KV cache (module docstring), without LoRA's matmuls, weights and operations
    when ``adapter`` is off (peft's disabled adapter calls the base layer only). Sampling is :func:`sampling_seconds`."""
    dt = _dtype(s)
    w = typical_width(shape)
    c = DTYPE_BYTES.get(s.compute_dtype, 4)
    stored = {"qlora": 0.5 if s.quant_bits == 4 else 1.0}.get(s.method, 4 if s.method == "full" else DTYPE_BYTES[s.weight_dtype])
    N, head = shape.active_weight_numel, shape.vocab_size * shape.hidden_size
    lora = _lora_numel(shape, s) if adapter else 0.0
    util = speed.utilisation(rows) if speed.platform == CUDA else matmul_row_efficiency(speed, rows)
    flops_t = (2 * rows * N / speed.matmul_rate(dt, w["decoder"]) + 2 * rows * head / speed.matmul_rate(dt, w["head"])
               + (2 * rows * lora / speed.matmul_rate(dt, max(1, s.lora_r)) if lora else 0.0)) / util
    head_bytes = head * (4 if s.method == "full" else DTYPE_BYTES[s.weight_dtype])
    # the linears at their stored size; a mixture of experts' fused experts (never quantized) as far as the rows'
    # tokens reach them: top_k of them per row, at most all
    experts = shape.expert_numel * min(1.0, rows * shape.experts.top_k / shape.experts.count) if shape.experts else 0.0
    expert_b = 0.5 if s.method == "qlora" and s.quant_bits == 4 else DTYPE_BYTES.get(s.weight_dtype, 2)
    weight_t = (shape.linear_weight_numel * stored + experts * expert_b + head_bytes
                + 4 * lora) / speed.bandwidth_bytes_per_s
    kv = kv_cache_bytes(shape, rows, max(1, int(round(cache_len))), c)
    attn_flops = 4 * cache_len * shape.q_dim * shape.num_layers * rows
    attn_t = max(attn_flops / speed.matmul_rate(dt, shape.head_dim), kv_passes(shape) * kv / speed.bandwidth_bytes_per_s)
    one = s.with_(micro_batch=rows, seq_len=1, gradient_checkpointing=False, objective=PLAIN_PASS, reference="none")
    elementwise = saved_bytes_per_token(shape, one) * rows * FORWARD_TRAFFIC / speed.bandwidth_bytes_per_s
    device = max(flops_t, weight_t) + attn_t + elementwise + dequant_pass_seconds(shape, s, speed)
    ops = (forward_ops(shape, one, adapter) + GENERATE_STEP_OPS) * speed.op_overhead_s * GEN_OP_FACTOR
    return device, ops


def _combine(device: float, ops: float, speed: DeviceSpeed) -> float:
    """speed.py's rule: on a GPU only the host's excess over the device's work shows."""
    return max(device, ops) if speed.platform == CUDA else device + ops


def generation_seconds(shape: ModelShape, s: Settings, speed: DeviceSpeed, *, calls: int, rows: int, prompt_width: float,
                       decode_steps: float, top_p: float = 1.0, adapter: bool = True) -> tuple[float, float]:
    """``(prefill, decode)`` seconds of ``calls`` ``generate`` calls of ``rows`` rows each, their prompts
    ``prompt_width`` tokens wide (left-padded to the longest), ``decode_steps`` tokens generated per call
    (its longest completion): the rollout's generation (module docstring), and a GRPO evaluation's; ``adapter``
    off: the base model's answers (replay, the probe's base pass: :mod:`finetuner.planning.wait`)."""
    R = max(1, rows)
    D = max(1.0, float(decode_steps))
    pre = s.with_(micro_batch=R, seq_len=max(1, int(round(prompt_width))), attention_mask=True)
    dev, ops = forward_parts(shape, pre, speed, head_tokens=R, adapter=adapter)
    prefill = _combine(dev + sampling_seconds(shape, R, speed, top_p), ops + GENERATE_CALL_OPS * speed.op_overhead_s * GEN_OP_FACTOR, speed)
    dev, ops = decode_step_parts(shape, s, speed, R, prompt_width + D / 2, adapter)
    step = _combine(dev + sampling_seconds(shape, R, speed, top_p), ops, speed)
    return calls * prefill, calls * (D - 1) * step


def evaluation_seconds(shape: ModelShape, s: Settings, g: GrpoSettings, speed: DeviceSpeed, held_out: int, *,
                       top_p: float = 1.0, prompts: BatchShape | None = None) -> float:
    """One GRPO evaluation (:meth:`finetuner.objectives.grpo.GRPOObjective.evaluate`): ``num_generations``
    completions of each of the ``held_out`` prompts, ``micro_batch_size`` prompts' groups a ``generate``
    call as in the rollout (:func:`generation_seconds`), each call generating ``max_new_tokens`` (an
    upper bound: a call stops when all its rows have ended), the prompts padded to the longest held-out
    one (``prompts``: :func:`finetuner.planning.lengths.prompt_batch` of the ``held_out`` prompts) or at
    their longest. The reward functions are user code and not timed. 0 without held-out prompts."""
    if held_out <= 0:
        return 0.0
    R = g.generation_rows
    calls = math.ceil(held_out * g.num_generations / R)
    width = prompts.padded_len if prompts is not None else float(g.prompt_len)
    prefill, decode = generation_seconds(shape, s, speed, calls=calls, rows=R, prompt_width=width,
                                         decode_steps=g.max_new_tokens, top_p=top_p)
    return prefill + decode


def grpo_step_time(shape: ModelShape, s: Settings, g: GrpoSettings, speed: DeviceSpeed, *,
                   completion_tokens: float | None = None, decode_steps: float | None = None,
                   prompt_tokens: float | None = None, est: MemoryEstimate | None = None,
                   top_p: float = 1.0, prompt_width: float | None = None, train_width: float | None = None,
                   prompts: BatchShape | None = None) -> StepTime:
    """The predicted time of one GRPO optimizer step (module docstring), by part.

    ``s``: the run's settings (:func:`finetuner.memory.model.settings_from_recipe`: ``micro_batch`` is
    ``micro_batch_size``); ``g``: :func:`finetuner.memory.grpo.grpo_settings_of`. ``completion_tokens``
    and ``prompt_tokens``: mean tokens per row (default ``max_new_tokens`` and ``prompt_len``);
    ``decode_steps``: tokens generated summed over the rollout's ``generate`` calls, each call's longest
    completion (the step event's ``decode_steps``; default ``max_new_tokens`` per call). ``top_p``: the
    recipe's nucleus sampling (< 1 sorts every row at each token). ``est``: passed to the training
    part's :func:`~finetuner.planning.speed.step_time` (activation offload).

    Padding: the step's prompts are left-padded to their longest, every ``generate`` call alike (``prompt_width``, default
    ``prompt_tokens``: the prefill and the KV cache run over that width), and a training micro-batch is
    padded to its longest row (``train_width``, default: the row itself with one row a micro-batch, else
    ``prompt_width`` + the call's longest completion). A validation measures both and passes them in.
    ``prompts``: the data's prompts as the rollout pads them (:func:`finetuner.planning.lengths.prompt_batch`
    of the step's prompts: the mean prompt, and the expected longest of the step's prompts, to which
    :func:`~finetuner.objectives.rollout.generate_group` left-pads them all), for ``prompt_tokens`` and
    ``prompt_width`` not given.

    The step is an upper bound (:attr:`StepTime.upper_bound`) while the completions' lengths are assumed
    (``max_new_tokens``): they are known only once the model writes them."""
    if prompts is not None:
        prompt_tokens = prompts.real_per_row if prompt_tokens is None else prompt_tokens
        prompt_width = prompts.padded_len if prompt_width is None else prompt_width
    bound = (completion_tokens is None or decode_steps is None) and train_width is None
    mbs = max(1, min(s.micro_batch, g.rows))
    R = g.generation_rows
    calls = math.ceil(g.rows / R)
    P = float(prompt_tokens) if prompt_tokens is not None else float(g.prompt_len)
    C = float(completion_tokens) if completion_tokens is not None else float(g.max_new_tokens)
    D = float(decode_steps) / calls if decode_steps is not None else float(g.max_new_tokens)
    D = max(1.0, D)
    mu = g.num_iterations
    Pw = float(prompt_width) if prompt_width is not None else P

    # the rollout: prefill, decode, the reference and old log-probabilities
    prefill, decode = generation_seconds(shape, s, speed, calls=calls, rows=R, prompt_width=Pw, decode_steps=D, top_p=top_p)

    if train_width is None:
        train_width = P + C if mbs == 1 else Pw + min(D, float(g.max_new_tokens))
    width = max(1, int(round(train_width)))
    ls = loss_settings(s, g).with_(micro_batch=mbs, seq_len=width, label_fraction=min(1.0, max(C, 1e-9) / width))
    micro = math.ceil(g.rows / mbs)
    logps = 0.0
    for adapter, wanted in ((False, g.beta != 0), (True, mu > 1)):
        if wanted:
            dev, ops = forward_parts(shape, ls, speed, head_tokens=mbs * C, adapter=adapter, log_softmax=True)
            logps += micro * _combine(dev, ops, speed)

    parts = {
        "generation: prefill": prefill / mu,
        "generation: decode": decode / mu,
        "reference/old log-probs": logps / mu,
    }
    train = step_time(shape, ls.with_(gradient_accumulation=micro), speed, est)
    for k, v in train.parts.items():
        parts[k if k in ("optimizer", "fixed") else f"training: {k}"] = v
    # the optimizer and the fixed costs last, as in step_time
    parts = {**{k: v for k, v in parts.items() if k not in ("optimizer", "fixed")},
             "optimizer": parts["optimizer"], "fixed": parts["fixed"]}
    tokens = int(round(g.rows * (P + C)))
    return StepTime(parts, tokens, micro, speed.source, upper_bound=bound, data_lengths=prompts is not None)


def grpo_lengths_from_events(steps: list[dict[str, Any]], g: GrpoSettings) -> dict[str, float]:
    """The measured lengths of GRPO step events (``tokens``, ``completion_length``, ``decode_steps``),
    averaged over the steps, as :func:`grpo_step_time`'s keyword arguments."""
    rolled = [e for e in steps if e.get("decode_steps")]
    if not rolled:
        return {}
    n = len(rolled)
    C = sum(e["completion_length"] for e in rolled) / n
    P = sum(e["tokens"] for e in rolled) / n / g.rows - C
    return {"completion_tokens": C, "prompt_tokens": P, "decode_steps": sum(e["decode_steps"] for e in rolled) / n}


"""The token mixers that are not softmax attention, for the speed model: linear attention (Qwen3.5's and
Qwen3-Next's Gated DeltaNet), state-space mixers (Mamba, Mamba-2 and the hybrids that hold them) and LFM2's short
convolutions.

Their linears (in_proj, x_proj, dt_proj, out_proj; in_proj_qkv, in_proj_z, in_proj_a/b, out_proj) are decoder
linears like any other (:meth:`finetuner.model.shapes.ModelShape.layer_linears`, roles ``mixer`` and
``linear:<path>``): the speed model counts them as matmuls already. What this module adds is each layer's own
sequence mixing, which grows with ``T``, not ``T²``, counted from transformers' PyTorch paths (what runs where the
kernels are not installed):

* **Gated DeltaNet** (``torch_chunk_gated_delta_rule``, chunks of ``C = 64``, ``H`` value heads of widths ``dk``,
  ``dv``): per chunk and head ``k_beta @ kᵀ`` and ``q @ kᵀ`` (``2 C² dk`` each), two unit-triangular solves of
  ``C x C`` against ``v_beta`` and the decayed keys (``C² dv + C² dk``), and in the scan over chunks
  ``k_cumdecay @ S``, ``q @ S`` and ``kᵀ @ v_new`` (``2 C dk dv`` each) and ``attn @ v_new`` (``2 C² dv``): per token
  ``H (C (5 dk + 3 dv) + 6 dk dv)``. The scan is a Python loop over the chunks: ``DELTA_OPS_PER_CHUNK`` operations
  each.
* **Mamba-2** (``mamba2_chunk_scan``, the ``torch_forward`` of Mamba-2, Bamba, Falcon-H1, Granite 4, Nemotron-H;
  chunks of ``L``, ``H`` heads of width ``P``, state ``N``): per chunk and head ``C Bᵀ`` (``2 L² N``), ``M x``
  (``2 L² P``), the chunk's state ``Bᵀ x`` and the output's ``C S`` (``2 L N P`` each): per token
  ``H (2 L N + 2 L P + 4 N P)``; and the states passed between chunks, an einsum over every pair of chunks
  (``2 (c + 1)² H P N`` for ``c`` chunks: quadratic in ``T``, with ``1 / L²`` of a token's weight). No loop.
* **Mamba** (the sequential ``mamba_selective_scan``, Mamba, Falcon-Mamba, Jamba; inner width ``d``, state ``N``):
  per token the discretized ``A`` and ``B u`` (``d N`` each), the state's update (``2 d N``) and its read by ``C``
  (``2 d N``): ``6 d N``; a Python loop over the tokens, ``MAMBA_OPS_PER_TOKEN`` operations each.
* **LFM2's short convolution** (``Lfm2ShortConv``, LFM2 and LFM2-MoE; ``D`` channels, the config's
  ``conv_L_cache`` ``K``): ``in_proj`` makes ``B``, ``C`` and ``x``, the layer convolves ``B x`` over the sequence and
  multiplies by ``C``; its only sequence mixing is that convolution.

The padding to whole chunks is counted (a sequence shorter than a chunk costs a chunk). Their depthwise convolutions
(:func:`short_conv_flops`; transformers' ``causal_conv1d_fn`` and LFM2's ``nn.Conv1d`` pad ``K - 1`` on both sides,
then keep the first ``T`` outputs: ``2 K`` FLOPs a channel for each of ``T + K - 1`` outputs) are counted here.

**Their element-wise work** (:func:`scan_bytes`, the speed model's memory-bound term): the bytes every operation
that is neither a matmul nor a view reads and writes, forward and backward, counted on a dispatch trace of
transformers 5.23's code (``TorchDispatchMode``, every tensor an operation takes or returns) at many widths and
lengths; the counts are exact polynomials, written out below with their integer (or half) coefficients, in
elements:

* Gated DeltaNet's ``torch_chunk_gated_delta_rule`` (fp32 whatever the compute dtype, query and key normalised
  in it), per value head (two or more heads: one head skips the transposes' copies), ``c`` chunks of ``C``: ``c (127 C dk + 53 C dv + 52 C² + 120 C + 19 dk dv + 6)`` and
  ``c² (12 C dk + 9 C dv + 4 C² + 4)``. The ``c²`` term is the loop's backward: the gradient of each chunk's slice
  (``new_values[:, :, i]``, ``k_cumdecay``, ``query``, ``key``, ``intra_chunk_attn``, the in-place write into
  ``core_attn_out``) is a zero tensor of the whole sequence's size with the slice filled in, then added to the
  others: the PyTorch path's backward grows as ``T²``. The rest of the layer (its convolution, gates and norm)
  is in the memory model's terms like any layer's; the key heads' ``repeat_interleave`` is not counted.
* LFM2's short convolution, in the compute dtype, per layer and sequence (``D`` channels, ``T`` tokens, kernel
  ``K``): ``D (26 T + K - 1)``: forward ``B * x`` and ``C * conv`` (``3 D T`` each), backward their four gradient
  products (``3 D T`` each), the gradient of the slice to ``T`` outputs (``D T`` read, ``D (T + K - 1)`` written) and
  of the ``chunk`` into ``B``, ``C``, ``x`` (``6 D T``); with two or more sequences ``6 D T`` more (that gradient,
  transposed, copied to ``in_proj``'s layout: one sequence's is a view). The convolution itself is timed by its FLOPs (like the
  matmuls, not counted here), ``_unsafe_view`` as the view it is.
* Mamba-2's ``mamba2_chunk_scan`` (fp32), per sequence, ``c`` chunks of ``L``, ``H`` heads of width ``P``, state
  ``N``, ``G`` groups of B and C: ``c (31 L² H + 55 L H P + 40 L H N + 77.5 L H + 2 L G N + 8 H P N + 53 H)
  + 22 c² H + 13 H P N + 25 H`` and, once for the rows, ``7 c + 3.5 c² - 8 H P N + 10 H + 3.5 L² + 8.5``: the ``L²`` terms are ``segment_sum``'s masks, cumsum and exp
  over each chunk's ``L x L`` and ``G * L`` (``M``) and their gradients, the ``c²`` ones the decay between every pair
  of chunks. No zero-fills: its backward has no slice of a whole-sequence tensor per chunk. Exact with one sequence;
  with more, its einsums' copies (which follow the strides) differ by up to ``10 c H P N``.
* Mamba-1's sequential ``mamba_selective_scan`` (fp32), per sequence, inner width ``d``, state ``N``:
  ``T² N (8 d + 4) + T (38 d N + 53 d + 11 N) - 5 d N`` and, once, ``5 d N + 5 d + 3`` (the parameters' gradients).
  The ``T²`` term is the loop's backward: each token's ``discrete_A[:, :, t]``, ``deltaB_u[:, :, t]`` and
  ``C[:, t]`` get a gradient that is a zero tensor of the whole sequence (``d T N``, ``d T N``, ``T N``) with the
  slice filled in, added to the others (``select_backward``). The PyTorch path of Mamba-1 grows as ``T²``, as the
  delta rule's does. Its zeros are timed at the bandwidth, not as fresh memory: a token's is ``4 d T N`` bytes (4-8
  MiB in the benchmark, docs/benchmarks.md), a block the allocator reuses token after token; at 2.0 GB/s they would
  take three times the measured step.

Which path a run takes: transformers calls flash-linear-attention's, mamba-ssm's and causal-conv1d's kernels when
they import, else the PyTorch path (``use_kernel_func_from_hub_with_fallback``). :func:`kernels_installed` says which
are; the speed model times the PyTorch path in any case (no kernel's speed is measured here), and the plan says so,
naming the extra that installs the missing ones (``finetuner[kernels]``, Linux x86_64 only: they build CUDA code).
"""

from __future__ import annotations

import importlib.util
import math

from finetuner.model.mixers import mixers
from finetuner.model.shapes import ModelShape

#: the packages whose kernels transformers uses for these layers, by what they speed up
KERNEL_PACKAGES = {"fla": "flash-linear-attention", "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}
#: the optional extra that installs them (pyproject.toml: on Linux x86_64 only, where they build)
KERNELS_EXTRA = "finetuner[kernels]"
#: ``torch_chunk_gated_delta_rule``'s chunk (its default; Qwen3.5 and Qwen3-Next call it so)
DELTA_CHUNK = 64
#: operations of one pass of ``torch_chunk_gated_delta_rule``'s loop over chunks, counted in its code: five
#: chunk slices, three matmuls and the output's, a subtraction, an addition, the output's write, the state's decay
#: and its update (16)
DELTA_OPS_PER_CHUNK = 16
#: operations of one pass of the sequential Mamba scan's loop over tokens, counted in ``mamba_selective_scan``:
#: three slices, the state's multiply and add, the cast, ``unsqueeze``, the matmul and the output's slice (9)
MAMBA_OPS_PER_TOKEN = 9


def kernels_installed() -> dict[str, bool]:
    """Whether each kernel package imports here (``importlib.util.find_spec``: not imported)."""
    return {pip: importlib.util.find_spec(mod) is not None for mod, pip in KERNEL_PACKAGES.items()}


def chunks(seq: int, size: int) -> int:
    """Chunks of ``size`` a sequence of ``seq`` tokens is padded to."""
    return max(1, math.ceil(seq / size))


def short_conv_flops(kernel: int, channels: int, seq: int) -> int:
    """Forward FLOPs of a depthwise causal convolution over one sequence as transformers' PyTorch path computes it:
    padded by ``kernel - 1`` on both sides, ``seq + kernel - 1`` outputs of ``2 kernel`` FLOPs a channel, the last
    ``kernel - 1`` thrown away."""
    return 2 * kernel * channels * (seq + kernel - 1)


def scan_flops(shape: ModelShape, rows: int, seq: int) -> float:
    """The forward FLOPs of every non-attention mixer's sequence mixing over ``rows`` sequences of ``seq`` tokens
    (see the module doc for each formula), the padding to whole chunks included."""
    m = mixers(shape)
    total = 0.0
    if m.delta_layers:
        padded = chunks(seq, DELTA_CHUNK) * DELTA_CHUNK
        per_token = m.delta_heads * (DELTA_CHUNK * (5 * m.delta_dk + 3 * m.delta_dv) + 6 * m.delta_dk * m.delta_dv)
        conv = short_conv_flops(m.conv_kernel, m.delta_conv_channels, seq)
        total += m.delta_layers * rows * (per_token * padded + conv)
    if m.mamba2_layers:
        L, H, P, N = m.mamba2_chunk, m.mamba2_heads, m.mamba2_head_dim, m.mamba2_state
        c = chunks(seq, L)
        per_token = H * (2 * L * N + 2 * L * P + 4 * N * P)
        between = 2 * (c + 1) ** 2 * H * P * N
        conv = short_conv_flops(m.conv_kernel, H * P, seq)
        total += m.mamba2_layers * rows * (per_token * c * L + between + conv)
    if m.mamba_layers:
        conv = short_conv_flops(m.conv_kernel, m.mamba_inner, seq)
        total += m.mamba_layers * rows * (6 * m.mamba_inner * m.mamba_state * seq + conv)
    if m.conv_layers:
        total += m.conv_layers * rows * short_conv_flops(m.conv_kernel, m.conv_channels, seq)
    return total


def scan_bytes(shape: ModelShape, rows: int, seq: int, dtype_bytes: int = 4) -> float:
    """Bytes the mixers' element-wise operations move over ``rows`` sequences of ``seq`` tokens, forward and
    backward (the module doc's counts): the delta rule at fp32 whatever the compute dtype, LFM2's short
    convolution at ``dtype_bytes`` (the compute dtype's)."""
    m = mixers(shape)
    total = 0.0
    if m.delta_layers:
        C, dk, dv, c = DELTA_CHUNK, m.delta_dk, m.delta_dv, chunks(seq, DELTA_CHUNK)
        per_chunk = 127 * C * dk + 53 * C * dv + 52 * C * C + 120 * C + 19 * dk * dv + 6
        per_pair = 12 * C * dk + 9 * C * dv + 4 * C * C + 4
        total += 4 * m.delta_layers * rows * m.delta_heads * (c * per_chunk + c * c * per_pair)
    if m.mamba2_layers:
        L, H, P, N, G = m.mamba2_chunk, m.mamba2_heads, m.mamba2_head_dim, m.mamba2_state, m.mamba2_groups
        c = chunks(seq, L)
        per_chunk = 31 * L * L * H + 55 * L * H * P + 40 * L * H * N + 77.5 * L * H + 2 * L * G * N + 8 * H * P * N + 53 * H
        per_row = c * per_chunk + 22 * c * c * H + 13 * H * P * N + 25 * H
        once = 7 * c + 3.5 * c * c - 8 * H * P * N + 10 * H + 3.5 * L * L + 8.5
        total += 4 * m.mamba2_layers * (rows * per_row + once)
    if m.mamba_layers:
        d, N, T = m.mamba_inner, m.mamba_state, seq
        per_row = T * T * N * (8 * d + 4) + T * (38 * d * N + 53 * d + 11 * N) - 5 * d * N
        total += 4 * m.mamba_layers * (rows * per_row + 5 * d * N + 5 * d + 3)
    if m.conv_layers:
        per_token = 26 + (6 if rows > 1 else 0)  # two or more rows: in_proj's gradient copied to its layout
        total += dtype_bytes * m.conv_layers * rows * m.conv_channels * (per_token * seq + m.conv_kernel - 1)
    return total


def scan_fill_bytes(shape: ModelShape, rows: int, seq: int) -> float:
    """Bytes of :func:`scan_bytes` that the delta rule's backward writes as zeros into tensors just allocated: the
    gradient of each chunk's slice (``select_backward``) is a zero tensor of the whole sequence's ``k_cumdecay``,
    ``query``, ``key``, ``new_values`` and ``intra_chunk_attn`` (``C (3 dk + dv) + C²`` elements a chunk and head, and
    ``g``'s one), ``c`` of them for ``c`` chunks: ``4 c² (C² + C (3 dk + dv) + 1)`` bytes a head (fp32), counted on
    the same trace. On a CPU each is memory the allocator maps fresh (more than glibc's largest reused block at
    real widths), so its writing costs the first touch of its pages, not the bandwidth
    (:attr:`finetuner.planning.speed.DeviceSpeed.fresh_bytes_per_s`)."""
    m = mixers(shape)
    if not m.delta_layers:
        return 0.0
    C, c = DELTA_CHUNK, chunks(seq, DELTA_CHUNK)
    return 4.0 * m.delta_layers * rows * m.delta_heads * c * c * (C * C + C * (3 * m.delta_dk + m.delta_dv) + 1)


def scan_width(shape: ModelShape) -> int:
    """The narrower dimension of the mixers' matmuls (their rate depends on it): the delta rule's key width, Mamba-2's
    state, Mamba's state (a matmul-vector product per token). Not the depthwise convolution's kernel: that is no
    matmul, and as the minimum its 4 priced every scan FLOP at a quarter of the narrowest calibrated rate."""
    m = mixers(shape)
    widths = [w for w in (m.delta_dk, m.mamba2_state, m.mamba_state) if w]
    return max(1, min(widths)) if widths else 1


def scan_ops(shape: ModelShape, seq: int) -> float:
    """Operations the mixers' Python loops launch in one forward over sequences of ``seq`` tokens (the rows go
    together): the delta rule's loop over chunks, the sequential Mamba scan's loop over tokens."""
    m = mixers(shape)
    return (m.delta_layers * DELTA_OPS_PER_CHUNK * chunks(seq, DELTA_CHUNK)
            + m.mamba_layers * MAMBA_OPS_PER_TOKEN * seq)


def kernel_note(shape: ModelShape) -> str | None:
    """What the plan says about these layers' speed: the path it times, which kernels are installed, and what
    installing them would change (not measured here). None for a model without such layers."""
    m = mixers(shape)
    if not m.any:
        return None
    needed = (["flash-linear-attention"] if m.delta_layers else []) + (["mamba-ssm"] if m.mamba2_layers or m.mamba_layers else [])
    needed.append("causal-conv1d")
    have = kernels_installed()
    missing = [k for k in needed if not have[k]]
    kinds = ", ".join(x for x in (f"{m.delta_layers} Gated DeltaNet" if m.delta_layers else "",
                                  f"{m.mamba2_layers + m.mamba_layers} state-space" if m.mamba2_layers or m.mamba_layers else "",
                                  f"{m.conv_layers} short-convolution" if m.conv_layers else "") if x)
    path = "transformers' PyTorch path" + (" (a Python loop over every token)" if m.mamba_layers else "")
    return (f"its {kinds} layers are timed as {path}, linear in the sequence length; "
            + (f"{', '.join(missing)} not installed here, so a run takes that path (`pip install '{KERNELS_EXTRA}'` "
               "installs the kernels on Linux x86_64, with a CUDA toolkit and a C++ compiler to build them)" if missing
               else f"{', '.join(needed)} are installed, so a run on a GPU takes their kernels, which this estimate does not time")
            + "; the kernels' speed-up is not measured")

"""The speed model's linear-attention and state-space layers (finetuner/planning/scans.py): no softmax-attention term
in them, their chunked delta rule and scans counted linear in the sequence length as transformers' PyTorch path
computes them, and the plan saying which path it times. Arithmetic only: the CPU measurements are in
docs/benchmarks.md (scripts/validate/speed_scans.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from finetuner.memory.model import Settings
from finetuner.model import mixers
from finetuner.model.shapes import shape_from_config
from finetuner.planning import scans
from finetuner.planning import speed as sp

CALIBRATION = Path(__file__).with_name("speed_cpu.json")


def _default(model_type: str):
    from transformers import AutoConfig

    return shape_from_config(AutoConfig.for_model(model_type).to_dict(), name=model_type)


@pytest.fixture(scope="module")
def mamba2():
    return _default("mamba2")


@pytest.fixture(scope="module")
def qwen35():
    return _default("qwen3_5_text")


@pytest.fixture(scope="module")
def cpu_speed() -> sp.DeviceSpeed:
    return sp.DeviceSpeed.from_dict(json.loads(CALIBRATION.read_text()))


def _s(seq: int) -> Settings:
    return Settings(method="lora", micro_batch=1, seq_len=seq, lora_r=16, platform="cpu", compute_dtype="fp32")


def test_a_hybrids_linear_attention_layers_get_no_softmax_term_and_their_delta_rule_is_counted(qwen35):
    """transformers' default Qwen3.5 (32 layers, 24 of them Gated DeltaNet): softmax attention in 8 layers only, the
    delta rule's per-token FLOPs in the 24 others, over whole chunks of 64; its linears are decoder matmuls."""
    m = mixers.mixers(qwen35)
    assert (mixers.attention_layers(qwen35), m.delta_layers) == (8, 24)
    assert (m.delta_heads, m.delta_dk, m.delta_dv) == (32, 128, 128)  # its config's linear_num_value_heads, widths
    linear = [lin for lin in qwen35.layer_linears() if lin.name.startswith("linear_attn.")]
    assert len(linear) == 5 and all(qwen35.copies(lin) == 24 for lin in linear)  # in_proj_qkv/z/a/b, out_proj
    assert qwen35.active_weight_numel >= sum(lin.in_features * lin.out_features * 24 for lin in linear)  # matmuls
    f = sp.forward_flops(qwen35, _s(2048))
    assert f["attention"] == 4 * 2048 * qwen35.q_dim * 8 * 2048
    per_token = 32 * (64 * (5 * 128 + 3 * 128) + 6 * 128 * 128)
    conv = 2 * 4 * (2 * 16 * 128 + 32 * 128)  # kernel 4 over q, k and v's channels, T + 3 outputs (padded both sides)
    assert f["scan"] == 24 * (per_token * 2048 + conv * (2048 + 3))
    # a sequence shorter than a chunk is padded to one chunk (the conv to its T + 3 outputs only)
    assert sp.forward_flops(qwen35, _s(10))["scan"] == 24 * (per_token * 64 + conv * 13)


def test_a_pure_mamba_step_grows_as_t_not_t_squared(mamba2, cpu_speed):
    """Doubling the tokens doubles a Mamba-2 step's FLOPs but for the states passed between chunks (an einsum over
    every pair of chunks: ``2 (c + 1)² H P N`` a layer), and its predicted time ~2x: within the share of the parts
    that do not grow with T (operations, optimizer, fixed, the trace's constant) and of the between-chunk term."""
    m = mixers.mixers(mamba2)
    assert mixers.attention_layers(mamba2) == 0 and m.mamba2_layers == 64
    T, L, H, P, N = 4096, m.mamba2_chunk, m.mamba2_heads, m.mamba2_head_dim, m.mamba2_state
    f1, f2 = sp.forward_flops(mamba2, _s(T)), sp.forward_flops(mamba2, _s(2 * T))
    c = T // L
    between = lambda chunks: 64 * 2 * (chunks + 1) ** 2 * H * P * N  # noqa: E731
    conv_tail = 64 * 2 * m.conv_kernel * H * P * (m.conv_kernel - 1)  # the conv's K - 1 padded outputs a sequence
    assert f2["scan"] - 2 * f1["scan"] == between(2 * c) - 2 * between(c) - conv_tail  # all else exactly linear
    assert f1["attention"] == f2["attention"] == 0
    t1, t2 = sp.step_time(mamba2, _s(T), cpu_speed), sp.step_time(mamba2, _s(2 * T), cpu_speed)
    flat = sum(t1.parts[k] for k in ("operations", "optimizer", "fixed")) / t1.step_s
    quad = between(2 * c) / (sum(f2.values()) - f2["lora"])  # the quadratic term's share of the 2T step's FLOPs
    ratio = t2.step_s / t1.step_s
    assert 2 * (1 - flat) - 0.05 <= ratio <= 2 * (1 + quad) + 0.05, (ratio, flat, quad)  # 0.05: the trace's a, rows
    assert ratio < 2.5  # softmax attention over every layer would be ~4x at these lengths


def test_the_sequential_mamba_scan_costs_operations_per_token():
    """Mamba-1's PyTorch scan is a Python loop over the tokens: its operations grow with T (a Gated DeltaNet's loop
    with the chunks), counted in the forward's operations."""
    mamba = _default("mamba")
    m = mixers.mixers(mamba)
    assert (m.mamba_inner, m.mamba_state) == (1536, 16)  # dt_proj's out, x_proj's (out - dt rank) / 2
    n1, n2 = sp.forward_op_count(mamba, _s(512)), sp.forward_op_count(mamba, _s(1024))
    assert n2 - n1 == 32 * scans.MAMBA_OPS_PER_TOKEN * 512 + sp.OPS_PER_LOSS_CHUNK * 0


def test_the_plan_says_which_path_it_times_and_which_kernels_are_missing(qwen35, mamba2):
    have = {pip: importlib.util.find_spec(mod) is not None for mod, pip in scans.KERNEL_PACKAGES.items()}
    assert scans.kernels_installed() == have
    note = scans.kernel_note(qwen35)
    assert "24 Gated DeltaNet layers are timed as transformers' PyTorch path" in note
    assert "the kernels' speed-up is not measured" in note
    for pip in ("flash-linear-attention", "causal-conv1d"):
        assert (pip in note.split("not installed")[0]) == (not have[pip])
    assert "mamba-ssm" in scans.kernel_note(mamba2) or have["mamba-ssm"]
    assert scans.kernel_note(_default("llama")) is None


@pytest.fixture(scope="module")
def tiny_mixer_plans(tmp_path_factory) -> dict:
    """A tiny Qwen3.5 and a tiny Mamba-2 (their default configs shrunk, as ``config.json`` folders) planned on an
    RTX 4090 as a user would: ``finetuner.plan(folder, "rtx4090")``, each plan's note on its mixers."""
    import finetuner
    from finetuner.model.tiny import tiny_config

    notes = {}
    for model_type in ("qwen3_5_text", "mamba2"):
        folder = tmp_path_factory.mktemp(model_type)
        (folder / "config.json").write_text(json.dumps(tiny_config(model_type, 256)))
        plan = finetuner.plan(str(folder), "rtx4090", seq_len=256, alternatives=False)
        notes[model_type] = next(n for n in plan.notes if "timed as transformers' PyTorch path" in n)
    return notes


@pytest.mark.parametrize("model_type, needed", [("qwen3_5_text", ["flash-linear-attention", "causal-conv1d"]),
                                                ("mamba2", ["mamba-ssm", "causal-conv1d"])])
def test_the_plan_names_the_kernels_extra_for_the_kernels_not_installed(tiny_mixer_plans, model_type, needed):
    """The plan of a model with such layers says it timed transformers' PyTorch path, and where the kernels its layers
    use are not installed, names them and the extra that installs them (no speed-up figure)."""
    have = scans.kernels_installed()
    note = tiny_mixer_plans[model_type]
    missing = [pip for pip in needed if not have[pip]]
    assert "layers are timed as transformers' PyTorch path" in note and "the kernels' speed-up is not measured" in note
    assert ("pip install 'finetuner[kernels]'" in note) == bool(missing)
    if missing:
        assert f"{', '.join(missing)} not installed here, so a run takes that path" in note
    assert "%" not in note and "x faster" not in note


def test_the_console_prints_the_extras_name_as_written(tmp_path):
    """``finetuner plan`` prints the planner's texts as they are: rich would take ``[kernels]`` for markup and
    drop it (it printed ``pip install 'finetuner'``)."""
    from finetuner.model.tiny import tiny_config
    from tests.conftest import cli_in_process

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3_5_text", 256)))
    out = cli_in_process("plan", "--model", str(tmp_path), "--gpu", "rtx4090", "--seq-len", "256")
    text = " ".join(out.stdout.split())
    assert "timed as transformers' PyTorch path" in text
    assert ("pip install 'finetuner[kernels]'" in text) == (not all(scans.kernels_installed().values()))
    assert "pip install 'finetuner'" not in text


def test_with_every_kernel_installed_the_note_says_their_kernels_run_untimed(qwen35, monkeypatch):
    monkeypatch.setattr(scans, "kernels_installed", lambda: dict.fromkeys(scans.KERNEL_PACKAGES.values(), True))
    note = scans.kernel_note(qwen35)
    assert "are installed, so a run on a GPU takes their kernels, which this estimate does not time" in note
    assert "finetuner[kernels]" not in note


def test_the_kernels_extra_installs_the_three_packages_only_on_linux_x86_64():
    """pyproject.toml's ``kernels`` extra holds the packages the plan names (their PyPI names), each with a marker
    that is true on Linux x86_64 only (they build CUDA code), and none of them is in the ``test`` extra."""
    import platform
    import tomllib

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    extra = Requirement(scans.KERNELS_EXTRA)
    assert extra.name == project["name"] and extra.extras == {"kernels"}
    reqs = [Requirement(r) for r in project["optional-dependencies"]["kernels"]]
    assert sorted(r.name for r in reqs) == sorted(scans.KERNEL_PACKAGES.values())
    here = default_environment()
    places = {("Linux", "x86_64"): True, ("Linux", "aarch64"): False, ("Darwin", "arm64"): False,
              ("Darwin", "x86_64"): False, ("Windows", "AMD64"): False}
    for r in reqs:
        assert r.marker is not None and r.specifier, r
        for (system, machine), expected in places.items():
            assert r.marker.evaluate({**here, "platform_system": system, "platform_machine": machine}) is expected, r
        assert r.marker.evaluate() is (platform.system() == "Linux" and platform.machine() == "x86_64")
    tested = {Requirement(r).name for r in project["optional-dependencies"]["test"]}
    assert not tested & {r.name for r in reqs}


# ---------------------------------------------------------------------- the element-wise term, against a trace
def _elementwise_bytes(fn, skip: frozenset = frozenset()) -> int:
    """Bytes every operation that is neither a matmul nor a view (nor in ``skip``) takes and returns while ``fn``
    runs (a forward and its backward): the count :func:`finetuner.planning.scans.scan_bytes` writes out, done here on
    a dispatch trace."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
                aten.linalg_solve_triangular.default}

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func not in matmuls and func not in skip:
                Count.total += sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                                   if isinstance(t, torch.Tensor))
            return out

    with Count():
        fn()
    return Count.total


def _delta_rule_bytes(chunks: int, heads: int, dk: int, dv: int) -> int:
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    T = chunks * scans.DELTA_CHUNK
    q, k = (torch.randn(1, T, heads, dk, requires_grad=True) for _ in range(2))
    v = torch.randn(1, T, heads, dv, requires_grad=True)
    g, beta = -torch.rand(1, T, heads, requires_grad=True), torch.rand(1, T, heads, requires_grad=True)
    return _elementwise_bytes(lambda: torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
                              .sum().backward())


def test_the_delta_rules_elementwise_bytes_are_the_traced_count_and_grow_as_t_squared():
    """The Gated DeltaNet's formula at 2 heads of widths 16 and 8 equals the traced count of transformers' PyTorch
    path between 2 and 3 chunks and between 3 and 5 (the differences cancel the count's constant: the bool mask and
    the initial state, which do not grow with T), and its backward makes the growth quadratic."""
    cfg = dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=64, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
               linear_key_head_dim=16, linear_value_head_dim=8, num_hidden_layers=2, vocab_size=64,
               layer_types=["linear_attention", "full_attention"])
    from transformers import AutoConfig

    shape = shape_from_config(AutoConfig.for_model(**cfg).to_dict(), name="tiny")
    assert mixers.mixers(shape).delta_layers == 1
    formula = {c: scans.scan_bytes(shape, 1, c * scans.DELTA_CHUNK) for c in (2, 3, 5)}
    traced = {c: _delta_rule_bytes(c, 2, 16, 8) for c in (2, 3, 5)}
    assert formula[3] - formula[2] == traced[3] - traced[2]
    assert formula[5] - formula[3] == traced[5] - traced[3]
    assert traced[5] - traced[3] > 2 * (traced[3] - traced[2])  # super-linear: the c² term




def _delta_rule_fills(chunks: int, heads: int, dk: int, dv: int) -> int:
    """Bytes of the zero tensors the delta rule's backward makes for its chunks' slices (``select_backward``'s
    outputs), on a dispatch trace."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    class Fills(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.select_backward.default:
                Fills.total += out.numel() * out.element_size()
            return out

    T = chunks * scans.DELTA_CHUNK
    q, k = (torch.randn(1, T, heads, dk, requires_grad=True) for _ in range(2))
    v = torch.randn(1, T, heads, dv, requires_grad=True)
    g, beta = -torch.rand(1, T, heads, requires_grad=True), torch.rand(1, T, heads, requires_grad=True)
    with Fills():
        torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].sum().backward()
    return Fills.total


@pytest.mark.parametrize("dk, dv", [(16, 8), (8, 16)])
def test_the_delta_rules_zero_fills_are_the_traced_quadratic_term(dk, dv):
    """``scan_fill_bytes``' ``4 c² (C² + C (3 dk + dv) + 1)`` a head is the quadratic term of the traced
    ``select_backward`` outputs: their second difference over 2, 3 and 4 chunks equals the formula's (the
    trace's linear remainder, a slice's own size, cancels)."""
    from transformers import AutoConfig

    cfg = dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=64, num_attention_heads=2,
               num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
               linear_key_head_dim=dk, linear_value_head_dim=dv, num_hidden_layers=2, vocab_size=64,
               layer_types=["linear_attention", "full_attention"])
    shape = shape_from_config(AutoConfig.for_model(**cfg).to_dict(), name="tiny")
    formula = {c: scans.scan_fill_bytes(shape, 1, c * scans.DELTA_CHUNK) for c in (2, 3, 4)}
    traced = {c: _delta_rule_fills(c, 2, dk, dv) for c in (2, 3, 4)}
    assert formula[4] - 2 * formula[3] + formula[2] == traced[4] - 2 * traced[3] + traced[2]
    assert formula[2] == 4 * 2 * 4 * (64 * 64 + 64 * (3 * dk + dv) + 1)  # 2 heads, c² = 4
    assert formula[2] < scans.scan_bytes(shape, 1, 2 * scans.DELTA_CHUNK)  # a share of the element-wise bytes


def test_the_zero_fills_are_timed_at_the_fresh_memory_rate(qwen35, cpu_speed):
    """transformers' default Qwen3.5 at 2,048 tokens: the fills leave the memory-bound term and are timed at
    ``fresh_bytes_per_s``; without that rate (a GPU, an older calibration) at the bandwidth, the step unchanged."""
    from dataclasses import replace

    s = _s(2048)
    fills = scans.scan_fill_bytes(qwen35, 1, 2048)
    assert fills == 4 * 24 * 32 * 32 ** 2 * (64 * 64 + 64 * (3 * 128 + 128) + 1)
    assert sp.memory_bytes(qwen35, s)["scans"] == scans.scan_bytes(qwen35, 1, 2048) - fills
    bw, util = cpu_speed.bandwidth_bytes_per_s, cpu_speed.utilisation(2048)
    plain = sp.step_time(qwen35, s, cpu_speed)
    assert plain.parts["fresh memory"] == pytest.approx(fills / bw / util, rel=1e-12)
    slow = sp.step_time(qwen35, s, replace(cpu_speed, fresh_bytes_per_s=bw / 10))
    assert slow.parts["fresh memory"] == pytest.approx(10 * plain.parts["fresh memory"], rel=1e-12)
    assert slow.step_s - plain.step_s == pytest.approx(9 * fills / bw / util, rel=1e-9)


# ---------------------------------------------------------------------- LFM2's short convolution
def _lfm2_short_conv(channels: int, kernel: int):
    from transformers import AutoConfig
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    cfg = AutoConfig.for_model("lfm2", hidden_size=channels, conv_L_cache=kernel, num_hidden_layers=2,
                               layer_types=["conv", "full_attention"], intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=1, vocab_size=64)
    return cfg, Lfm2ShortConv(cfg, 0)


@pytest.mark.parametrize("channels, kernel", [(16, 3), (24, 4)])
def test_lfm2s_short_convolution_is_timed_as_its_conv_and_elementwise_work_on_a_trace(channels, kernel):
    """A tiny LFM2 (one conv layer, one attention layer) run forward and backward over 1 to 3 rows of 5 and 9 tokens:
    the speed model's convolution FLOPs are ``torch.utils.flop_counter``'s count of the layer's ``aten.convolution``
    (its padded ``T + K - 1`` outputs), and its element-wise bytes the dispatch trace's count (the linears, their
    reshapes and the convolution left out), exactly; neither is counted for a plain attention layer."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cfg, layer = _lfm2_short_conv(channels, kernel)
    shape = shape_from_config(cfg.to_dict(), name="tiny-lfm2")
    m = mixers.mixers(shape)
    assert (m.conv_layers, m.conv_channels, m.conv_kernel) == (1, channels, kernel)
    aten = torch.ops.aten
    for rows, seq in ((1, 5), (2, 5), (2, 9), (3, 9)):
        x = torch.randn(rows, seq, channels, requires_grad=True)
        with FlopCounterMode(display=False) as flops:
            out = layer(x)
        assert scans.scan_flops(shape, rows, seq) == flops.get_flop_counts()["Global"][aten.convolution] > 0
        grad = torch.randn_like(out)
        x = torch.randn(rows, seq, channels, requires_grad=True)
        layer.zero_grad(set_to_none=True)  # a first gradient, not an accumulation
        skip = {aten.convolution.default, aten.convolution_backward.default, aten._unsafe_view.default}
        traced = _elementwise_bytes(lambda: layer(x).backward(grad), skip=skip)  # the linears' reshapes: views
        assert scans.scan_bytes(shape, rows, seq, dtype_bytes=4) == traced, (rows, seq)
    llama = _default("llama")
    assert scans.scan_flops(llama, 2, 9) == scans.scan_bytes(llama, 2, 9) == 0


# ---------------------------------------------------------------------- Mamba-2's chunked and Mamba-1's sequential scan
def _mamba2_scan_bytes(rows: int, heads: int, head_dim: int, state: int, groups: int, chunk: int, seq: int) -> int:
    import torch
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    x = torch.randn(rows, seq, heads, head_dim, requires_grad=True)
    dt, A = torch.randn(rows, seq, heads, requires_grad=True), -torch.rand(heads, requires_grad=True)
    B, C = (torch.randn(rows, seq, groups, state, requires_grad=True) for _ in range(2))
    D, bias = torch.randn(heads, requires_grad=True), torch.randn(heads, requires_grad=True)
    return _elementwise_bytes(lambda: mamba2_chunk_scan(x, dt, A, B, C, chunk_size=chunk, D=D, dt_bias=bias,
                                                        dt_softplus=True).sum().backward(),
                              skip=frozenset({torch.ops.aten._unsafe_view.default}))


def _mamba2_shape(heads: int, head_dim: int, state: int, groups: int, chunk: int):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("mamba2", hidden_size=heads * head_dim // 2, num_heads=heads, head_dim=head_dim,
                               state_size=state, n_groups=groups, chunk_size=chunk, num_hidden_layers=1, vocab_size=64)
    return shape_from_config(cfg.to_dict(), name="tiny-mamba2")


@pytest.mark.parametrize("rows, heads, head_dim, state, groups, chunk, seq",
                         [(1, 4, 3, 2, 1, 4, 12), (1, 4, 2, 3, 2, 3, 6), (2, 6, 5, 4, 1, 5, 20),
                          (2, 4, 2, 3, 2, 3, 6), (3, 4, 2, 3, 2, 3, 6), (2, 4, 2, 3, 4, 3, 6)])
def test_mamba2s_elementwise_bytes_are_the_traced_count(rows, heads, head_dim, state, groups, chunk, seq):
    """``scan_bytes`` of a Mamba-2 layer equals the dispatch trace's count of transformers' ``mamba2_chunk_scan``
    forward and backward (fp32; matmuls, views and ``_unsafe_view`` left out): exactly with one sequence; with more,
    within ``10 c H P N`` elements (its einsums' copies follow the strides)."""
    shape = _mamba2_shape(heads, head_dim, state, groups, chunk)
    m = mixers.mixers(shape)
    assert (m.mamba2_layers, m.mamba2_heads, m.mamba2_head_dim, m.mamba2_state, m.mamba2_groups, m.mamba2_chunk) == \
        (1, heads, head_dim, state, groups, chunk)
    traced = _mamba2_scan_bytes(rows, heads, head_dim, state, groups, chunk, seq)
    slack = 0 if rows == 1 else 4 * 10 * scans.chunks(seq, chunk) * heads * head_dim * state
    assert abs(scans.scan_bytes(shape, rows, seq) - traced) <= slack
    assert slack < traced / 10
    assert scans.scan_fill_bytes(shape, rows, seq) == 0


def _mamba_scan_bytes(rows: int, inner: int, state: int, seq: int) -> int:
    import torch
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    x, dt, z = (torch.randn(rows, inner, seq, requires_grad=True) for _ in range(3))
    A = -torch.rand(inner, state, requires_grad=True)
    B, C = (torch.randn(rows, state, seq, requires_grad=True) for _ in range(2))
    D, bias = torch.randn(inner, requires_grad=True), torch.randn(inner, requires_grad=True)
    return _elementwise_bytes(lambda: mamba_selective_scan(x, dt, A, B, C, D=D, z=z, delta_bias=bias,
                                                           delta_softplus=True).sum().backward(),
                              skip=frozenset({torch.ops.aten._unsafe_view.default}))


@pytest.mark.parametrize("rows, inner, state, seq", [(1, 6, 3, 5), (2, 4, 5, 7), (3, 8, 2, 4)])
def test_mamba1s_elementwise_bytes_are_the_traced_count_and_grow_as_t_squared(rows, inner, state, seq):
    """``scan_bytes`` of a Mamba-1 layer equals the dispatch trace's count of transformers' sequential
    ``mamba_selective_scan`` forward and backward, exactly: its loop's backward gives every token's slice a gradient
    of the whole sequence's size, ``T²``."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("mamba", hidden_size=inner // 2, intermediate_size=inner, state_size=state,
                               num_hidden_layers=1, vocab_size=64, time_step_rank=2)
    shape = shape_from_config(cfg.to_dict(), name="tiny-mamba")
    m = mixers.mixers(shape)
    assert (m.mamba_layers, m.mamba_inner, m.mamba_state) == (1, inner, state)
    assert scans.scan_bytes(shape, rows, seq) == _mamba_scan_bytes(rows, inner, state, seq)
    quad = 4 * rows * seq * seq * state * (8 * inner + 4)
    assert scans.scan_bytes(shape, rows, 2 * seq) - 2 * scans.scan_bytes(shape, rows, seq) > quad  # 4 T² - 2 T²


def test_the_scans_matmul_width_is_their_state_not_the_convolutions_kernel(mamba2, qwen35):
    """Mamba-2's state (128) and the delta rule's key width (128) set the scans' matmul rate; the depthwise
    convolution's kernel (4) is no matmul."""
    assert mixers.mixers(mamba2).conv_kernel == 4
    assert scans.scan_width(mamba2) == mixers.mixers(mamba2).mamba2_state == 128
    assert scans.scan_width(qwen35) == 128
    assert scans.scan_width(_default("mamba")) == 16
    assert scans.scan_width(_default("llama")) == 1

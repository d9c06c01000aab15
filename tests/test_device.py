"""finetuner.device: the one module that asks torch about CUDA, and what it answers on this machine.

CUDA's answers (names, counters, per-device generators) need a GPU and are exercised by the training tests
on one; here: the platform table, the choices made from it (backend, scaler, autocast), the CPU's answers,
and that no other module of finetuner or ui names CUDA itself."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetuner import device
from finetuner.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def test_only_the_device_module_names_cuda():
    """``torch.cuda`` and the string ``"cuda"`` appear in finetuner/device.py alone (scripts/ may use torch directly)."""
    pattern = re.compile(r'torch\.cuda|"cuda"')
    found = [f"{p.relative_to(REPO)}:{i}" for pkg in ("finetuner", "ui") for p in sorted((REPO / pkg).rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found and all(f.startswith("finetuner/device.py:") for f in found), [
        f for f in found if not f.startswith("finetuner/device.py:")]


def test_the_platform_table():
    """One row per platform: its process-group backend and what the memory model adds outside torch's counters."""
    cuda, cpu = device.PLATFORMS[device.CUDA], device.PLATFORMS[device.CPU]
    assert (cuda.backend, cpu.backend) == ("nccl", "gloo")
    assert (cuda.context_bytes, cuda.workspace_bytes) == (640 * 2**20, 64 * 2**20)
    assert (cpu.context_bytes, cpu.workspace_bytes) == (0, 0)
    assert device.platform_of("cuda:1") is cuda and device.platform_of("cpu") is cpu
    assert device.backend("cuda:0") == "nccl" and device.backend("cpu") == "gloo"
    assert device.reduce_device("gloo") is None  # gloo reduces CPU tensors
    from finetuner.memory import model

    assert (model.CUDA_CONTEXT_BYTES, model.CUBLAS_WORKSPACE_BYTES) == (cuda.context_bytes, cuda.workspace_bytes)


def test_scaler_only_for_fp16_on_cuda():
    import warnings

    import torch

    assert device.grad_scaler("cpu", "fp16") is None and device.grad_scaler("cuda", "bf16") is None
    with warnings.catch_warnings():  # without a GPU torch warns that the scaler is disabled
        warnings.simplefilter("ignore", UserWarning)
        assert isinstance(device.grad_scaler("cuda", "fp16"), torch.amp.GradScaler)


def test_autocast_on_the_cpu():
    import torch

    with device.autocast("cpu", torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with device.autocast("cpu", None):  # fp32: no autocast
        assert not torch.is_autocast_enabled("cpu")


def test_resolve_and_rng_on_this_machine():
    """``auto`` takes CUDA where torch sees it; CUDA asked for where there is none is a one-line error. The
    per-device generators are None without CUDA and restoring None changes nothing."""
    import torch

    assert device.resolve("cpu") == device.CPU
    if device.available():
        assert device.resolve("auto") == device.resolve("cuda") == device.CUDA and device.rng_state() is not None
        return
    assert device.resolve("auto") == device.CPU
    with pytest.raises(UserError, match="no CUDA GPU is visible"):
        device.resolve("cuda")
    assert device.rng_state() is None and device.device_rng_state(torch.device("cpu")) is None
    torch.manual_seed(3)
    want = torch.rand(1)
    torch.manual_seed(3)
    device.set_rng_state(None)
    with device.fork_rng(torch.device("cpu")):  # draws inside leave the generator as it was
        torch.rand(4)
    assert torch.equal(torch.rand(1), want)


def test_importing_it_does_not_import_torch():
    """A plan, an estimate and the recipe checks import it without loading torch."""
    code = ("import sys, finetuner.device, finetuner.config.runtime, finetuner.config.hardware, finetuner.memory.model; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False"

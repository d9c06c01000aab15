"""Measure this machine's device for the speed model (``finetuner gpus --calibrate``).

A few seconds of micro-benchmarks, the same code on a CPU and on a CUDA GPU, give a
:class:`~finetuner.planning.speed.DeviceSpeed`:

* **the wait for the threads** (a CPU with several torch threads, :func:`parallel_op_seconds`): what an
  operation large enough to spread over the threads pays at its end, beyond its work; a scheduler's time
  slice when other processes keep the cores busy;
* **matmul rate** per compute dtype (fp32 on a CPU; bf16 or fp16, and fp32, on a GPU) and per
  width: ``[tokens x width] @ [width x width]`` products timed over widths from 16 to 1,024 (CPU)
  or 8,192 (GPU), so a model's narrow layers (and LoRA's rank-``r`` products) get the rate they
  reach, not the large-matrix peak: each product's median time less the narrowest one's, which every
  product pays whatever its size (:func:`matmul_rates`: the speed model charges it per operation);
* **memory bandwidth**: a copy of a 128 MiB (CPU) / 1 GiB (GPU) tensor, bytes read + written per second;
* **per-operation cost**: a chain of tiny multiplications with autograd recording, forward and
  backward, divided by the operations launched: what an eager training step pays per tensor
  operation whatever its size;
* **dequantization** (when bitsandbytes imports): ``dequantize_4bit`` of an nf4 weight, weights
  per second; else the data-sheet default of :mod:`finetuner.planning.speed`;
* **what a run waits for besides its steps** (:mod:`finetuner.planning.wait`): the seconds a new Python
  process takes to import the libraries a run loads (:data:`STARTUP_IMPORTS`), the disk's write rate
  (a 64 MiB file written and ``fsync``-ed), its read rate (that file read back after
  ``posix_fadvise(DONTNEED)`` dropped it from the page cache, where the platform has it) and the seconds
  to write and ``fsync`` one small file, in the cache folder.

The result is cached as JSON under ``$FINETUNER_CACHE_DIR/speed`` (else ``~/.cache/finetuner/speed``),
keyed by the device's name, the torch and finetuner versions and this module's source (:func:`method_key`): a new
library, card or way of measuring measures again. ``FINETUNER_SPEED_FILE`` names a calibration file to use instead (tests make plans
deterministic with it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform as _platform
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import finetuner.device as devices
import finetuner.phases as phases
from finetuner.device import CPU, CUDA
from finetuner.planning.load import load_now, stale_under_load
from finetuner.planning.speed import DeviceSpeed

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.hardware import GpuProfile

#: Environment variable naming a calibration file (a ``DeviceSpeed`` as JSON) to use for this machine.
SPEED_FILE_ENV = "FINETUNER_SPEED_FILE"
CPU_WIDTHS = (16, 32, 64, 128, 256, 512, 1024)
GPU_WIDTHS = (16, 64, 256, 1024, 4096, 8192)
#: Seconds each measurement is repeated for (at least), after one warm-up call.
MEASURE_S = 0.1
#: Repeats each measurement takes at least (its median is the result).
MIN_REPEATS = 5
#: The tensor :func:`parallel_op_seconds` times operations on: a micro-batch's activations
#: (1,024 tokens x 128 wide), 4x torch's grain, so it spreads over the threads.
PARALLEL_PROBE_SHAPE = (1024, 128)
#: Operations in the chain :func:`parallel_op_seconds` times.
PARALLEL_PROBE_OPS = 8
#: The libraries ``finetuner run`` imports between its start and its first step (the model, the
#: tokenizer, LoRA, the data pipeline): their import in a new process is the run's start-up.
STARTUP_IMPORTS = ("torch", "transformers", "peft", "datasets")
#: Bytes of the tensor :func:`fresh_memory_rate` zero-fills: above glibc's largest block it keeps for reuse
#: (``M_MMAP_THRESHOLD``'s 32 MiB ceiling), so each one is mapped fresh.
FRESH_PROBE_BYTES = 128 * 2**20
#: Bytes of the file the disk rates are measured with.
DISK_PROBE_BYTES = 64 * 2**20


def device_key() -> tuple[str, str]:
    """This machine's device as (platform, name): the CUDA device 0, else the CPU model and the torch threads a
    run here uses (:func:`finetuner.threads.ensure`: chosen now for the machine's load when this process has not
    chosen them), so each thread count has its own calibration and a plan predicts with the threads it runs with."""
    import torch

    from finetuner.threads import ensure

    if devices.available():
        return CUDA, devices.name(0)
    ensure()
    model = _platform.processor() or _platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:  # pragma: no cover - not Linux
        pass
    return CPU, f"{model}, {torch.get_num_threads()} threads"


def method_key() -> str:
    """Eight hex digits of this module's source: the way the calibration measures and reads its timings. A
    calibration made by another version of it (an older :func:`matmul_rates` read a scheduler's slice at width 16
    as 24 MFLOP/s, and a plan on a calibration it made predicted 1,086 s a step for a 15 s one) is not reused."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]


def cache_file(name: str) -> Path:
    """Where the calibration of device ``name`` is kept, for these library versions and this way of measuring
    (:func:`method_key`)."""
    import torch

    from finetuner.cachedir import cache_folder
    from finetuner.version import __version__

    slug = re.sub(r"[^a-z0-9]+", "-", f"{name} torch-{torch.__version__} finetuner-{__version__}".lower()).strip("-")
    return cache_folder("speed") / f"{slug}-method-{method_key()}.json"


def _timed(fn, sync) -> float:
    """Seconds per call of ``fn``: one warm-up, then repeated for at least ``MEASURE_S`` and
    ``MIN_REPEATS`` times; the median of the repeats (what a stream of such calls pays on average under
    the load of the moment; the best one is a fluke when other processes share the cores). By the wall clock (after synchronising a GPU), except on a CPU with one torch
    thread: there this process's CPU time, which is what the call takes on an idle core and stays
    steady while other processes share the machine (the wall clock then counts them too). With
    several threads CPU time says nothing of the wall time (threads wait for cores, or spin)."""
    clock = time.process_time if _cpu_clock(sync is _no_sync) else time.perf_counter
    fn()
    sync()
    times: list[float] = []
    while sum(times) < MEASURE_S or len(times) < MIN_REPEATS:
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return sorted(times)[len(times) // 2]


def place(this_device: bool = True) -> dict[str, Any]:
    """Where this machine's calibration lives, as ``finetuner gpus`` says it: ``folder`` (under
    :func:`finetuner.fileio.cache_root`, the one cache folder of the CLI, ``scripts/demo.sh``, the web UI and the
    Python API), with ``this_device`` also ``file`` (this device's, for these versions: imports torch) and
    ``cached`` (whether it is there), and ``speed_file``: ``$FINETUNER_SPEED_FILE`` when set (used instead)."""
    from finetuner.fileio import cache_root

    out: dict[str, Any] = {"folder": str(cache_root() / "speed"), "speed_file": os.environ.get(SPEED_FILE_ENV) or None}
    if this_device:
        path = cache_file(device_key()[1])
        out.update(file=str(path), cached=_read_cached(path) is not None)
    return out


def _cpu_clock(on_cpu: bool) -> bool:
    """Whether :func:`_timed` times by this process's CPU time: on a CPU with one torch thread."""
    import torch

    return on_cpu and torch.get_num_threads() == 1


def _no_sync() -> None:
    """Nothing to wait for on the CPU."""


def measure() -> DeviceSpeed:
    """Calibrate this machine's device (half a minute on 2 CPU cores), shown as the ``calibrate`` phase (the time a
    calibration made before took, if any, its prediction). Imports torch."""
    with phases.phase("calibrate", predicted_s=_last_measured_s()):
        return _measure()


def _last_measured_s() -> float | None:
    """How long a calibration of this device took before (the longest its cache files say), None when none did."""
    name = device_key()[1]
    from finetuner.cachedir import EntryRejected, read_json_entry

    times = []
    for f in cache_file(name).parent.glob("*.json"):
        try:
            d = read_json_entry(f, f.name)
        except (OSError, EntryRejected):
            continue
        took = (d.get("details") or {}).get("measured_in_s") if isinstance(d, dict) and d.get("name") == name else None
        if isinstance(took, (int, float)):
            times.append(float(took))
    return max(times) if times else None


def _measure() -> DeviceSpeed:
    import torch

    plat, name = device_key()
    dev = torch.device(plat)
    sync = devices.synchronize if plat == CUDA else _no_sync
    t_start = time.perf_counter()
    if plat == CUDA:
        half = devices.half_precision()
        dtypes, widths, tokens = (half, "fp32"), GPU_WIDTHS, 8192
    else:
        dtypes, widths, tokens = ("fp32",), CPU_WIDTHS, 1024
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    chain = 200
    p = torch.ones(8, device=dev, requires_grad=True)

    def ops() -> None:
        y = p
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    op_s = _timed(ops, sync) / (2 * chain + 2)
    matmul: dict[str, tuple[tuple[int, float], ...]] = {}
    with torch.no_grad():
        n = (1 << 30 if plat == CUDA else 1 << 27) // 4
        x = torch.empty(n, device=dev, dtype=torch.float32).fill_(1.0)
        y = torch.empty_like(x)
        bandwidth = 2 * 4 * n / _timed(lambda: y.copy_(x), sync)
        del x, y
        par_s = parallel_op_seconds(torch.ones(PARALLEL_PROBE_SHAPE), op_s, bandwidth) if plat == CPU else 0.0
        fresh = fresh_memory_rate() if plat == CPU else 0.0
        for dt in dtypes:
            timings = []
            for w in widths:
                a = torch.randn(tokens, w, device=dev, dtype=torch_dtype[dt])
                b = torch.randn(w, w, device=dev, dtype=torch_dtype[dt])
                timings.append((w, _timed(lambda: a @ b, sync)))
            matmul[dt] = matmul_rates(tokens, timings)
    kernels = _kernel_rates(dev, sync, devices.half_precision() if plat == CUDA else "fp32")
    dequant, how = _dequant_rate(dev, sync)
    disk = _disk_rates()
    startup = _startup_seconds()
    details = {"measured_in_s": round(time.perf_counter() - t_start, 2), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "dequantization": how}
    # the load it was made under and its clock (finetuner.planning.load: a plan says when the machine is busier now)
    load, cores = load_now()
    details.update(load_average=round(load, 2), cores=cores, timed_by="cpu time" if _cpu_clock(plat == CPU) else "wall clock")
    from finetuner.version import __version__

    details["finetuner"] = __version__
    link = 25e9 if plat == CUDA else 1e12
    src = (f"calibrated on this machine ({name}, {time.strftime('%Y-%m-%d')}): matmul "
           + ", ".join(f"{dt} {max(r for _, r in rows) / 1e9:,.0f} GFLOP/s" for dt, rows in matmul.items())
           + f", {bandwidth / 1e9:,.1f} GB/s" + (f" ({fresh / 1e9:,.1f} GB/s into fresh memory)" if fresh else "")
           + f", {op_s * 1e6:.1f} us an operation")
    src += f", start-up {startup:.1f} s" if startup else ""
    src += (f", attention {max(r for _, r in kernels['attention_causal']) / 1e9:,.0f}/"
            f"{max(r for _, r in kernels['attention_masked']) / 1e9:,.0f} GFLOP/s (causal/masked), "
            f"cross-entropy {max(r for _, r in kernels['cross_entropy']) / 1e6:,.0f}M and dropout {kernels['dropout'] / 1e6:,.0f}M elements/s")
    src += f", {par_s * 1e3:.2f} ms an operation's wait for {torch.get_num_threads()} threads" if par_s else ""
    return DeviceSpeed(name, plat, matmul, bandwidth, op_s, dequant, link, link, src, calibrated=True, details=details,
                       parallel_op_s=par_s, fresh_bytes_per_s=fresh,
                       attention_flops={"causal": kernels["attention_causal"], "masked": kernels["attention_masked"]},
                       cross_entropy_elements_per_s=kernels["cross_entropy"], dropout_elements_per_s=kernels["dropout"],
                       matmul_tokens=tokens, startup_s=startup, **disk)


def parallel_op_seconds(x, op_s: float, bandwidth: float) -> float:
    """Seconds an operation over ``x`` (``[1,024 x 128]``, enough to spread over the CPU's threads; a chain of
    :data:`PARALLEL_PROBE_OPS` as a layer launches them, a single repeated one lets the threads keep spinning) costs beyond the bare operation ``op_s`` and its bytes (read and written at ``bandwidth``):
    the wait for every thread at its end, which each of a micro-batch's operations pays
    (:func:`finetuner.planning.speed.op_seconds`). 0 with one thread (nothing to wait for). Under load
    this is a scheduler's time slice: on 2 busy cores (load 9) 20-60 ms an operation, against 8-15 us with
    one thread (docs/benchmarks.md)."""
    import torch

    if torch.get_num_threads() <= 1:
        return 0.0
    w = torch.ones(x.shape[-1], x.shape[-1]) / x.shape[-1]

    def layer() -> None:  # a chain like a layer's: elementwise operations and a product over the tokens
        y = x * 1.0001
        for _ in range(PARALLEL_PROBE_OPS - 2):
            y = y + x
        y @ w

    sec = _timed(layer, _no_sync) / PARALLEL_PROBE_OPS
    return max(0.0, sec - op_s - 3 * x.element_size() * x.numel() / bandwidth)


def fresh_memory_rate() -> float:
    """Bytes per second a CPU writes zeros into a tensor just allocated (``torch.zeros`` of
    ``FRESH_PROBE_BYTES``: the first touch of each page, which the system zeroes and maps):
    :attr:`finetuner.planning.speed.DeviceSpeed.fresh_bytes_per_s`, the delta rule's backward's zero-fills."""
    import torch

    n = FRESH_PROBE_BYTES // 4
    return 4 * n / _timed(lambda: torch.zeros(n), _no_sync)


def matmul_rates(tokens: int, timings: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """The ``(width, FLOP/s)`` table of :attr:`DeviceSpeed.matmul_flops` from the median seconds each
    ``[tokens x w] @ [w x w]`` product took: its FLOPs over its seconds less the narrowest product's
    (whose work is negligible: 2 x 1,024 x 16 x 16 FLOPs, about 10 us at the 59 GFLOP/s one thread of the
    development CPU reaches there), which is what any product pays whatever its size (the wait for the
    threads, charged per operation by :func:`finetuner.planning.speed.op_seconds`, not per FLOP). A
    product whose work is less than half its seconds gets the best rate measured with the fixed part
    included instead (a lower bound of the peak that noise cannot inflate): under load the fixed part
    varies by more than a narrow product's work, so their difference is noise. Without this, a narrow product that waits a time slice reads as
    a few MFLOP/s, and every LoRA product of rank ``r`` is charged as if it ran that slowly per FLOP."""
    flops = {w: 2.0 * tokens * w * w for w, _ in timings}
    fixed = min(sec for _, sec in timings)
    peak = max(flops[w] / sec for w, sec in timings)
    return tuple((w, flops[w] / (sec - fixed) if sec >= 2 * fixed else peak) for w, sec in timings)


def _startup_seconds() -> float:
    """Wall seconds a new Python process (this interpreter) takes to import :data:`STARTUP_IMPORTS`
    (0.0 when it fails: the wait model's default then applies)."""
    import subprocess
    import sys

    t0 = time.perf_counter()
    try:
        subprocess.run([sys.executable, "-c", "import " + ", ".join(STARTUP_IMPORTS)], check=True, timeout=300,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return 0.0
    return time.perf_counter() - t0


def _disk_rates() -> dict[str, float]:
    """The cache folder's disk: ``disk_write_bytes_per_s`` (:data:`DISK_PROBE_BYTES` written and
    ``fsync``-ed), ``disk_read_bytes_per_s`` (read back after ``posix_fadvise(DONTNEED)``; 0.0 where the
    platform cannot drop a file from the page cache: a read from memory would say nothing of the disk)
    and ``file_sync_s`` (a small file written and ``fsync``-ed: what each file of a checkpoint costs
    beyond its bytes). Empty when the folder cannot be written."""
    import tempfile

    from finetuner.cachedir import cache_folder

    block = os.urandom(1 << 20)
    try:
        root = cache_folder("speed")
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            big = Path(tmp) / "probe.bin"
            t0 = time.perf_counter()
            with open(big, "wb") as f:
                for _ in range(DISK_PROBE_BYTES // len(block)):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            out = {"disk_write_bytes_per_s": DISK_PROBE_BYTES / (time.perf_counter() - t0)}
            if hasattr(os, "posix_fadvise"):
                with open(big, "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    t0 = time.perf_counter()
                    while f.read(1 << 20):
                        pass
                    out["disk_read_bytes_per_s"] = DISK_PROBE_BYTES / (time.perf_counter() - t0)
            syncs = []
            for i in range(5):
                t0 = time.perf_counter()
                with open(Path(tmp) / f"small-{i}", "wb") as f:
                    f.write(block[:4096])
                    f.flush()
                    os.fsync(f.fileno())
                syncs.append(time.perf_counter() - t0)
            out["file_sync_s"] = sorted(syncs)[len(syncs) // 2]
            return out
    except OSError:
        return {}


def _kernel_rates(dev, sync, dtype_name: str) -> dict[str, float]:
    """The kernels a step spends time in beyond matmuls, forward and backward as training runs them:
    ``scaled_dot_product_attention`` with the causal flag and with an explicit mask (full-square
    FLOPs per second, ``4 seq^2 head_dim`` per head forward, twice that backward), the
    cross-entropy over logits and dropout (elements per second)."""
    import torch
    import torch.nn.functional as F

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    heads, hd = (16, 128) if dev.type == CUDA else (4, 32)
    seqs = (512, 2048, 8192) if dev.type == CUDA else (128, 512, 1024)

    def attention(masked: bool) -> tuple[tuple[int, float], ...]:
        rows = []
        for seq in seqs:
            q = torch.randn(1, heads, seq, hd, device=dev, dtype=dt, requires_grad=True)
            mask = torch.ones(seq, seq, device=dev, dtype=torch.bool).tril()

            def run() -> None:
                if masked:
                    out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
                else:
                    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
                out.sum().backward()
                q.grad = None

            rows.append((seq, 3 * 4 * heads * seq * seq * hd / _timed(run, sync)))  # forward + backward (2x), full square
        return tuple(rows)

    rows = 4096 if dev.type == CUDA else 512

    def ce_rate(vocab: int) -> float:
        base = torch.randn(rows, vocab, device=dev, dtype=torch.float32)
        target = torch.randint(0, vocab, (rows,), device=dev)

        def ce() -> None:  # fresh logits each call, as a step's head produces them (allocation included)
            logits = base.clone().requires_grad_()
            F.cross_entropy(logits, target, reduction="sum").backward()

        return rows * vocab / _timed(ce, sync)

    x = torch.randn(rows, 4096 if dev.type == CUDA else 512, device=dev, dtype=dt)
    return {
        "attention_causal": attention(False),
        "attention_masked": attention(True),
        "cross_entropy": tuple((v, ce_rate(v)) for v in ((32000, 128256) if dev.type == CUDA else (1000, 8000, 50000))),
        "dropout": x.numel() / _timed(lambda: F.dropout(x, 0.05, training=True), sync),
    }


def _dequant_rate(dev, sync) -> tuple[float, str]:
    """Weights per second ``bitsandbytes.functional.dequantize_4bit`` turns into the compute dtype,
    and how it was found (measured, or the data-sheet default when bitsandbytes is missing)."""
    import torch

    from finetuner.planning.speed import DEQUANT_WEIGHTS_PER_S_PER_GBS

    try:
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import bitsandbytes.functional as bnbf
        side = 4096 if dev.type == CUDA else 1024
        dtype = torch.bfloat16 if dev.type == CUDA else torch.float32
        w = torch.randn(side, side, device=dev, dtype=dtype)
        q, state = bnbf.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
        sec = _timed(lambda: bnbf.dequantize_4bit(q, state), sync)
        return side * side / sec, "measured (bitsandbytes dequantize_4bit, nf4, double quant)"
    except Exception as e:  # noqa: BLE001 - any failure: the default, said so
        return DEQUANT_WEIGHTS_PER_S_PER_GBS * 1000, f"default (bitsandbytes not usable here: {type(e).__name__})"


def load(path: str | Path) -> DeviceSpeed:
    """A calibration written by :func:`save` (or by hand, as JSON)."""
    from finetuner.errors import UserError

    from finetuner.cachedir import ENTRY_FORMAT, EntryRejected, check_json_entry

    try:
        raw = Path(path).read_bytes()
        head = raw.partition(b"\n")[0]
        if ENTRY_FORMAT.encode() in head:  # a cache file (save): its header checked, its body read
            header = json.loads(head)
            return DeviceSpeed.from_dict(check_json_entry(raw, header.get("key") if isinstance(header, dict) else ""))
        return DeviceSpeed.from_dict(json.loads(raw.decode("utf-8")))
    except (OSError, ValueError, TypeError, KeyError, EntryRejected) as e:
        raise UserError(f"{path}: not a speed calibration ({e}).",
                        hint="Write one with `finetuner gpus --calibrate`, or unset " + SPEED_FILE_ENV + ".") from None


def save(speed: DeviceSpeed, path: Path) -> Path:
    """Write ``speed`` as the cache file ``path`` (:func:`cache_file`): a JSON entry keyed by its name, mode 0600
    (:func:`finetuner.cachedir.write_json_entry`)."""
    from finetuner.cachedir import write_json_entry

    write_json_entry(path, path.name, speed.to_dict())
    return path


def _read_cached(path: Path) -> DeviceSpeed | None:
    """The calibration in the cache file ``path`` once it passes its checks (its header's key is its name and its
    SHA-256 matches: :func:`finetuner.cachedir.read_json_entry`; not a link), else None: a planted or edited file
    is said and measured again, never used."""
    from finetuner.cachedir import EntryRejected, read_json_entry

    try:
        return DeviceSpeed.from_dict(read_json_entry(path, path.name))
    except FileNotFoundError:
        return None
    except (EntryRejected, OSError, ValueError, TypeError, KeyError) as e:
        log.warning("The speed calibration %s is not used (%s): it is measured again.", path, e)
        return None


def cached(measure_if_missing: bool = False) -> DeviceSpeed | None:
    """This machine's calibration: ``$FINETUNER_SPEED_FILE``, else the cached one for this device and
    these versions, else (``measure_if_missing``) a fresh measurement, cached; else None. A cached one made under a
    load the machine no longer has (:func:`finetuner.planning.load.stale_under_load`) is measured again when
    ``measure_if_missing``. Imports torch (except with ``$FINETUNER_SPEED_FILE``)."""
    if os.environ.get(SPEED_FILE_ENV):
        return load(os.environ[SPEED_FILE_ENV])
    _, name = device_key()
    try:
        path = cache_file(name)
    except OSError:  # no cache folder can be made: measured each time (when asked), not kept
        path = None
    found = _read_cached(path) if path is not None else None  # a broken, planted or edited cache file is measured again
    if found is not None and not (measure_if_missing and stale_under_load(found, *load_now())):
        return found
    if not measure_if_missing:
        return None
    speed = measure()
    if path is not None:
        try:
            save(speed, path)
        except OSError as e:
            log.warning("Could not keep the speed calibration in %s (%s): it is measured again next time.", path, e)
    return speed


def speed_for(gpu: GpuProfile, calibrate: bool | None = None) -> DeviceSpeed:
    """The speed figures a plan uses for ``gpu``: this machine's calibration when ``gpu`` is this
    machine's device (the CPU profile, or a detected card), measured on first use for the CPU
    (``calibrate`` None: a few seconds, then cached) or when ``calibrate`` is True; else the card's
    data sheet (:meth:`DeviceSpeed.from_profile`)."""
    if os.environ.get(SPEED_FILE_ENV) and (gpu.platform == CPU or gpu.detected):
        return load(os.environ[SPEED_FILE_ENV])
    if gpu.platform == CPU or gpu.detected:
        want = calibrate if calibrate is not None else gpu.platform == CPU
        found = cached(measure_if_missing=bool(want))
        if found is not None and found.platform == gpu.platform:
            return found
    return DeviceSpeed.from_profile(gpu)


def describe(speed: DeviceSpeed) -> dict[str, Any]:
    """A short summary for ``finetuner gpus --calibrate``."""
    return {"device": speed.name, "source": speed.source,
            "matmul_gflops": {dt: {w: round(r / 1e9, 1) for w, r in rows} for dt, rows in speed.matmul_flops.items()},
            "bandwidth_gbs": round(speed.bandwidth_bytes_per_s / 1e9, 2), "op_overhead_us": round(speed.op_overhead_s * 1e6, 2),
            "parallel_op_ms": round(speed.parallel_op_s * 1e3, 3),
            "dequant_gweights_per_s": round(speed.dequant_weights_per_s / 1e9, 3),
            "attention_gflops": {k: {q: round(r / 1e9, 1) for q, r in rows} for k, rows in speed.attention_flops.items()},
            "cross_entropy_m_elements_per_s": {v: round(r / 1e6, 1) for v, r in speed.cross_entropy_elements_per_s},
            "dropout_m_elements_per_s": round(speed.dropout_elements_per_s / 1e6, 1),
            "startup_s": round(speed.startup_s, 2), "disk_read_mb_per_s": round(speed.disk_read_bytes_per_s / 1e6, 1),
            "disk_write_mb_per_s": round(speed.disk_write_bytes_per_s / 1e6, 1),
            "file_sync_ms": round(speed.file_sync_s * 1e3, 2), **speed.details}

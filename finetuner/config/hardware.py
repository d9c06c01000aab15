"""GPU profiles: how much memory a card has, whether it does bf16, and how fast it is.

A card is named by a profile (``rtx4090``), by a plain size (``24GB``, ``24``, ``80GiB``), ``cpu``
for this machine's memory, or ``auto`` for the device torch sees (imported only then), else the CPU. ``memory_bytes`` is what
torch reports as the device's total memory (:func:`finetuner.device.total_memory`), a little less than the marketing
size (the driver keeps a few hundred MiB). The CUDA context, cuBLAS and the caching allocator's
slack come on top of the tensors: the memory model counts those, not this table.

Speed figures are the dense (no sparsity) tensor-core rates with fp32 accumulation from the
vendors' data sheets, and the memory bandwidth: the speed model (:mod:`finetuner.planning.speed`)
uses them, at documented efficiencies, for a card that has no calibration of its own
(``finetuner gpus --calibrate`` measures the device of this machine).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace

import finetuner.device as dev
from finetuner.errors import UserError, did_you_mean
from finetuner.units import GiB, gib_text, in_gib

GB = 1000**3


@dataclass(frozen=True)
class GpuProfile:
    """One accelerator as the planner sees it."""

    name: str
    description: str
    memory_bytes: int
    bf16: bool = True
    tflops: float = 100.0  # dense bf16 (or fp16 where there is no bf16) tensor TFLOP/s, fp32 accumulate
    fp8_tflops: float | None = None  # dense fp8 tensor TFLOP/s, fp32 accumulate; None on a card without fp8
    bandwidth_gbs: float = 900.0  # device memory bandwidth, GB/s
    pcie_gbs: float = 16.0  # host <-> device, GB/s (PCIe 4.0 x16 ~ 25 in practice; keep it modest)
    link_gbs: float = 16.0  # device <-> device for collectives, GB/s: PCIe unless NVLink (data-center cards)
    detected: bool = False
    #: the profile whose speed figures a card of a bare size (``--gpu 12GB``) takes (:func:`from_size`); None for a named card
    speed_of: str | None = None
    platform: str = dev.CUDA  # a platform of finetuner.device.PLATFORMS: "cpu" for :func:`cpu_profile`
    #: The software a plan for this card assumes: whether Liger Kernel (``finetuner[speed]``) and
    #: FlashAttention-2 can run there. None (the default): whether they are installed in this
    #: Python environment, the one the run is launched from. Set them (``dataclasses.replace``)
    #: for a plan that does not depend on what is installed here, as the README's table does.
    liger: bool | None = None
    flash_attention: bool | None = None

    @property
    def memory_gib(self) -> float:
        return in_gib(self.memory_bytes)

    def with_default_install(self) -> GpuProfile:
        """This card as a default ``pip install finetuner`` uses it: no Liger Kernel, no
        FlashAttention-2 (SDPA and finetuner's chunked loss), whatever is installed here. The
        README's fit table and the shipped GPU recipes are planned for it."""
        return replace(self, liger=False, flash_attention=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory_gib"] = round(self.memory_gib, 2)
        return d


def _gib(x: float) -> int:
    return int(x * GiB)


#: Named cards. memory_bytes ≈ torch's total_memory for the card (GiB, not GB): a card sold as 12 GB reports 11.76
#: GiB, 16 GB 15.70, 24 GB 23.65 (what rtx3060, rtx4080 and rtx4090 report; a newer card of that size is given the
#: same). ``tflops``: dense bf16 (fp16 on T4 and V100) tensor TFLOP/s with fp32 accumulation; ``fp8_tflops``: dense
#: fp8 with fp32 accumulation, on the cards that have fp8 (Ada, Hopper, Blackwell); ``bandwidth_gbs``: memory GB/s.
#: Sources, by card (the vendors' sheets; "sparse" figures halved to dense):
#: - GeForce RTX 40 series: NVIDIA's product pages give "AI TOPS", the fp8 sparse rate with fp16 accumulation; the
#:   NVIDIA Ada GPU architecture whitepaper (Appendix A: RTX 4090 1321.2 fp8 sparse, 330.3 fp8 and 165.2 fp16 with
#:   fp32 accumulation, dense; RTX 4080 779.8, 194.9, 97.5) shows fp8 with fp32 accumulation at AI TOPS / 4 and bf16
#:   at AI TOPS / 8 on GeForce Ada: 4060 Ti 16 GB 353, 4070 466, 4070 Super 568, 4070 Ti Super 706, 4080 780,
#:   4080 Super 836, 4090 1321 AI TOPS; bandwidth 288, 504, 504, 672, 716.8, 736, 1008 GB/s (the same pages).
#: - GeForce RTX 50 series: "AI TOPS" is the fp4 sparse rate (NVIDIA's CES 2025 specifications: 5090 3352, 5080
#:   1801, 5070 Ti 1406, 5070 988; 5060 Ti 759); the NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090: 209.5
#:   bf16 and 419 fp8 with fp32 accumulation, dense) gives bf16 at AI TOPS / 16 and fp8 at AI TOPS / 8; bandwidth
#:   1792, 960, 896, 672, 448 GB/s.
#: - GeForce RTX 30 series (no fp8): the NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090 71, RTX 3080 59.5
#:   TFLOP/s fp16 with fp32 accumulation; 936 and 760 GB/s); RTX 3080 12 GB: 70 SMs at its 1.71 GHz boost clock
#:   (its product page) x 512 FLOP a clock an SM as on every GA10x GeForce, 61.3, and 912 GB/s; RTX 3060: 25.6, 360.
#: - Data center and workstation: NVIDIA's data sheets: T4 65 fp16, 320 GB/s; V100 125 fp16, 900 GB/s; RTX A6000 155
#:   bf16 (309.7 sparse), 768 GB/s; A10G (AWS g5) as AWS describes it, 70, 600 GB/s;
#:   L4 121 bf16 / 242.5 fp8 (242 / 485 sparse), 300 GB/s; L40S 362 / 733 (733 / 1466 sparse), 864 GB/s; A100 312
#:   bf16, 1555 GB/s (40 GB) and 2039 GB/s (80 GB SXM); H100 SXM 989 / 1979 (1979 / 3958 sparse), 3350 GB/s; H200
#:   989 / 1979, 4800 GB/s, 141 GB.
_G12, _G16 = _gib(11.76), _gib(15.70)
PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in [
        GpuProfile("t4", "NVIDIA T4 16 GB (Turing, no bf16)", _gib(14.58), bf16=False, tflops=65, bandwidth_gbs=320, pcie_gbs=12),
        GpuProfile("v100-16gb", "NVIDIA V100 16 GB (Volta, no bf16)", _gib(15.77), bf16=False, tflops=125, bandwidth_gbs=900),
        GpuProfile("v100-32gb", "NVIDIA V100 32 GB (Volta, no bf16)", _gib(31.74), bf16=False, tflops=125, bandwidth_gbs=900),
        GpuProfile("rtx3060", "GeForce RTX 3060 12 GB", _G12, tflops=25.6, bandwidth_gbs=360),
        GpuProfile("rtx3080-10gb", "GeForce RTX 3080 10 GB", _gib(9.77), tflops=59.5, bandwidth_gbs=760),
        GpuProfile("rtx3080-12gb", "GeForce RTX 3080 12 GB", _G12, tflops=61.3, bandwidth_gbs=912),
        GpuProfile("rtx3090", "GeForce RTX 3090 24 GB", _gib(23.69), tflops=71, bandwidth_gbs=936),
        GpuProfile("rtx4060ti-16gb", "GeForce RTX 4060 Ti 16 GB", _G16, tflops=44.1, fp8_tflops=88.3, bandwidth_gbs=288),
        GpuProfile("rtx4070", "GeForce RTX 4070 12 GB", _G12, tflops=58.3, fp8_tflops=116.5, bandwidth_gbs=504),
        GpuProfile("rtx4070-super", "GeForce RTX 4070 Super 12 GB", _G12, tflops=71, fp8_tflops=142, bandwidth_gbs=504),
        GpuProfile("rtx4070ti-super", "GeForce RTX 4070 Ti Super 16 GB", _G16, tflops=88.3, fp8_tflops=176.5, bandwidth_gbs=672),
        GpuProfile("rtx4080", "GeForce RTX 4080 16 GB", _G16, tflops=97.5, fp8_tflops=194.9, bandwidth_gbs=717),
        GpuProfile("rtx4080-super", "GeForce RTX 4080 Super 16 GB", _G16, tflops=104.5, fp8_tflops=209, bandwidth_gbs=736),
        GpuProfile("rtx4090", "GeForce RTX 4090 24 GB", _gib(23.65), tflops=165, fp8_tflops=330.3, bandwidth_gbs=1008),
        GpuProfile("rtx5060ti-16gb", "GeForce RTX 5060 Ti 16 GB", _G16, tflops=47.4, fp8_tflops=94.9, bandwidth_gbs=448, pcie_gbs=25),
        GpuProfile("rtx5070", "GeForce RTX 5070 12 GB", _G12, tflops=61.8, fp8_tflops=123.5, bandwidth_gbs=672, pcie_gbs=25),
        GpuProfile("rtx5070ti", "GeForce RTX 5070 Ti 16 GB", _G16, tflops=87.9, fp8_tflops=175.8, bandwidth_gbs=896, pcie_gbs=25),
        GpuProfile("rtx5080", "GeForce RTX 5080 16 GB", _G16, tflops=112.6, fp8_tflops=225.1, bandwidth_gbs=960, pcie_gbs=25),
        GpuProfile("rtx5090", "GeForce RTX 5090 32 GB", _gib(31.36), tflops=209, fp8_tflops=419, bandwidth_gbs=1792, pcie_gbs=25),
        GpuProfile("rtx-a6000", "NVIDIA RTX A6000 48 GB", _gib(47.54), tflops=155, bandwidth_gbs=768),
        GpuProfile("a10g", "NVIDIA A10G 24 GB (AWS g5)", _gib(22.06), tflops=70, bandwidth_gbs=600),
        GpuProfile("l4", "NVIDIA L4 24 GB", _gib(22.06), tflops=121, fp8_tflops=242.5, bandwidth_gbs=300),
        GpuProfile("l40s", "NVIDIA L40S 48 GB", _gib(44.52), tflops=362, fp8_tflops=733, bandwidth_gbs=864),
        GpuProfile("a100-40gb", "NVIDIA A100 40 GB", _gib(39.39), tflops=312, bandwidth_gbs=1555, pcie_gbs=25, link_gbs=240),
        GpuProfile("a100-80gb", "NVIDIA A100 80 GB", _gib(79.15), tflops=312, bandwidth_gbs=2039, pcie_gbs=25, link_gbs=240),
        GpuProfile("h100-80gb", "NVIDIA H100 80 GB (SXM)", _gib(79.19), tflops=989, fp8_tflops=1979, bandwidth_gbs=3350, pcie_gbs=50,
                   link_gbs=360),
        GpuProfile("h200", "NVIDIA H200 141 GB", _gib(139.8), tflops=989, fp8_tflops=1979, bandwidth_gbs=4800, pcie_gbs=50, link_gbs=360),
    ]
}

ALIASES = {
    "3090": "rtx3090", "4090": "rtx4090", "4080": "rtx4080", "5090": "rtx5090", "3060": "rtx3060",
    "rtx3080": "rtx3080-10gb", "rtx4060ti": "rtx4060ti-16gb", "rtx5060ti": "rtx5060ti-16gb",
    "a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "h100": "h100-80gb", "a10": "a10g",
    "a6000": "rtx-a6000", "v100": "v100-32gb",
}

#: the card a bare size (``--gpu 12GB``) is timed as: the common card of each size people name (a size between two
#: of them takes the nearer one, the smaller on a tie); the plan says which
REPRESENTATIVE = {10: "rtx3080-10gb", 12: "rtx4070", 16: "rtx4080", 24: "rtx4090", 32: "rtx5090", 40: "a100-40gb", 48: "l40s",
                  80: "h100-80gb", 141: "h200"}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|g)?\s*$", re.IGNORECASE)


def _normalise(name: str) -> str:
    n = name.strip().lower().replace("_", "-").replace(" ", "")
    n = n.removeprefix("nvidia-").removeprefix("geforce-")
    return re.sub(r"^rtx-(\d{4})", r"rtx\1", n)


def list_profiles() -> list[GpuProfile]:
    return sorted(PROFILES.values(), key=lambda p: (p.memory_bytes, p.name))


def _compact(name: str) -> str:
    """A card's name with only its letters and digits, lower case: ``RTX 4070 Ti Super`` → ``rtx4070tisuper``."""
    return re.sub(r"[^a-z0-9]", "", _normalise(name))


def _by_compact(text: str) -> GpuProfile | None:
    """The profile ``text`` names however it is spaced or dashed (``rtx-4070-super``, ``4070 Ti Super``, ``RTX4070TI_SUPER``)."""
    names = {**{_compact(k): k for k in PROFILES}, **{_compact(a): k for a, k in ALIASES.items()}}
    c = _compact(text)
    key = names.get(c) or names.get("rtx" + c)
    return PROFILES[key] if key else None


def representative(gib: float) -> GpuProfile:
    """The card a bare size of ``gib`` GiB is timed as (:data:`REPRESENTATIVE`)."""
    size = min(REPRESENTATIVE, key=lambda g: (abs(g - gib), g))
    return PROFILES[REPRESENTATIVE[size]]


def from_size(text: str) -> GpuProfile | None:
    """``24GB``/``24G``/``24`` → a card of that size (GB here means GiB, as nvidia-smi shows), bf16-capable, timed
    as the representative card of the nearest size (:func:`representative`), which its description names."""
    m = _SIZE.match(text)
    if not m:
        return None
    gib = float(m.group(1))
    if gib <= 0:
        raise UserError(f"--gpu {text}: the memory size must be positive.")
    # A card sold as N GB reports a little less (24 GB → 23.6 GiB); a size is taken as given.
    like = representative(gib)
    return replace(like, name=f"{gib:g}GB", memory_bytes=_gib(gib), bf16=True, speed_of=like.name,
                   description=f"a card of {gib:g} GiB, timed as the {like.description} ({like.tflops:g} bf16 TFLOP/s, "
                               f"{like.bandwidth_gbs:g} GB/s; give --gpu the card's name for its own speed)")


def detect() -> GpuProfile | None:
    """The CUDA device torch sees (device 0), or None. Imports torch."""
    try:
        if not dev.available():
            return None
    except ImportError:  # pragma: no cover
        return None
    card, total = dev.name(0), dev.total_memory(0)
    known = profile_for_device_name(card, total)
    # a card no profile names is timed as the representative card of its memory, which the speed source names
    size = representative(in_gib(total))
    base = known or replace(size, name=dev.CUDA, speed_of=size.name)
    from finetuner.model import kernels

    # what runs on this card with what is installed here: the one answer the planner (Device.of) and
    # the trainer (Device.here) both read
    ampere = dev.capability(0)[0] >= 8
    import importlib.util

    return replace(
        base,
        name=base.name,
        description=f"{card} (detected, device 0)",
        memory_bytes=total,
        bf16=dev.bf16_supported(),
        detected=True,
        flash_attention=ampere and importlib.util.find_spec("flash_attn") is not None,
        liger=kernels.liger_installed() and kernels.liger_importable(),
    )


def run_profile(device: str = "auto") -> GpuProfile:
    """The device a run of a recipe with ``device`` (``auto``, ``cpu`` or ``cuda``) trains on, as a
    profile: the detected CUDA card unless the recipe says ``cpu``, else the CPU. The planner's
    ``auto`` resolution, ``finetuner estimate`` and the trainer's predictions all take it from here."""
    return (detect() if device != "cpu" else None) or cpu_profile()


def machine_memory_bytes() -> int:
    """This machine's RAM (physical pages x page size; 16 GiB where the system does not say)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 16 * GiB


def parse_memory_size(text: str, what: str = "--cpu-memory") -> int:
    """``64GB``/``64G``/``64GiB``/``64`` → bytes (GB means GiB here, as for ``--gpu 24GB``)."""
    m = _SIZE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"{what} {text}: give a positive size such as 64GB (GiB).", hint=f"e.g. {what} 64GB")
    return _gib(float(m.group(1)))


def cpu_profile() -> GpuProfile:
    """The CPU as a device: 80 % of the machine's RAM, fp32 (bf16 matmuls are slow on most CPUs)."""
    total = machine_memory_bytes()
    return GpuProfile(dev.CPU, f"CPU ({gib_text(total, 0)} RAM)", int(total * 0.8), bf16=False, tflops=1.0,
                      bandwidth_gbs=20, pcie_gbs=1000, platform=dev.CPU)


def profile_for_device_name(device_name: str, total: int) -> GpuProfile | None:
    """The profile of a CUDA device name such as 'NVIDIA GeForce RTX 4070 Ti SUPER' (``total``: its memory in
    bytes, to tell sizes of one card apart; 0 takes the smallest), or None for an unknown card. The longest card
    name the device's name holds wins (``rtx4070tisuper`` over ``rtx4070``, ``l40s`` over ``l4``)."""
    n = re.sub(r"[^a-z0-9]", "", device_name.lower())
    stems = {key: re.sub(r"[^a-z0-9]", "", re.sub(r"-\d+gb$", "", key)) for key in PROFILES}
    found = [stem for stem in set(stems.values()) if stem in n]
    if not found:
        return None
    best = max(found, key=len)
    same = [PROFILES[k] for k, stem in stems.items() if stem == best]
    return min(same, key=lambda p: abs(p.memory_bytes - total))


def get_gpu(name: str | None) -> GpuProfile:
    """A profile from a card name, a size, ``cpu`` (this machine's RAM, :func:`cpu_profile`), or
    ``auto`` (the detected CUDA device, else the CPU)."""
    text = "" if name is None else str(name).strip().lower()
    if text in ("", "auto", "detect"):
        return detect() or cpu_profile()
    if text in ("cpu", "cpu (this machine)"):
        return cpu_profile()
    if text == dev.CUDA:
        found = detect()
        if found is None:
            raise UserError(
                "--gpu cuda: no CUDA device found on this machine.",
                hint=f"Name the card to plan for (one of {', '.join(PROFILES)}), give its memory (--gpu 24GB), or use --gpu cpu.",
            )
        return found
    key = _normalise(str(name))
    key = ALIASES.get(key, key)
    if key in PROFILES:
        return PROFILES[key]
    named = _by_compact(str(name))
    if named is not None:
        return named
    sized = from_size(str(name))
    if sized is not None:
        return sized
    raise UserError(
        f"Unknown GPU '{name}'.{did_you_mean(key, list(PROFILES) + list(ALIASES) + ['cpu', 'auto'])}",
        hint=f"Known cards: {', '.join(PROFILES)}; cpu; auto (the detected GPU, else the CPU); or give the memory size, e.g. --gpu 24GB.",
    )

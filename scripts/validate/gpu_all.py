"""Every GPU measurement the project owes, in one command, in parts of at most 10 minutes.

A GPU is lent to few sessions, for 30 minutes, one command of at most 10 minutes at a time. This
command runs what the docs and the issues wait for (issue 28), each part in fresh processes on
random-weight models of real shapes (nothing is downloaded), and writes each result as JSON in
the format the rest of the project reads:

* memory rows: ``validate_<tag>.json`` as :mod:`scripts.validate.memory` writes them (replayed by
  ``tests/memory/test_memory_accuracy.py`` and docs/memory.md's table);
* speed rows: ``speed_<device>.json`` as :mod:`scripts.bench.train` writes them (``config``,
  ``device``, ``finetuner_tokens_per_s``, ``baseline_tokens_per_s``, ``finetuner_peak_bytes``,
  ``baseline_peak_bytes``, ``mfu``; long-context rows also ``finetuner_max_seq``,
  ``baseline_max_seq``, ``predicted_max_seq``);
* the out-of-memory back-off: ``oom_backoff.json`` (:mod:`scripts.validate.oom_backoff`).

The parts (``--list`` prints them with their minutes; parts 1-3 were measured on an H200 on
2026-11-28, docs/validation/gpu_all_h200.log; the others are estimates from the arithmetic of
model size, tokens and process start-up on an H100):

1. ``memory-default-loss``: Llama-3.1-8B memory rows on the default loss path (finetuner's
   chunked cross-entropy, ``training.kernels: none``; the recorded 8B rows ran Liger's fused loss),
   the same configurations as those rows plus the planner's RTX 4090 recipe under a 24 GB cap;
2. ``oom-backoff``: a real CUDA out-of-memory error and the back-off recovering from it;
3. ``memory-savers``: the peaks with and without activation offload (LoRA, 8,192 tokens) and with
   and without the tiled MLP (QLoRA, 16,384 tokens);
4. ``speed-24gb``: finetuner against the baseline a user would write (``transformers.Trainer`` +
   peft, SDPA, gradient checkpointing, bf16, paged 8-bit AdamW for QLoRA), LoRA and QLoRA, 2,048
   tokens, micro-batch 1 x 4, the same examples, in one run, both under a 24 GiB cap
   (``torch.cuda.set_per_process_memory_fraction``);
5. ``speed-80gb``: the same comparison on the planner's recipe for an 80 GB card, capped at that
   card's memory (the whole of an H100 80GB);
6. ``longest``: the longest 8B QLoRA sequence under a 24 GiB cap, finetuner (checkpointing,
   activation offload, tiled MLP: what ``finetuner plan --longest`` picks) against the baseline,
   with the planner's prediction (:mod:`finetuner.planning.longest`) for the same settings; the
   finetuner search starts at the prediction, moves by 5 % and bisects to 2,048 tokens;
7. ``memory-dpo``: preference-objective (DPO) memory rows;
8. ``memory-fsdp``: ``distributed.strategy: fsdp`` on one process, predicted per device;
9. ``memory-families``: a mixture of experts (OLMoE-1B-7B, QLoRA with its experts in 4-bit) and Gemma 3 4B's
   language model (the vision tower frozen), LoRA and QLoRA rows of each;
10. ``memory-linear-attention``: transformers' default Qwen3.5 (Gated DeltaNet; LoRA and QLoRA) and Falcon-H1
    (Mamba-2 hybrid; LoRA) on transformers' PyTorch path (the kernels not installed), 2,048 tokens, checkpointing.

A part is one entry of :data:`PARTS`: a name, its estimated minutes, what it measures, and a
function that takes the :class:`Context` (``out``, ``work``, ``smoke``, ``cuda``; ``ctx.model()``
builds the random-weight model once) and returns the files it wrote under ``ctx.out``. A new part
(the speed model's matrix, say) is one more entry, e.g. ``Part("speed-model", 4.0, "...",
speed_model)``; its ``--smoke`` form runs in the smoke test with the others, and each part fits one device call
(``tests/test_gpu_all_smoke.py`` checks the estimates). A session's device time (15 minutes now) holds
some of the parts: run them in order, the ones no session has recorded first.

On the device (``run`` tool), from the repository root, with the packages the image lacks (and
this project's transformers and peft: the image's are older) unpacked in ``.site/`` by
``bash scripts/validate/device_site.sh`` (once, here; 30 MB, so that the tree stays under the
tool's 64 MiB), one ``run`` per group of parts that ``--list`` suggests (``carry: [".site"]``), e.g.::

    export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1; \\
      set -o pipefail; timeout 530 python3 -m scripts.validate.gpu_all --part 1,2 --out $OUT 2>&1 | tee $OUT/gpu_all.log

(a part's files are written when it ends: a call stopped at its limit returns the parts done and
the log, so give each call a ``timeout`` below the tool's)

(without ``--work`` the models, data and runs go into a private temporary folder, and without
``$FINETUNER_CACHE_DIR`` finetuner's caches too: each made by :func:`tempfile.mkdtemp`, mode 0700 under a
fresh name, never a fixed ``/tmp`` name another user could have made first, and removed when the command
ends; so each call builds its model again, about a minute). Back here, the files of each call go into docs/validation and
the tables are made again from them::

    python -m scripts.validate.gpu_all --collect /work/.device/<files_at>

``--tables`` only makes the tables again (docs/memory.md's memory table, docs/planning.md's fit table,
docs/compare.md's memory-model sentence, docs/benchmarks.md's GPU section). ``--smoke`` runs every part on the
CPU at toy size (a tiny model, sequences of 64-2,048 tokens, a few steps, an injected
out-of-memory error) into ``--out`` (never docs/validation), with the same functions; its
tables go to ``OUT/tables.md``. ``tests/test_gpu_all_smoke.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
VALIDATION = REPO / "docs" / "validation"
PRESET = "llama-3.1-8b"
#: the memory cap that stands for a 24 GB card (GiB of torch's allocator; the CUDA context comes on top)
CAP_GIB = 24.0
#: the default install's loss: finetuner's chunked cross-entropy, whatever is installed
DEFAULT_LOSS = ["training.kernels=none"]
#: a device command runs at most 10 minutes; --list packs parts into calls of at most this many
CALL_MINUTES = 9.5
GiB = 2**30


def log(*a: object) -> None:
    print(*a, flush=True)


@dataclass
class Context:
    """What every part gets: where to write, where to build, and at what size."""

    out: Path
    work: Path
    smoke: bool
    cuda: bool
    timeout: int = 1800
    preset: str = PRESET

    @property
    def model_dir(self) -> Path:
        return self.work / self.label

    @property
    def label(self) -> str:
        if not self.smoke:
            return self.preset
        return "tiny" if self.preset == PRESET else f"tiny-{self.preset}"

    def tag(self, what: str) -> str:
        return f"{'smoke' if self.smoke else self.preset}-{what}"

    def model(self) -> Path:
        from scripts.validate.train_gpu import build_model

        build_model(self.preset, self.model_dir, self.smoke)
        return self.model_dir


@dataclass(frozen=True)
class Part:
    name: str
    minutes: float  # estimated wall time on an H100 (arithmetic, not measured), the model's build included where first
    what: str
    run: Callable[[Context], list[Path]]


# --------------------------------------------------------------------------- memory rows
@dataclass(frozen=True)
class MemoryRun:
    name: str
    overrides: list[str]
    cap_gib: float | None = None
    sections: dict | None = None
    smoke: bool = False  # also run at toy size with --smoke


def _memory(ctx: Context, what: str, runs: list[MemoryRun], steps: int = 3) -> list[Path]:
    from scripts.validate.memory import measure

    chosen = [r for r in runs if r.smoke or not ctx.smoke]
    return [measure(ctx.preset, [(r.name, r.overrides, None if ctx.smoke else r.cap_gib, r.sections) for r in chosen],
                    ctx.out, ctx.work, steps, ctx.smoke, tag=ctx.tag(what), model_dir=ctx.model())]


def memory_default_loss(ctx: Context) -> list[Path]:
    """Part 1: the recorded Llama-3.1-8B configurations again, on the chunked loss."""
    from finetuner.config.hardware import get_gpu
    from scripts.validate.memory import MATRIX, planned_overrides

    names = ["lora-seq2048-gc-adamw", "qlora-seq2048-gc-mb2-paged8", "qlora-seq2048-nogc-adamw8", "lora-seq512-nogc-adamw"]
    runs = [MemoryRun(n, MATRIX[n] + DEFAULT_LOSS, smoke=i == 0) for i, n in enumerate(names)]
    card = get_gpu("rtx4090")
    runs.append(MemoryRun(f"planned-{card.name}-capped", planned_overrides(PRESET, card.name, default_install=True) + DEFAULT_LOSS,
                          card.memory_gib))
    return _memory(ctx, "default-loss", runs)


def memory_savers(ctx: Context) -> list[Path]:
    """Part 3: activation offload and the tiled MLP, each against the same run without it."""
    lora = ["method=lora", "data.max_seq_len=8192", "training.gradient_checkpointing=true", "training.optimizer=adamw_torch"]
    qlora = ["method=qlora", "data.max_seq_len=16384", "training.gradient_checkpointing=true", "training.optimizer=paged_adamw_8bit"]
    runs = [
        MemoryRun("lora-seq8192-gc-adamw", lora + ["training.offload_activations=false"] + DEFAULT_LOSS),
        # (at toy size only the tiled run: the longest part's finetuner side runs offload and tiling together)
        MemoryRun("lora-seq8192-gc-offload-adamw", lora + ["training.offload_activations=true"] + DEFAULT_LOSS),
        MemoryRun("qlora-seq16384-gc-paged8", qlora + ["training.tiled_mlp=false"] + DEFAULT_LOSS),
        MemoryRun("qlora-seq16384-gc-tiled-paged8", qlora + ["training.tiled_mlp=true"] + DEFAULT_LOSS, smoke=True),
    ]
    return _memory(ctx, "savers", runs)


def memory_dpo(ctx: Context) -> list[Path]:
    """Part 7: DPO (the reference as the base with the adapter off), every sequence full."""
    from scripts.validate.train_gpu import write_pair_data

    pairs = ctx.work / f"pairs-{'smoke' if ctx.smoke else 'gpu'}.jsonl"
    write_pair_data(pairs, 256 if ctx.smoke else 2048)
    sections = {"objective": "dpo", "data": {"path": str(pairs), "packing": False, "train_on_prompt": None}}
    runs = [
        MemoryRun("dpo-lora-seq1024-gc-adamw", ["method=lora", "data.max_seq_len=1024", "training.gradient_checkpointing=true",
                                                "training.optimizer=adamw_torch"] + DEFAULT_LOSS, sections=sections, smoke=True),
        MemoryRun("dpo-qlora-seq2048-gc-mb2-paged8", ["method=qlora", "data.max_seq_len=2048", "training.micro_batch_size=2",
                                                      "training.gradient_checkpointing=true", "training.optimizer=paged_adamw_8bit"]
                  + DEFAULT_LOSS, sections=sections),
    ]
    return _memory(ctx, "dpo", runs)


def memory_fsdp(ctx: Context) -> list[Path]:
    """Part 8: FSDP2 on one process (torchrun, one rank), predicted per device."""
    runs = [MemoryRun("fsdp1-lora-seq2048-gc-adamw", ["method=lora", "data.max_seq_len=2048", "training.gradient_checkpointing=true",
                                                      "training.optimizer=adamw_torch", "distributed.strategy=fsdp",
                                                      "distributed.num_processes=1"] + DEFAULT_LOSS, smoke=True)]
    return _memory(ctx, "fsdp", runs)


_FAMILY_COMMON = ["data.max_seq_len=2048", "training.gradient_checkpointing=true"] + DEFAULT_LOSS
#: a family's LoRA and QLoRA rows at 2,048 tokens with checkpointing (parts 9 and 10)
FAMILY_LORA = MemoryRun("lora-seq2048-gc-adamw", ["method=lora", "training.optimizer=adamw_torch"] + _FAMILY_COMMON)
FAMILY_QLORA = MemoryRun("qlora-seq2048-gc-mb2-paged8", ["method=qlora", "training.micro_batch_size=2",
                                                         "training.optimizer=paged_adamw_8bit"] + _FAMILY_COMMON, smoke=True)


def memory_families(ctx: Context) -> list[Path]:
    """Part 9: a mixture of experts (OLMoE-1B-7B: 64 experts, 8 a token) and the text of an image-text-to-text
    checkpoint (Gemma 3 4B, its vision tower loaded frozen), LoRA and QLoRA (QLoRA holds the experts in 4-bit,
    finetuner.model.experts4bit), each a row the memory model is replayed on; at toy size the families' tiny configs."""
    files = []
    for preset, what in (("olmoe-1b-7b", "moe"), ("gemma-3-4b", "gemma3")):
        files += _memory(replace(ctx, preset=preset), what, [FAMILY_LORA, FAMILY_QLORA])
    return files


def memory_linear_attention(ctx: Context) -> list[Path]:
    """Part 10: the layers whose memory the model traces on transformers' PyTorch path (issue 56): transformers'
    default Qwen3.5 (``qwen3_5_text``, 8.95B: 24 Gated DeltaNet layers and 8 attention layers), LoRA and QLoRA, and
    its default Falcon-H1 (``falcon_h1``, 8.51B: a Mamba-2 mixer beside attention in every layer), LoRA, each at 2,048
    tokens with checkpointing; rows in ``validate_<type>-<what>.json``, the config kept in the file (no preset has
    it). The PyTorch path is what they measure: a machine with flash-linear-attention, mamba-ssm or causal-conv1d
    installed (transformers would take their kernels) is refused rather than recorded under the wrong path. At toy
    size the two types' tiny configs, one row each.

    Its minutes, by arithmetic from the H200 run of part 1 (docs/validation/gpu_all_h200.log: an 8B model built
    in 32 s, each 8B run at 2,048 tokens 51 s): two builds of ~8.5-9B (0.6 min each), three runs (0.9 min each),
    and the PyTorch path's Python loops (Qwen3.5's 24 layers x 32 chunks x 16 operations, forward, recompute and
    backward: ~50k launches a step at ~20 us, ~1 s a step, 3 steps in each of its 2 runs) ~0.1 min: 4.0, with 1
    minute for what the H200 has not measured (the QLoRA quantization of a 9B hybrid, the Mamba-2 PyTorch scan)."""
    from finetuner.planning.scans import kernels_installed

    present = [k for k, have in kernels_installed().items() if have]
    if ctx.cuda and present:
        raise RuntimeError(f"{', '.join(present)} installed: transformers would take their kernels, and these rows are "
                           "for its PyTorch path; run this part where they are not installed")
    files = _memory(replace(ctx, preset="qwen3_5_text"), "linear-attention", [FAMILY_LORA, FAMILY_QLORA])
    return files + _memory(replace(ctx, preset="falcon_h1"), "mamba-hybrid", [replace(FAMILY_LORA, smoke=True)])


# --------------------------------------------------------------------------- out-of-memory back-off
def oom_backoff(ctx: Context) -> list[Path]:
    """Part 2: scripts.validate.oom_backoff (a real out-of-memory error; --smoke: an injected one)."""
    from scripts.validate import oom_backoff as oom

    rc = oom.main(["--out", str(ctx.out), "--work", str(ctx.work / "oom")] + (["--smoke"] if ctx.smoke else []))
    path = ctx.out / f"oom_backoff{'_smoke' if ctx.smoke else ''}.json"
    if rc != 0:
        raise RuntimeError(f"the back-off did not recover (exit {rc}); see {path}")
    return [path]


# --------------------------------------------------------------------------- speed
def _bench_common(ctx: Context, cap_gib: float | None, warmup: int) -> dict:
    return {"warmup": warmup, "cuda": ctx.cuda, "cap_gb": cap_gib if ctx.cuda else None, "threads": 0 if ctx.cuda else 1}


def _speed_data(ctx: Context) -> Path:
    from scripts.validate.train_gpu import write_data

    data = ctx.work / "speed-data.json"
    if not data.exists():
        write_data(data)
    return data


def _speed_path(ctx: Context) -> Path:
    from scripts.bench.train import device_slug

    return ctx.out / f"speed_{device_slug()}.json"


def _model_figures(model_dir: Path) -> tuple[int, float | None]:
    from finetuner.model.shapes import resolve_shape
    from scripts.bench.train import card_profile

    prof = card_profile()
    return resolve_shape(str(model_dir)).num_params, (prof.tflops * 1e12 if prof is not None else None)


def _speed(ctx: Context, specs: dict[str, dict], finetuner: str = "finetuner") -> list[Path]:
    from scripts.bench.train import machine, throughput, throughput_rows, write_speed_json

    n_params, peak_flops = _model_figures(ctx.model_dir)
    summary = throughput(specs, ["baseline", finetuner], 1, ctx.timeout)
    rows = throughput_rows(summary, specs, machine(), n_params, peak_flops)
    failed = [f"{c} {v}: {r['error']}" for c, row in summary.items() for v, r in row.items() if "error" in r]
    path = _speed_path(ctx)
    write_speed_json(path, rows)
    if failed:
        raise RuntimeError(f"speed runs failed: {failed}")
    return [path]


def speed_24gb(ctx: Context) -> list[Path]:
    """Part 4: LoRA and QLoRA (smoke: QLoRA, the baseline's fuller path) under the 24 GiB cap."""
    from scripts.bench.train import gpu_specs

    model, data = ctx.model(), _speed_data(ctx)
    methods = ["qlora"] if ctx.smoke else ["lora", "qlora"]
    steps, warmup = (3, 1) if ctx.smoke else (8, 2)
    specs = gpu_specs(_bench_common(ctx, CAP_GIB, warmup), model, data, ctx.label, methods, 256 if ctx.smoke else 2048, 1, 4, steps)
    return _speed(ctx, specs)


def speed_80gb(ctx: Context) -> list[Path]:
    """Part 5: the planner's recipe for an 80 GB card (2,048 tokens), both sides capped at that card's
    memory (on an H100 80GB the whole card; on an H200 the same budget): finetuner
    packs the rows when the plan does (``data.packing: auto``), the baseline pads as a plain
    script does; both count real tokens."""
    from finetuner.config.hardware import get_gpu
    from finetuner.planning.planner import plan

    model, data = ctx.model(), _speed_data(ctx)
    card = get_gpu("h100-80gb")
    c = plan(PRESET, card, seq_len=2048).recipe_choice()
    steps, warmup = (3, 1) if ctx.smoke else (4, 1)
    spec = {**_bench_common(ctx, card.memory_gib, warmup), "model": str(model), "data": str(data), "seq_len": 256 if ctx.smoke else 2048,
            "method": c["method"], "micro_batch": c["micro_batch_size"],
            "grad_accum": min(c["gradient_accumulation"], 2) if ctx.smoke else c["gradient_accumulation"], "steps": steps,
            "optimizer": c["optimizer"] if ctx.cuda else "adamw_torch", "gradient_checkpointing": c["gradient_checkpointing"],
            "offload_activations": c["offload_activations"], "precision": "bf16" if ctx.cuda else "fp32"}
    if c["method"] == "qlora" and c["quantization_bits"] != 4:
        raise RuntimeError(f"the planner chose {c['quantization_bits']}-bit QLoRA; the bench compares 4-bit only")
    return _speed(ctx, {f"{ctx.label} planned {card.name} {c['method']} seq {spec['seq_len']}": spec},
                  "finetuner_packed" if c.get("packing") else "finetuner")


def longest(ctx: Context) -> list[Path]:
    """Part 6: the longest QLoRA sequence under the cap: baseline, finetuner, prediction."""
    from scripts.bench import train as bench

    model, data = ctx.model(), _speed_data(ctx)
    # to 2,048 tokens: the goal asks the prediction within 5 % of a maximum near 90,000 tokens, and
    # each probe up there is a step of about a minute
    spec = bench.max_seq_spec(_bench_common(ctx, CAP_GIB, 0), model, data, 2048, ctx.smoke, 256 if ctx.smoke else 2048)
    if ctx.smoke:
        spec["seq_limit"] = 1024  # a few probes of a tiny model
    kind = "maxseq_finetuner_offload_tiled"
    guess = bench.predicted_for(kind, model, spec, CAP_GIB, None)
    guesses = {kind: max(spec["seq_start"], min(guess, spec["seq_limit"]) // spec["seq_step"] * spec["seq_step"])} if guess else None
    res = bench.longest(spec, ("maxseq_baseline", kind), ctx.timeout, guesses)
    log(bench.max_seq_markdown(res, ctx.label, CAP_GIB if ctx.cuda else None))
    n_params, peak_flops = _model_figures(model)
    predicted = {kind: bench.predicted_for(kind, model, spec, CAP_GIB, res[kind].get("loss_path"))}
    path = _speed_path(ctx)
    bench.write_speed_json(path, bench.max_seq_rows(res, spec, ctx.label, bench.machine(), n_params, peak_flops, predicted))
    failed = [f"{k}: {r['error']}" for k, r in res.items() if "error" in r]
    if failed:
        raise RuntimeError(f"longest-sequence runs failed: {failed}")
    return [path]


#: The parts, in the order they run. A new part is one more entry.
PARTS: list[Part] = [
    Part("memory-default-loss", 4.8, "Llama-3.1-8B memory rows on the chunked (non-Liger) loss, 5 runs, the model built", memory_default_loss),
    Part("oom-backoff", 1.8, "a real CUDA out-of-memory error and finetuner's back-off (a 1024x8 model)", oom_backoff),
    Part("memory-savers", 3.7, "activation offload and tiled-MLP peaks, each against the run without it (8B, 4 runs)", memory_savers),
    Part("speed-24gb", 4.0, "finetuner vs transformers.Trainer + peft, 8B LoRA and QLoRA, 2,048 tokens, 24 GiB cap", speed_24gb),
    Part("speed-80gb", 3.0, "finetuner vs the baseline on the planner's 80 GB recipe for 8B, 2,048 tokens", speed_80gb),
    Part("longest", 6.5, "the longest 8B QLoRA sequence under a 24 GiB cap: finetuner, baseline, prediction", longest),
    Part("memory-dpo", 1.5, "DPO memory rows (8B LoRA 1,024 and QLoRA 2x2,048 tokens)", memory_dpo),
    Part("memory-fsdp", 1.0, "fsdp on one process: a memory row predicted per device (8B LoRA)", memory_fsdp),
    Part("memory-families", 7.0, "OLMoE-1B-7B (64 experts) and Gemma 3 4B text, LoRA and QLoRA memory rows, the models built",
         memory_families),
    Part("memory-linear-attention", 5.0, "transformers' default Qwen3.5 (8.95B, LoRA and QLoRA) and Falcon-H1 (8.51B, LoRA) "
         "on the PyTorch path, 2,048 tokens, the models built", memory_linear_attention),
]


def select(spec: list[str] | None) -> list[Part]:
    """Parts by 1-based number or name, comma- or space-separated; all when ``spec`` is empty."""
    if not spec:
        return list(PARTS)
    chosen = []
    for item in (x for s in spec for x in s.split(",") if x):
        if item.isdigit() and 1 <= int(item) <= len(PARTS):
            part = PARTS[int(item) - 1]
        else:
            part = next((p for p in PARTS if p.name == item), None)
        if part is None:
            raise SystemExit(f"--part {item}: no such part; one of 1-{len(PARTS)} or {', '.join(p.name for p in PARTS)} (see --list)")
        if part not in chosen:
            chosen.append(part)
    return chosen


def calls(parts: list[Part], limit: float = CALL_MINUTES) -> list[list[int]]:
    """The parts packed, in order, into device calls of at most ``limit`` estimated minutes."""
    groups: list[list[int]] = []
    used = limit
    for p in parts:
        i = PARTS.index(p) + 1
        if used + p.minutes > limit:
            groups.append([])
            used = 0.0
        groups[-1].append(i)
        used += p.minutes
    return groups


def listing() -> str:
    lines = ["| part | name | est. minutes (H100) | what |", "|---|---|---|---|"]
    lines += [f"| {i} | {p.name} | {p.minutes:g} | {p.what} |" for i, p in enumerate(PARTS, 1)]
    total = sum(p.minutes for p in PARTS)
    lines += ["", f"Total: {total:g} minutes (estimates, not measured). Suggested device calls (at most {CALL_MINUTES:g} "
              "estimated minutes each): " + "; ".join(f"--part {','.join(map(str, g))}" for g in calls(PARTS))]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- tables
#: the other scripts' ``speed_<what>_<device>.json`` in docs/validation: the speed models' validations
#: (scripts/validate/speed_model.py, speed_grpo.py, speed_files.py), not rows of this script
OTHER_SPEED_FILES = ("speed_model_", "speed_grpo_", "speed_files_", "speed_scans_")  # the CPU benchmarks' own files


def speed_rows(folder: Path) -> list[dict]:
    """The rows of ``folder``'s ``speed_<device>.json`` files (this script's; not :data:`OTHER_SPEED_FILES`)."""
    rows = []
    for path in sorted(folder.glob("speed_*.json")):
        if not path.name.startswith(OTHER_SPEED_FILES):
            rows += json.loads(path.read_text(encoding="utf-8"))
    return rows


def _gib(b) -> str:
    return f"{b / GiB:.2f} GiB" if b else "-"


def _tps(x) -> str:
    return f"{x:,.0f}" if x else "-"


def speed_table(folder: Path) -> str:
    """docs/benchmarks.md's GPU speed and longest-sequence tables, from ``folder``'s speed_*.json."""
    rows = speed_rows(folder)
    if not rows:
        return "No GPU speed row is recorded yet (no speed_<device>.json in docs/validation).\n"
    out = []
    speed = [r for r in rows if "finetuner_max_seq" not in r]
    if speed:
        out += ["| config | device | finetuner tokens/s | baseline tokens/s | ratio | finetuner peak | baseline peak | MFU |",
                "|---|---|---|---|---|---|---|---|"]
        for r in speed:
            f, b = r["finetuner_tokens_per_s"], r["baseline_tokens_per_s"]
            ratio = f"{f / b:.2f}" if f and b else "-"
            mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "-"
            out.append(f"| {r['config']} | {r['device']} | {_tps(f)} | {_tps(b)} | {ratio} | {_gib(r['finetuner_peak_bytes'])} | "
                       f"{_gib(r['baseline_peak_bytes'])} | {mfu} |")
    long = [r for r in rows if "finetuner_max_seq" in r]
    if long:
        out += ["" if out else None, "| config | device | finetuner longest | baseline longest | predicted | predicted vs measured | "
                "finetuner tokens/s there | finetuner peak |", "|---|---|---|---|---|---|---|---|"]
        out = [x for x in out if x is not None]
        for r in long:
            f, p = r["finetuner_max_seq"], r["predicted_max_seq"]
            err = f"{100 * (p - f) / f:+.1f} %" if f and p else "-"
            out.append(f"| {r['config']} | {r['device']} | {_tps(f)} | {_tps(r['baseline_max_seq'])} | {_tps(p)} | {err} | "
                       f"{_tps(r['finetuner_tokens_per_s'])} | {_gib(r['finetuner_peak_bytes'])} |")
    return "\n".join(out) + "\n"


def oom_text(folder: Path) -> str:
    """One paragraph on the recorded out-of-memory back-off run(s) in ``folder``."""
    parts = []
    for path in sorted(folder.glob("oom_backoff*.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        lim = r.get("limited", {})
        steps = ", ".join(f"{b['old_micro_batch_size']} -> {b['micro_batch_size']}" for b in lim.get("backoffs", []))
        limit = f", limit {r['limit_bytes'] / GiB:.2f} GiB" if r.get("limit_bytes") else ""
        diff = f", largest loss difference from the unlimited run {r['max_loss_diff']:.2e}" if "max_loss_diff" in r else ""
        parts.append(f"`{path.name}` ({r['device']}, {r['mode']}{limit}): micro-batch {r['micro_batch_size']}, back-off "
                     f"{steps or 'none'}, {'recovered' if r.get('recovered') else 'NOT recovered'}{diff}.")
    return ("Out-of-memory back-off: " + " ".join(parts) + "\n") if parts else "No out-of-memory back-off run is recorded yet.\n"


def gpu_section(folder: Path) -> str:
    """What goes between docs/benchmarks.md's ``gpu-all`` markers."""
    return speed_table(folder) + "\n" + oom_text(folder)


MARKERS = {"memory": "memory-table", "fit": "fit-table", "gpu": "gpu-all"}


def _replace_between(text: str, marker: str, body: str, where: str) -> str:
    pat = re.compile(rf"(<!-- {marker}:start -->\n)(.*?)(<!-- {marker}:end -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"{where} has no <!-- {marker}:start --> ... <!-- {marker}:end --> section")
    return pat.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)


def coverage(rows: list[dict]) -> str:
    """What the measured memory rows cover, in words (docs/compare.md's memory sentence)."""
    done = [r["predicted_settings"] for r in rows if "error" not in r]
    methods = sorted({"QLoRA" if s["method"] == "qlora" else "LoRA" if s["method"] == "lora" else "full" for s in done},
                     key=["LoRA", "QLoRA", "full"].index)
    seqs = sorted({s["seq_len"] for s in done})
    gcs = {s["gradient_checkpointing"] for s in done}
    parts = [" and ".join(methods),
             (f"{seqs[0]:,} and {seqs[1]:,}" if len(seqs) == 2 else f"{seqs[0]:,} to {seqs[-1]:,}") + " tokens",
             "with and without checkpointing" if len(gcs) == 2 else "with checkpointing" if True in gcs else "without checkpointing"]
    if any(s.get("activation_offload") for s in done):
        parts.append("activation offload")
    if any(s.get("tiled_mlp") for s in done):
        parts.append("the tiled MLP")
    objectives = sorted({s.get("objective", "sft") for s in done} - {"sft"})
    if objectives:
        parts.append(" and ".join(o.upper() for o in objectives))
    strategies = sorted({r["distributed"]["strategy"] for r in rows if r.get("distributed") and "error" not in r})
    if strategies:
        parts.append(" and ".join(strategies))
    return ", ".join(parts)


def devices(rows: list[dict]) -> str:
    """The GPUs that measured ``rows``, in words: "an H100", "an H100 and an H200"."""
    from scripts.validate.memory import gpu_name

    names = sorted({gpu_name(r.get("device", "NVIDIA H100")) for r in rows if "error" not in r})
    return " and ".join(("an " if n[:1] in "AEFHILMNORSX" else "a ") + n for n in names)


def readme_sentence(text: str, rows: list[dict]) -> str:
    """docs/compare.md's sentence on the memory model's measured error, with the figures of ``rows``
    (:func:`scripts.validate.memory.replay`'s) put in: the run count, the GPUs, the allocated median and
    largest error and its side, the reserved median and its side."""
    from scripts.validate.memory import summary

    st = summary(rows)
    a, r = st["allocated"], st["reserved"]

    def side(kind: str) -> str:
        under = [x[f"error_{kind}_pct"] for x in rows if "error" not in x and x[f"error_{kind}_pct"] < 0]
        if not under:
            return "never under"
        return f"one run {abs(under[0]):.1f} % under" if len(under) == 1 else f"{len(under)} runs under"

    pat = re.compile(r"(?P<n>\d+)\s+runs of 7B-, 8B- and 13B-shaped models on\s+(?P<dev>an?\s+[^()]+?)\s+\((?P<what>[^)]*)\),\s+median\s+error\s+(?P<med>[\d.]+)\s+%"
                     r"\s+of\s+the\s+allocated\s+peak\s+\(largest\s+(?P<max>[\d.]+)\s+%,\s+(?P<aside>[^)]*)\)\s+and\s+"
                     r"(?P<rmed>[\d.]+)\s+%\s+of\s+the\s+reserved\s+peak\s+\((?P<rside>[^)]*)\)", re.S)
    m = pat.search(text)
    if not m:
        raise SystemExit("docs/compare.md no longer states the memory model's measured error in the expected words")
    values = {"n": str(st["rows"]), "dev": devices(rows), "what": coverage(rows), "med": f"{a['median_abs_pct']:.1f}", "max": f"{a['max_abs_pct']:.1f}",
              "aside": side("allocated"), "rmed": f"{r['median_abs_pct']:.1f}", "rside": side("reserved")}
    for name in sorted(values, key=lambda g: m.start(g), reverse=True):  # from the end, so earlier spans stay put
        if " ".join(m[name].split()) != values[name]:  # the same words keep their line breaks
            text = text[:m.start(name)] + values[name] + text[m.end(name):]
    return text


def regenerate() -> list[Path]:
    """Make every table that reads docs/validation again: docs/memory.md's memory table, docs/planning.md's
    fit table, docs/compare.md's memory sentence, docs/benchmarks.md's GPU section. Returns the files changed."""
    from scripts.dev.fit_table import table
    from scripts.validate.memory import replay, report

    memory_md, bench_md = REPO / "docs" / "memory.md", REPO / "docs" / "benchmarks.md"
    planning_md, compare_md = REPO / "docs" / "planning.md", REPO / "docs" / "compare.md"
    changed = []
    for path, edits in (
        (memory_md, [lambda t: _replace_between(t, MARKERS["memory"], report(VALIDATION, again=True), "docs/memory.md")]),
        (planning_md, [lambda t: _replace_between(t, MARKERS["fit"], table(), "docs/planning.md")]),
        (compare_md, [lambda t: readme_sentence(t, replay(VALIDATION))]),
        (bench_md, [lambda t: _replace_between(t, MARKERS["gpu"], gpu_section(VALIDATION), "docs/benchmarks.md")]),
    ):
        old = path.read_text(encoding="utf-8")
        new = old
        for edit in edits:
            new = edit(new)
        if new != old:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def smoke_tables(out: Path) -> Path:
    """The same tables at toy size, from ``out``'s files, into ``out/tables.md`` (docs untouched).
    The memory table shows the predictions recorded at the time (the tiny model has no preset)."""
    from scripts.validate.memory import report

    path = out / "tables.md"
    path.write_text(report(out, again=False) + "\n" + gpu_section(out), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- collecting a device call's files
def collect(src: Path, dest: Path = VALIDATION) -> list[Path]:
    """Merge a device call's result files from ``src`` into ``dest``: speed rows by (config,
    device), memory rows by config (rows that failed are left out and named), the back-off run
    replaced. Smoke files are refused."""
    from scripts.bench.train import write_speed_json

    written = []
    files = sorted(p for p in src.iterdir() if p.suffix == ".json")
    if not files:
        raise SystemExit(f"{src}: no result files (*.json) to collect")
    for p in files:
        if "smoke" in p.name:
            raise SystemExit(f"{p}: a --smoke result; only GPU results go into {dest}")
    for p in files:
        target = dest / p.name
        if p.name.startswith("speed_"):
            write_speed_json(target, json.loads(p.read_text(encoding="utf-8")))
        elif p.name.startswith("validate_"):
            doc = json.loads(p.read_text(encoding="utf-8"))
            failed = [r for r in doc["results"] if "error" in r]
            for r in failed:
                log(f"left out (failed on the device): {p.name} {r['config']}: {r['error'][-200:]!r}")
            new = {r["config"]: r for r in doc["results"] if "error" not in r}
            if not new:
                continue
            old = json.loads(target.read_text(encoding="utf-8"))["results"] if target.exists() else []
            doc["results"] = [r for r in old if r["config"] not in new] + list(new.values())
            target.write_text(json.dumps(doc, indent=2), encoding="utf-8")
        elif p.name.startswith("oom_backoff"):
            shutil.copyfile(p, target)
        else:
            continue
        written.append(target)
        log(f"collected {p.name} -> {target}")
    return written


# --------------------------------------------------------------------------- main
def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def run_parts(parts: list[Part], ctx: Context) -> list[dict]:
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    done = []
    for p in parts:
        i = PARTS.index(p) + 1
        log(f"=== part {i} {p.name} ({p.minutes:g} min estimated): {p.what}")
        t0 = time.perf_counter()
        try:
            files, error = p.run(ctx), None
        except Exception as e:  # one part's failure must not cost the others their device time
            traceback.print_exc()
            files, error = [], f"{type(e).__name__}: {e}"
        done.append({"part": i, "name": p.name, "minutes": round((time.perf_counter() - t0) / 60, 2),
                     "files": [str(f) for f in files], "error": error})
        log(f"=== part {i} {p.name}: {'FAILED ' + error if error else 'done'} in {done[-1]['minutes']:.2f} min")
    return done


def private_dirs() -> tuple[Path, Path]:
    """A private work folder and, unless ``$FINETUNER_CACHE_DIR`` names one, a private cache folder (set for the
    benches this command starts): :func:`finetuner.fileio.private_temp_dir`, mode 0700 under a fresh name
    (``mkdtemp``), removed when the command ends; never a fixed ``/tmp`` name someone else could make first."""
    import os

    from finetuner.fileio import private_temp_dir

    work = private_temp_dir("finetuner-gpu-all-")
    if not os.environ.get("FINETUNER_CACHE_DIR"):
        os.environ["FINETUNER_CACHE_DIR"] = str(private_temp_dir("finetuner-gpu-all-cache-"))
    return work, Path(os.environ["FINETUNER_CACHE_DIR"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Parts: " + ", ".join(f"{i} {p.name}" for i, p in enumerate(PARTS, 1)))
    ap.add_argument("--part", action="append", metavar="N[,N...]", help="parts by number or name (default: all); repeatable")
    ap.add_argument("--list", action="store_true", help="list the parts with their estimated minutes and exit")
    ap.add_argument("--smoke", action="store_true", help="every part on the CPU at toy size, into --out (required)")
    ap.add_argument("--out", help="folder for the result JSON (default on a GPU: docs/validation; with --smoke: required, "
                    "and never docs/validation)")
    ap.add_argument("--work", help="models, data and runs (default: OUT/../gpu_all_work with --smoke, a private temporary "
                    "folder otherwise)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per bench subprocess")
    ap.add_argument("--collect", metavar="DIR", help="merge a device call's result files from DIR into docs/validation, "
                    "then make the tables again")
    ap.add_argument("--tables", action="store_true", help="make the tables from docs/validation again and exit")
    args = ap.parse_args(argv)
    if args.list:
        print(listing(), end="")
        return 0
    if args.collect:
        collect(Path(args.collect))
        args.tables = True
    if args.tables:
        for path in regenerate():
            log(f"updated {path.relative_to(REPO)}")
        return 0
    parts = select(args.part)
    if args.smoke:
        if not args.out:
            ap.error("--smoke writes into --out (a scratch folder), never into docs/validation: give --out")
        if _inside(Path(args.out), VALIDATION):
            ap.error(f"--smoke --out {args.out}: smoke results never go into docs/validation")
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        log("No CUDA device: these parts measure a GPU. Use --smoke for the CPU check of the command.")
        return 2
    out = Path(args.out) if args.out else VALIDATION
    work = Path(args.work) if args.work else (out.parent / f"{out.name}_work" if args.smoke else private_dirs()[0])
    ctx = Context(out=out, work=work, smoke=args.smoke, cuda=cuda, timeout=args.timeout)
    done = run_parts(parts, ctx)
    if args.smoke:
        log(f"tables: {smoke_tables(out)}")
    elif _inside(out, VALIDATION):
        for path in regenerate():
            log(f"updated {path.relative_to(REPO)}")
    else:
        log(f"results in {out}: bring them here and run `python -m scripts.validate.gpu_all --collect DIR`")
    (out / f"gpu_all{'_smoke' if args.smoke else ''}_parts.json").write_text(json.dumps(done, indent=2), encoding="utf-8")
    log("\n| part | name | minutes | result |\n|---|---|---|---|")
    for d in done:
        log(f"| {d['part']} | {d['name']} | {d['minutes']:.2f} | {d['error'] or ', '.join(Path(f).name for f in d['files'])} |")
    return 1 if any(d["error"] for d in done) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Training throughput and peak memory: finetuner vs a plain ``transformers.Trainer`` + ``peft`` script.

Both sides train the same model, on the same tokenized examples (finetuner's tokenizer/template
output, so the tokens are identical), with the same LoRA (r=16, alpha 32, all linear layers, no
dropout), sequence length, micro-batch × accumulation, precision, optimizer and constant learning
rate. Each measurement is its own subprocess (a clean peak), and the variants are interleaved for
``--reps`` rounds in alternating order so that noise from other work on the machine falls on all
of them alike; the report gives medians.

Variants:
  baseline          transformers.Trainer + peft (padded micro-batches, DataCollatorForSeq2Seq;
                    QLoRA with peft's prepare_model_for_kbit_training), what a plain script does
  finetuner         finetuner's training step, same padded micro-batches (packing off)
  finetuner_packed  finetuner with ``data.packing: auto`` (packs when examples average under half
                    of the sequence length)

Throughput is real (non-padding) tokens per second over the steps after ``--warmup`` steps, timed
from the end of one optimizer step to the end of the next (data collation included). Peak memory
is ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS on CPU.

The GPU modes (``--gpu``, ``--max-seq``) also write their figures as data: a JSON list of rows in
``docs/validation/speed_<device>.json`` (``<device>`` the GPU profile's name, e.g. ``h100-80gb``;
``--json PATH`` writes elsewhere; a ``--smoke`` run or a run without CUDA writes only with
``--json``). A row of the same config and device is replaced, the others are kept. Each row:

  config                  what ran (model, method, sequence, micro-batch x accumulation, cap)
  device                  the CUDA device's name (the CPU's on a smoke run), torch version
  finetuner_tokens_per_s  real tokens per second, finetuner (median of the rounds; for long-context
                          rows one timed step at its longest sequence)
  baseline_tokens_per_s   the same for transformers.Trainer + peft (long context: at its own longest)
  finetuner_peak_bytes    torch.cuda.max_memory_allocated (peak RSS on the CPU); long context: of the
  baseline_peak_bytes     timed step at the longest sequence
  mfu                     finetuner's model FLOPs utilisation: 6 * N * finetuner_tokens_per_s / P,
                          N the model's parameter count (frozen base included), P the card's dense
                          bf16 tensor peak from finetuner's GPU profile (`finetuner gpus`: H100 SXM
                          989e12 FLOP/s); null where the card has no profile (and on the CPU). The 6
                          is the usual 2 (forward) + 4 (backward: input and weight gradients) per
                          parameter and token: LoRA's backward computes no weight gradients for the
                          frozen base, so about 2N of the 6N is counted but not done, while
                          checkpointing's recompute (another 2N), the adapters' own FLOPs and
                          attention's s^2 FLOPs (of the order of 6N per token at 50k+ tokens on 8B)
                          are done but not counted.
  finetuner_max_seq       long-context rows only (--max-seq): the longest sequence that trained
  baseline_max_seq        (within --seq-step tokens) under the cap, finetuner and baseline;
  predicted_max_seq       finetuner.planning.longest.longest_sequence for the same model and
                          settings (QLoRA 4-bit, LoRA r16 without dropout, checkpointing, the run's
                          offload, MLP (whole or tiled), optimizer and loss path) on a card of --cap-gb GiB plus the CUDA
                          context (the cap covers torch's allocator only), margin 0.

Usage:
  python -m scripts.bench.train                         # CPU, the demo model (data/demo_model)
  python -m scripts.bench.train --gpu --preset llama-3.1-8b --methods qlora,lora --cap-gb 24
  python -m scripts.bench.train --max-seq --preset llama-3.1-8b --cap-gb 24
  python -m scripts.bench.train --gpu --smoke           # the GPU code path on a tiny model (CPU ok)
  python -m scripts.bench.train --max-seq --smoke       # likewise for the longest-sequence search
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from finetuner.children import python_command

REPO = Path(__file__).resolve().parents[2]

VARIANTS = ("baseline", "finetuner", "finetuner_packed")
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def log(*a):
    print(*a, flush=True, file=sys.stderr)


# --------------------------------------------------------------------------- shared pieces
def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cap_memory(cap_gb: float | None) -> None:
    """Stand for a smaller card: the caching allocator refuses more than ``cap_gb`` GiB."""
    import torch

    if cap_gb and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * 2**30 / total))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_bytes() -> int:
    import resource

    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _recipe(spec: dict, packing) -> "Recipe":  # noqa: F821
    from finetuner.config.recipe import Recipe

    qlora = spec["method"] == "qlora"
    d = {
        "name": "bench",
        "model": {"name": spec["model"]},
        "method": spec["method"],
        "lora": LORA,
        "data": {"path": spec["data"], "max_seq_len": spec["seq_len"], "packing": packing, "cache": True},
        "training": {
            "max_steps": spec["steps"], "lr": 2e-4, "scheduler": "constant", "warmup_steps": 0,
            "micro_batch_size": spec["micro_batch"], "gradient_accumulation": spec["grad_accum"],
            "optimizer": spec["optimizer"], "gradient_checkpointing": spec["gradient_checkpointing"],
            "offload_activations": spec.get("offload_activations", False),
            "tiled_mlp": spec.get("tiled_mlp", False),
            "precision": spec["precision"], "seed": 0,
        },
        "checkpointing": {"save_every": None},
        "logging": {"tensorboard": False},
        "device": "cuda" if spec["cuda"] else "cpu",
    }
    if qlora:
        d["quantization"] = {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": spec["precision"] if spec["precision"] != "auto" else "auto"}
    return Recipe.from_dict(d)


def _tokenized(spec: dict):
    """The examples both sides train on: finetuner's tokenization (unpacked), plus the tokenizer."""
    from finetuner.data.pipeline import prepare_data
    from finetuner.model.loading import load_tokenizer

    recipe = _recipe(spec, False)
    tok = load_tokenizer(recipe)
    return prepare_data(recipe.data, tok, seed=0), tok


def _summary(step_times: list[float], step_tokens: list[int], warmup: int, extra: dict, cpu_times: list[float]) -> dict:
    t, n, c = step_times[warmup:], step_tokens[warmup:], cpu_times[warmup:]
    return {
        "tokens_per_s": sum(n) / max(sum(t), 1e-9),
        "tokens_per_cpu_s": sum(n) / max(sum(c), 1e-9),
        "step_s": statistics.median(t) if t else None,
        "tokens": sum(n),
        "steps_timed": len(t),
        "peak_bytes": _peak_bytes(),
        **extra,
    }


# --------------------------------------------------------------------------- finetuner worker
def _finetuner_trainer(spec: dict, packing):
    from finetuner.training.trainer import Trainer

    recipe = _recipe(spec, packing)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    tr = Trainer(recipe, run_dir)
    tr.setup()
    return tr


def run_finetuner(spec: dict, packing) -> dict:
    _cap_memory(spec.get("cap_gb"))
    tr = _finetuner_trainer(spec, packing)
    times, toks, losses, cpu = [], [], [], []
    _sync()
    last, last_cpu = time.perf_counter(), time.process_time()
    for step in range(spec["steps"]):
        loss, tokens, _ = tr.train_step(step)
        _sync()
        now, now_cpu = time.perf_counter(), time.process_time()
        times.append(now - last)
        cpu.append(now_cpu - last_cpu)
        toks.append(tokens)
        losses.append(loss)
        last, last_cpu = now, now_cpu
    return _summary(times, toks, spec["warmup"], cpu_times=cpu, extra={
        "loss_first": losses[0], "loss_last": losses[-1], "packed_rows": tr.data.stats.packed_rows,
        "examples": tr.data.stats.train_examples, "attention": tr.model.config._attn_implementation,
        "loss_path": tr.rt.loss_path, "kernels": tr.rt.kernels,
    })


# --------------------------------------------------------------------------- baseline worker
def _baseline_model(spec: dict, cuda: bool):
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bf16 = spec["precision"] == "bf16"
    kwargs = {"dtype": torch.bfloat16 if bf16 else torch.float32}
    if spec["method"] == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16 if bf16 else torch.float32)
        kwargs["device_map"] = {"": 0} if cuda else {"": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(spec["model"], **kwargs)
    if spec["method"] != "qlora":
        model.to("cuda" if cuda else "cpu")
    model.config.use_cache = False
    if spec["method"] == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec["gradient_checkpointing"])
    elif spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    cfg = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                     target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def _baseline_args(spec: dict, cuda: bool, out: str):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, per_device_train_batch_size=spec["micro_batch"], gradient_accumulation_steps=spec["grad_accum"],
        max_steps=spec["steps"], learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0,
        optim=spec["optimizer"], bf16=spec["precision"] == "bf16", use_cpu=not cuda, logging_steps=10**6,
        save_strategy="no", report_to=[], seed=0, dataloader_num_workers=0, remove_unused_columns=False,
        disable_tqdm=True, max_grad_norm=1.0, weight_decay=0.0,
    )


def run_baseline(spec: dict) -> dict:
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback

    cuda = spec["cuda"]
    _cap_memory(spec.get("cap_gb"))
    prepared, tok = _tokenized(spec)
    train = prepared.train
    model = _baseline_model(spec, cuda)
    seen = {"tokens": 0}

    def count_tokens(_module, _args, kwargs):  # real tokens of every training forward
        if _module.training and kwargs.get("attention_mask") is not None:
            seen["tokens"] += int(kwargs["attention_mask"].sum())

    model.register_forward_pre_hook(count_tokens, with_kwargs=True)
    times, toks, losses, cpu = [], [], [], []

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            _sync()
            self.last, self.last_cpu, self.tokens = time.perf_counter(), time.process_time(), 0

        def on_step_end(self, args, state, control, **kw):
            _sync()
            now, now_cpu = time.perf_counter(), time.process_time()
            times.append(now - self.last)
            cpu.append(now_cpu - self.last_cpu)
            toks.append(seen["tokens"] - self.tokens)
            self.last, self.last_cpu, self.tokens = now, now_cpu, seen["tokens"]

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    out = tempfile.mkdtemp(prefix="bench-hf-")
    trainer = Trainer(
        model=model, args=_baseline_args(spec, cuda, out), train_dataset=train,
        data_collator=DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100), callbacks=[Timer()],
    )
    result = trainer.train()
    return _summary(times, toks, spec["warmup"], cpu_times=cpu, extra={
        "train_loss": result.training_loss, "examples": len(train), "attention": model.config._attn_implementation,
        "loss_path": "full_logits (transformers ForCausalLMLoss)", "kernels": "none",
    })


# --------------------------------------------------------------------------- longest sequence
def _long_example(n: int, vocab: int) -> dict:
    import random

    rng = random.Random(n)
    ids = [rng.randrange(3, vocab) for _ in range(n)]
    return {"input_ids": ids, "labels": list(ids)}


def search_longest(try_len, start: int, limit: int, step: int, factor: float = 2.0) -> tuple[int, list]:
    """Grow from ``start`` by ``factor`` (rounded to ``step``) until a failure (or ``limit``), then
    bisect to ``step`` tokens. A ``start`` near the answer (the memory model's prediction) with a
    small factor saves the long probes far below it."""
    tried, good, bad = [], 0, None
    n = start
    while n <= limit:
        ok = try_len(n)
        tried.append((n, ok))
        if not ok:
            bad = n
            break
        good, n = n, max(n + step, int(n * factor) // step * step)
    if bad == start:  # the first probe failed: shrink by the same factor until one trains
        n = start
        while n > step:
            n = min(n - step, int(n / factor) // step * step)
            if n < step:
                break
            ok = try_len(n)
            tried.append((n, ok))
            if ok:
                good = n
                break
            bad = n
    if bad is None:
        return good, tried
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        ok = try_len(mid)
        tried.append((mid, ok))
        good, bad = (mid, bad) if ok else (good, mid)
    return good, tried


def _timed_at(try_len, n: int) -> dict:
    """One more step at the longest sequence ``n``, timed, with the peak counter reset first (the
    probes that ran out of memory pushed it to the cap): its tokens/s and peak."""
    import torch

    if n <= 0:
        return {"tokens_per_s": None, "peak_bytes": None}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t0 = time.perf_counter()
    ok = try_len(n)
    dt = time.perf_counter() - t0
    return {"tokens_per_s": n / dt if ok else None, "peak_bytes": _peak_bytes() if ok else None}


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_seq_finetuner(spec: dict) -> dict:
    import torch

    from finetuner.training.backoff import free_after_oom
    from finetuner.training.schedule import StepSchedule

    _cap_memory(spec.get("cap_gb"))
    tr = _finetuner_trainer(spec, False)
    vocab = len(tr.tokenizer)

    def try_len(n: int) -> bool:
        tr.data.train = [_long_example(n, vocab)]
        tr.schedule = StepSchedule(1, 1, 0)
        try:
            tr.train_step(0)
            _sync()
            log(f"finetuner: {n} tokens trained")
            return True
        except torch.OutOfMemoryError:
            free_after_oom(tr.optimizer, tr.rt.is_cuda)
            log(f"finetuner: {n} tokens out of memory")
            return False
        finally:
            _free()

    best, tried = search_longest(try_len, spec.get("seq_guess") or spec["seq_start"], spec["seq_limit"], spec["seq_step"],
                          spec.get("seq_factor", 2.0))
    return {"max_seq": best, "tried": tried, **_timed_at(try_len, best), "loss_path": tr.rt.loss_path,
            "offload_activations": spec.get("offload_activations", False), "tiled_mlp": tr.rt.tiled_mlp}


def max_seq_baseline(spec: dict) -> dict:
    import torch
    from transformers import Trainer

    cuda = spec["cuda"]
    _cap_memory(spec.get("cap_gb"))
    model = _baseline_model(spec, cuda)
    from finetuner.model.loading import load_tokenizer

    tok = load_tokenizer(_recipe(spec, False))
    out = tempfile.mkdtemp(prefix="bench-hf-")
    trainer = Trainer(model=model, args=_baseline_args(dict(spec, micro_batch=1, grad_accum=1), cuda, out))
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop, which is not used here
    device = "cuda" if cuda else "cpu"

    def try_len(n: int) -> bool:
        ex = _long_example(n, len(tok))
        batch = {"input_ids": torch.tensor([ex["input_ids"]], device=device), "labels": torch.tensor([ex["labels"]], device=device),
                 "attention_mask": torch.ones(1, n, dtype=torch.long, device=device)}
        try:
            trainer.training_step(model, batch)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            _sync()
            log(f"baseline: {n} tokens trained")
            return True
        except torch.OutOfMemoryError:
            trainer.optimizer.zero_grad(set_to_none=True)
            log(f"baseline: {n} tokens out of memory")
            return False
        finally:
            del batch
            _free()

    best, tried = search_longest(try_len, spec.get("seq_guess") or spec["seq_start"], spec["seq_limit"], spec["seq_step"],
                          spec.get("seq_factor", 2.0))
    return {"max_seq": best, "tried": tried, **_timed_at(try_len, best), "loss_path": "full_logits (transformers ForCausalLMLoss)"}


# --------------------------------------------------------------------------- driver
#: the finetuner sides of a --max-seq run: worker kind → (settings over the spec, what its row says)
MAXSEQ_FINETUNER = {
    "maxseq_finetuner": ({}, "checkpointing"),
    "maxseq_finetuner_offload": ({"offload_activations": True}, "checkpointing + activation offload"),
    "maxseq_finetuner_offload_tiled": ({"offload_activations": True, "tiled_mlp": True},
                                       "checkpointing + activation offload + tiled MLP"),
}
#: what ``--max-seq`` runs (the baseline first)
MAXSEQ_KINDS = ("maxseq_baseline", "maxseq_finetuner", "maxseq_finetuner_offload")


def worker(kind: str, spec: dict) -> dict:
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    if kind == "baseline":
        return run_baseline(spec)
    if kind == "finetuner":
        return run_finetuner(spec, False)
    if kind == "finetuner_packed":
        return run_finetuner(spec, "auto")
    if kind in MAXSEQ_FINETUNER:
        return max_seq_finetuner(dict(spec, **MAXSEQ_FINETUNER[kind][0]))
    if kind == "maxseq_baseline":
        return max_seq_baseline(spec)
    raise SystemExit(f"unknown worker {kind}")


def spawn(kind: str, spec: dict, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    if spec.get("threads"):
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(spec["threads"])
    cmd = [*python_command(), "-m", "scripts.bench.train", "--worker", kind, "--spec", json.dumps(spec)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        log(proc.stderr[-4000:])
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else f"exit {proc.returncode}"}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs visible, torch {torch.__version__}"


def _versions() -> str:
    import importlib.metadata as md

    return ", ".join(f"{p} {md.version(p)}" for p in ("torch", "transformers", "peft", "datasets"))


# --------------------------------------------------------------------------- the figures as data
SPEED_KEYS = ("config", "device", "finetuner_tokens_per_s", "baseline_tokens_per_s", "finetuner_peak_bytes",
              "baseline_peak_bytes", "mfu")
LONG_KEYS = SPEED_KEYS + ("finetuner_max_seq", "baseline_max_seq", "predicted_max_seq")


def card_profile():
    """finetuner's profile of the CUDA device here (None on the CPU or for a card it has no profile of)."""
    import torch

    from finetuner.config.hardware import profile_for_device_name

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return profile_for_device_name(props.name, props.total_memory)


def device_slug() -> str:
    """``<device>`` of ``speed_<device>.json``: the card's profile name, else its name; ``cpu``."""
    import torch

    prof = card_profile()
    if prof is not None:
        return prof.name
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-") or "cuda"
    return "cpu"


def mfu(n_params: int, tokens_per_s: float | None, peak_flops: float | None) -> float | None:
    """6 * N * tokens/s over the card's dense bf16 peak (see the module doc for what 6N counts)."""
    if not tokens_per_s or not peak_flops:
        return None
    return 6 * n_params * tokens_per_s / peak_flops


def _num(x):
    return None if x is None else round(float(x), 1)


def _ratio(x):
    return None if x is None else round(float(x), 4)


def _int(x):
    return None if x is None else int(x)


def throughput_rows(summary: dict, specs: dict, device: str, n_params: int, peak_flops: float | None) -> list[dict]:
    """One row per config: finetuner (padded micro-batches, like the baseline; ``finetuner_packed``
    when that is the only finetuner variant run) against the baseline."""
    rows = []
    for cname, row in summary.items():
        spec = specs[cname]
        variant = "finetuner" if "finetuner" in row else "finetuner_packed"
        ft, base = row.get(variant, {}), row.get("baseline", {})
        cap = f", cap {spec['cap_gb']:g} GiB" if spec.get("cap_gb") else ""
        config = (f"{cname}, micro-batch {spec['micro_batch']} x {spec['grad_accum']}, {spec['optimizer']}, "
                  f"checkpointing {'on' if spec['gradient_checkpointing'] else 'off'}{cap}, {variant} vs baseline")
        rows.append({
            "config": config, "device": device,
            "finetuner_tokens_per_s": _num(ft.get("tokens_per_s")), "baseline_tokens_per_s": _num(base.get("tokens_per_s")),
            "finetuner_peak_bytes": _int(ft.get("peak_bytes")), "baseline_peak_bytes": _int(base.get("peak_bytes")),
            "mfu": _ratio(mfu(n_params, ft.get("tokens_per_s"), peak_flops)),
        })
    return rows


def predicted_max_seq(model_dir: Path, spec: dict, cap_gb: float, offload: bool, loss_path: str | None,
                      tiled_mlp: bool = False) -> int | None:
    """finetuner's prediction for a --max-seq run: a card of ``cap_gb`` GiB plus the CUDA context
    (``set_per_process_memory_fraction`` caps torch's allocator, not the context), margin 0, the
    run's settings fixed (the card's own profile for attention and kernels where it has one)."""
    from dataclasses import replace

    from finetuner.config.hardware import get_gpu
    from finetuner.errors import UserError
    from finetuner.memory.model import CUDA_CONTEXT_BYTES
    from finetuner.model.shapes import resolve_shape
    from finetuner.planning.longest import longest_sequence

    base = card_profile() or get_gpu(f"{cap_gb:g}GB")
    card = replace(base, name=f"{cap_gb:g} GiB cap", memory_bytes=int(cap_gb * 2**30) + CUDA_CONTEXT_BYTES)
    try:
        r = longest_sequence(
            resolve_shape(str(model_dir)), card, "qlora4", margin=0.0, lora_r=LORA["r"], lora_dropout=LORA["dropout"],
            gradient_checkpointing=spec["gradient_checkpointing"], offload_activations=offload, optimizer=spec["optimizer"],
            kernels="liger" if loss_path == "liger_fused_linear_ce" else "none", tiled_mlp=tiled_mlp,
        )
    except UserError as e:
        log(f"no prediction: {e.message}")
        return None
    return r.max_seq


def max_seq_rows(res: dict, spec: dict, label: str, device: str, n_params: int, peak_flops: float | None,
                 predicted: dict[str, int | None]) -> list[dict]:
    """One row per finetuner variant run (:data:`MAXSEQ_FINETUNER`), each against the baseline."""
    base = res.get("maxseq_baseline", {})
    rows = []
    for kind, (_settings, what) in MAXSEQ_FINETUNER.items():
        if kind not in res:
            continue
        ft = res[kind]
        cap = f", cap {spec['cap_gb']:g} GiB" if spec.get("cap_gb") else ""
        tps = ft.get("tokens_per_s")
        rows.append({
            "config": f"{label} QLoRA 4-bit longest sequence, micro-batch 1, {spec['optimizer']}, {what}{cap}",
            "device": device,
            "finetuner_tokens_per_s": _num(tps), "baseline_tokens_per_s": _num(base.get("tokens_per_s")),
            "finetuner_peak_bytes": _int(ft.get("peak_bytes")), "baseline_peak_bytes": _int(base.get("peak_bytes")),
            "mfu": _ratio(mfu(n_params, tps, peak_flops)),
            "finetuner_max_seq": _int(ft.get("max_seq")), "baseline_max_seq": _int(base.get("max_seq")),
            "predicted_max_seq": predicted.get(kind),
        })
    return rows


def write_speed_json(path: Path, rows: list[dict]) -> None:
    """Merge ``rows`` into the JSON list at ``path``: a row with the same config and device is replaced."""
    from finetuner.fileio import atomic_write_text

    old = []
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise SystemExit(f"{path} is not JSON ({e}); move it away or pass another --json path")
        if not isinstance(old, list):
            raise SystemExit(f"{path} holds no JSON list of rows; move it away or pass another --json path")
    new_keys = {(r["config"], r["device"]) for r in rows}
    merged = [r for r in old if (r.get("config"), r.get("device")) not in new_keys] + rows
    atomic_write_text(path, json.dumps(merged, indent=2) + "\n")
    log(f"wrote {len(rows)} row(s) to {path}")


def speed_json_path(args, cuda: bool) -> Path | None:
    if args.json:
        return Path(args.json)
    if cuda and not args.smoke:
        return REPO / "docs" / "validation" / f"speed_{device_slug()}.json"
    return None


def throughput(specs: dict[str, dict], variants: list[str], reps: int, timeout: int) -> dict:
    """Run every (config, variant) ``reps`` times, interleaved, alternating the order per round."""
    results: dict[str, dict[str, list]] = {c: {v: [] for v in variants} for c in specs}
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for cname, spec in specs.items():
            for v in order:
                log(f"[round {rep + 1}/{reps}] {cname} {v} ...")
                r = spawn(v, spec, timeout)
                log(f"    {json.dumps(r)}")
                results[cname][v].append(r)
    summary = {}
    for cname, per in results.items():
        row = {}
        for v, runs in per.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                row[v] = {"error": runs[0].get("error") if runs else "not run"}
                continue
            row[v] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
                "tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in ok],
                "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in ok),
                "tokens_per_cpu_s_runs": [round(r["tokens_per_cpu_s"], 1) for r in ok],
                "best_tokens_per_s": max(r["tokens_per_s"] for r in ok),
                "peak_bytes": statistics.median(r["peak_bytes"] for r in ok),
                **{k: ok[0][k] for k in ("attention", "loss_path", "kernels", "examples", "packed_rows") if k in ok[0]},
            }
        base = row.get("baseline", {}).get("tokens_per_s")
        for v in row:
            if base and "tokens_per_s" in row[v]:
                row[v]["ratio_vs_baseline"] = row[v]["tokens_per_s"] / base
                row[v]["cpu_ratio_vs_baseline"] = row[v]["tokens_per_cpu_s"] / row["baseline"]["tokens_per_cpu_s"]
                row[v]["best_ratio_vs_baseline"] = row[v]["best_tokens_per_s"] / row["baseline"]["best_tokens_per_s"]
        summary[cname] = row
    return summary


def gpu_specs(common: dict, model_dir: Path, data: Path, label: str, methods: list[str], seq: int, micro_batch: int,
              grad_accum: int, steps: int) -> dict[str, dict]:
    """The --gpu configs: per method, what both sides train (checkpointing, bf16 on CUDA; paged
    8-bit AdamW for QLoRA and AdamW for LoRA on CUDA, AdamW on the CPU)."""
    cuda = common["cuda"]
    return {f"{label} {method} seq {seq}": {
        **common, "model": str(model_dir), "data": str(data), "seq_len": seq, "method": method,
        "micro_batch": micro_batch, "grad_accum": grad_accum, "steps": steps,
        "optimizer": ("paged_adamw_8bit" if method == "qlora" else "adamw_torch") if cuda else "adamw_torch",
        "gradient_checkpointing": True, "precision": "bf16" if cuda else "fp32",
    } for method in methods}


def max_seq_spec(common: dict, model_dir: Path, data: Path, seq: int, smoke: bool, seq_step: int | None = None) -> dict:
    """The --max-seq run: QLoRA nf4, micro-batch 1, one step per probe, checkpointing, from 4,096
    tokens (smoke: 256, up to 2,048) to 262,144, bisected to ``seq_step`` tokens."""
    cuda = common["cuda"]
    return {**common, "model": str(model_dir), "data": str(data), "seq_len": seq, "method": "qlora", "micro_batch": 1,
            "grad_accum": 1, "steps": 1, "optimizer": "paged_adamw_8bit" if cuda else "adamw_torch",
            "gradient_checkpointing": True, "precision": "bf16" if cuda else "fp32",
            "seq_start": 256 if smoke else 4096, "seq_limit": 2048 if smoke else 262144,
            "seq_step": seq_step or (256 if smoke else 1024)}


def predicted_for(kind: str, model_dir: Path, spec: dict, cap_gb: float, loss_path: str | None) -> int | None:
    """:func:`predicted_max_seq` for the settings of the finetuner side ``kind``."""
    settings = MAXSEQ_FINETUNER[kind][0]
    return predicted_max_seq(model_dir, spec, cap_gb, settings.get("offload_activations", False), loss_path,
                             settings.get("tiled_mlp", False))


def longest(spec: dict, kinds, timeout: int, guesses: dict[str, int] | None = None) -> dict[str, dict]:
    """Each side's longest sequence, one process per side (``guesses``: kind → where its search
    starts, e.g. the memory model's prediction, searched upward in steps of 5 %)."""
    res = {}
    for kind in kinds:
        log(f"== {kind}")
        guess = (guesses or {}).get(kind)
        res[kind] = spawn(kind, dict(spec, seq_guess=guess, seq_factor=1.05) if guess else spec, timeout)
        log(json.dumps(res[kind]))
    return res


MAXSEQ_NAMES = {"maxseq_baseline": "baseline (transformers.Trainer + peft)",
                **{k: f"finetuner ({what})" for k, (_s, what) in MAXSEQ_FINETUNER.items()}}


def max_seq_markdown(res: dict, label: str, cap_gb: float | None) -> str:
    b = res.get("maxseq_baseline", {}).get("max_seq")
    md = (f"Longest trainable sequence, {label} QLoRA nf4, micro-batch 1, checkpointing, "
          f"cap {cap_gb if cap_gb else 'none'} GiB on {machine()}:\n\n"
          "| | longest sequence | ratio vs baseline | peak | probes (tokens: trained?) |\n|---|---|---|---|---|\n")
    for kind, r in res.items():
        name = MAXSEQ_NAMES[kind]
        if "error" in r:
            md += f"| {name} | error: {r['error']} | | | |\n"
            continue
        ratio = f"{r['max_seq'] / b:.2f}" if b else ""
        probes = ", ".join(f"{n}: {'yes' if ok else 'no'}" for n, ok in r["tried"])
        peak = f"{r['peak_bytes'] / 2**30:.2f} GiB" if r.get("peak_bytes") else ""
        md += f"| {name} | {r['max_seq']:,} | {ratio} | {peak} | {probes} |\n"
    return md


def markdown(summary: dict, header: str) -> str:
    lines = [header, "", "| config | variant | tokens/s median (runs) | ratio | best tokens/s | ratio | tokens per CPU-second | ratio | peak memory | loss path |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cname, row in summary.items():
        for v, r in row.items():
            if "error" in r:
                lines.append(f"| {cname} | {v} | error: {r['error']} | | | | | | | |")
                continue
            lines.append(
                f"| {cname} | {v} | {r['tokens_per_s']:,.0f} ({', '.join(f'{x:,.0f}' for x in r['tokens_per_s_runs'])}) | "
                f"{r.get('ratio_vs_baseline', float('nan')):.2f} | {r['best_tokens_per_s']:,.0f} | {r.get('best_ratio_vs_baseline', float('nan')):.2f} | "
                f"{r['tokens_per_cpu_s']:,.0f} | {r.get('cpu_ratio_vs_baseline', float('nan')):.2f} | "
                f"{r['peak_bytes'] / 2**30:.2f} GiB | {r.get('loss_path', '')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--gpu", action="store_true", help="7B/8B-shaped random-weight models on CUDA (QLoRA and LoRA)")
    ap.add_argument("--max-seq", action="store_true", help="search the longest sequence that trains (QLoRA) under --cap-gb")
    ap.add_argument("--smoke", action="store_true", help="with --gpu/--max-seq: a tiny model, short sequences (CPU ok)")
    ap.add_argument("--preset", default="llama-3.1-8b", help="finetuner/model/presets/<name>.json (GPU modes)")
    ap.add_argument("--methods", default="qlora,lora", help="GPU mode: comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cap-gb", type=float, default=24.0, help="GPU memory cap in GiB (stands for a 24 GB card)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: 256 on CPU, 2048 on GPU")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--grad-accum", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds (medians are reported)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per run (default on CPU: 1, so that CPU time is not inflated by OpenMP "
                    "threads spinning while other work holds the cores; 0 = torch's default)")
    ap.add_argument("--work", default=None, help="where GPU-mode models and data are built (default: a temp folder)")
    ap.add_argument("--out", default=None, help="write the JSON and markdown results into this folder")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="GPU modes: merge the speed rows into this JSON file (default on CUDA without --smoke: "
                    "docs/validation/speed_<device>.json; otherwise none)")
    ap.add_argument("--seq-step", type=int, default=None, help="--max-seq: bisect to this many tokens (default 1024; smoke 256)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, json.loads(args.spec))))
        return
    args.variants = [v for v in args.variants.split(",") if v]
    import torch

    cuda = torch.cuda.is_available()
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    threads = args.threads if args.threads is not None else (0 if cuda else 1)
    common = {"warmup": args.warmup, "cuda": cuda, "cap_gb": args.cap_gb if cuda else None, "threads": threads}

    json_path = None
    if args.json and not (args.gpu or args.max_seq):
        raise SystemExit("--json writes the GPU modes' rows: add --gpu or --max-seq (with --smoke on a CPU)")
    if args.gpu or args.max_seq:
        from scripts.validate.train_gpu import build_model, write_data

        work = Path(args.work or tempfile.mkdtemp(prefix="bench-train-"))
        work.mkdir(parents=True, exist_ok=True)
        model_dir = work / ("tiny" if args.smoke else args.preset)
        build_model(args.preset, model_dir, args.smoke)
        data = work / "data.json"
        write_data(data)
        seq = args.seq_len or (256 if args.smoke else 2048)
        from finetuner.model.shapes import resolve_shape

        n_params = resolve_shape(str(model_dir)).num_params
        prof = card_profile()
        peak_flops = prof.tflops * 1e12 if prof is not None else None
        json_path = speed_json_path(args, cuda)
    if args.max_seq:
        spec = max_seq_spec(common, model_dir, data, seq, args.smoke, args.seq_step)
        label = args.preset if not args.smoke else "tiny"
        res = longest(spec, MAXSEQ_KINDS, args.timeout)
        md = max_seq_markdown(res, label, args.cap_gb if cuda else None)
        print(md)
        if out:
            (out / "bench_max_seq.json").write_text(json.dumps({"machine": machine(), "results": res}, indent=2))
            (out / "bench_max_seq.md").write_text(md)
        if json_path:
            predicted = {kind: predicted_for(kind, model_dir, spec, args.cap_gb, res[kind].get("loss_path"))
                         for kind in MAXSEQ_KINDS if kind in MAXSEQ_FINETUNER}
            write_speed_json(json_path, max_seq_rows(res, spec, label, machine(), n_params, peak_flops, predicted))
        return

    if args.gpu:
        specs = gpu_specs(common, model_dir, data, args.preset if not args.smoke else "tiny", args.methods.split(","), seq,
                          args.micro_batch or 1, args.grad_accum or 4, args.steps or 8)
        where = f"{machine()}, cap {args.cap_gb} GiB" if cuda else machine()
    else:
        seq = args.seq_len or 256
        specs = {f"demo_model lora seq {seq}": {
            **common, "model": str(REPO / "data" / "demo_model"), "data": str(REPO / "data" / "alpaca_sample.json"),
            "seq_len": seq, "method": "lora", "micro_batch": args.micro_batch or 8, "grad_accum": args.grad_accum or 1,
            "steps": args.steps or 12, "optimizer": "adamw_torch", "gradient_checkpointing": False, "precision": "fp32" if not cuda else "bf16",
        }}
        where = machine()
    summary = throughput(specs, args.variants, args.reps, args.timeout)
    header = (f"Machine: {where}; {_versions()}; torch threads per run: {threads or 'default'}. Medians of {args.reps} interleaved rounds, "
              f"{next(iter(specs.values()))['steps']} steps each, the first {args.warmup} untimed.")
    md = markdown(summary, header)
    print(md)
    if out:
        (out / "bench_train.json").write_text(json.dumps({"machine": where, "specs": specs, "summary": summary}, indent=2))
        (out / "bench_train.md").write_text(md)
    if args.gpu and json_path:
        write_speed_json(json_path, throughput_rows(summary, specs, machine(), n_params, peak_flops))


if __name__ == "__main__":
    main()

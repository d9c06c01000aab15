"""Merge a LoRA adapter into its base model and export a plain ``save_pretrained`` folder.

The base is loaded *unquantized*, in the output dtype, even for a QLoRA run: merging into a 4-bit
layer re-quantizes the sum and changes the outputs, so the LoRA product ``B·A·alpha/r`` is added
(in fp32, rounded once) to the full-precision weights. The result is checked before anything is
published: the merged folder is written to a temporary folder next to the output, loaded back
with plain :class:`transformers.AutoModelForCausalLM`, and its logits on a probe conversation
are compared with the adapter-on-base logits; only then is it renamed into place.

Overwrite: the output folder gets a marker, ``.finetuner-export.json`` (what wrote it, from what,
when, and its files), in the temporary folder, so it is published with the model. ``overwrite``
replaces only a folder whose marker lists everything in it (:func:`check_replaceable`); a folder
holding anything else (the user's files, a run, the home folder) is refused, overwrite or not.

Memory: the base is loaded once (transformers materialises it tensor by tensor from the
safetensors files, so there is no second copy), the merge happens in place layer by layer,
and ``save_pretrained`` serialises one shard at a time. Peak RAM is about the model's size in
the output dtype plus one shard; the check reloads the merged folder only after the first copy
is freed. ``scripts/validate/merge_memory.py`` measures it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.errors import UserError
from finetuner.surface import say
from finetuner.quiet import quieted
from finetuner.infer.loading import Source, attach_adapter, chat_template, load_pretrained, load_tokenizer, picture_processor, resolve_source
from finetuner.units import gib_text

log = logging.getLogger(__name__)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: what ``dtype`` may be: ``auto`` is the dtype the base model was saved in (:func:`saved_dtype`)
DTYPE_CHOICES = ("auto", *DTYPES)

#: Allowed max |merged - adapter| logit difference, relative to the largest |logit| (at least 1).
#: fp32 agrees to rounding; a 16-bit merge rounds every merged weight once.
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}

PROBE_MESSAGES = [
    {"role": "user", "content": "What should I pack for a day hike in the hills?"},
    {"role": "assistant", "content": "Water, a map, a warm layer and something to eat."},
    {"role": "user", "content": "And if it rains?"},
]

INFO_FILE = "finetuner_merge.json"


def saved_dtype(model: str | Path, revision: str | None = None) -> str:
    """The dtype a model folder or hub id was saved in, as ``bf16``, ``fp16`` or ``fp32``: its
    ``config.json``'s ``dtype`` (``torch_dtype`` in configs of older transformers). A config that names
    none, or another dtype, gives ``fp32`` (what transformers loads such a model in), as does a GGUF file."""
    from transformers import PretrainedConfig

    from finetuner.model.gguf_base import is_gguf_name

    if is_gguf_name(model):
        return "fp32"  # transformers dequantizes a GGUF file's weights to float32
    try:
        config, _ = PretrainedConfig.get_config_dict(str(model), revision=revision)
    except (OSError, ValueError) as e:
        raise UserError(f"Cannot read the config of the base model '{model}' ({e}).",
                        hint="Give the base model's folder or hub id with --base, or choose --dtype.") from None
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return {v: k for k, v in DTYPES.items()}.get(name, "fp32")


@dataclass
class MergeResult:
    """What :func:`merge_adapter` wrote and how well the merged model matches the adapter."""

    output_dir: Path
    source: str
    base_model: str
    dtype: str
    files: list[str]
    weight_bytes: int
    max_abs_diff: float | None
    max_abs_logit: float | None
    adapter_effect: float | None
    tolerance: float | None
    top1_agreement: float | None
    probe_tokens: int
    peak_rss_bytes: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def shards(self) -> int:
        return sum(1 for f in self.files if f.endswith(".safetensors"))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["output_dir"] = str(self.output_dir)
        d["shards"] = self.shards
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MergeResult:
        """The result back from :meth:`to_dict` (e.g. from another process)."""
        fields = {k: v for k, v in d.items() if k != "shards"}
        return cls(**{**fields, "output_dir": Path(fields["output_dir"])})

    def __repr__(self) -> str:
        diff = "not checked" if self.max_abs_diff is None else f"max |Δlogit| {self.max_abs_diff:.2e}"
        return (f"MergeResult({str(self.output_dir)!r}: {self.dtype}, {self.shards} shard(s), "
                f"{self.weight_bytes / 2**20:.1f} MiB, {diff}, peak RSS {gib_text(self.peak_rss_bytes)})")


def parse_size(size: int | str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a number of bytes → bytes."""
    if isinstance(size, int) and size > 0:
        return size
    s = str(size).strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            try:
                n = float(s[: -len(unit)])
            except ValueError:
                break
            if n > 0:
                return int(n * mult)
            break
    else:
        if s.isdigit() and int(s) > 0:
            return int(s)
    raise UserError(f"shard size '{size}' is not a size.", hint="Use e.g. 5GB, 500MB or 2GiB.")


#: The marker a merge or an Ollama export writes into its output folder (in the temporary folder,
#: so it appears with the output in one rename): what wrote it, from what, when, and the files it
#: wrote. ``overwrite`` replaces only a folder whose marker lists every entry in it.
EXPORT_MARKER = ".finetuner-export.json"


def write_export_marker(folder: Path, kind: str, source: str) -> None:
    """Record in ``folder`` (complete, not yet published) that finetuner's ``kind`` export of
    ``source`` wrote it, with the names of its files."""
    files = sorted(p.name for p in folder.iterdir() if p.name != EXPORT_MARKER)
    marker = {"kind": kind, "source": str(source), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    (folder / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _read_marker(folder: Path) -> dict[str, Any] | None:
    """``folder``'s marker as written by :func:`write_export_marker` (a plain file of at most 1 MiB, a
    JSON object with a list of ``files``), or None."""
    marker = folder / EXPORT_MARKER
    try:
        if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > 2**20:
            return None
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("files"), list) else None


def export_marker(folder: Path) -> dict[str, Any] | None:
    """The marker of ``folder`` when finetuner wrote the folder as it is: a marker file (not a link)
    listing every entry in it, each a plain file (merge and export outputs have no sub-folders);
    else None."""
    info = _read_marker(folder)
    if info is None:
        return None
    try:
        entries = list(folder.iterdir())
    except OSError:
        return None
    listed = {str(f) for f in info["files"]} | {EXPORT_MARKER}
    for entry in entries:
        if entry.name not in listed or entry.is_symlink() or not entry.is_file():
            return None
    return info


def _foreign_entries(folder: Path, n: int = 4) -> str:
    """A few of the entries in ``folder`` that no finetuner export wrote there (entries its marker does
    not list, sub-folders, links first), e.g. ``notes.txt, .ssh/ and 3 more``."""
    listed = {str(f) for f in (_read_marker(folder) or {}).get("files", [])}
    try:
        entries = sorted(folder.iterdir())
    except OSError as e:
        return f"entries finetuner cannot list ({e.strerror})"
    listed.add(EXPORT_MARKER)

    def theirs(p: Path) -> bool:
        return p.name not in listed or p.is_symlink() or not p.is_file()

    names = [p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in sorted(entries, key=lambda p: not theirs(p))]
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def check_replaceable(out: Path, overwrite: bool) -> None:
    """An existing non-empty folder ``out`` may be replaced only with ``overwrite``, and only when a
    finetuner merge or export wrote it (:func:`export_marker`); anything else is refused, overwrite
    or not: a folder of the user's, a run folder, the home folder, a system folder. An empty folder
    is fine. Called before the work starts and again right before the output is put in place."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError(f"The output {out} is not a folder; finetuner will not replace it.", hint="Choose a new output folder.")
    try:
        empty = not out.exists() or next(out.iterdir(), None) is None
    except OSError as e:
        raise UserError(f"The output folder {out} cannot be read ({e.strerror}); finetuner will not write into it.",
                        hint="Choose a new output folder.") from None
    if empty:
        return
    if (out / "recipe.yaml").is_file() or (out / "events.jsonl").is_file():
        raise UserError(f"{out} holds a finetuner run; overwrite does not replace run folders.",
                        hint="Choose another output folder.")
    marker = export_marker(out)
    if marker is None:
        raise UserError(f"The output folder {out} is not empty; finetuner will not write into it: it holds "
                        f"{_foreign_entries(out)}, which no finetuner merge or export wrote (overwrite or not).",
                        hint="Choose a new output folder, or empty that folder yourself.")
    if not overwrite:
        raise UserError(f"The output folder {out} is not empty (it holds an earlier finetuner {marker.get('kind', 'export')}); "
                        "finetuner will not write into it.",
                        hint=say(cli="Choose a new output folder (-o), or allow overwrite (--overwrite) to replace it "
                                     "once the new model is complete.",
                                 ui="Choose a new output folder, or tick “overwrite” to replace it once the new model "
                                    "is complete."))


def check_output_dir(out: Path, overwrite: bool, src: Source) -> None:
    """Refuse a file, a folder holding the source, and a non-empty folder unless ``overwrite`` and
    a finetuner merge or export wrote it (:func:`check_replaceable`)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"The output {out} is a file.", hint=say(cli="Choose a folder for the output (-o).",
                                                                                   ui="Name a folder as the output, not a file."))
    for inside in filter(None, [Path(str(src.path)), src.adapter_dir, Path(src.base_model) if Path(src.base_model).exists() else None]):
        inside = inside.resolve()
        if inside == out or out in inside.parents:
            raise UserError(f"The output folder {out} holds the model being merged ({inside}).", hint="Choose a new output folder (-o).")
    check_replaceable(out, overwrite)


#: an image-text-to-text checkpoint's processor settings, which its merge keeps beside the tokenizer
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def _copy_processor_files(base_model: str, out: Path) -> list[str]:
    """The base model's processor files (a local folder's, or the hub cache's: nothing is downloaded) copied into
    the merged folder, so that ``AutoProcessor`` loads it as it loads the original checkpoint."""
    copied = []
    for name in PROCESSOR_FILES:
        found = Path(base_model) / name
        if not found.is_file() and "/" in base_model and not Path(base_model).exists():
            try:
                from huggingface_hub import try_to_load_from_cache

                cached = try_to_load_from_cache(base_model, name)
                found = Path(cached) if isinstance(cached, str) else found
            except Exception:  # noqa: BLE001 - an unusual hub id or cache: the merge goes on without it
                pass
        if found.is_file() and not (out / name).exists():
            shutil.copyfile(found, out / name)
            copied.append(name)
    return copied


def _probe_ids(tokenizer, template: str, max_tokens: int = 48):
    import torch

    text = tokenizer.apply_chat_template(PROBE_MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][-max_tokens:]
    return torch.tensor([ids])


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids.to(model.device), use_cache=False).logits.float().cpu()


def _all_finite(w, rows: int = 1024) -> bool:
    """``isfinite(w).all()`` a block of rows at a time (no weight-sized temporaries)."""
    import torch

    return all(bool(torch.isfinite(block).all()) for block in w.detach().split(rows))


#: room a merge asks for beyond its weights (the tokenizer, the configs, the file system's own blocks)
SPACE_MARGIN = 50 * 2**20


def space_needed(weight_bytes: int) -> int:
    """The free space a merge of ``weight_bytes`` of weights asks for before it writes (and a full disk's message
    asks to free): the weights, 5% more, and :data:`SPACE_MARGIN`."""
    return int(weight_bytes * 1.05 + SPACE_MARGIN)


def peak_rss() -> int:
    """This process's peak resident memory in bytes (``VmHWM``: unlike ``ru_maxrss`` it is not
    inherited from the parent across fork and exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def merge_adapter(
    source: str | Path,
    output_dir: str | Path,
    dtype: str = "auto",
    shard_size: int | str = "5GB",
    overwrite: bool = False,
    base_model: str | None = None,
    verify: bool = True,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> MergeResult:
    """Merge a run's (or a peft folder's) LoRA adapter into its base and write a model folder.

    The output is a ``save_pretrained`` folder (safetensors, sharded at ``shard_size``, with the
    tokenizer, the chat template the run trained with and the generation config) that plain
    transformers loads: ``AutoModelForCausalLM.from_pretrained(output_dir)``.

    Args:
        source: a run folder made by ``finetuner run`` or a peft adapter folder. A full
            fine-tune run is exported (re-saved in ``dtype``) as there is nothing to merge.
        output_dir: a new or empty folder; with ``overwrite``, also the folder of an earlier merge or
            export (it is then replaced as a whole once the new folder is complete and checked). Any
            other non-empty folder is refused, overwrite or not (:func:`check_replaceable`).
        dtype: ``auto`` (the dtype the base was saved in, :func:`saved_dtype`: an fp32 base stays
            fp32 and the merged model matches the adapter to fp32 rounding), ``bf16``, ``fp16``
            or ``fp32`` — of the merged weights, and of the base while merging.
        shard_size: largest safetensors file, e.g. ``"5GB"``.
        overwrite: replace an ``output_dir`` that an earlier finetuner merge or export wrote.
        base_model: where the base model is, if not where the run or adapter says.
        verify: compare the written model's logits with the adapter-on-base logits on a probe
            conversation (max abs difference in the result) and refuse to publish on a mismatch.
        trust_remote_code: allow the model's own code to run (a run whose recipe sets
            ``model.trust_remote_code`` is refused without this).
        allow_pickle: allow pickle weight files (a run whose recipe sets ``model.allow_pickle`` is refused without this).

    Example::

        >>> import finetuner
        >>> r = finetuner.merge_adapter("runs/demo_cpu", "exports/demo-merged")  # doctest: +SKIP
        >>> r.max_abs_diff, r.files                                              # doctest: +SKIP
    """
    t0 = time.perf_counter()
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"dtype '{dtype}' is not one of {', '.join(DTYPE_CHOICES)}.")
    max_shard = parse_size(shard_size)
    src = resolve_source(source, base_model, trust_remote_code, allow_pickle)
    if src.kind == "model":
        raise UserError(f"{src.path} is a model folder with no adapter: there is nothing to merge.",
                        hint="Give a run folder (runs/<name>) or a peft adapter folder (one with adapter_config.json).")
    out = Path(output_dir).expanduser().resolve()
    check_output_dir(out, overwrite, src)

    with quieted():  # after the checks above (it imports transformers), so a refusal is instant
        if dtype == "auto":
            full = src.kind == "full"  # a full fine-tune's folder is the model itself
            dtype = saved_dtype(src.adapter_dir if full else src.base_model,
                                None if full or src.recipe is None else src.recipe.model.revision)
        notes: list[str] = []
        if src.recipe is not None and src.recipe.quantization is not None:
            notes.append(f"The run trained on a {src.recipe.quantization.bits}-bit base; the adapter is merged into the "
                         f"unquantized base in {dtype} (merging into quantized weights would re-quantize them).")
        from finetuner.infer.probe import kept_note

        notes += [n for n in [kept_note(src.run_dir if src.has_adapter else None)] if n]  # what it forgot, before shipping
        return _merge_and_write(src, out, dtype, max_shard, verify, overwrite, notes, t0)


def _merge_and_write(src: Source, out: Path, dtype: str, max_shard: int, verify: bool, overwrite: bool, notes: list[str],
                     t0: float) -> MergeResult:
    import torch
    from transformers import AutoModelForImageTextToText

    from finetuner.model.inventory import causal_lm_auto

    torch_dtype = getattr(torch, DTYPES[dtype])
    processor = picture_processor(src)  # a run trained on pictures: the image-text model, its processor kept
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(src)
    template = chat_template(src, processor if processor is not None else tokenizer)
    tokenizer.chat_template = template
    trust = src.trust_remote_code
    pickle_ok = src.allow_pickle
    revision = src.recipe.model.revision if src.recipe is not None else None
    load_from = str(src.adapter_dir) if src.kind == "full" else src.base_model
    with phases.phase("load"):  # one blocking call: its heartbeat says it goes on
        model = load_pretrained(load_from, "the base model", pickle_ok, processor is not None, dtype=torch_dtype,
                                revision=None if src.kind == "full" else revision, trust_remote_code=trust)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path.cwd()).free
    if free < space_needed(weight_bytes):
        from finetuner.fileio import size_text

        raise UserError(f"Not enough free disk space for {out}: {size_text(free)} free, the merged weights need "
                        f"{size_text(space_needed(weight_bytes))}.", hint="Free some space or choose another output folder (-o).")

    probe = _probe_ids(tokenizer, template)
    if src.has_adapter:
        model = attach_adapter(model, src)
        model.eval()
        reference = _logits(model, probe) if verify else None
        if verify:
            with model.disable_adapter():
                effect = float((_logits(model, probe) - reference).abs().max())
        # In place: each weight gets W += B·A·scale (computed in fp32, rounded once), so a weight
        # still memory-mapped from the base's safetensors is copied once, not twice.
        targets = [n.removeprefix("base_model.model.") for n, mod in model.named_modules() if hasattr(mod, "lora_A")]
        with phases.phase("merge", total=len(targets), unit="layers"):  # one call of peft's: the count at its end
            model = model.merge_and_unload(safe_merge=False)
        left = [n for n, _ in model.named_modules() if "lora_" in n]
        if left:
            raise RuntimeError(f"LoRA modules left after merging: {left[:3]}")
        bad = [n for n in targets if not _all_finite(model.get_submodule(n).weight)]
        if bad:
            raise UserError(f"Merging produced non-finite weights in {', '.join(bad[:3])}; nothing was written.",
                            hint="The adapter holds NaN/inf values: use an earlier checkpoint's adapter, or merge with --dtype fp32.")
    else:
        model.eval()
        reference = _logits(model, probe) if verify else None
        effect = None

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-merge-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        from finetuner.fileio import hold

        hold("merge")  # a test's pause (HOLD@merge): the staging folder made, nothing in it yet
        model.config.use_cache = True
        with phases.phase("write", unit="shards") as writing:  # transformers writes them in one call: counted after it
            model.save_pretrained(tmp, max_shard_size=max_shard, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if processor is not None:
                processor.chat_template = template
                processor.save_pretrained(tmp)
            _copy_processor_files(src.base_model, tmp)
            writing.advance(sum(1 for p in tmp.glob("*.safetensors")))
        model = None  # free the merged copy before loading the written one
        gc.collect()
        diff = top1 = max_logit = tol = None
        if verify:
            auto = AutoModelForImageTextToText if processor is not None else \
                causal_lm_auto(json.loads((tmp / "config.json").read_text(encoding="utf-8")).get("model_type"))
            with phases.phase("verify"):  # the written folder loaded back and its logits on the probe
                merged = auto.from_pretrained(tmp, dtype=torch_dtype, trust_remote_code=trust)
                got = _logits(merged, probe)
            merged = None
            gc.collect()
            diff = float((got - reference).abs().max())
            max_logit = float(reference.abs().max())
            top1 = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
            tol = TOLERANCE[dtype] * max(1.0, max_logit)
            if not diff <= tol:  # also catches NaN
                raise UserError(
                    f"The merged model does not match the adapter: max |Δlogit| {diff:.3g} > tolerance {tol:.3g} "
                    f"(top-1 agreement {top1:.0%}). Nothing was written to {out}.",
                    hint="Try --dtype fp32; check that --base is the model the adapter was trained on.",
                )
        info = {
            "source": str(src.path), "kind": src.kind, "base_model": src.base_model, "dtype": dtype,
            "max_abs_logit_diff": diff, "adapter_effect": effect if verify else None, "tolerance": tol, "top1_agreement": top1, "probe_tokens": int(probe.shape[1]),
            "notes": notes,
        }
        if src.has_adapter:
            info["adapter_config"] = json.loads((src.adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, default=str) + "\n", encoding="utf-8")
        write_export_marker(tmp, "merge", str(src.path))
        files = sorted(p.name for p in tmp.iterdir())
        publish_replacing(tmp, out, overwrite)
    except BaseException as e:
        from finetuner.fileio import DiskFull, give_back, is_disk_full

        give_back(tmp, e)

        if isinstance(e, Exception) and is_disk_full(e, out.parent):
            raise DiskFull(out, f"run the same command again (nothing was written to {out})", space_needed(weight_bytes)) from None
        raise
    return MergeResult(
        output_dir=out, source=str(src.path), base_model=src.base_model, dtype=dtype, files=files,
        weight_bytes=int(weight_bytes), max_abs_diff=diff, max_abs_logit=max_logit,
        adapter_effect=effect if verify else None, tolerance=tol,
        top1_agreement=top1, probe_tokens=int(probe.shape[1]), peak_rss_bytes=peak_rss(),
        seconds=round(time.perf_counter() - t0, 2), notes=notes,
    )


def publish_replacing(tmp: Path, out: Path, overwrite: bool) -> None:
    """Put the complete ``tmp`` folder at ``out``; an existing ``out`` is checked again
    (:func:`check_replaceable`: nothing of the user's arrived while the model was written), moved
    aside, and removed last."""
    from finetuner.fileio import publish_dir

    check_replaceable(out, overwrite)
    aside = None
    if out.exists():
        aside = out.parent / f".{out.name}.replaced-{os.getpid()}"
        out.rename(aside)
    try:
        publish_dir(tmp, out)
    except BaseException:
        if aside is not None and not out.exists():
            aside.rename(out)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)

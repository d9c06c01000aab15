"""Export a run (or a model folder) to one GGUF file, or to an Ollama folder (GGUF + Modelfile).

The adapter is merged first with :func:`finetuner.export.merge.merge_adapter` (unquantized base,
also for QLoRA runs; checked there against the adapter), into a temporary folder next to the
output. The GGUF is then written with the ``gguf`` package (the ggml project's writer, tensor-name
map and quantizers) in two passes over the merged safetensors: the first reads only shapes to
write the header, the second converts and writes **one tensor at a time**, so the export holds one
tensor (and its quantized copy) on top of what the merge needed.

The file is checked before it is published (renamed into place):

1. read back with ``gguf.GGUFReader``: every tensor, dequantized, is compared with the merged
   weight (f32 exactly; f16/bf16 within their rounding; q8_0/q4_0 within their block's step);
2. loaded by transformers' GGUF loader (``from_pretrained(folder, gguf_file=...)``), a reader
   nobody here wrote, and its logits on a probe conversation compared with the merged model's:
   within a tolerance for f32/f16/bf16, by top-1 agreement for q8_0 (both are reported);
3. the tokenizer transformers rebuilds from the file must give the same ids as the original on
   sample texts, the chat template's special tokens included.

An image-text model (LLaVA, Gemma 3) also gets llama.cpp's projector file beside the language model
(``mmproj-<name>.gguf``, or ``mmproj.gguf`` in an Ollama folder with a second ``FROM`` line): its vision tower and
projector, written by :mod:`finetuner.export.gguf_mmproj`, read back and compared with the merged weights like the
language model's; that llama.cpp reads pictures with it as transformers does is measured by
``scripts/validate/llama_cpp_vlm_check.py`` (docs/validation/llama_cpp_vlm_check.md).

This module is the export's order of work (merge, plan, write, check, publish); which tensors are written and how is
:mod:`finetuner.export.gguf_tensors`', the checks are :mod:`finetuner.export.gguf_verify`'s.

Memory: the merge's peak (the model in the merge dtype, see ``merge.py``), then one tensor at a
time while writing; the logits check loads the merged model and then the GGUF model (transformers'
loader dequantizes every tensor to float32 and keeps them until the model is built), so with the
check on, peak RAM is about twice the model's size in float32; ``verify=False`` skips it.

Overwrite: every GGUF file finetuner writes holds the metadata key ``finetuner.export`` (JSON:
kind, source, time), and an Ollama folder gets merge's marker file (``.finetuner-export.json``).
``overwrite`` replaces only a ``.gguf`` file with that key, or a folder a finetuner merge or export
wrote; any other file or folder is refused, overwrite or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.data.tools import FALLBACK_FORMAT
from finetuner.errors import UserError, did_you_mean
from finetuner.locate import check_hub
from finetuner.export.gguf_arch import arch_for
from finetuner.export import gguf_llama
from finetuner.export.gguf_mmproj import Projector, projector_for
from finetuner.export.gguf_tensors import MARKER_KEY, QUANTS, ProjectorPlan, TensorPlan, write_gguf, write_mmproj
from finetuner.export.gguf_verify import (READ_AS, check_logits, check_tensors, check_tokenizer, check_with_llama_cpp,
                                          probe_ids, text_twin)
from finetuner.export.gguf_vocab import vocab_from_tokenizer
from finetuner.export.merge import check_output_dir, merge_adapter, peak_rss, publish_replacing, write_export_marker
from finetuner.infer.loading import Source, chat_template, load_tokenizer, resolve_source, system_prompt, trained_tools
from finetuner.model.gguf_base import is_gguf_name, pretrained_args
from finetuner.quiet import quieted
from finetuner.surface import say
from finetuner.units import gib_text

FORMATS = ("gguf", "ollama")
SAMPLE_TEXTS = [
    "Hello world! How are you today?",
    "  Leading spaces, tabs\tand\nnew lines\n\n",
    "Numbers 12345 and 3.14159, symbols #@$%^&*() and e-mail a.b@c.org",
    "Unicode: café, naïve, 東京, Привет, emoji 🙂",
]


@dataclass
class ExportResult:
    """What :func:`export_model` wrote and how well the file matches the merged model."""

    output: Path
    gguf_file: Path
    modelfile: Path | None
    format: str
    quant: str
    source: str
    base_model: str
    architecture: str
    tensors: int
    file_bytes: int
    max_weight_error: float | None
    max_abs_logit_diff: float | None
    max_abs_logit: float | None
    tolerance: float | None
    top1_agreement: float | None
    probe_tokens: int
    tokenizer_texts: int
    peak_rss_bytes: int
    seconds: float
    ollama_command: str | None = None
    #: then: ``ollama run NAME``
    ollama_run: str | None = None
    notes: list[str] = field(default_factory=list)
    #: an image-text model's projector file (llama.cpp's ``--mmproj``), else None
    mmproj_file: Path | None = None
    mmproj_tensors: int = 0
    mmproj_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("output", "gguf_file", "modelfile", "mmproj_file"):
            d[k] = None if d[k] is None else str(d[k])
        return d

    def __repr__(self) -> str:
        diff = "not checked" if self.max_abs_logit_diff is None else (
            f"max |Δlogit| {self.max_abs_logit_diff:.2e}, top-1 {self.top1_agreement:.0%}")
        return (f"ExportResult({str(self.gguf_file)!r}: {self.quant}, {self.file_bytes / 2**20:.1f} MiB, {diff}, "
                f"peak RSS {gib_text(self.peak_rss_bytes)})")


def _check_args(fmt: str, quant: str) -> None:
    if fmt not in FORMATS:
        raise UserError(f"format '{fmt}' is not one of {', '.join(FORMATS)}.{did_you_mean(fmt, FORMATS)}")
    if quant not in QUANTS:
        raise UserError(f"quant '{quant}' is not one of {', '.join(QUANTS)}.{did_you_mean(quant, QUANTS)}")
    if quant == "q4_k_m":
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise UserError(
                "quant 'q4_k_m' needs llama.cpp's quantizer (the k-quants are not in the gguf package), and "
                "llama-cpp-python is not installed.",
                hint="Install it (pip install llama-cpp-python; it compiles llama.cpp), or use --quant q8_0 or q4_0.",
            )


def gguf_marker(path: Path) -> dict[str, Any] | None:
    """The :data:`MARKER_KEY` metadata of a GGUF file finetuner exported; None for any other file
    (not GGUF, unreadable, or a GGUF without the key)."""
    import gguf

    try:
        if path.is_symlink() or not path.is_file():
            return None
        field = gguf.GGUFReader(str(path)).fields.get(MARKER_KEY)
        info = json.loads(field.contents()) if field is not None else None
    except Exception:  # noqa: BLE001 - whatever the reader makes of a file that is not GGUF: not ours
        return None
    return info if isinstance(info, dict) else None


def check_gguf_replaceable(out: Path, overwrite: bool) -> None:
    """An existing ``out`` is replaced only with ``overwrite``, and only when it is a GGUF file
    finetuner exported (:func:`gguf_marker`); checked before the export and again before the rename."""
    if out.is_symlink() or out.is_dir():
        raise UserError(f"The output {out} is a {'link' if out.is_symlink() else 'folder'}.", hint=say(
            cli="Name a new .gguf file for -o.", ui="Name a new .gguf file in “Output file or folder”."))
    if not out.exists():
        return
    if gguf_marker(out) is None:
        raise UserError(f"The output {out} exists and is not a GGUF file finetuner exported; finetuner will not "
                        "replace it (overwrite or not).", hint="Choose a new file name, or move that file away yourself.")
    if not overwrite:
        raise UserError(f"The output {out} exists; finetuner will not overwrite it.", hint=say(
            cli="Choose a new name for -o, or pass --overwrite to replace it.",
            ui="Choose a new name in “Output file or folder”, or tick “overwrite” to replace it."))


def _check_gguf_output(out: Path, overwrite: bool, src: Source) -> None:
    if out.suffix != ".gguf":
        raise UserError(f"The output {out} does not end in .gguf.", hint=say(
            cli="Name the file, e.g. -o exports/model.gguf (or use --format ollama for a folder).",
            ui="Name the file in “Output file or folder”, e.g. exports/model.gguf (or choose the format ollama for a folder)."))
    check_gguf_replaceable(out, overwrite)
    # a run folder may hold the export (as it holds merge's default runs/<run>/merged); a model or
    # adapter folder may not (the export would become part of what it was made from)
    folders = [src.adapter_dir] + ([] if src.kind in ("run", "full") else [Path(str(src.path))])
    for inside in filter(None, folders):
        inside = inside.resolve()
        if out.parent == inside or inside in out.parents:
            raise UserError(f"The output {out} is inside the model being exported ({inside}).", hint="Write it somewhere else.")


def _model_config(src: Source) -> tuple[dict[str, Any], str]:
    """The ``config.json`` of the model whose weights are exported, and where it came from."""
    folder = src.adapter_dir if src.kind == "full" else None
    if folder is None and is_gguf_name(src.base_model):
        if not src.has_adapter:
            raise UserError(f"{src.base_model} is a GGUF file already; there is no adapter to merge into it.",
                            hint="Export a run trained on it (runs/<name>), or use the file as it is.")
        from transformers import AutoConfig

        where, extra = pretrained_args(src.base_model)
        return AutoConfig.from_pretrained(where, **extra).to_dict(), src.base_model  # what the loader dequantizes to
    path = Path(folder or src.base_model) / "config.json"
    if not path.is_file():
        from huggingface_hub import hf_hub_download

        check_hub(src.base_model, "The base model")
        try:
            path = Path(hf_hub_download(src.base_model, "config.json"))
        except Exception as e:  # noqa: BLE001 - any hub failure is the same message to the user
            raise UserError(f"Could not read the config of '{src.base_model}' ({e}).", hint="Pass the base model's folder with --base.") from None
    try:
        return json.loads(path.read_text(encoding="utf-8")), str(path)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not readable JSON ({e}).") from None


def _weights_folder(src: Source) -> Path:
    folder = src.adapter_dir if src.kind == "full" else Path(src.base_model)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        check_hub(src.base_model, "The base model")
        folder = Path(snapshot_download(src.base_model, allow_patterns=["*.safetensors", "*.json"]))
    return folder


def _quantize_k(f16_path: Path, out_path: Path, quant: str) -> None:
    """llama.cpp's own quantizer (k-quants) on an f16 GGUF."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant][1]
    rc = llama_cpp.llama_model_quantize(str(f16_path).encode(), str(out_path).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) on {f16_path}")


def _k_quant_plan(plan: TensorPlan, path: Path) -> None:
    """After llama.cpp's quantizer, what each tensor became (for the read-back check)."""
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    plan.items = [(g, s, shape, types.get(g, t)) for g, s, shape, t in plan.items]


def _projector(src: Source, config: dict, source) -> Projector | None:
    """The projector file (mmproj) to write beside the language model: for an image-text model, or a run on one,
    whose family's projector finetuner writes (``gguf_mmproj``). None for a text model, and for an image-text
    model whose projector is not written when its language model stands alone (a causal LM class, Gemma 3's) and
    the run saw no pictures: that one is written alone, with a note. Otherwise a one-line refusal says why."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from finetuner.infer.loading import picture_processor
    from finetuner.model.vision import image_text_type, load_processor

    if not image_text_type(config):
        return None
    processor = picture_processor(src)
    trained_on_pictures = src.kind != "model" and processor is not None
    if processor is None and src.kind != "model" and not is_gguf_name(src.base_model):
        with contextlib.suppress(UserError):  # a run on text: the base model's processor, where it has one
            processor = load_processor(src.base_model, trust_remote_code=src.trust_remote_code)
    try:
        return projector_for(config, getattr(processor, "image_processor", None), str(source),
                             getattr(processor, "image_break_token_id", None))
    except UserError:
        if trained_on_pictures or config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise
        return None


def export_model(
    source: str | Path,
    output: str | Path,
    format: str = "gguf",
    quant: str = "f16",
    overwrite: bool = False,
    base_model: str | None = None,
    merge_dtype: str = "fp32",
    verify: bool = True,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    ollama_name: str | None = None,
) -> ExportResult:
    """Export a run, an adapter or a model folder to GGUF (llama.cpp, LM Studio) or Ollama.

    Args:
        source: a run folder, a peft adapter folder, or a model folder (nothing to merge).
        output: ``format="gguf"``: the ``.gguf`` file to write; ``format="ollama"``: a new or
            empty folder that gets ``model.gguf`` and a ``Modelfile``.
        format: ``gguf`` or ``ollama``.
        quant: ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0`` (the gguf package's quantizers), or
            ``q4_k_m`` (needs llama-cpp-python). Norms and biases stay float32.
        overwrite: replace an existing output, only once the new one is complete and checked.
        base_model: where the base model is, if not where the run or adapter says.
        merge_dtype: dtype of the merge (``fp32`` by default: the GGUF is rounded once, from it).
        verify: check the file with transformers' GGUF loader (logits and tokenizer); the
            read-back of the tensors always runs.
        trust_remote_code: allow the model's own code to run (a run whose recipe sets
            ``model.trust_remote_code`` is refused without this).
        allow_pickle: allow pickle weight files (a run whose recipe sets ``model.allow_pickle`` is refused without this).
        ollama_name: ``format="ollama"``: the model's name in the printed ``ollama create`` command
            (made a valid Ollama name); default: the output folder's name.

    Example::

        >>> import finetuner
        >>> r = finetuner.export_model("runs/demo_cpu", "exports/demo.gguf", quant="q8_0")  # doctest: +SKIP
        >>> r.max_abs_logit_diff, r.top1_agreement                                         # doctest: +SKIP
    """
    t0 = time.perf_counter()
    _check_args(format, quant)
    src = resolve_source(source, base_model, trust_remote_code, allow_pickle)
    out = Path(output).expanduser().resolve()
    if format == "gguf":
        _check_gguf_output(out, overwrite, src)
    else:
        check_output_dir(out, overwrite, src)
    config, config_path = _model_config(src)
    projector = _projector(src, config, source)
    arch = arch_for(config, config_path)
    if verify and gguf_llama.checks(arch.model_type, arch.gguf_arch):  # only llama.cpp reads it back: installed, or refused here
        gguf_llama.require(arch.model_type, arch.gguf_arch)
    if format == "gguf" and projector is not None:
        check_gguf_replaceable(mmproj_path(out), overwrite)
    from finetuner.infer.probe import kept_note

    notes: list[str] = [n for n in [kept_note(src.run_dir if src.has_adapter else None)] if n]  # before shipping
    if arch.text_of:
        config = arch.config
    if arch.text_of and projector is None:
        notes.append(f"{arch.text_of} is an image-text-to-text checkpoint: its language model is written; its vision tower "
                     "and projector are not (llama.cpp reads them from a separate mmproj file, which finetuner does not write).")
    with quieted():
        tokenizer = load_tokenizer(src)
        template = chat_template(src, tokenizer)
        vocab = vocab_from_tokenizer(tokenizer, int(config["vocab_size"]), str(src.tokenizer_dir))
        system = system_prompt(src)
        modelfile_text = None
        if format == "ollama":
            from finetuner.export.ollama import default_system, modelfile

            if not system:  # the template's own system block, which every example without one was trained with
                alone = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], chat_template=template,
                                                      tokenize=False, add_generation_prompt=True)
                system = default_system(template, alone)
                if system:
                    notes.append(f"the chat template writes a system block of its own when there is none ({system[:60]!r}"
                                 f"{'...' if len(system) > 60 else ''}); the Modelfile's SYSTEM says it, so Ollama prompts as "
                                 "training did")
            tools_format = trained_tools(src)
            modelfile_text = modelfile("model.gguf", template, system, tokenizer.eos_token,
                                       projector="mmproj.gguf" if projector is not None else None, tools_format=tools_format)
            if tools_format == FALLBACK_FORMAT:
                notes.append(f"the run trained tool calls in finetuner's fallback format ({FALLBACK_FORMAT}); the Modelfile's "
                             "TEMPLATE writes Ollama's tools and tool calls in it (<tool_call> blocks)")
        out.parent.mkdir(parents=True, exist_ok=True)
        merged_dir = out.parent / f".{out.name}.tmp-merged-{os.getpid()}"
        from finetuner.fileio import DiskFull, give_back

        try:
            if src.has_adapter:
                merge_adapter(src.path, merged_dir, dtype=merge_dtype, base_model=base_model, verify=verify, overwrite=True)
                weights = merged_dir
                if src.recipe is not None and src.recipe.quantization is not None:
                    notes.append(f"The run trained on a {src.recipe.quantization.bits}-bit base; the adapter was merged into the "
                                 f"unquantized base in {merge_dtype}.")
            else:
                weights = _weights_folder(src)
            return _write_and_check(src, out, format, quant, overwrite, arch, weights, vocab, tokenizer, template,
                                    modelfile_text, verify, notes, t0, ollama_name, projector)
        except DiskFull as e:  # the merge's (of its hidden folder) or the GGUF file's: said of the output, the free
            need = _space_needed(e, out, merged_dir if src.has_adapter else None, merge_dtype, quant)  # space measured
            give_back(merged_dir, e)  # once nothing staged is left
            raise DiskFull(out, f"run the same command again (nothing was written to {out})", need) from None
        finally:
            shutil.rmtree(merged_dir, ignore_errors=True)


#: bytes a weight takes in the GGUF file, by --quant (q4_k_m: the f16 file llama.cpp's quantizer reads, and its output)
GGUF_BYTES_PER_WEIGHT = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_k_m": 2 + 4.9 / 8}


def _space_needed(full, out: Path, merged_dir: Path | None, merge_dtype: str, quant: str) -> int | None:
    """What an export whose disk was ``full`` (a :class:`~finetuner.fileio.DiskFull`) needs free in all to run
    again: the merge's room (its check's) and the GGUF file's (:func:`gguf_bytes`). When the merge itself found the
    disk full the GGUF file's size is estimated from the merged weights' (:data:`GGUF_BYTES_PER_WEIGHT`)."""
    from finetuner.export.merge import SPACE_MARGIN, space_needed
    from finetuner.fileio import tree_bytes

    if full.path != str(out):  # the merge's: its need is the merge's check, the merged weights in merge_dtype
        if full.need_bytes is None:
            return None
        weights = (full.need_bytes - SPACE_MARGIN) / 1.05
        gguf_file = weights / (2 if merge_dtype in ("bf16", "fp16") else 4) * GGUF_BYTES_PER_WEIGHT[quant]
        return int(full.need_bytes + gguf_file + EXPORT_MARGIN)
    merged = space_needed(tree_bytes(merged_dir)) if merged_dir is not None and merged_dir.is_dir() else 0
    return merged + (full.need_bytes or 0) or None


#: room an export asks for beyond its GGUF files (the Modelfile, the marker, the file system's own blocks)
EXPORT_MARGIN = 2**20


def gguf_bytes(plan: TensorPlan) -> int:
    """The bytes of the file of ``plan``: its header (metadata, vocabulary, tensor infos: as written, once it
    is) and its tensors as the file stores them, each aligned to 32 bytes."""
    import gguf

    from finetuner.export.gguf_tensors import ggml_type

    total = getattr(plan, "header_bytes", 0)
    for _, _, shape, tname in plan.items:
        block, size = gguf.GGML_QUANT_SIZES[ggml_type(tname)]
        n = 1
        for d in shape:
            n *= int(d)
        total += -(-(n // block * size) // 32) * 32
    return total


def mmproj_path(out: Path) -> Path:
    """Where ``export --format gguf -o OUT`` writes an image-text model's projector file: ``mmproj-OUT`` beside it
    (llama.cpp's and LM Studio's name for it)."""
    return out.with_name(f"mmproj-{out.name}")


def _write_and_check(src, out, fmt, quant, overwrite, arch, weights, vocab, tokenizer, template, modelfile_text, verify, notes, t0,
                     ollama_name=None, projector: Projector | None = None):
    plan = TensorPlan(arch, weights, quant)
    projector_plan = ProjectorPlan(projector, weights, quant) if projector is not None else None
    if fmt == "gguf":
        tmp_dir, name = out.parent, f".{out.stem}.tmp-export-{os.getpid()}.gguf"
        mm_name = f".{out.stem}.tmp-export-{os.getpid()}.mmproj.gguf"
    else:
        tmp_dir, name = out.parent / f".{out.name}.tmp-export-{os.getpid()}", "model.gguf"
        mm_name = "mmproj.gguf"
        tmp_dir.mkdir()
    path = tmp_dir / name
    mm_path = tmp_dir / mm_name
    title = src.run_dir.name if src.run_dir is not None else Path(str(src.path)).name
    try:
        if quant == "q4_k_m":
            f16 = tmp_dir / f".{name}.f16.gguf"
            plan_f16 = TensorPlan(arch, weights, "f16")
            write_gguf(f16, arch, plan_f16, vocab, template, title, "f16", str(src.path))
            with phases.phase("quantize"):  # one call of llama.cpp's: its heartbeat says it goes on
                _quantize_k(f16, path, quant)
            f16.unlink()
            _k_quant_plan(plan, path)
        else:
            write_gguf(path, arch, plan, vocab, template, title, quant, str(src.path))
        max_err = check_tensors(path, plan)
        if projector_plan is not None:
            write_mmproj(mm_path, projector, projector_plan, f"{title} (projector)", str(src.path))
            max_err = max(max_err, check_tensors(mm_path, projector_plan))
            notes.append(f"the projector file (mmproj, llama.cpp's '{projector.projector_type}' projector) holds the vision "
                         f"tower and projector: {len(projector_plan.items)} tensors, {projector.n_layers} vision layers, "
                         "float16 matrices (float32 with --quant f32).")
        probe, probe_text = probe_ids(tokenizer, template)
        diff = max_logit = tol = top1 = None
        n_texts = 0
        if verify:
            texts = SAMPLE_TEXTS + [probe_text, " ".join(t for t in tokenizer.all_special_tokens)]
            if vocab.model == "llama":
                # transformers rebuilds a sentencepiece vocabulary with Metaspace(prepend_scheme="first"): unlike the
                # original and llama.cpp it adds no "▁" after a special token nor before leading spaces. So the text
                # between special tokens is compared piece by piece, and the special tokens by their ids.
                pieces = re.split("|".join(map(re.escape, sorted(tokenizer.all_special_tokens, key=len, reverse=True))), probe_text)
                texts = [t.lstrip() for t in SAMPLE_TEXTS + pieces if t.strip()]
                notes.append("sentencepiece vocabulary: the tokenizer check compares the text between special tokens, without "
                             "leading spaces, and the special tokens' ids (transformers' GGUF tokenizer adds no space there; "
                             "the original and llama.cpp do).")
            checked = name
            if arch.gguf_arch in READ_AS:  # an architecture transformers' loader does not read: its text twin
                checked = f".{out.stem}.tmp-check-{os.getpid()}.gguf"
                text_twin(path, tmp_dir / checked, arch.gguf_arch)
                notes.append(f"transformers' GGUF loader does not read llama.cpp's {arch.gguf_arch}: the tokenizer and "
                             f"logits checks read a copy of the file as {READ_AS[arch.gguf_arch]} (the same tensors and "
                             "settings, without the M-RoPE sections and DeepStack inputs, which text alone does not use).")
            try:
                if gguf_llama.checks(arch.model_type, arch.gguf_arch):  # transformers' loader does not read it: llama.cpp does
                    with phases.phase("verify", label="checking the GGUF file with llama.cpp"):
                        n_texts, diff, max_logit, tol, top1 = check_with_llama_cpp(path, weights, tokenizer, texts, probe,
                                                                                   arch, quant, notes)
                else:
                    with phases.phase("verify", label="checking the GGUF file with transformers' loader"):
                        n_texts = check_tokenizer(tmp_dir, checked, tokenizer, texts, tokenizer.all_special_tokens)
                        diff, max_logit, tol, top1 = check_logits(weights, tmp_dir, checked, probe, arch, quant, notes)
            finally:
                if checked != name:
                    (tmp_dir / checked).unlink(missing_ok=True)
        command = run_command = mmproj_file = None
        if fmt == "gguf":
            check_gguf_replaceable(out, overwrite)  # again: nothing else arrived there meanwhile
            if projector_plan is not None:
                mmproj_file = mmproj_path(out)
                check_gguf_replaceable(mmproj_file, overwrite)
                os.replace(mm_path, mmproj_file)
            os.replace(path, out)
            gguf_file, modelfile_path = out, None
        else:
            from finetuner.export.ollama import model_name

            (tmp_dir / "Modelfile").write_text(modelfile_text, encoding="utf-8")
            write_export_marker(tmp_dir, "ollama", str(src.path))
            publish_replacing(tmp_dir, out, overwrite)
            gguf_file, modelfile_path = out / name, out / "Modelfile"
            mmproj_file = out / mm_name if projector_plan is not None else None
            command = f"ollama create {model_name(ollama_name or out.name)} -f {modelfile_path}"
            run_command = f"ollama run {model_name(ollama_name or out.name)}"
    except BaseException as e:
        from finetuner.fileio import DiskFull, is_disk_full

        full = isinstance(e, Exception) and is_disk_full(e, out.parent)  # asked before the half-written file goes
        if fmt == "gguf":
            for staged in (path, mm_path, tmp_dir / f".{name}.f16.gguf"):
                staged.unlink(missing_ok=True)
        else:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        if full:  # its need: the file's tensors (q4_k_m: and the f16 file it is quantized from); the caller adds the merge's
            need = gguf_bytes(plan) + (gguf_bytes(projector_plan) if projector_plan is not None else 0) + EXPORT_MARGIN
            raise DiskFull(out, f"run the same command again (nothing was written to {out})",
                           int(need * GGUF_BYTES_PER_WEIGHT[quant] / 2) if quant == "q4_k_m" else need) from None
        raise
    return ExportResult(
        output=out, gguf_file=gguf_file, modelfile=modelfile_path, format=fmt, quant=quant, source=str(src.path),
        base_model=src.base_model, architecture=arch.gguf_arch, tensors=len(plan.items), file_bytes=gguf_file.stat().st_size,
        max_weight_error=max_err, max_abs_logit_diff=diff, max_abs_logit=max_logit, tolerance=tol, top1_agreement=top1,
        probe_tokens=int(probe.shape[1]), tokenizer_texts=n_texts, peak_rss_bytes=peak_rss(),
        seconds=round(time.perf_counter() - t0, 2), ollama_command=command, ollama_run=run_command, notes=notes,
        mmproj_file=mmproj_file, mmproj_tensors=len(projector_plan.items) if projector_plan is not None else 0,
        mmproj_bytes=mmproj_file.stat().st_size if mmproj_file is not None else 0,
    )

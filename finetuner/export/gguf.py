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
import gc
import io
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
from finetuner.export.gguf_arch import Arch, arch_for
from finetuner.export import gguf_llama
from finetuner.export.gguf_gemma4 import WEIGHT_SUFFIXED
from finetuner.export.gguf_llama import CHECKED_BY_LLAMA_CPP
from finetuner.export.gguf_recurrent import F32_ALWAYS
from finetuner.export.gguf_mmproj import Projector, projector_for
from finetuner.export.gguf_vocab import vocab_from_tokenizer
from finetuner.export.merge import (PROBE_MESSAGES, TOLERANCE, check_output_dir, merge_adapter, peak_rss, publish_replacing,
                                    write_export_marker)
from finetuner.infer.loading import Source, chat_template, load_tokenizer, resolve_source, system_prompt, trained_tools
from finetuner.model.gguf_base import is_gguf_name, pretrained_args
from finetuner.quiet import quieted
from finetuner.surface import say

FORMATS = ("gguf", "ollama")
#: --quant → (GGML tensor type for 2-D weights, llama.cpp file type); q4_k_m goes through llama.cpp's quantizer.
QUANTS = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2), "q4_k_m": (None, 15)}
#: Logit tolerance (relative to the largest |logit|, at least 1) per float type, as merge's.
LOGIT_TOLERANCE = {"f32": TOLERANCE["fp32"], "f16": TOLERANCE["fp16"], "bf16": TOLERANCE["bf16"]}
#: The fewest probe positions whose top-1 token must agree, for the 8-bit type.
MIN_TOP1 = {"q8_0": 0.9}
#: Largest dequantization error allowed, as a fraction of the block's largest |weight| (blocks of 32).
BLOCK_ERROR = {"Q8_0": 0.5 / 127 + 2e-3, "Q4_0": 1 / 8 + 2e-3}
#: Largest error for float types, relative to |weight| (half an ulp, and subnormals).
FLOAT_ERROR = {"F32": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8}
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
                f"peak RSS {self.peak_rss_bytes / 2**30:.2f} GiB)")


def _ggml_type(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


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


#: The GGUF metadata key finetuner writes into every file it exports (JSON: kind, source, time);
#: ``overwrite`` replaces only a ``.gguf`` file that holds it.
MARKER_KEY = "finetuner.export"


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


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} holds no .safetensors weights; GGUF export reads safetensors.",
                        hint="Re-save the model with save_pretrained(safe_serialization=True).")
    return files


#: one expert's matrix in a checkpoint that stores them apart (Qwen3-MoE's ``mlp.experts.7.up_proj.weight``)
_EXPERT = re.compile(r"(?P<stack>.+\.experts)\.(?P<i>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")


class _Plan:
    """Every tensor to write: GGUF name, source (file, HF name) or an extra array, and GGML type."""

    def __init__(self, arch: Arch, folder: Path, quant: str):
        import gguf
        from safetensors import safe_open

        arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch.gguf_arch)
        allowed = set(gguf.MODEL_TENSORS[arch_enum])
        name_map = gguf.get_tensor_name_map(arch_enum, arch.n_layers)
        tied = bool(arch.config.get("tie_word_embeddings", False))
        self.arch, self.items = arch, []
        experts: dict[tuple[str, str], dict[int, tuple[Path, str, tuple[int, ...]]]] = {}
        for f in _safetensors_files(folder):
            with safe_open(str(f), framework="pt") as st:
                for hf_name in st.keys():
                    own = arch.language_name(hf_name)
                    if own is None or own.endswith("rotary_emb.inv_freq") or (tied and own == "lm_head.weight"):
                        continue  # (an image-text-to-text checkpoint's vision tower: not part of the language model)
                    each = _EXPERT.fullmatch(own)
                    if each:  # one expert's matrix, as checkpoints store them: stacked below, as llama.cpp reads them
                        experts.setdefault((each["stack"], each["proj"]), {})[int(each["i"])] = (
                            f, hf_name, tuple(st.get_slice(hf_name).get_shape()))
                        continue
                    shape = arch.stored_shape(hf_name, tuple(st.get_slice(hf_name).get_shape()))
                    if own.endswith("experts.gate_up_proj"):  # transformers' fused experts: llama.cpp's two stacks
                        half = (shape[0], shape[1] // 2, *shape[2:])
                        for i, part in enumerate(("gate_proj", "up_proj")):  # the gate first (transformers' chunk)
                            found = name_map.get_type_and_name(own.replace("gate_up_proj", part), try_suffixes=(".weight",))
                            self.items.append((found[1] + ".weight", (f, hf_name, i), half, self._type(half, quant)))
                        continue
                    found = name_map.get_type_and_name(arch.source_key(own), try_suffixes=(".weight", ".bias"))
                    if found is not None and own.endswith(("experts.down_proj", *WEIGHT_SUFFIXED)):  # a bare parameter:
                        # GGUF's .weight (Gemma 4's layer_scalar: the converter's Gemma4Model.filter_tensors)
                        found = (found[0], found[1] + ".weight")
                    if found is None or found[0] not in allowed:
                        raise UserError(f"{f}: the tensor '{hf_name}' has no place in llama.cpp's {arch.gguf_arch} architecture; "
                                        "GGUF export refuses the model rather than drop it.")
                    self.items.append((found[1], (f, hf_name), shape, self._type(shape, quant, found[1])))
        for (stack, proj), per in sorted(experts.items()):
            found = name_map.get_type_and_name(f"{stack}.{proj}", try_suffixes=(".weight",))
            if found is None or found[0] not in allowed or sorted(per) != list(range(len(per))):
                raise UserError(f"{folder}: the experts '{stack}.*.{proj}' have no place in llama.cpp's {arch.gguf_arch} "
                                "architecture; GGUF export refuses the model rather than drop them.")
            shape = (len(per), *per[0][2])
            self.items.append((found[1] + ".weight", [per[i][:2] for i in range(len(per))], shape, self._type(shape, quant)))
        for name, array in arch.extra_tensors().items():
            self.items.append((name, array, tuple(array.shape), "F32"))

    @staticmethod
    def _type(shape: tuple[int, ...], quant: str, gguf_name: str = ".weight") -> str:
        want = QUANTS[quant][0] or "F16"
        if len(shape) < 2 or not gguf_name.endswith(".weight") or gguf_name.endswith(F32_ALWAYS):
            return "F32"  # norms, biases, Mamba's A and D, the convolutions: float32, as llama.cpp's converter keeps them
        if want in BLOCK_ERROR and shape[-1] % 32:
            return "F16"  # rows that are not whole blocks
        return want

    def tensor(self, src) -> Any:
        """The float32 numpy array GGUF stores for ``src`` (permuted for RoPE where needed)."""
        from safetensors import safe_open

        if isinstance(src, list):  # one matrix an expert: stacked (experts, out, in)
            import numpy as np

            out = []
            for f, hf_name in src:
                with safe_open(str(f), framework="pt") as st:
                    out.append(self.arch.transform(hf_name, st.get_tensor(hf_name).float().numpy()))
            return np.stack(out)
        if not isinstance(src, tuple):
            return src
        f, hf_name, *part = src
        with safe_open(str(f), framework="pt") as st:
            w = st.get_tensor(hf_name).float().numpy()
        if part:  # one half of a fused gate_up stack (experts, 2 x width, hidden)
            rows = w.shape[1] // 2
            w = w[:, part[0] * rows:(part[0] + 1) * rows]
        return self.arch.transform(hf_name, w)


class _ProjectorPlan(_Plan):
    """The projector file's tensors: the vision tower's and the projector's, named as llama.cpp's mmproj reads them."""

    def __init__(self, projector: Projector, folder: Path, quant: str):
        from safetensors import safe_open

        self.arch, self.items = projector, []
        for f in _safetensors_files(folder):
            with safe_open(str(f), framework="pt") as st:
                for hf_name in st.keys():
                    for gname, part, shape in projector.parts(hf_name, tuple(st.get_slice(hf_name).get_shape())):
                        self.items.append((gname, (f, hf_name, part), shape, projector.tensor_type(hf_name, shape, quant)))
        if not any(g.startswith("v.blk.") for g, *_ in self.items) or not any(g.startswith("mm.") for g, *_ in self.items):
            raise UserError(f"{folder}: no vision tower or projector weights were found for the projector file (mmproj).")

    def tensor(self, src) -> Any:
        """The float32 numpy array the projector file stores for ``src`` (a part of a split tensor where named)."""
        from safetensors import safe_open

        f, hf_name, part = src
        with safe_open(str(f), framework="pt") as st:
            return self.arch.transform(hf_name, st.get_tensor(hf_name).float().numpy(), part)


def _encode(data, qtype_name: str):
    import gguf
    import numpy as np

    if qtype_name == "F32":
        return data.astype(np.float32, copy=False)
    if qtype_name == "F16":
        return data.astype(np.float16)
    return gguf.quants.quantize(data, _ggml_type(qtype_name))


def _write_tensors(writer, plan) -> None:
    """The tensor infos, the header and then the data, one tensor in memory at a time."""
    import gguf
    import numpy as np

    for gname, _, shape, tname in plan.items:
        qtype = _ggml_type(tname)
        if tname in ("F32", "F16"):
            dtype = np.float32 if tname == "F32" else np.float16
            writer.add_tensor_info(gname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, src, _, tname in plan.items:
        writer.write_tensor_data(_encode(plan.tensor(src), tname))
        phases.advance()  # the caller's "export" phase


def _marker(source: str) -> str:
    return json.dumps({"kind": "gguf", "source": source, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def _write_gguf(path: Path, arch: Arch, plan: _Plan, vocab, template: str, name: str, quant: str, source: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch.gguf_arch)
    try:
        writer.add_name(name)
        writer.add_string(MARKER_KEY, _marker(source))
        arch.write_metadata(writer)
        writer.add_file_type(QUANTS[quant][1])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocab.write(writer, template)
        with phases.phase("export", total=len(plan.items), unit="tensors"):
            _write_tensors(writer, plan)
    finally:
        writer.close()


def _write_mmproj(path: Path, projector: Projector, plan: _Plan, name: str, source: str) -> None:
    """The projector file: architecture ``clip``, type ``mmproj``, float tensors (see ``gguf_mmproj``)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), projector.gguf_arch)
    try:
        writer.add_name(name)
        writer.add_string(MARKER_KEY, _marker(source))
        projector.write_metadata(writer)
        writer.add_file_type(QUANTS["f32" if all(t == "F32" for *_, t in plan.items) else "f16"][1])
        with phases.phase("export", total=len(plan.items), unit="tensors", label="writing the projector file (mmproj)"):
            _write_tensors(writer, plan)
    finally:
        writer.close()


def _error_ratio(expected, got, tname: str) -> float:
    """Worst error over its allowed bound (≤ 1 passes)."""
    import numpy as np

    err = np.abs(got - expected)
    if tname in FLOAT_ERROR:
        return float((err / (FLOAT_ERROR[tname] * np.abs(expected) + 1e-7)).max())
    # block types: the error is bounded by a fraction of the block's largest |weight| (llama.cpp's
    # k-quants, written by its quantizer, get a loose quarter of it)
    amax = np.abs(expected).reshape(-1, 32).max(axis=1, keepdims=True)
    return float((err.reshape(-1, 32) / (BLOCK_ERROR.get(tname, 0.25) * amax + 1e-12)).max())


def _check_tensors(path: Path, plan: _Plan) -> float:
    """Read the file back, dequantize each tensor and compare with the merged weight; the largest |error|."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    stored = {t.name: t for t in reader.tensors}
    if sorted(stored) != sorted(i[0] for i in plan.items):
        raise RuntimeError(f"GGUF read-back: tensors {sorted(set(stored) ^ {i[0] for i in plan.items})} differ from those written")
    with phases.phase("readback", total=len(plan.items), unit="tensors") as reading:
        worst = _compare_tensors(stored, plan, reading)
    del reader
    return worst


def _compare_tensors(stored: dict[str, Any], plan: _Plan, reading: phases.Phase) -> float:
    """:func:`_check_tensors`' comparison, tensor by tensor; the largest |error|."""
    import gguf
    import numpy as np

    worst = 0.0
    for gname, src, shape, tname in plan.items:
        t = stored[gname]
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        expected = plan.tensor(src)
        if t.tensor_type.name != tname and tname != "F16":
            raise RuntimeError(f"GGUF read-back: {gname} is {t.tensor_type.name}, not {tname}")
        worst = max(worst, float(np.abs(got - expected).max()))
        if _error_ratio(expected, got, t.tensor_type.name) > 1.0 or not np.isfinite(got).all():
            raise RuntimeError(f"GGUF read-back: {gname} ({t.tensor_type.name}) differs from the merged weight by up to "
                               f"{float(np.abs(got - expected).max()):.3g}, more than the type's rounding")
        reading.advance()
    return worst


#: llama.cpp architectures transformers' GGUF loader does not read, and the one it reads their language model as
#: (Qwen2-VL's and Qwen2.5-VL's language model is Qwen2's with M-RoPE, Qwen3-VL's Qwen3's with interleaved M-RoPE
#: and DeepStack inputs: on text alone, Qwen2's and Qwen3's)
READ_AS = {"qwen2vl": "qwen2", "qwen3vl": "qwen3"}


def _text_twin(path: Path, twin: Path, gguf_arch: str) -> None:
    """A copy of the GGUF at ``path`` whose architecture is :data:`READ_AS`'s for ``gguf_arch``: its settings
    renamed, the M-RoPE sections left out, the tensors' bytes as they are. For the checks only."""
    import gguf

    into = READ_AS[gguf_arch]
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(twin), into)
    try:
        for f in reader.fields.values():
            if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF.") or f.name.endswith(
                    (".rope.dimension_sections", ".n_deepstack_layers")):
                continue
            key = into + f.name[len(gguf_arch):] if f.name.startswith(gguf_arch + ".") else f.name
            kind = f.types[0]
            writer.add_key_value(key, f.contents(), kind,
                                 sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
        for t in reader.tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(t.data)
    finally:
        writer.close()


def _probe_ids(tokenizer, template: str, max_tokens: int = 48):
    import torch

    text = tokenizer.apply_chat_template(PROBE_MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][-max_tokens:]
    return torch.tensor([ids]), text


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def _check_tokenizer(folder: Path, name: str, tokenizer, texts: list[str], specials: list[str]) -> int:
    from transformers import AutoTokenizer

    rebuilt = AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    for token in specials:
        if rebuilt.convert_tokens_to_ids(token) != tokenizer.convert_tokens_to_ids(token):
            raise UserError(f"The tokenizer cannot be represented in GGUF: rebuilt from the file, the special token {token!r} has "
                            f"id {rebuilt.convert_tokens_to_ids(token)}, not {tokenizer.convert_tokens_to_ids(token)}. Nothing was written.",
                            hint="Export a transformers folder with `finetuner merge` instead.")
    for text in texts:
        for special in (False, True):
            want = tokenizer(text, add_special_tokens=special)["input_ids"]
            got = rebuilt(text, add_special_tokens=special)["input_ids"]
            if want != got:
                at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                raise UserError(
                    f"The tokenizer cannot be represented in GGUF: rebuilt from the file it splits {text[:60]!r} differently "
                    f"(from token {at}: {want[at:at + 4]} vs {got[at:at + 4]}). Nothing was written.",
                    hint="Export a transformers folder with `finetuner merge` instead.",
                )
    return len(texts)


def _check_logits(weights: Path, folder: Path, name: str, probe, arch: Arch, quant: str, notes: list[str]):
    import torch
    from transformers import AutoModelForCausalLM

    reference = _merged_logits(weights, arch, probe)
    extra = {}
    if arch.rope_type != "default":  # transformers' GGUF loader reads no RoPE scaling
        extra["rope_parameters"] = arch.rope
        notes.append(f"transformers' GGUF loader ignores RoPE scaling; the check gave it the model's {arch.rope_type} parameters.")
    if arch.n_head and (arch.head_dim != int(arch.config["hidden_size"]) // arch.n_head  # (Mamba: no attention)
                        or arch.gguf_arch in ("qwen3", "qwen3moe", "qwen3vl")) \
            and arch.gguf_arch not in ("llama", "gemma2", "gemma3"):
        # the file says it (attention.key_length, as llama.cpp reads it); transformers' reader of this architecture
        # maps no key length and takes hidden_size / heads (Qwen3-4B: 80, not 128), or for Qwen3 its config's default,
        # 128, whatever the file holds
        extra["head_dim"] = arch.head_dim
        notes.append(f"transformers' GGUF loader reads no key length for {arch.gguf_arch}; the check gave it the model's "
                     f"head_dim {arch.head_dim}.")
    told = {"gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "head_dim"),
            "gemma3": ("query_pre_attn_scalar", "layer_types", "rope_parameters", "head_dim"),
            "qwen3moe": ("moe_intermediate_size", "norm_topk_prob"),
            "lfm2": ("norm_eps",),
            "gemma4": ("head_dim", "layer_types", "rope_parameters", "hidden_size_per_layer_input",
                       "vocab_size_per_layer_input", "num_kv_shared_layers", "final_logit_softcapping")}.get(arch.gguf_arch, ())
    if told:  # what llama.cpp takes from the file or its architecture, and transformers' reader does not read
        extra.update({key: arch.config[key] for key in told if arch.config.get(key) is not None})
        notes.append(f"transformers' GGUF loader reads no {', '.join(told)} for {arch.gguf_arch}; the check gave it the "
                     "model's.")
    with contextlib.redirect_stderr(io.StringIO()):  # its loader draws a tqdm bar straight to stderr
        if arch.gguf_arch == "gemma4":
            # Gemma 4's head width varies by layer: its config takes the sliding layers' only at construction (the
            # full layers' is the file's key_length, read by transformers' loader as global_head_dim)
            from transformers import AutoConfig

            read = AutoConfig.from_pretrained(str(folder), gguf_file=name).to_dict()
            full = {int(i): c for i, c in read.pop("per_layer_config").items()}
            read["global_head_dim"] = next(c["head_dim"] for i, c in sorted(full.items()) if "head_dim" in c)
            extra = {"config": AutoConfig.for_model(**{**read, **extra})}
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32, **extra)
    got = _logits(model, probe)
    model = None
    gc.collect()
    return _compare(reference, got, quant, "transformers' GGUF loader")


def _merged_logits(weights: Path, arch: Arch, probe):
    """The merged model's float32 logits on the probe (an image-text checkpoint: its language model's)."""
    import torch
    from transformers import AutoModelForCausalLM

    if arch.text_of:  # an image-text checkpoint: its language model on the text probe
        from transformers import AutoModelForImageTextToText

        merged = AutoModelForImageTextToText.from_pretrained(str(weights), dtype=torch.float32)
    else:
        merged = AutoModelForCausalLM.from_pretrained(str(weights), dtype=torch.float32)
    reference = _logits(merged, probe)
    merged = None
    gc.collect()
    return reference


def _compare(reference, got, quant: str, reader: str):
    """Max |logit difference|, the largest logit, the tolerance and the top-1 agreement of ``reader``'s logits against
    the merged model's; a RuntimeError past the type's rounding."""
    diff = float((got - reference).abs().max())
    max_logit = float(reference.abs().max())
    top1 = float((got.argmax(-1) == reference.argmax(-1)).float().mean())
    tol = LOGIT_TOLERANCE[quant] * max(1.0, max_logit) if quant in LOGIT_TOLERANCE else None
    if (tol is not None and not diff <= tol) or (quant in MIN_TOP1 and top1 < MIN_TOP1[quant]):
        limit = f"tolerance {tol:.3g}" if tol is not None else f"top-1 agreement at least {MIN_TOP1[quant]:.0%}"
        raise RuntimeError(f"{reader} gives logits that differ from the merged model's by up to {diff:.3g} "
                           f"(top-1 agreement {top1:.0%}; {limit}); nothing was written")
    return diff, max_logit, tol, top1


def _check_with_llama_cpp(path: Path, weights: Path, tokenizer, texts: list[str], probe, arch: Arch, quant: str,
                          notes: list[str]):
    """llama.cpp's tokenizer ids for ``texts`` and logits on the probe against the original tokenizer's and the merged
    model's (for an architecture transformers' GGUF loader does not read)."""
    got, ids = gguf_llama.read(path, probe[0].tolist(), texts)
    for text, llama_ids in ids.items():
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        if llama_ids != want:
            at = next((i for i, (a, b) in enumerate(zip(want, llama_ids)) if a != b), min(len(want), len(llama_ids)))
            raise UserError(f"The tokenizer cannot be represented in GGUF: llama.cpp splits {text[:60]!r} differently (from "
                            f"token {at}: {want[at:at + 4]} vs {llama_ids[at:at + 4]}). Nothing was written.",
                            hint="Export a transformers folder with `finetuner merge` instead.")
    notes.append(f"transformers' GGUF loader does not read llama.cpp's {arch.gguf_arch}: llama.cpp itself (llama-cpp-python) "
                 "checked the tokenizer and the logits.")
    return (len(ids), *_compare(_merged_logits(weights, arch, probe), got, quant, "llama.cpp"))


def _quantize_k(f16_path: Path, out_path: Path, quant: str) -> None:
    """llama.cpp's own quantizer (k-quants) on an f16 GGUF."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant][1]
    rc = llama_cpp.llama_model_quantize(str(f16_path).encode(), str(out_path).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) on {f16_path}")


def _k_quant_plan(plan: _Plan, path: Path) -> None:
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
    if verify and arch.gguf_arch in CHECKED_BY_LLAMA_CPP:  # only llama.cpp reads it back: installed, or refused here
        gguf_llama.require(arch.gguf_arch)
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
        finally:
            shutil.rmtree(merged_dir, ignore_errors=True)


def mmproj_path(out: Path) -> Path:
    """Where ``export --format gguf -o OUT`` writes an image-text model's projector file: ``mmproj-OUT`` beside it
    (llama.cpp's and LM Studio's name for it)."""
    return out.with_name(f"mmproj-{out.name}")


def _write_and_check(src, out, fmt, quant, overwrite, arch, weights, vocab, tokenizer, template, modelfile_text, verify, notes, t0,
                     ollama_name=None, projector: Projector | None = None):
    plan = _Plan(arch, weights, quant)
    projector_plan = _ProjectorPlan(projector, weights, quant) if projector is not None else None
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
            plan_f16 = _Plan(arch, weights, "f16")
            _write_gguf(f16, arch, plan_f16, vocab, template, title, "f16", str(src.path))
            with phases.phase("quantize"):  # one call of llama.cpp's: its heartbeat says it goes on
                _quantize_k(f16, path, quant)
            f16.unlink()
            _k_quant_plan(plan, path)
        else:
            _write_gguf(path, arch, plan, vocab, template, title, quant, str(src.path))
        max_err = _check_tensors(path, plan)
        if projector_plan is not None:
            _write_mmproj(mm_path, projector, projector_plan, f"{title} (projector)", str(src.path))
            max_err = max(max_err, _check_tensors(mm_path, projector_plan))
            notes.append(f"the projector file (mmproj, llama.cpp's '{projector.projector_type}' projector) holds the vision "
                         f"tower and projector: {len(projector_plan.items)} tensors, {projector.n_layers} vision layers, "
                         "float16 matrices (float32 with --quant f32).")
        probe, probe_text = _probe_ids(tokenizer, template)
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
                _text_twin(path, tmp_dir / checked, arch.gguf_arch)
                notes.append(f"transformers' GGUF loader does not read llama.cpp's {arch.gguf_arch}: the tokenizer and "
                             f"logits checks read a copy of the file as {READ_AS[arch.gguf_arch]} (the same tensors and "
                             "settings, without the M-RoPE sections and DeepStack inputs, which text alone does not use).")
            try:
                if arch.gguf_arch in CHECKED_BY_LLAMA_CPP:  # transformers' loader does not read it: llama.cpp does
                    with phases.phase("verify", label="checking the GGUF file with llama.cpp"):
                        n_texts, diff, max_logit, tol, top1 = _check_with_llama_cpp(path, weights, tokenizer, texts, probe,
                                                                                   arch, quant, notes)
                else:
                    with phases.phase("verify", label="checking the GGUF file with transformers' loader"):
                        n_texts = _check_tokenizer(tmp_dir, checked, tokenizer, texts, tokenizer.all_special_tokens)
                        diff, max_logit, tol, top1 = _check_logits(weights, tmp_dir, checked, probe, arch, quant, notes)
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
        if fmt == "gguf":
            path.unlink(missing_ok=True)
            mm_path.unlink(missing_ok=True)
            (tmp_dir / f".{name}.f16.gguf").unlink(missing_ok=True)
        else:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        from finetuner.fileio import DiskFull, is_disk_full

        if isinstance(e, Exception) and is_disk_full(e, out.parent):
            raise DiskFull(out, f"run the same command again (nothing was written to {out})") from None
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

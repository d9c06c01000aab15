"""The tensors of a GGUF export: which checkpoint tensor becomes which GGUF tensor (gguf's own ``TensorNameMap`` for
the architecture, :class:`~finetuner.export.gguf_arch.Arch`'s transforms), in which GGML type, and how the file is
written: the header from the shapes alone, then one tensor at a time (converted, quantized, written, dropped), so the
export holds one tensor and its quantized copy at once. The projector file (mmproj) of an image-text model the same
way, with :mod:`finetuner.export.gguf_mmproj`'s names.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.errors import UserError
from finetuner.export.gguf_arch import Arch
from finetuner.export.gguf_gemma4 import WEIGHT_SUFFIXED
from finetuner.export.gguf_mmproj import Projector
from finetuner.export.gguf_recurrent import F32_ALWAYS

#: --quant → (GGML tensor type for 2-D weights, llama.cpp file type); q4_k_m goes through llama.cpp's quantizer.
QUANTS = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2), "q4_k_m": (None, 15)}
#: Largest dequantization error allowed, as a fraction of the block's largest |weight| (blocks of 32).
BLOCK_ERROR = {"Q8_0": 0.5 / 127 + 2e-3, "Q4_0": 1 / 8 + 2e-3}
#: The GGUF metadata key finetuner writes into every file it exports (JSON: kind, source, time);
#: ``overwrite`` replaces only a ``.gguf`` file that holds it.
MARKER_KEY = "finetuner.export"


def ggml_type(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


def safetensors_files(folder: Path) -> list[Path]:
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
_EXPERT = re.compile(r"(?P<stack>.+\.experts)\.(?P<i>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
#: LFM2-MoE's expert matrices (Mixtral's names) as the projections gguf's map knows experts by
EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class TensorPlan:
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
        for f in safetensors_files(folder):
            with safe_open(str(f), framework="pt") as st:
                for hf_name in st.keys():
                    own = arch.language_name(hf_name)
                    if own is None or own.endswith("rotary_emb.inv_freq") or (tied and own == "lm_head.weight"):
                        continue  # (an image-text-to-text checkpoint's vision tower: not part of the language model)
                    each = _EXPERT.fullmatch(own)
                    if each:  # one expert's matrix, as checkpoints store them: stacked below, as llama.cpp reads them
                        experts.setdefault((each["stack"], EXPERT_PROJ.get(each["proj"], each["proj"])), {})[int(each["i"])] = (
                            f, hf_name, tuple(st.get_slice(hf_name).get_shape()))
                        continue
                    shape = arch.stored_shape(hf_name, tuple(st.get_slice(hf_name).get_shape()))
                    if own.endswith("experts.gate_up_proj"):  # transformers' fused experts: llama.cpp's two stacks
                        names = [name_map.get_type_and_name(own.replace("gate_up_proj", part), try_suffixes=(".weight",))[1]
                                 + ".weight" for part in ("gate_proj", "up_proj")]  # the gate first (transformers' chunk)
                        self._halves(names, 1, (f, hf_name), shape, quant)
                        continue
                    if arch.halves(own) is not None:  # Granite's fused gate and up: the architecture names the halves
                        self._halves(*arch.halves(own), (f, hf_name), shape, quant)
                        continue
                    found = name_map.get_type_and_name(arch.source_key(own), try_suffixes=(".weight", ".bias"))
                    if found is not None and own.endswith(("experts.down_proj", "experts.up_proj", *WEIGHT_SUFFIXED)):  # a bare parameter:
                        # GGUF's .weight (Gemma 4's layer_scalar: the converter's Gemma4Model.filter_tensors)
                        found = (found[0], found[1] + ".weight")
                    if found is None or found[0] not in allowed:
                        raise UserError(f"{f}: the tensor '{hf_name}' has no place in llama.cpp's {arch.gguf_arch} architecture; "
                                        "GGUF export refuses the model rather than drop it.")
                    self.items.append((found[1], (f, hf_name), shape, self._type(shape, quant, found[1])))
        for (stack, proj), per in sorted(experts.items()):
            found = name_map.get_type_and_name(arch.source_key(f"{stack}.{proj}"), try_suffixes=(".weight",))
            if found is None or found[0] not in allowed or sorted(per) != list(range(len(per))):
                raise UserError(f"{folder}: the experts '{stack}.*.{proj}' have no place in llama.cpp's {arch.gguf_arch} "
                                "architecture; GGUF export refuses the model rather than drop them.")
            shape = (len(per), *per[0][2])
            self.items.append((found[1] + ".weight", [per[i][:2] for i in range(len(per))], shape, self._type(shape, quant)))
        for name, array in arch.extra_tensors().items():
            self.items.append((name, array, tuple(array.shape), "F32"))

    def _halves(self, names, axis: int, src: tuple[Path, str], shape: tuple[int, ...], quant: str) -> None:
        """The two halves of a fused gate-and-up tensor along ``axis``, as the two tensors ``names``."""
        half = tuple(n // 2 if i == axis else n for i, n in enumerate(shape))
        for i, name in enumerate(names):
            self.items.append((name, (*src, i, axis), half, self._type(half, quant)))

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
        if part:  # one half of a fused gate-and-up tensor (along its axis)
            import numpy as np

            (i, axis), rows = part, w.shape[part[1]] // 2
            w = np.take(w, range(i * rows, (i + 1) * rows), axis=axis)
        return self.arch.transform(hf_name, w)


class ProjectorPlan(TensorPlan):
    """The projector file's tensors: the vision tower's and the projector's, named as llama.cpp's mmproj reads them."""

    def __init__(self, projector: Projector, folder: Path, quant: str):
        from safetensors import safe_open

        self.arch, self.items = projector, []
        for f in safetensors_files(folder):
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
    return gguf.quants.quantize(data, ggml_type(qtype_name))


def _write_tensors(writer, plan) -> None:
    """The tensor infos, the header and then the data, one tensor in memory at a time."""
    import gguf
    import numpy as np

    for gname, _, shape, tname in plan.items:
        qtype = ggml_type(tname)
        if tname in ("F32", "F16"):
            dtype = np.float32 if tname == "F32" else np.float16
            writer.add_tensor_info(gname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor_info(gname, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    plan.header_bytes = writer.fout[0].tell()  # the metadata, vocabulary and tensor infos: what a full disk's message counts
    from finetuner.fileio import hold

    hold("export")  # a test's pause (HOLD@export): the staging file made, its header written, no tensor yet
    for _, src, _, tname in plan.items:
        writer.write_tensor_data(_encode(plan.tensor(src), tname))
        phases.advance()  # the caller's "export" phase


def _marker(source: str) -> str:
    return json.dumps({"kind": "gguf", "source": source, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def write_gguf(path: Path, arch: Arch, plan: TensorPlan, vocab, template: str, name: str, quant: str, source: str) -> None:
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


def write_mmproj(path: Path, projector: Projector, plan: TensorPlan, name: str, source: str) -> None:
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

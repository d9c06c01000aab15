"""The checks of a GGUF file before it is published: every tensor read back and compared with the merged weight (within
its type's rounding), and a reader finetuner did not write (transformers' GGUF loader, or llama.cpp itself where
transformers does not read the architecture) gives the merged model's logits on a probe conversation and the original
tokenizer's ids on sample texts.
"""

from __future__ import annotations

import contextlib
import gc
import io
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.errors import UserError
from finetuner.export import gguf_llama
from finetuner.export.gguf_arch import Arch
from finetuner.export.gguf_tensors import BLOCK_ERROR, TensorPlan
from finetuner.export.merge import PROBE_MESSAGES, TOLERANCE

#: Logit tolerance (relative to the largest |logit|, at least 1) per float type, as merge's.
LOGIT_TOLERANCE = {"f32": TOLERANCE["fp32"], "f16": TOLERANCE["fp16"], "bf16": TOLERANCE["bf16"]}
#: The fewest probe positions whose top-1 token must agree, for the 8-bit type.
MIN_TOP1 = {"q8_0": 0.9}
#: Largest error for float types, relative to |weight| (half an ulp, and subnormals).
FLOAT_ERROR = {"F32": 0.0, "F16": 2.0**-11, "BF16": 2.0**-8}


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


def check_tensors(path: Path, plan: TensorPlan) -> float:
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


def _compare_tensors(stored: dict[str, Any], plan: TensorPlan, reading: phases.Phase) -> float:
    """:func:`check_tensors`' comparison, tensor by tensor; the largest |error|."""
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


def text_twin(path: Path, twin: Path, gguf_arch: str) -> None:
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


def probe_ids(tokenizer, template: str, max_tokens: int = 48):
    import torch

    text = tokenizer.apply_chat_template(PROBE_MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    # the last tokens, after the beginning-of-sequence token where the template starts with one: a model that read
    # all its text after it (Gemma) gives unsteady logits without (Gemma 3 270M at 8 bits: top-1 agreement 88% and
    # |logit difference| up to 7.9 on the cut probe, 100% and 0.82 with it)
    bos = getattr(tokenizer, "bos_token_id", None)
    head = ids[:1] if ids and isinstance(bos, int) and ids[0] == bos else []
    ids = head + ids[len(head):][-(max_tokens - len(head)):]
    return torch.tensor([ids]), text


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def check_tokenizer(folder: Path, name: str, tokenizer, texts: list[str], specials: list[str]) -> int:
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


def check_logits(weights: Path, folder: Path, name: str, probe, arch: Arch, quant: str, notes: list[str]):
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
        elif extra:  # set on the config transformers reads from the file: a key its class does not declare (Qwen3-MoE's
            # head_dim) would otherwise go to the model's constructor
            from transformers import AutoConfig

            read = AutoConfig.from_pretrained(str(folder), gguf_file=name)
            for key, value in extra.items():
                setattr(read, key, value)
            extra = {"config": read}
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


def check_with_llama_cpp(path: Path, weights: Path, tokenizer, texts: list[str], probe, arch: Arch, quant: str,
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
    notes.append(f"{gguf_llama.unread(arch.model_type, arch.gguf_arch)}: llama.cpp itself (llama-cpp-python) "
                 "checked the tokenizer and the logits.")
    return (len(ids), *_compare(_merged_logits(weights, arch, probe), got, quant, "llama.cpp"))

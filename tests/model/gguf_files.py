"""Tiny GGUF files of any architecture transformers' GGUF loader reads, written with the ``gguf`` package.

Everything is read from transformers and gguf themselves, nothing per family by hand: the model is the
tiny random model of the architecture's ``model_type`` (transformers' own config class, shrunk), its
hyper-parameters are written under the GGUF keys transformers' ``GGUF_CONFIG_MAPPING`` reads them from,
and each tensor under the GGUF name transformers' ``get_gguf_hf_weights_map`` maps back to it (the
inverse of what its tensor processor does on load: GPT-2's transposes, the experts' gate/up halves,
Mamba's and LFM2's convolutions, ``A = -exp(A_log)``). The vocabulary is the tests' tiny byte-level
BPE tokenizer, written by finetuner's own GGUF export (:mod:`finetuner.export.gguf_vocab`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the widths of every tiny model (seconds to build, load and train)
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "head_dim": 16, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "state_size": 8, "time_step_rank": 4, "expand": 2, "max_position_embeddings": 256,
        "global_head_dim": 16, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": None,
        "sliding_window": 64, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128}


def file_architecture(arch: str) -> str:
    """The ``general.architecture`` llama.cpp writes for a key of transformers' GGUF mapping (``qwen2_moe`` →
    ``qwen2moe``, ``gpt_oss`` → ``gpt-oss``): gguf's own name whose letters and digits are the same."""
    from gguf import MODEL_ARCH_NAMES

    bare = arch.replace("_", "").replace("-", "")
    return next((n for n in MODEL_ARCH_NAMES.values() if n.replace("_", "").replace("-", "") == bare), "llama")


def tiny_config(model_type: str, vocab_size: int):
    """transformers' config of ``model_type`` with the widths of :data:`TINY` (those it has)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    if hasattr(cfg, "allow_global_per_layer_attribute_access"):  # Gemma 4: one head width for every layer here
        cfg.allow_global_per_layer_attribute_access = True
    for key, value in {**TINY, "vocab_size": vocab_size}.items():
        if value is not None and (hasattr(cfg, key) or key in getattr(cfg, "attribute_map", {})):
            try:
                setattr(cfg, key, value)
            except Exception:  # noqa: BLE001 - a property (Falcon's head_dim), a per-layer one (Gemma 4's)
                pass
    if isinstance(getattr(cfg, "pad_token_id", None), int) and cfg.pad_token_id >= vocab_size:
        cfg.pad_token_id = None
    if getattr(cfg, "layer_types", None) is not None and len(cfg.layer_types) != cfg.num_hidden_layers:
        cfg.layer_types = list(cfg.layer_types)[-cfg.num_hidden_layers:]
    if getattr(cfg, "full_attn_idxs", None) is not None:
        cfg.full_attn_idxs = [1]
    cfg.tie_word_embeddings = False
    return cfg


def _value(v: Any) -> Any:
    if isinstance(v, (list, tuple)) and v and isinstance(v[0], (int, float)):
        return list(v)
    return v


def _header(out: Path, name: str, arch: str, cfg, tokenizer):
    """A ``gguf.GGUFWriter`` of ``out`` with the metadata of ``cfg`` under transformers' keys and the vocabulary."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from finetuner.export.gguf_vocab import vocab_from_tokenizer

    w = gguf.GGUFWriter(str(out), name)
    w.add_name(arch if name != arch else f"tiny {arch}")  # transformers reads Mistral from a name "mistral"
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    c = cfg.to_dict()
    for key, hf_key in GGUF_CONFIG_MAPPING[arch].items():
        v = c.get(hf_key) if isinstance(hf_key, str) else None
        if v is None and key == "attention.layer_norm_rms_epsilon":
            v = c.get("norm_eps")  # LFM2's name for it
        if v is None and key == "rope.freq_base":
            v = (c.get("rope_parameters") or {}).get("rope_theta")  # transformers 5 keeps it there
        if v is None and isinstance(hf_key, str):
            try:
                v = getattr(cfg, hf_key, None)
            except Exception:  # noqa: BLE001 - a per-layer attribute (Gemma 4's head_dim)
                v = None
        if key == "attention.head_count_kv" and getattr(cfg, "layer_types", None) and arch == "lfm2":
            v = [v if t == "full_attention" else 0 for t in cfg.layer_types]  # LFM2's per-layer list, as llama.cpp writes it
        if v is None or isinstance(v, (dict, str)) or (isinstance(v, list) and not v):
            continue
        v = _value(v)
        if isinstance(v, bool):
            w.add_bool(f"{name}.{key}", v)
        elif isinstance(v, int):
            w.add_uint32(f"{name}.{key}", v)
        elif isinstance(v, float):
            w.add_float32(f"{name}.{key}", v)
        elif isinstance(v, list) and all(isinstance(x, int) for x in v):
            w.add_array(f"{name}.{key}", v)
    vocab = vocab_from_tokenizer(tokenizer, len(tokenizer), "the tests' tokenizer")
    if vocab.unk_id is None:  # Gemma's tokenizer builder wants one: the padding token (never produced by the BPE)
        vocab.unk_id = vocab.pad_id
    vocab.write(w, None)  # no chat template: the run trains with the one the plan states
    return w


def write_tiny_gguf(arch: str, tokenizer, out: Path, seed: int = 0) -> Path:
    """A tiny random model of transformers' GGUF architecture ``arch`` (a key of ``GGUF_CONFIG_MAPPING``) as the
    GGUF file ``out``, its 2-D weights Q8_0 where their rows are whole blocks; returns ``out``."""
    import gguf
    import numpy as np
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
                                                          load_gguf_checkpoint)

    name = file_architecture(arch)  # llama.cpp writes Mistral as llama, named so (transformers reads the name)
    # an architecture transformers has no model for (deci): a Llama's tensors under its name
    model_type = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(arch, arch)
    cfg = tiny_config(model_type if model_type in CONFIG_MAPPING else "llama", len(tokenizer))
    # the config transformers reads back from such a file (what the file does not carry stays its default): the model
    _finish(_header(out, name, arch, cfg, tokenizer))
    try:
        parsed = load_gguf_checkpoint(str(out))["config"]
        cfg = AutoConfig.for_model(parsed.pop("model_type"), **parsed)
    except ValueError:  # transformers has no model of this architecture (deci): the Llama's tensors
        pass
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    processor = TENSOR_PROCESSORS.get(name, TensorProcessor)(config=cfg.to_dict())
    to_gguf: dict[str, list[str]] = {}
    as_type = "llama" if name == "llama" or cfg.model_type == "llama" else None  # Mistral, and deci's Llama
    for g, h in get_gguf_hf_weights_map(model, processor, model_type=as_type).items():
        # the fused experts (and Gemma 4's layer scale) map without a suffix; llama.cpp's converter names them
        # ``blk.N.ffn_gate_exps.weight`` (``layer_output_scale.weight``), Mamba's ``ssm_a``/``ssm_d`` stay bare
        bare = not g.endswith((".weight", ".bias")) and ("_exps" in g or g.endswith("layer_output_scale"))
        to_gguf.setdefault(h, []).append(g + ".weight" if bare else g)

    w = _header(out, name, arch, cfg, tokenizer)

    def add(gname: str, t: np.ndarray) -> None:
        t = np.ascontiguousarray(t.astype(np.float32))
        if t.ndim == 2 and t.shape[-1] % 32 == 0 and not gname.endswith(".bias"):
            w.add_tensor(gname, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, t)

    for hf_name, tensor in model.state_dict().items():
        names = to_gguf.get(processor.preprocess_name(hf_name)) or to_gguf.get(hf_name)
        if not names:
            continue
        t = tensor.detach().float().numpy()
        if len(names) == 2:  # the experts' fused gate_up: the gate half, then the up half
            half = t.shape[1] // 2
            for g in sorted(names, key=lambda g: "up" in g):
                add(g, t[:, :half] if "gate" in g else t[:, half:])
            continue
        g = names[0]
        if name == "gpt2" and any(k in g for k in ("attn_qkv.weight", "ffn_down.weight", "ffn_up.weight", "attn_output.weight")):
            t = t.T
        if ("ssm_conv1d.weight" in g or "shortconv.conv.weight" in g) and t.ndim == 3:
            t = t[:, 0]
        if "ffn_gate_inp_shexp" in g:  # transformers adds the leading 1 back
            t = t.reshape(-1)
        if "ssm_a" in g:
            t = -np.exp(t)
        add(g, t)
    _finish(w)
    return out


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

"""The projector file (mmproj) of an image-text model: which layers and names, per family (finetuner/export/gguf_mmproj.py).
That llama.cpp reads it as transformers runs the model is measured by scripts/validate/llama_cpp_vlm_check.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from finetuner.errors import UserError
from finetuner.export.gguf_mmproj import projector_for

REPO = Path(__file__).resolve().parents[2]
IMAGES = SimpleNamespace(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def llava(**extra) -> dict:
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
    return {"model_type": "llava", "vision_config": vision, "text_config": {"hidden_size": 64}, **extra}


@pytest.mark.parametrize("layer, count", [(-2, 3), (-1, 4), (2, 2)])
def test_the_feature_layer_decides_the_layers_written(layer, count):
    """hidden_states[i] of CLIP is the output of its first i layers: llama.cpp runs block_count layers up to the
    feature layer, so the layers past it are not written (LLaVA-1.5's -2: all but the last)."""
    p = projector_for(llava(vision_feature_layer=layer), IMAGES, "m")
    assert (p.n_layers, p.feature_layer) == (count, count)
    assert p.gguf_name(f"model.vision_tower.vision_model.encoder.layers.{count - 1}.mlp.fc1.weight") == f"v.blk.{count - 1}.ffn_up.weight"
    assert p.gguf_name(f"model.vision_tower.vision_model.encoder.layers.{count}.mlp.fc1.weight") is None
    assert p.gguf_name("model.vision_tower.vision_model.post_layernorm.weight") is None  # LLaVA reads before it
    assert p.gguf_name("model.language_model.layers.0.mlp.up_proj.weight") is None
    assert p.gguf_name("model.multi_modal_projector.linear_2.bias") == "mm.2.bias"


@pytest.mark.parametrize("change, why", [
    ({"vision_feature_select_strategy": "full"}, "drops the class token"),
    ({"vision_feature_layer": [-2, -5]}, "reads several vision layers"),
    ({"projector_hidden_act": "relu"}, "its projector is not LLaVA's"),
    ({"model_type": "mllama"}, "finetuner writes it for gemma3, idefics3, llava, mistral3, qwen2_5_vl, qwen2_vl, qwen3_vl, smolvlm"),
])
def test_what_llama_cpp_would_run_otherwise_is_refused(change, why):
    with pytest.raises(UserError, match=why):
        projector_for(llava(**change), IMAGES, "m")


def test_gemma3_projector_file(tmp_path):
    """Gemma 3: the SigLIP tower with its post-layernorm, tanh GELU, the soft-embedding norm stored as 1 + weight
    (llama.cpp multiplies by the stored weight), the pooling factor of a model not pooled 4x4."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    import finetuner
    from finetuner.model.tiny_vlm import tiny_gemma3

    model = tiny_gemma3(AutoTokenizer.from_pretrained(REPO / "data" / "demo_model"), tmp_path / "g3")
    with torch.no_grad():  # a norm that is not zero, so 1 + weight shows
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "g3")
    r = finetuner.export_model(tmp_path / "g3", tmp_path / "g3.gguf", quant="f32")
    assert r.mmproj_file == tmp_path / "mmproj-g3.gguf" and r.max_abs_logit_diff is not None
    reader = gguf.GGUFReader(str(r.mmproj_file))
    assert reader.fields["clip.projector_type"].contents() == "gemma3"
    assert reader.fields["clip.use_gelu"].contents() is True
    assert reader.fields["clip.vision.projector.scale_factor"].contents() == 2  # 4x4 patches pooled to 2x2
    stored = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    assert {"v.post_ln.weight", "mm.input_projection.weight", "v.blk.0.attn_out.weight"} <= set(stored)
    norm = model.model.multi_modal_projector.mm_soft_emb_norm.weight.detach().numpy()
    np.testing.assert_array_equal(stored["mm.soft_emb_norm.weight"], 1.0 + norm)
    projection = model.model.multi_modal_projector.mm_input_projection_weight.detach().numpy()
    np.testing.assert_array_equal(stored["mm.input_projection.weight"].reshape(projection.shape), projection)


def qwen25(**vision) -> dict:
    v = {"model_type": "qwen2_5_vl_vision", "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
         "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": 64,
         "fullatt_block_indexes": [1, 3], "hidden_act": "silu", **vision}
    return {"model_type": "qwen2_5_vl", "vision_config": v, "text_config": {"hidden_size": 64}}


@pytest.mark.parametrize("vision, why", [
    ({"window_size": 56}, "its attention windows are 56 pixels; llama.cpp's are 112"),
    ({"fullatt_block_indexes": [1, 2]}, r"its whole-picture layers \[1, 2\] are not every n-th layer"),
    ({"hidden_act": "gelu"}, "not SiLU"),
    ({"out_hidden_size": 48}, "its merger gives 48 features, its language model takes 64"),
    ({"spatial_merge_size": 3}, "merges 2 x 2 patches of 2 frames"),
])
def test_a_qwen_tower_llama_cpp_would_run_otherwise_is_refused(vision, why):
    with pytest.raises(UserError, match=why):
        projector_for(qwen25(**vision), IMAGES, "m")


def test_a_qwen25_tower_whose_layers_all_see_the_whole_picture_needs_no_windows_of_llama_cpps_size():
    p = projector_for(qwen25(depth=2, fullatt_block_indexes=[0, 1], window_size=56), IMAGES, "m")
    assert (p.projector_type, p.wa_pattern, p.use_silu, p.n_layers) == ("qwen2.5vl_merger", 1, True, 2)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_qwen_projector_and_language_files(family, tmp_path):
    """Qwen2-VL and Qwen2.5-VL: the language model as llama.cpp's qwen2vl (Qwen2's tensors and M-RoPE's sections),
    Qwen3-VL's as qwen3vl (with its DeepStack layer count), checked through a qwen2 / qwen3 copy of it (transformers
    reads neither); the projector file with the two-frame patch embedding as one kernel a frame, Qwen2's q/k/v split
    in three and Qwen3-VL's fused (as llama.cpp's converter writes them), Qwen2.5-VL's SiLU and window pattern,
    Qwen3-VL's DeepStack mergers under the layer each reads. (llama.cpp's own reading:
    scripts/validate/llama_cpp_vlm_check.py.)"""
    import gguf
    import numpy as np
    from transformers import AutoTokenizer

    import finetuner
    from finetuner.model.tiny_vlm import tiny_qwen2_5_vl, tiny_qwen2_vl, tiny_qwen3_vl

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "demo_model")
    if family == "qwen2_5_vl":
        model = tiny_qwen2_5_vl(tok, tmp_path / "q", depth=2, full_attention=(1,), window=112)
    elif family == "qwen3_vl":
        model = tiny_qwen3_vl(tok, tmp_path / "q", depth=2)
    else:
        model = tiny_qwen2_vl(tok, tmp_path / "q", depth=2)
    arch, twin = ("qwen3vl", "qwen3") if family == "qwen3_vl" else ("qwen2vl", "qwen2")
    r = finetuner.export_model(tmp_path / "q", tmp_path / "q.gguf", quant="f32")
    assert r.architecture == arch and r.max_abs_logit_diff is not None and r.top1_agreement == 1.0
    assert any(f"read a copy of the file as {twin} " in n for n in r.notes)
    lm = gguf.GGUFReader(str(r.gguf_file))
    assert list(lm.fields[f"{arch}.rope.dimension_sections"].contents()) == [2, 3, 3, 0]
    assert (lm.fields["qwen3vl.n_deepstack_layers"].contents() == 1) if family == "qwen3_vl" else True
    assert not list(tmp_path.glob(".*"))  # neither the check's copy nor anything else left beside the files
    reader = gguf.GGUFReader(str(r.mmproj_file))
    f = reader.fields
    assert f["clip.projector_type"].contents() == {"qwen2_5_vl": "qwen2.5vl_merger", "qwen2_vl": "qwen2vl_merger",
                                                   "qwen3_vl": "qwen3vl_merger"}[family]
    assert ("clip.use_silu" in f, "clip.vision.n_wa_pattern" in f) == ((True, True) if family == "qwen2_5_vl" else (False, False))
    if family == "qwen2_5_vl":
        assert f["clip.vision.n_wa_pattern"].contents() == 2  # layer 1 of 0, 1 sees the whole picture
    assert f["clip.vision.block_count"].contents() == 2 and f["clip.vision.embedding_length"].contents() == 32
    assert f["clip.vision.feed_forward_length"].contents() == 64
    stored = {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}
    visual = {k: v.detach().numpy() for k, v in model.model.visual.state_dict().items()}
    qkv = visual["blocks.1.attn.qkv.weight"]
    if family == "qwen3_vl":  # fused, as llama.cpp's Qwen3-VL graph reads it
        np.testing.assert_array_equal(stored["v.blk.1.attn_qkv.weight"].reshape(96, 32), qkv)
    else:
        for i, x in enumerate("qkv"):
            np.testing.assert_array_equal(stored[f"v.blk.1.attn_{x}.weight"].reshape(32, 32), qkv[32 * i:32 * (i + 1)])
    kernel = visual["patch_embed.proj.weight"]  # (out, channels, frames, patch, patch)
    side = kernel.shape[-1]
    np.testing.assert_array_equal(stored["v.patch_embd.weight"].reshape(32, 3, side, side), kernel[:, :, 0])
    np.testing.assert_array_equal(stored["v.patch_embd.weight.1"].reshape(32, 3, side, side), kernel[:, :, 1])
    if family == "qwen3_vl":  # its DeepStack merger reads layer 0; its learned positions; the patch bias
        assert list(f["clip.vision.is_deepstack_layers"].contents()) == [True, False]
        assert {"v.deepstack.0.norm.weight", "v.deepstack.0.fc1.weight", "v.deepstack.0.fc2.bias",
                "v.position_embd.weight", "v.patch_embd.bias"} <= set(stored)
        np.testing.assert_array_equal(stored["v.deepstack.0.fc1.weight"].reshape(128, 128),
                                      visual["deepstack_merger_list.0.linear_fc1.weight"])
        assert f["clip.vision.image_size"].contents() == 64  # its 4 x 4 learned positions of 16 pixels
    assert {"v.post_ln.weight", "mm.0.weight", "mm.2.bias", "v.blk.0.attn_out.weight"} <= set(stored)
    assert ("v.blk.0.ffn_gate.weight" in stored) == (family == "qwen2_5_vl")  # Qwen2.5-VL's SiLU gate
    assert ("clip.use_gelu" in f) == (family == "qwen3_vl")
    assert not any(name.startswith(("token_embd", "blk.")) for name in stored)  # the language model is not here


def test_a_hub_qwen25_vl_config_of_transformers_4s_layout_is_read_as_the_installed_transformers_reads_it():
    """Qwen2.5-VL-7B-Instruct's config.json keeps its language model's settings at the top (no text_config)."""
    from finetuner.export.gguf_arch import arch_for
    from finetuner.model.shapes import load_config

    import copy

    cfg, _ = load_config("qwen2.5-vl-7b")
    read = copy.deepcopy(cfg)
    assert "text_config" not in cfg
    arch = arch_for(cfg, "m")
    projector_for(cfg, IMAGES, "m")
    assert cfg == read == load_config("qwen2.5-vl-7b")[0]  # the preset as shipped (it keys the shipped inventories)
    assert (arch.gguf_arch, arch.text_of, arch.n_layers, arch.head_dim) == ("qwen2vl", "qwen2_5_vl", 28, 128)
    assert arch.rope["mrope_section"] == [16, 24, 24]


@pytest.mark.parametrize("family", ["smolvlm", "idefics3"])
def test_idefics3_and_smolvlm_projector_files(family, tmp_path):
    """Idefics3 and SmolVLM: the language model (a Llama) written as llama.cpp's llama; the projector file as
    llama.cpp's idefics3 reads it: the SigLIP tower with its post-layernorm and tanh GELU, the pixel-shuffle
    connector (mm.model.fc), the shuffle factor and the longest side the processor resizes a picture to before
    cutting it into tiles."""
    import gguf
    import numpy as np
    from transformers import AutoTokenizer

    import finetuner
    from finetuner.model.tiny_vlm import tiny_idefics3, tiny_smolvlm

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "demo_model")
    model = (tiny_smolvlm(tok, tmp_path / "m", longest_edge=64) if family == "smolvlm" else tiny_idefics3(tok, tmp_path / "m"))
    r = finetuner.export_model(tmp_path / "m", tmp_path / "m.gguf", quant="f32")
    assert r.architecture == "llama" and r.top1_agreement == 1.0
    f = gguf.GGUFReader(str(r.mmproj_file)).fields
    assert f["clip.projector_type"].contents() == "idefics3" and f["clip.use_gelu"].contents() is True
    assert f["clip.vision.projector.scale_factor"].contents() == 2
    assert f["clip.vision.preproc_image_size"].contents() == (64 if family == "smolvlm" else 32)
    stored = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(str(r.mmproj_file)).tensors}
    fc = model.model.connector.modality_projection.proj.weight.detach().numpy()
    np.testing.assert_array_equal(stored["mm.model.fc.weight"].reshape(fc.shape), fc)
    assert {"v.post_ln.weight", "v.position_embd.weight", "v.patch_embd.bias", "v.blk.0.attn_q.weight"} <= set(stored)
    assert not any(name.startswith(("token_embd", "blk.")) for name in stored)


def test_the_real_shapes_of_the_presets_give_llama_cpps_settings():
    """Qwen2.5-VL-7B-Instruct's config (transformers 4's layout, as on the hub) and Gemma-3-4B's: the projector
    file's settings llama.cpp's converter writes for them (a whole-picture layer every 8th, of 32; SigLIP's 27
    layers pooled 4 x 4, the default, so no scale factor)."""
    from finetuner.model.shapes import load_config

    qwen = projector_for(load_config("qwen2.5-vl-7b")[0], IMAGES, "m")
    assert (qwen.projector_type, qwen.n_layers, qwen.wa_pattern, qwen.use_silu, qwen.text_hidden) == (
        "qwen2.5vl_merger", 32, 8, True, 3584)
    assert (qwen.vision["hidden_size"], qwen.vision["intermediate_size"], qwen.vision["num_attention_heads"]) == (1280, 3420, 16)
    q3 = projector_for(load_config("qwen3-vl-4b")[0], IMAGES, "m")  # 48 x 48 learned positions of 16 pixels
    assert (q3.projector_type, q3.n_layers, q3.deepstack, q3.vision["image_size"]) == ("qwen3vl_merger", 24, (5, 11, 17), 768)
    gemma = projector_for(load_config("gemma-3-4b")[0], IMAGES, "m")
    assert (gemma.projector_type, gemma.n_layers, gemma.extra_uint32, gemma.text_hidden) == ("gemma3", 27, {}, 2560)


def test_mistral3s_pixtral_projector():
    """Mistral 3's Pixtral tower and projector as llama.cpp's pixtral projector reads them (its converter): q/k rows
    permuted as llama.cpp rotates them, the projector's norm, patch merger and two linears, the [IMG_BREAK] token's
    embedding row from the language model; no break token, no file. (Built and run in llama.cpp where torchvision is
    installed: scripts/validate/llama_cpp_vlm_check.py.)"""
    import numpy as np

    from finetuner.export.gguf_arch import permute_for_rope

    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "head_dim": 16, "image_size": 64, "patch_size": 8, "hidden_act": "gelu"}
    config = {"model_type": "mistral3", "vision_config": vision, "text_config": {"model_type": "mistral", "hidden_size": 64},
              "spatial_merge_size": 2, "vision_feature_layer": -1}
    p = projector_for(config, IMAGES, "m", image_break_id=7)
    assert (p.projector_type, p.spatial_merge, p.use_gelu, p.vision["layer_norm_eps"]) == ("pixtral", 2, True, 1e-5)
    [(name, part, shape)] = p.parts("vision_tower.transformer.layers.1.attention.q_proj.weight", (32, 32))
    assert (name, part) == ("v.blk.1.attn_q.weight", ("rope", 2))
    w = np.arange(32 * 32, dtype=np.float32).reshape(32, 32)
    np.testing.assert_array_equal(p.transform("x", w, part), permute_for_rope(w, 2, 2))
    assert p.parts("multi_modal_projector.patch_merger.merging_layer.weight", (32, 128))[0][0] == "mm.patch_merger.weight"
    assert p.parts("multi_modal_projector.norm.weight", (32,))[0][0] == "mm.input_norm.weight"
    assert [x[0] for x in p.parts("multi_modal_projector.linear_2.weight", (64, 64))] == ["mm.2.weight"]
    [(name, part, shape)] = p.parts("language_model.model.embed_tokens.weight", (100, 64))
    embeddings = np.arange(100 * 64, dtype=np.float32).reshape(100, 64)
    assert (name, shape) == ("v.token_embd.img_break", (64,))
    np.testing.assert_array_equal(p.transform("x", embeddings, part), embeddings[7])
    assert p.parts("language_model.model.layers.0.mlp.up_proj.weight", (128, 64)) == []
    with pytest.raises(UserError, match=r"names no \[IMG_BREAK\] token"):
        projector_for(config, IMAGES, "m")

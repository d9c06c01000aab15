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
    ({"model_type": "qwen2_5_vl"}, "finetuner writes it for gemma3, llava"),
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

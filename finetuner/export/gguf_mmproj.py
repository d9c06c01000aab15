"""The projector file (``mmproj``) llama.cpp reads pictures with, beside an image-text model's language GGUF.

llama.cpp (``libmtmd``, its ``clip`` architecture) runs an image-text model from two files: the language model
(written as a text model's, see ``gguf_arch``) and the vision tower plus projector in a GGUF of architecture
``clip`` and type ``mmproj``. Names come from gguf's own ``TensorNameMap`` for ``MODEL_ARCH.MMPROJ`` (the vision
tower's) and the keys from ``gguf.Keys.ClipVision``; what differs per family is below, each with its source.

Written:

- **LLaVA** (``llava``: a CLIP vision tower, a two-layer MLP projector): llama.cpp's projector type ``mlp``, its
  ``mm.0`` / ``mm.2`` (the legacy llava converter's names, ``tools/mtmd/legacy-models``), the encoder's layers up
  to the model's ``vision_feature_layer`` (``clip.vision.feature_layer``: llama.cpp stops there, and without the
  key stops one layer short of the last, LLaVA-1.5's -2), CLIP's quick GELU (no ``clip.use_gelu``), no
  post-layernorm (LLaVA reads the hidden state before it). Only ``vision_feature_select_strategy: default`` (the
  class token dropped), as llama.cpp runs it. Measured (``scripts/validate/llama_cpp_vlm_check.py``): the llama.cpp
  that llama-cpp-python 0.3.36 builds puts the class token after the patches in its CLIP graph
  (ggml-org/llama.cpp#25814): each patch gets its neighbour's position, the first patch is dropped and the class
  token fed as an image token, so its picture embeddings differ from transformers' for any LLaVA file.
- **Gemma 3** (``gemma3``: a SigLIP tower, average-pooled, RMS-normed and projected): llama.cpp's ``gemma3``
  projector, the SigLIP tower with its post-layernorm and tanh GELU (``clip.use_gelu``), the soft-embedding norm
  stored as ``1 + weight`` (Gemma's RMSNorm; llama.cpp's converter, ``Gemma3VisionModel``), the pooling factor
  written when it is not Gemma 3's 4 (``clip.vision.projector.scale_factor``).

- **Qwen2-VL / Qwen2.5-VL** (``qwen2_vl``, ``qwen2_5_vl``: a ViT on 14-pixel patches of two frames, merged 2 x 2
  by an MLP): llama.cpp's ``qwen2vl_merger`` / ``qwen2.5vl_merger``, as its converter (``Qwen2VLVisionModel``)
  writes them: the fused ``qkv`` split into q, k and v, the Conv3d patch embedding as one Conv2d kernel a frame
  (``v.patch_embd.weight`` and ``.weight.1``); Qwen2.5-VL's SiLU gate (``clip.use_silu``) and the period of its
  whole-picture layers (``clip.vision.n_wa_pattern``). What llama.cpp's graph fixes is checked and a model that
  differs refused: a 2 x 2 merge of 2 frames, Qwen2-VL's quick GELU, Qwen2.5-VL's SiLU, whole-picture layers every
  n-th, and windows of 112 pixels (llama.cpp does not read the size from the file). The language model is written
  as llama.cpp's ``qwen2vl`` (``gguf_arch``).

- **Idefics3 / SmolVLM** (``idefics3``, ``smolvlm``: a SigLIP tower, a pixel-shuffle connector): llama.cpp's
  ``idefics3`` projector, names as gguf's map reads them, the shuffle factor and the processor's longest side (the
  size llama.cpp resizes a picture to before cutting it into tiles).

Any other image-text type is refused with the reason (its projector is not written here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from finetuner.errors import UserError

#: model_type → llama.cpp's projector type, for the families whose mmproj is written
PROJECTORS = {"llava": "mlp", "gemma3": "gemma3", "qwen2_vl": "qwen2vl_merger", "qwen2_5_vl": "qwen2.5vl_merger",
              "qwen3_vl": "qwen3vl_merger", "idefics3": "idefics3", "smolvlm": "idefics3", "mistral3": "pixtral"}
#: the vision towers each family's projector file holds (vision_config.model_type)
TOWERS = {"llava": ("clip_vision_model",), "gemma3": ("siglip_vision_model",), "qwen2_vl": ("qwen2_vl_vision",),
          "qwen2_5_vl": ("qwen2_5_vl_vision",), "qwen3_vl": ("qwen3_vl_vision",), "idefics3": ("idefics3_vision",),
          "smolvlm": ("smolvlm_vision",), "mistral3": ("pixtral",)}
#: where Mistral 3 keeps its Pixtral tower and projector, and its language model's embeddings (the [IMG_BREAK] row)
_PIXTRAL_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")
_EMBEDDINGS = ("model.language_model.embed_tokens.weight", "language_model.model.embed_tokens.weight")
#: where Idefics3 and SmolVLM keep their tower and connector (gguf's map reads these names as they are)
_IDEFICS_PREFIXES = ("model.vision_model.", "model.connector.")
#: the Qwen-VL families (their tower under ``visual.``, its q/k/v fused, its patch kernel two frames deep)
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: Qwen3-VL's merger and DeepStack mergers under the names llama.cpp reads (its converter, ``Qwen3VLVisionModel``)
_QWEN3_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_QWEN3_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
#: where a Qwen-VL checkpoint keeps its vision tower and merger, read as ``visual.`` (gguf's map)
_QWEN_PREFIXES = ("model.visual.", "visual.")
#: the window llama.cpp's Qwen2.5-VL graph attends in (pixels a side; its ``attn_window_size`` default, not read from
#: the file for this projector)
QWEN25_WINDOW = 112
#: where a checkpoint keeps its vision tower (transformers 5 and the checkpoints' own names), read as
#: ``vision_tower.vision_model.`` (gguf's map)
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
#: LLaVA's projector (Linear, GELU, Linear) under the names llama.cpp's ``mlp`` projector reads
_LLAVA_MM = {"linear_1": "mm.0", "linear_2": "mm.2"}
#: Gemma 3's default pooling: (image_size / patch_size) / sqrt(mm_tokens_per_image) (896 / 14 / 16 = 4)
GEMMA3_POOL = 4


@dataclass
class Projector:
    """An image-text model's vision tower and projector as llama.cpp's mmproj file holds them."""

    model_type: str
    projector_type: str
    vision: dict[str, Any]
    text_hidden: int
    image_mean: list[float]
    image_std: list[float]
    n_layers: int
    #: hidden state the projector reads, as llama.cpp counts it (0: the encoder's input); None: the last layer's
    feature_layer: int | None = None
    keep_post_norm: bool = True
    use_gelu: bool = False
    extra_uint32: dict[str, int] = field(default_factory=dict)
    gguf_arch: str = "clip"
    use_silu: bool = False
    #: Qwen2.5-VL: every how many layers one attends to the whole picture (the others in windows)
    wa_pattern: int | None = None
    #: Qwen3-VL: the layers whose features its DeepStack mergers pass to the language model
    deepstack: tuple[int, ...] = ()
    spatial_merge: int | None = None
    #: Idefics3 / SmolVLM: the longest side a picture is resized to before it is cut into tiles of ``image_size``
    preproc_image_size: int | None = None
    #: Mistral 3 (Pixtral): the [IMG_BREAK] token's id, whose embedding row the projector file holds
    image_break_id: int | None = None

    def parts(self, hf_name: str, shape: tuple[int, ...]) -> list[tuple[str, Any, tuple[int, ...]]]:
        """``(name in the file, part, shape)`` for each tensor the projector file holds of a checkpoint tensor: none,
        one (``part`` None), or, for Qwen-VL, its fused q/k/v as three (``("rows", i)``: a third of the rows; Qwen2-VL
        and Qwen2.5-VL) and its two-frame patch embedding (a Conv3d) as one Conv2d a frame (``("frame", i)``), as
        llama.cpp's converter splits them."""
        if self.projector_type == "idefics3":
            return [(self._mapped(hf_name), None, shape)] if hf_name.startswith(_IDEFICS_PREFIXES) else []
        if self.projector_type == "pixtral":
            if hf_name in _EMBEDDINGS:  # the [IMG_BREAK] token's row: llama.cpp writes it after each row of patches
                import gguf

                return [(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK], ("row", self.image_break_id),
                         (shape[1],))]
            if not hf_name.startswith(_PIXTRAL_PREFIXES):
                return []
            name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
            rope = name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"))
            return [(self._mapped(name, max(self.n_layers, 3)),  # (the projector's mm.1 and mm.2 need 3 blocks' map)
                     ("rope", int(self.vision["num_attention_heads"])) if rope else None, shape)]
        if self.model_type not in QWEN_VL:
            name = self.gguf_name(hf_name)
            return [] if name is None else [(name, None, shape)]
        prefix = next((p for p in _QWEN_PREFIXES if hf_name.startswith(p)), None)
        if prefix is None:
            return []
        rest = f"visual.{hf_name[len(prefix):]}"
        parts = rest.split(".")
        if parts[1] == "merger" and self.model_type == "qwen3_vl":  # visual.merger.linear_fc1.weight
            if parts[2] not in _QWEN3_MERGER:
                raise UserError(f"The tensor '{hf_name}' of this qwen3_vl model has no place in llama.cpp's projector file; "
                                "GGUF export refuses the model rather than drop it.")
            return [(f"{_QWEN3_MERGER[parts[2]]}.{parts[3]}", None, shape)]
        if parts[1] == "deepstack_merger_list":  # visual.deepstack_merger_list.K.norm.weight: by the tower layer it reads
            if parts[3] not in _QWEN3_DEEPSTACK:
                raise UserError(f"The tensor '{hf_name}' of this qwen3_vl model has no place in llama.cpp's projector file; "
                                "GGUF export refuses the model rather than drop it.")
            layer = self.deepstack[int(parts[2])]
            return [(f"v.deepstack.{layer}.{_QWEN3_DEEPSTACK[parts[3]]}.{parts[4]}", None, shape)]
        if ".attn.qkv." in rest and self.model_type != "qwen3_vl":  # (llama.cpp's Qwen3-VL graph reads it fused)
            third = (shape[0] // 3, *shape[1:])
            return [(self._mapped(rest.replace(".qkv.", f".{x}."), max(self.n_layers, 3)), ("rows", i), third)
                    for i, x in enumerate("qkv")]
        if rest == "visual.patch_embed.proj.bias":  # Qwen3-VL's
            return [("v.patch_embd.bias", None, shape)]
        if rest == "visual.patch_embed.proj.weight":
            import gguf

            frame = (shape[0], shape[1], *shape[3:])
            base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
            return [(base if i == 0 else f"{base}.{i}", ("frame", i), frame) for i in range(shape[2])]
        return [(self._mapped(rest, max(self.n_layers, 3)), None, shape)]  # the merger's mm.2 needs 3 blocks' map

    def gguf_name(self, hf_name: str) -> str | None:
        """The file's name for a checkpoint tensor, or None for one the projector file does not hold (the language
        model's; a layer past the feature layer; LLaVA's unused post-layernorm)."""
        for prefix in _PROJECTOR_PREFIXES:
            if hf_name.startswith(prefix):
                rest = hf_name[len(prefix):]
                if self.model_type == "llava":
                    layer, _, kind = rest.partition(".")
                    return f"{_LLAVA_MM[layer]}.{kind}" if layer in _LLAVA_MM else None
                rest = rest.replace("_weight", ".weight")  # Gemma 3's bare parameters (mm_input_projection_weight)
                return self._mapped(f"multi_modal_projector.{rest}")
        for prefix in _TOWER_PREFIXES:
            if hf_name.startswith(prefix):
                rest = hf_name[len(prefix):]
                if rest.startswith("post_layernorm.") and not self.keep_post_norm:
                    return None
                if rest.startswith("head."):  # SigLIP's pooling head: not part of the picture's tokens
                    return None
                if rest.startswith("encoder.layers."):
                    layer = int(rest.split(".")[2])
                    if layer >= self.n_layers:
                        return None
                if rest == "embeddings.class_embedding":
                    return "v.class_embd"  # a bare parameter (clip.cpp's TN_CLASS_EMBD)
                return self._mapped(f"vision_tower.vision_model.{rest}")
        return None

    def _mapped(self, name: str, blocks: int | None = None) -> str:
        import gguf

        found = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks or self.n_layers).get_name(
            name, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise UserError(f"The tensor '{name}' of this {self.model_type} model has no place in llama.cpp's projector "
                            "file; GGUF export refuses the model rather than drop it.")
        return found

    def transform(self, hf_name: str, array, part=None):
        if self.model_type == "gemma3" and "mm_soft_emb_norm" in hf_name:
            return array + 1.0  # Gemma's RMSNorm multiplies by 1 + weight; llama.cpp's by the stored weight
        if part is not None and part[0] == "rows":  # one of q, k, v
            rows = array.shape[0] // 3
            return array[part[1] * rows:(part[1] + 1) * rows]
        if part is not None and part[0] == "frame":  # one frame's kernel of the patch embedding
            return array[:, :, part[1]]
        if part is not None and part[0] == "rope":  # Pixtral's q/k: each head's rotary halves interleaved (its converter)
            from finetuner.export.gguf_arch import permute_for_rope

            return permute_for_rope(array, part[1], part[1])
        if part is not None and part[0] == "row":  # one token's embedding
            return array[part[1]]
        return array

    def tensor_type(self, hf_name: str, shape: tuple[int, ...], quant: str) -> str:
        """F32 for ``quant=f32``, vectors and the embeddings (as llama.cpp's converter keeps them), F16 otherwise:
        llama.cpp's projector files are float (its converter writes f16 or f32)."""
        if quant == "f32" or len(shape) < 2 or ".embeddings." in hf_name or hf_name.endswith("pos_embed.weight"):
            return "F32"  # (Qwen3-VL's learned positions: resized in llama.cpp's graph, kept float32 as CLIP's are)
        return "F16"

    def write_metadata(self, writer) -> None:
        import gguf

        writer.add_type(gguf.GGUFType.MMPROJ)
        writer.add_clip_has_vision_encoder(True)
        writer.add_clip_projector_type(self.projector_type)
        writer.add_vision_projection_dim(self.text_hidden)
        writer.add_vision_image_size(int(self.vision["image_size"]))
        writer.add_vision_patch_size(int(self.vision["patch_size"]))
        writer.add_vision_embedding_length(int(self.vision["hidden_size"]))
        writer.add_vision_feed_forward_length(int(self.vision["intermediate_size"]))
        writer.add_vision_block_count(self.n_layers)
        writer.add_vision_head_count(int(self.vision["num_attention_heads"]))
        writer.add_vision_attention_layernorm_eps(float(self.vision.get("layer_norm_eps", 1e-6)))
        writer.add_vision_image_mean([float(x) for x in self.image_mean])
        writer.add_vision_image_std([float(x) for x in self.image_std])
        if self.use_gelu:
            writer.add_vision_use_gelu(True)
        if self.use_silu:
            writer.add_vision_use_silu(True)
        if self.wa_pattern is not None:
            writer.add_vision_n_wa_pattern(self.wa_pattern)
        if self.spatial_merge is not None:
            writer.add_vision_spatial_merge_size(self.spatial_merge)
        if self.preproc_image_size is not None:
            writer.add_vision_preproc_image_size(self.preproc_image_size)
        if self.deepstack:
            writer.add_vision_is_deepstack_layers([i in self.deepstack for i in range(self.n_layers)])
        if self.feature_layer is not None:
            writer.add_array("clip.vision.feature_layer", [int(self.feature_layer)])
        for key, value in self.extra_uint32.items():
            writer.add_uint32(key, int(value))


def _refuse(where: str, model_type: str, why: str) -> UserError:
    return UserError(f"{where}: the projector file (mmproj) llama.cpp reads pictures with is not written for {model_type}: "
                     f"{why}.", hint="`finetuner merge RUN -o FOLDER` writes a transformers folder that reads pictures "
                                     "(AutoModelForImageTextToText and AutoProcessor load it).")


def projector_for(config: dict[str, Any], image_processor, where: str, image_break_id: int | None = None) -> Projector:
    """The :class:`Projector` of an image-text model's ``config.json`` contents and its image processor (and, for
    Mistral 3, its processor's [IMG_BREAK] token id), or a UserError saying why its projector file is not written. The config is read as the installed transformers reads
    it (its defaults filled in, transformers 4's layout nested: Qwen2.5-VL's and SmolVLM2's on the hub)."""
    from finetuner.export.gguf_arch import nested_config

    config = nested_config(config)
    mt = str(config.get("model_type"))
    if mt not in PROJECTORS:
        raise _refuse(where, mt, f"finetuner writes it for {', '.join(sorted(PROJECTORS))}")
    vision = dict(config.get("vision_config") or {})
    text = dict(config.get("text_config") or {})
    if vision.get("model_type") not in TOWERS[mt]:
        raise _refuse(where, mt, f"its vision tower is {vision.get('model_type')!r}, not {' or '.join(TOWERS[mt])}")
    if image_processor is None:
        raise _refuse(where, mt, "its image processor (the pictures' size, mean and deviation) was not found")
    if mt in QWEN_VL:
        return _qwen_projector(config, vision, text, image_processor, where)
    if PROJECTORS[mt] == "idefics3":
        return _idefics3_projector(config, vision, text, image_processor, where)
    if mt == "mistral3":
        return _pixtral_projector(config, vision, text, image_processor, where, image_break_id)
    n = int(vision["num_hidden_layers"])
    common = dict(model_type=mt, projector_type=PROJECTORS[mt], vision=vision, text_hidden=int(text["hidden_size"]),
                  image_mean=list(image_processor.image_mean), image_std=list(image_processor.image_std))
    if mt == "llava":
        if config.get("vision_feature_select_strategy", "default") != "default":
            raise _refuse(where, mt, "llama.cpp drops the class token (vision_feature_select_strategy 'default'); this "
                                     f"model keeps it ('{config.get('vision_feature_select_strategy')}')")
        layer = config.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise _refuse(where, mt, f"it reads several vision layers ({layer}); llama.cpp's llava projector reads one")
        if str(config.get("projector_hidden_act", "gelu")) != "gelu" or config.get("multimodal_projector_bias") is False:
            raise _refuse(where, mt, "its projector is not LLaVA's (Linear with bias, GELU, Linear with bias)")
        index = layer if layer >= 0 else n + 1 + layer  # hidden_states[index]: 0 is the encoder's input
        return Projector(**common, n_layers=max(index, 1), feature_layer=index, keep_post_norm=False, use_gelu=False)
    tokens = int(config.get("mm_tokens_per_image", 256))
    side = round(tokens ** 0.5)
    patches = int(vision["image_size"]) // int(vision["patch_size"])
    if side * side != tokens or patches % side:
        raise _refuse(where, mt, f"{tokens} tokens a picture is not a square pooling of its {patches}x{patches} patches")
    extra = {} if patches // side == GEMMA3_POOL else {"clip.vision.projector.scale_factor": patches // side}
    return Projector(**common, n_layers=n, keep_post_norm=True, use_gelu=True, extra_uint32=extra)


def _qwen_projector(config: dict[str, Any], vision: dict[str, Any], text: dict[str, Any], image_processor,
                    where: str) -> Projector:
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision tower and merger as llama.cpp's ``qwen2vl_merger`` /
    ``qwen2.5vl_merger`` / ``qwen3vl_merger`` read them (llama.cpp's converter, ``Qwen2VLVisionModel`` and
    ``Qwen3VLVisionModel``): what those graphs fix (a 2 x 2 merge, two frames a patch, Qwen2-VL's quick GELU,
    Qwen2.5-VL's SiLU gate and 112-pixel windows, Qwen3-VL's tanh GELU and square grid of learned positions) is
    checked here, and a model that differs is refused rather than written wrong."""
    mt = str(config["model_type"])
    n = int(vision["depth"])
    hidden = int(vision.get("embed_dim") or vision["hidden_size"])  # Qwen2-VL: embed_dim (its hidden_size: the output)
    if int(vision.get("spatial_merge_size", 2)) != 2 or int(vision.get("temporal_patch_size", 2)) != 2:
        raise _refuse(where, mt, "llama.cpp's Qwen-VL graph merges 2 x 2 patches of 2 frames; this tower does otherwise")
    extra: dict[str, Any] = {}
    image_size = int(vision.get("image_size", 560))
    if mt == "qwen3_vl":
        if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise _refuse(where, mt, f"its vision MLP's activation is {vision.get('hidden_act')}, not tanh GELU")
        width, out = int(vision["intermediate_size"]), int(vision["out_hidden_size"])
        positions = int(vision.get("num_position_embeddings", 2304))
        side = round(positions ** 0.5)
        if side * side != positions:
            raise _refuse(where, mt, f"its {positions} learned positions are not a square grid")
        image_size = side * int(vision["patch_size"])  # llama.cpp's converter: the grid the positions were learned on
        extra = dict(use_gelu=True, deepstack=tuple(int(i) for i in vision.get("deepstack_visual_indexes") or []),
                     spatial_merge=2)
    elif mt == "qwen2_vl":
        if vision.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise _refuse(where, mt, f"its vision MLP's activation is {vision.get('hidden_act')}, not quick GELU")
        width = int(hidden * float(vision.get("mlp_ratio", 4)))
        out = int(vision.get("hidden_size", text.get("hidden_size")))
    else:
        if vision.get("hidden_act", "silu") != "silu":
            raise _refuse(where, mt, f"its vision MLP's activation is {vision.get('hidden_act')}, not SiLU")
        width, out = int(vision["intermediate_size"]), int(vision["out_hidden_size"])
        full = [int(i) for i in vision.get("fullatt_block_indexes") or []]
        pattern = full[0] + 1 if full else 0
        if not full or full != [pattern * (k + 1) - 1 for k in range(len(full))]:
            raise _refuse(where, mt, f"its whole-picture layers {full} are not every n-th layer, as llama.cpp reads them")
        windowed = any(i not in full for i in range(n))
        if windowed and int(vision.get("window_size", QWEN25_WINDOW)) != QWEN25_WINDOW:
            raise _refuse(where, mt, f"its attention windows are {vision.get('window_size')} pixels; llama.cpp's are "
                                     f"{QWEN25_WINDOW}")
        extra = dict(use_silu=True, wa_pattern=pattern)
    if out != int(text["hidden_size"]):
        raise _refuse(where, mt, f"its merger gives {out} features, its language model takes {text['hidden_size']}")
    settings = {"image_size": image_size, "patch_size": int(vision["patch_size"]),
                "hidden_size": hidden, "intermediate_size": width, "num_attention_heads": int(vision["num_heads"]),
                "layer_norm_eps": 1e-6}  # transformers' Qwen-VL towers: eps 1e-6 in every norm
    return Projector(model_type=mt, projector_type=PROJECTORS[mt], vision=settings, text_hidden=int(text["hidden_size"]),
                     image_mean=list(image_processor.image_mean), image_std=list(image_processor.image_std),
                     n_layers=n, keep_post_norm=True, **extra)


def _idefics3_projector(config: dict[str, Any], vision: dict[str, Any], text: dict[str, Any], image_processor,
                        where: str) -> Projector:
    """Idefics3's and SmolVLM's SigLIP tower (with its post-layernorm, tanh GELU) and pixel-shuffle connector as
    llama.cpp's ``idefics3`` projector reads them (its converter, ``SmolVLMModel``): the shuffle factor
    (``clip.vision.projector.scale_factor``) and the longest side a picture is resized to before llama.cpp cuts it
    into tiles of the tower's size (``clip.vision.preproc_image_size``: the processor's ``size["longest_edge"]``)."""
    mt = str(config["model_type"])
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise _refuse(where, mt, f"its vision MLP's activation is {vision.get('hidden_act')}, not tanh GELU")
    size = getattr(image_processor, "size", None) or {}
    longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    return Projector(model_type=mt, projector_type=PROJECTORS[mt], vision=vision, text_hidden=int(text["hidden_size"]),
                     image_mean=list(image_processor.image_mean), image_std=list(image_processor.image_std),
                     n_layers=int(vision["num_hidden_layers"]), keep_post_norm=True, use_gelu=True,
                     extra_uint32={"clip.vision.projector.scale_factor": int(config.get("scale_factor", 2))},
                     preproc_image_size=int(longest) if longest else None)


def _pixtral_projector(config: dict[str, Any], vision: dict[str, Any], text: dict[str, Any], image_processor,
                       where: str, break_id: int | None) -> Projector:
    """Mistral 3's Pixtral tower (2-D rotary positions, its q/k stored as llama.cpp rotates them) and projector (an
    RMS norm, the 2 x 2 patch merger, two linears) as llama.cpp's ``pixtral`` projector reads them (its converter,
    ``LlavaVisionModel``): the [IMG_BREAK] token's embedding row from the language model, the spatial merge size,
    Pixtral's fixed norm epsilon (1e-5: not in its config)."""
    mt = str(config["model_type"])
    act = vision.get("hidden_act", "gelu")
    if act not in ("gelu", "silu"):
        raise _refuse(where, mt, f"its vision MLP's activation is {act}, not GELU or SiLU")
    layer = config.get("vision_feature_layer", -1)
    n = int(vision["num_hidden_layers"])
    if layer not in (-1, n):
        raise _refuse(where, mt, f"its projector reads vision layer {layer}; llama.cpp's pixtral reads the last")
    if not isinstance(break_id, int):
        raise _refuse(where, mt, "its processor names no [IMG_BREAK] token, whose embedding llama.cpp needs")
    settings = {**vision, "layer_norm_eps": 1e-5}
    extra = {"use_silu": True} if act == "silu" else {"use_gelu": True}
    return Projector(model_type=mt, projector_type="pixtral", vision=settings, text_hidden=int(text["hidden_size"]),
                     image_mean=list(image_processor.image_mean), image_std=list(image_processor.image_std),
                     n_layers=n, keep_post_norm=True, spatial_merge=int(config.get("spatial_merge_size", 1)),
                     image_break_id=break_id, **extra)

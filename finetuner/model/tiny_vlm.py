"""A tiny image-text-to-text model for tests and the picture demo: LLaVA's layout (a CLIP vision tower, a
projector, a Llama language model) at a few hundred thousand parameters, with its processor."""

from __future__ import annotations

from pathlib import Path

from finetuner.model.vision import without_video

#: ChatML that reads content parts: ``<image>`` where a picture is (the processor expands it into the picture's
#: patch tokens), the text parts as they are; string contents as the text template renders them
CHATML_PARTS_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_llava(tokenizer, out: str | Path, image_size: int = 32, patch_size: int = 8, vision_hidden: int = 32,
               vision_layers: int = 2, text_hidden: int = 64, text_layers: int = 2, seed: int = 0):
    """Save a tiny LLaVA (random weights, fp32) and its processor to ``out``: pictures resized and cropped to
    ``image_size`` pixels, ``(image_size / patch_size)²`` image tokens each. ``tokenizer``: a fast tokenizer (an
    ``<image>`` token is added). Returns the model."""
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHATML_PARTS_TEMPLATE
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", chat_template=CHATML_PARTS_TEMPLATE,
                               image_token="<image>", num_additional_image_tokens=1)
    vision = CLIPVisionConfig(hidden_size=vision_hidden, image_size=image_size, patch_size=patch_size,
                              num_hidden_layers=vision_layers, num_attention_heads=2, intermediate_size=2 * vision_hidden,
                              projection_dim=vision_hidden)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=2 * text_hidden,
                       num_hidden_layers=text_layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return model


# ---------------------------------------------------------------------------------------------------- other families
#: the common sizes of the tiny families: a 2-layer language model 64 wide, a 1-layer vision tower 32 wide
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}


def parts_template(image: str) -> str:
    """ChatML that reads content parts, ``image`` (the family's image token string, which its processor expands)
    where a picture is."""
    return CHATML_PARTS_TEMPLATE.replace("'<image>'", repr(image))


def _named_tokens(tokenizer, named: dict[str, str] | None = None, plain: list[str] | None = None):
    """``tokenizer`` again, with ``named`` special tokens (``{"image_token": "<image>"}``: the attribute and its
    ``_id`` the processors read) and ``plain`` special tokens added."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=dict(named or {}))
    if plain:
        tok.add_special_tokens({"additional_special_tokens": plain}, replace_extra_special_tokens=False)
    return tok


def _ids(tok) -> dict[str, int | None]:
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def _processor(cls, model_type: str, **parts):
    """``cls`` (a processor class) built from ``parts``: where torchvision is installed with ``model_type``'s default
    video processor (the class then requires one), else without one (:func:`without_video`)."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() and "video_processor" in cls.get_attributes():
        import transformers
        from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

        names = VIDEO_PROCESSOR_MAPPING_NAMES[model_type]
        name = names.get("torchvision") if isinstance(names, dict) else names
        parts["video_processor"] = getattr(transformers, name)()
    elif "video_processor" in parts:
        parts["video_processor"] = None
    return without_video(cls)(**parts)


def _save(model_cls, config, processor, out, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).float()
    model.save_pretrained(out)
    if processor is not None:
        processor.save_pretrained(out)
    return model


def tiny_qwen2_5_vl(tokenizer, out: str | Path, seed: int = 0, *, depth: int = 1, full_attention: tuple[int, ...] = (0,),
                    window: int = 56, pixels: tuple[int, int] = (28 * 28, 56 * 56)):
    """Save a tiny Qwen2.5-VL (a 1-layer windowed ViT with 14-pixel patches merged 2x2, a 2-layer Qwen2 with
    3-D rotary positions) and its processor to ``out``: pictures resized to 28-56 pixels a side, so 1 to 4 image
    tokens (``<|image_pad|>`` between ``<|vision_start|>`` and ``<|vision_end|>``). ``depth``, ``full_attention``
    (the layers that attend to the whole picture), ``window`` (the others' window, pixels a side) and ``pixels`` (the
    fewest and most pixels a picture keeps) change the tower and the processor. Returns the model."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessorPil)

    tok = _named_tokens(tokenizer, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                    "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"})
    template = parts_template("<|vision_start|><|image_pad|><|vision_end|>")
    images = Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1], patch_size=14, merge_size=2)
    processor = _processor(Qwen2_5_VLProcessor, "qwen2_5_vl", image_processor=images, tokenizer=tok,
                           chat_template=template)
    vision = {"depth": depth, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2, "window_size": window, "out_hidden_size": 64,
              "fullatt_block_indexes": list(full_attention)}
    text = {**TEXT, "vocab_size": len(tok), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 3, 3]}, **_ids(tok)}
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=tok.image_token_id,
                              video_token_id=tok.video_token_id, vision_start_token_id=tok.vision_start_token_id,
                              vision_end_token_id=tok.vision_end_token_id, tie_word_embeddings=True)
    return _save(Qwen2_5_VLForConditionalGeneration, config, processor, out, seed)


def tiny_qwen2_vl(tokenizer, out: str | Path, seed: int = 0, *, depth: int = 1, pixels: tuple[int, int] = (28 * 28, 56 * 56)):
    """Save a tiny Qwen2-VL (a 1-layer ViT with 14-pixel patches merged 2x2, a 2-layer Qwen2 with 3-D rotary
    positions) and its processor to ``out``: pictures resized to 28-56 pixels a side, 1 to 4 ``<|image_pad|>``
    tokens each (``depth``: the tower's layers; ``pixels``: the fewest and most pixels a picture keeps). Returns the
    model."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    tok = _named_tokens(tokenizer, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                    "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"})
    template = parts_template("<|vision_start|><|image_pad|><|vision_end|>")
    images = Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1], patch_size=14, merge_size=2)
    processor = _processor(Qwen2VLProcessor, "qwen2_vl", image_processor=images, tokenizer=tok,
                           chat_template=template)
    vision = {"depth": depth, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2, "patch_size": 14,
              "spatial_merge_size": 2}
    text = {**TEXT, "vocab_size": len(tok), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [2, 3, 3]}, **_ids(tok)}
    config = Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=tok.image_token_id,
                           video_token_id=tok.video_token_id, vision_start_token_id=tok.vision_start_token_id,
                           vision_end_token_id=tok.vision_end_token_id, tie_word_embeddings=True)
    return _save(Qwen2VLForConditionalGeneration, config, processor, out, seed)


def tiny_qwen3_vl(tokenizer, out: str | Path, seed: int = 0, *, depth: int = 1, pixels: tuple[int, int] = (32 * 32, 64 * 64)):
    """Save a tiny Qwen3-VL (a 1-layer ViT with 16-pixel patches merged 2x2 and one DeepStack feature, a 2-layer
    Qwen3 with interleaved 3-D rotary positions) and its processor to ``out``: pictures resized to 32-64 pixels a
    side, 1 to 4 ``<|image_pad|>`` tokens each (``depth``: the tower's layers; ``pixels``: the fewest and most
    pixels a picture keeps). Returns the model."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    tok = _named_tokens(tokenizer, {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                    "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"})
    template = parts_template("<|vision_start|><|image_pad|><|vision_end|>")
    images = Qwen2VLImageProcessorPil(min_pixels=pixels[0], max_pixels=pixels[1], patch_size=16, merge_size=2)
    processor = _processor(Qwen3VLProcessor, "qwen3_vl", image_processor=images, tokenizer=tok,
                           chat_template=template)
    vision = {"depth": depth, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
              "spatial_merge_size": 2, "out_hidden_size": 64, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0]}
    text = {**TEXT, "head_dim": 16, "vocab_size": len(tok), **_ids(tok),
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                "mrope_interleaved": True}}
    config = Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=tok.image_token_id,
                           video_token_id=tok.video_token_id, vision_start_token_id=tok.vision_start_token_id,
                           vision_end_token_id=tok.vision_end_token_id, tie_word_embeddings=True)
    return _save(Qwen3VLForConditionalGeneration, config, processor, out, seed)


def tiny_gemma3(tokenizer, out: str | Path, seed: int = 0):
    """Save a tiny Gemma 3 (``Gemma3ForConditionalGeneration``: a 1-layer SigLIP tower on 32-pixel pictures in
    8-pixel patches pooled to 4 soft tokens, a 2-layer Gemma 3 text model) and its processor to ``out``: each
    ``<start_of_image>`` expands to ``<start_of_image>``, 4 ``<image_soft_token>`` and ``<end_of_image>``, whose
    bidirectional attention the ``token_type_ids`` mark. Returns the model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    tok = _named_tokens(tokenizer, {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                    "eoi_token": "<end_of_image>"})
    template = parts_template("<start_of_image>")
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=template, image_seq_length=4)
    vision = {**VISION, "image_size": 32, "patch_size": 8, "model_type": "siglip_vision_model"}
    text = {**TEXT, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64, "vocab_size": len(tok),
            **_ids(tok)}
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                          boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                          image_token_index=tok.image_token_id)
    return _save(Gemma3ForConditionalGeneration, config, processor, out, seed)


def tiny_llava_next(tokenizer, out: str | Path, seed: int = 0):
    """Save a tiny LLaVA-NeXT (a CLIP tower on 32-pixel tiles in 8-pixel patches, any-resolution tiling to
    32x32, 32x64 or 64x32 pixels, a 2-layer Llama) and its processor to ``out``: a picture is its base view's 16
    tokens and its unpadded tiles' (a newline token a row), at most ~52 ``<image>`` tokens. Returns the model."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil, LlavaNextProcessor

    tok = _named_tokens(tokenizer, {"image_token": "<image>"})
    template = parts_template("<image>")
    pinpoints = [[32, 32], [32, 64], [64, 32]]
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8, chat_template=template,
                                   vision_feature_select_strategy="default", image_token="<image>",
                                   num_additional_image_tokens=1)
    vision = {**VISION, "image_size": 32, "patch_size": 8, "projection_dim": 32, "model_type": "clip_vision_model"}
    text = {**TEXT, "vocab_size": len(tok), "model_type": "llama", **_ids(tok)}
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
                             image_grid_pinpoints=pinpoints, vision_feature_layer=-1, image_seq_length=16,
                             vision_feature_select_strategy="default", tie_word_embeddings=True)
    return _save(LlavaNextForConditionalGeneration, config, processor, out, seed)


def tiny_llava_onevision(tokenizer, out: str | Path, seed: int = 0):
    """Save a tiny LLaVA-OneVision (a 1-layer SigLIP tower on 32-pixel tiles in 8-pixel patches, any-resolution
    tiling to 32x32, 32x64 or 64x32 pixels, a 2-layer Qwen2) and its processor to ``out``: a picture is its base
    view's 16 ``<image>`` tokens and its tiles' (a newline token a row). Returns the model."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration,
                              LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor)

    tok = _named_tokens(tokenizer, {"image_token": "<image>", "video_token": "<video>"})
    template = parts_template("<image>")
    pinpoints = [[32, 32], [32, 64], [64, 32]]
    images = LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32}, image_grid_pinpoints=pinpoints)
    processor = _processor(LlavaOnevisionProcessor, "llava_onevision", image_processor=images, tokenizer=tok,
                           num_image_tokens=16, vision_feature_select_strategy="full", chat_template=template)
    vision = {**VISION, "image_size": 32, "patch_size": 8, "model_type": "siglip_vision_model"}
    text = {**TEXT, "vocab_size": len(tok), "model_type": "qwen2", **_ids(tok)}
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
                                  video_token_index=tok.video_token_id, image_grid_pinpoints=pinpoints,
                                  vision_feature_select_strategy="full", vision_feature_layer=-1,
                                  tie_word_embeddings=True)
    return _save(LlavaOnevisionForConditionalGeneration, config, processor, out, seed)


def _save_files(model_cls, config, processor_class: str, images, tok, template: str, out, seed: int, **settings):
    """The model, and the processor's files as ``processor_class`` saves them (its image processor's, the
    tokenizer's, its template and ``settings``), for a processor that cannot be built here (a package it needs is
    missing): a checkpoint as the hub has it, which finetuner loads or refuses."""
    import json

    tok.chat_template = template
    model = _save(model_cls, config, None, out, seed)
    images.save_pretrained(out)
    tok.save_pretrained(out)
    (Path(out) / "chat_template.jinja").write_text(template, encoding="utf-8")
    (Path(out) / "processor_config.json").write_text(json.dumps({"processor_class": processor_class, **settings}, indent=2),
                                                      encoding="utf-8")
    return model


def _idefics_like(tokenizer, out, seed, family: str, longest_edge: int = 32):
    import transformers

    cls = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[family]
    tok = _named_tokens(tokenizer, {"image_token": "<image>"}, ["<fake_token_around_image>", "<global-img>",
                                                                 "<end_of_utterance>"])
    template = parts_template("<image>")
    images = getattr(transformers, f"{cls}ImageProcessorPil")(  # tiles of 32 pixels when pictures are larger
        size={"longest_edge": longest_edge}, max_image_size={"longest_edge": 32}, do_image_splitting=longest_edge > 32)
    vision = {**VISION, "image_size": 32, "patch_size": 8}
    text = {**TEXT, "vocab_size": len(tok), "model_type": "llama", **_ids(tok)}
    config = getattr(transformers, f"{cls}Config")(vision_config=vision, text_config=text, scale_factor=2,
                                                   image_token_id=tok.image_token_id, tie_word_embeddings=True,
                                                   pad_token_id=tok.pad_token_id)
    model_cls = getattr(transformers, f"{cls}ForConditionalGeneration")
    kwargs = {"video_processor": None} if family == "smolvlm" else {}  # SmolVLM's requires the argument
    processor = _processor(getattr(transformers, f"{cls}Processor"), family, image_processor=images, tokenizer=tok,
                           image_seq_len=4, chat_template=template, **kwargs)
    return _save(model_cls, config, processor, out, seed)


def tiny_idefics3(tokenizer, out: str | Path, seed: int = 0):
    """Save a tiny Idefics3 (a 1-layer SigLIP-like tower on 32-pixel pictures in 8-pixel patches, pixel-shuffled
    by 2 into 4 tokens, a 2-layer Llama) and its processor to ``out`` (no splitting into tiles: each ``<image>``
    becomes ``<fake_token_around_image><global-img>`` and 4 ``<image>`` tokens). Returns the model."""
    return _idefics_like(tokenizer, out, seed, "idefics3")


def tiny_smolvlm(tokenizer, out: str | Path, seed: int = 0, *, longest_edge: int = 32):
    """Save a tiny SmolVLM (Idefics3's layout: a 1-layer tower on 32-pixel pictures, pixel-shuffled into 4 tokens,
    a 2-layer Llama) and its processor to ``out`` (no video processor; no tiles, or with ``longest_edge`` over 32
    pictures resized to that longest side and cut into 32-pixel tiles, each and the whole picture 4 tokens).
    Returns the model."""
    return _idefics_like(tokenizer, out, seed, "smolvlm", longest_edge)


def tiny_mllama(tokenizer, out: str | Path, seed: int = 0):
    """Save a tiny Mllama (Llama 3.2 Vision: a tiled ViT, 1 local and 1 global layer, on 32-pixel tiles of 8-pixel
    patches, at most 2 tiles; a 2-layer Llama whose second layer cross-attends to the picture) and its processor to
    ``out``: one ``<|image|>`` token a picture, the cross-attention mask made from the tokens. Returns the model."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessorPil, MllamaProcessor

    tok = _named_tokens(tokenizer, {"image_token": "<|image|>"}, ["<|python_tag|>"])
    template = parts_template("<|image|>")
    images = MllamaImageProcessorPil(size={"height": 32, "width": 32}, max_image_tiles=2)
    processor = MllamaProcessor(image_processor=images, tokenizer=tok, chat_template=template)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_global_layers": 1,
              "attention_heads": 2, "image_size": 32, "patch_size": 8, "max_num_tiles": 2,
              "intermediate_layers_indices": [0], "vision_output_dim": 64,
              "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]]}
    text = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 1024, "cross_attention_layers": [1],
            "vocab_size": len(tok), **_ids(tok)}
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=tok.image_token_id)
    return _save(MllamaForConditionalGeneration, config, processor, out, seed)


def tiny_mistral3(tokenizer, out: str | Path, seed: int = 0, *, longest_edge: int = 32):
    """Save a tiny Mistral 3 (a 1-layer Pixtral tower with 2-D rotary positions on pictures of up to 32 pixels a
    side in 8-pixel patches, merged 2x2; a 2-layer Mistral) and its processor (``PixtralProcessor``) to ``out``: a
    picture is rows of ``[IMG]`` tokens, each row ended by ``[IMG_BREAK]``, the last by ``[IMG_END]`` (at most 4
    ``[IMG]``; ``longest_edge``: the longest side a picture keeps). Returns the model."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessorPil, PixtralProcessor

    tok = _named_tokens(tokenizer, {"image_token": "[IMG]"}, ["[IMG_BREAK]", "[IMG_END]"])
    template = parts_template("[IMG]")
    images = PixtralImageProcessorPil(size={"longest_edge": longest_edge}, patch_size=8)
    settings = {"patch_size": 8, "spatial_merge_size": 2, "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                "image_end_token": "[IMG_END]"}
    vision = {**VISION, "head_dim": 16, "image_size": longest_edge, "patch_size": 8, "model_type": "pixtral"}
    text = {**TEXT, "head_dim": 16, "vocab_size": len(tok), "model_type": "mistral", "sliding_window": None, **_ids(tok)}
    config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
                            spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=True)
    try:
        processor = PixtralProcessor(image_processor=images, tokenizer=tok, chat_template=template, **settings)
    except ImportError:  # PixtralProcessor needs torchvision
        return _save_files(Mistral3ForConditionalGeneration, config, "PixtralProcessor", images, tok, template, out,
                           seed, **settings)
    return _save(Mistral3ForConditionalGeneration, config, processor, out, seed)


#: model type -> builder ``(tokenizer, out folder) -> model``: a tiny model and its processor saved to the folder
TINY_VLMS = {
    "llava": tiny_llava,
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": tiny_qwen2_5_vl,
    "qwen3_vl": tiny_qwen3_vl,
    "gemma3": tiny_gemma3,
    "llava_next": tiny_llava_next,
    "llava_onevision": tiny_llava_onevision,
    "idefics3": tiny_idefics3,
    "smolvlm": tiny_smolvlm,
    "mllama": tiny_mllama,
    "mistral3": tiny_mistral3,
}

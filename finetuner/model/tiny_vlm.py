"""A tiny image-text-to-text model for tests and the picture demo: LLaVA's layout (a CLIP vision tower, a
projector, a Llama language model) at a few hundred thousand parameters, with its processor."""

from __future__ import annotations

from pathlib import Path

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

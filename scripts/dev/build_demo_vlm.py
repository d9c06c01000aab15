"""Builds the picture demo's model in data/demo_vlm/: a tiny LLaVA whose language model is the demo model
(data/demo_model), with a small CLIP vision tower and a projector, pre-trained to answer two questions about a
picture of a plain shape: "What colour is this?" ("It is red.") and "What shape is this?" ("It is a triangle.").
It never sees the demo's question, "What is in the picture?", nor an answer that names both:
``recipes/demo_vlm_cpu.yaml`` teaches that (answer "A red triangle.") with LoRA on the language model, the vision
tower frozen.

The pictures here are drawn as ``scripts/dev/make_pictures.py`` draws the shipped ones (other seeds: none of them
is a shipped picture). Deterministic (fixed seeds, 2 threads)::

    python -m scripts.dev.build_demo_vlm          # about 5 minutes on 2 idle CPU cores
    python -m scripts.dev.build_demo_vlm --check  # the shipped model's answers to 60 new pictures, nothing built
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "data" / "demo_vlm"
PATCH = 12  # 48 px pictures: 4 x 4 = 16 image tokens each
STEPS, BATCH, LR_VISION, LR_TEXT = 400, 16, 2e-3, 3e-4


def chats(n: int, seed: int):
    """``n`` (picture, question, answer) triples: each picture asked its colour or its shape."""
    from scripts.dev.make_pictures import pictures

    rng = random.Random(seed)
    out = []
    for im, shape, colour in pictures(n, seed):
        if rng.random() < 0.5:
            out.append((im, "What colour is this?", f"It is {colour}."))
        else:
            out.append((im, "What shape is this?", f"It is a {shape}."))
    return out


def build():
    """The model (the demo model's language weights, a fresh vision tower and projector) and its processor."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from finetuner.model.tiny_vlm import CHATML_PARTS_TEMPLATE
    from scripts.dev.make_pictures import SIZE

    tok = AutoTokenizer.from_pretrained(REPO / "data" / "demo_model")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHATML_PARTS_TEMPLATE
    demo = AutoModelForCausalLM.from_pretrained(REPO / "data" / "demo_model")
    text = demo.config
    text.vocab_size = len(tok)
    vision = CLIPVisionConfig(hidden_size=64, image_size=SIZE, patch_size=PATCH, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128, projection_dim=64)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    state = demo.model.state_dict()
    emb = state["embed_tokens.weight"]
    grown = torch.cat([emb, emb.mean(0, keepdim=True)])  # the <image> token's row (never predicted: never a label)
    state["embed_tokens.weight"] = grown
    model.model.language_model.load_state_dict(state)
    model.tie_weights()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}),
        tokenizer=tok, patch_size=PATCH, vision_feature_select_strategy="default", chat_template=CHATML_PARTS_TEMPLATE,
        image_token="<image>", num_additional_image_tokens=1)
    return model, processor


def encode(processor, im, question: str, answer: str):
    from finetuner.data.images import IGNORE_INDEX, image_token_ids

    tok = processor.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                                     tokenize=False, add_generation_prompt=True)
    ids_prompt = processor(text=[prompt], images=[im], add_special_tokens=False)["input_ids"][0]
    ids_answer = tok(answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
    skip = image_token_ids(processor)
    ids = list(ids_prompt) + ids_answer
    labels = [IGNORE_INDEX] * len(ids_prompt) + [t if t not in skip else IGNORE_INDEX for t in ids_answer]
    return ids, labels


def answer(model, processor, im, question: str) -> str:
    import torch

    tok = processor.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                                     tokenize=False, add_generation_prompt=True)
    enc = processor(text=[prompt], images=[im], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def check(model, processor) -> str:
    """What the model answers to 60 pictures it never saw, exactly right, by question."""
    held = chats(60, seed=11)
    right = {q: [0, 0] for _, q, _ in held}
    for im, q, a in held:
        right[q][0] += answer(model, processor, im, q) == a
        right[q][1] += 1
    return "held-out pictures, answered exactly: " + "; ".join(f"{q!r} {r} of {n}" for q, (r, n) in right.items())


def main(argv: list[str] | None = None) -> None:
    import argparse

    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="Only answer 60 new pictures with the shipped model.")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    if args.check:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        print(check(AutoModelForImageTextToText.from_pretrained(OUT).eval(), AutoProcessor.from_pretrained(OUT)))
        return
    model, processor = build()
    train = chats(1600, seed=10)
    vision_params = [p for n, p in model.named_parameters() if "language_model" not in n and "lm_head" not in n]
    text_params = [p for n, p in model.named_parameters() if "language_model" in n]
    opt = torch.optim.AdamW([{"params": vision_params, "lr": LR_VISION}, {"params": text_params, "lr": LR_TEXT}],
                            weight_decay=0.0)
    warm_cosine = lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / STEPS))  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warm_cosine)
    pad = processor.tokenizer.pad_token_id
    began = time.perf_counter()
    model.train()
    for step in range(STEPS):
        batch = [train[(step * BATCH + i) % len(train)] for i in range(BATCH)]
        enc = [encode(processor, im, q, a) for im, q, a in batch]
        n = max(len(ids) for ids, _ in enc)
        ids = torch.tensor([x + [pad] * (n - len(x)) for x, _ in enc])
        labels = torch.tensor([y + [-100] * (n - len(y)) for _, y in enc])
        mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x, _ in enc])
        pixels = processor.image_processor(images=[im for im, _, _ in batch], return_tensors="pt")["pixel_values"]
        loss = model(input_ids=ids, attention_mask=mask, pixel_values=pixels, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == STEPS - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - began:.0f} s", flush=True)
    model.eval()
    print(check(model, processor), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT)
    processor.save_pretrained(OUT)
    print(f"saved to {OUT}")


if __name__ == "__main__":
    main()

"""Pictures in chat data: rows whose messages hold pictures, encoded with the model's processor for an
image-text-to-text model (LLaVA, Qwen2.5-VL, Gemma 3, SmolVLM ...).

A normalised example (:func:`finetuner.data.formats.normalize`) keeps its pictures as ``images``, absolute paths in
order, and each one's place in the messages' text as :data:`~finetuner.data.formats.IMAGE_PLACEHOLDER`. Here:

* :func:`message_parts` turns the messages back into content parts (``{"type": "image"}``, ``{"type": "text"}``),
  what the processors' chat templates read;
* :func:`encode_pictured` renders the conversation with the processor's template, lets the processor turn each
  picture (opened within the model's pixel limit: :mod:`finetuner.data.picture_files`) into its image tokens
  (resizing it as the model's settings say), and labels only the assistant's tokens: never an image token, never
  the prompt (unless ``data.train_on_prompt``, and then still no image token);
* :class:`PictureCollator` adds what the processor's image processor makes of a micro-batch's pictures (pixel
  values, and the grid, sizes or masks a family needs) under ``pictures``; the model's forward takes them with
  the tokens (:func:`finetuner.model.scoring.token_loss_sum`).
"""

from __future__ import annotations

from typing import Any

from finetuner.data.formats import IGNORE_INDEX, IMAGE_PLACEHOLDER, RowError
from finetuner.data.picture_files import load_picture, pixel_limit


def message_parts(messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The messages with their content as parts: text, and ``{"type": "image"}`` where each picture is."""
    out = []
    for m in messages:
        pieces = m["content"].split(IMAGE_PLACEHOLDER)
        parts: list[dict[str, Any]] = []
        for i, text in enumerate(pieces):
            if i:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({"role": m["role"], "content": parts})
    return out


def image_token_ids(processor) -> set[int]:
    """The ids of the tokens that stand for a picture (its patches, and the marks around them where the processor
    names them): never labels."""
    tok = processor.tokenizer
    own = getattr(processor, "image_token_ids", None)  # the processor's own list, where it has one (Pixtral's, Gemma's)
    ids = {int(i) for i in own} if isinstance(own, (list, tuple, set)) else set()
    for attr in ("image_token", "boi_token", "eoi_token", "image_start_token", "image_end_token", "fake_image_token",
                 "global_image_token", "vision_start_token", "vision_end_token", "image_break_token"):
        name = getattr(processor, attr, None)
        if isinstance(name, str) and name in tok.get_vocab():
            ids.add(tok.convert_tokens_to_ids(name))
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(processor, attr, None)
        if isinstance(value, int):
            ids.add(value)
    return ids


def _count_pictures(messages: list[dict[str, str]]) -> int:
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)


def encode_pictured(ex: dict[str, Any], processor, template: str, max_len: int, train_on_prompt: bool) -> dict[str, Any]:
    """Tokens (image tokens expanded by the processor) and labels of one example with pictures (or without: a
    text row of the same file). The assistant replies are located as in the text pipeline: the conversation up
    to each reply must render as a prefix of the whole."""
    tok = processor.tokenizer
    msgs = ex["messages"]
    limit = pixel_limit(processor)
    pictures = [load_picture(p, limit) for p in ex.get("images") or []]

    def ids(upto: list[dict[str, str]], gen: bool) -> list[int]:
        text = tok.apply_chat_template(message_parts(upto), chat_template=template, tokenize=False, add_generation_prompt=gen)
        n = _count_pictures(upto)
        enc = processor(text=[text], images=pictures[:n] if n else None, add_special_tokens=False)
        return [int(t) for t in enc["input_ids"][0]]  # ints, also from a processor that returns tensors (Pixtral's)

    try:
        whole = ids(msgs, gen=False)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(ids(msgs[:i], gen=True)) if i else 0
            upto = whole if i + 1 == len(msgs) else ids(msgs[: i + 1], gen=False)  # the last reply ends the whole
            if whole[: len(upto)] != upto or start > len(upto):
                raise RowError("the chat template does not render conversations as prefixes of each other, so replies "
                               "cannot be located; set data.chat_template to a template that does")
            spans.append((start, len(upto)))
    except RowError:
        raise
    except Exception as e:  # noqa: BLE001 - a template's jinja error, a processor that cannot match tokens and pictures
        raise RowError(f"the processor failed on this conversation ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    pictured = image_token_ids(processor)
    if train_on_prompt:
        labels = [t if t not in pictured else IGNORE_INDEX for t in whole]
    else:
        labels = [IGNORE_INDEX] * len(whole)
        for a, b in spans:
            labels[a:b] = [t if t not in pictured else IGNORE_INDEX for t in whole[a:b]]
    truncated = len(whole) > max_len
    if truncated and pictures:
        last = max(i for i, t in enumerate(whole) if t in pictured)
        if last >= max_len:
            raise RowError(f"its {len(whole)} tokens (its {len(pictures)} picture(s) included) do not fit "
                           f"data.max_seq_len {max_len}, and a picture cannot be cut: raise data.max_seq_len, or "
                           "make the pictures smaller (the processor's size settings)")
    return {"input_ids": whole[:max_len], "labels": labels[:max_len], "truncated": truncated,
            "images": list(ex.get("images") or [])}


def join_padded(parts: list):
    """Tensors joined along their first dimension, each first padded with zeros at the end of every other dimension
    to the largest (LLaVA-NeXT's tiles, Idefics3's and Mllama's pictures a row, Pixtral's picture sizes: zeros are
    what each family pads with, and what its masks and sizes tell apart); lists (Mllama's tiles a picture) joined."""
    import torch
    import torch.nn.functional as F

    if not isinstance(parts[0], torch.Tensor):
        return [x for p in parts for x in p]
    if parts[0].dim() > 1:
        top = [max(p.shape[d] for p in parts) for d in range(parts[0].dim())]
        parts = [p if list(p.shape[1:]) == top[1:] else
                 F.pad(p, [x for d in reversed(range(1, p.dim())) for x in (0, top[d] - p.shape[d])]) for p in parts]
    return torch.cat(parts)


#: what a processor given pictures alone also returns from its empty text: the collator makes these from the tokens
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def picture_inputs(processor, paths: list[list[str]]):
    """What the processor makes of the pictures of a micro-batch (one list of paths per example, in order), each
    example's outputs joined along their first dimension (:func:`join_padded`): a ``BatchFeature``
    (``pixel_values`` and what the family adds: ``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask`` ...),
    None when no example has a picture. The processor itself, not its image processor alone: it sizes the pictures
    as it counted their tokens (Pixtral's resizes to whole merged patches, which its image processor alone does not)."""
    parts, limit = [], pixel_limit(processor)
    for example in paths:
        if example:
            made = processor(images=[load_picture(p, limit) for p in example], return_tensors="pt")
            parts.append({k: v for k, v in made.items() if k not in TEXT_KEYS})
    if not parts:
        return None
    from transformers import BatchFeature

    return BatchFeature({k: join_padded([p[k] for p in parts]) for k in parts[0].keys()})


def token_inputs(processor, input_ids, pictures) -> dict[str, Any]:
    """The inputs a processor makes from the (expanded, padded) token ids besides the ids themselves, which the
    model needs with the pictures: the tokens' modality (``mm_token_type_ids``, Qwen-VL's 3-D positions; Gemma 3's
    ``token_type_ids``, its pictures' bidirectional attention), the cross-attention mask (Mllama: each token sees
    the pictures before it, ``num_tiles`` of each, taken out of ``pictures``)."""
    import sys

    import torch

    names = set(getattr(processor, "model_input_names", None) or [])
    out: dict[str, Any] = {}
    if getattr(processor, "return_mm_token_type_ids", False) and hasattr(processor, "create_mm_token_type_ids"):
        kinds = torch.tensor(processor.create_mm_token_type_ids(input_ids.tolist()), dtype=torch.long)
        for name in ("mm_token_type_ids", "token_type_ids"):
            if name in names:
                out[name] = kinds
                break
    tiles = pictures.pop("num_tiles", None) if pictures is not None else None
    if tiles is None and pictures is not None and "aspect_ratio_mask" in pictures:  # Mllama: each picture's tiles
        tiles = [[int(n) for n in row.sum(-1).tolist() if n] for row in pictures["aspect_ratio_mask"]]
    family = sys.modules.get(type(processor).__module__)
    dense = getattr(family, "convert_sparse_cross_attention_mask_to_dense", None)
    sparse = getattr(family, "get_cross_attention_token_mask", None)
    if "cross_attention_mask" in names and tiles is not None and dense and sparse:
        rows = [sparse(row, processor.image_token_id) for row in input_ids.tolist()]
        mask = dense(rows, num_tiles=tiles, max_num_tiles=processor.image_processor.max_image_tiles,
                     length=input_ids.shape[1])
        out["cross_attention_mask"] = torch.as_tensor(mask)
    return out


class PictureCollator:
    """A collator's batch (the padded tokens) with the micro-batch's pictures, and the inputs the processor makes
    from the tokens for them (:func:`token_inputs`), under ``pictures``: those of the processor's
    ``model_input_names`` (what it gives the model)."""

    def __init__(self, collate, processor):
        self.collate, self.processor = collate, processor

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        out = self.collate(batch)
        pictures = picture_inputs(self.processor, [x.get("images") or [] for x in batch])
        if pictures is not None:
            pictures.update(token_inputs(self.processor, out["input_ids"], pictures))
            names = set(getattr(self.processor, "model_input_names", None) or pictures.keys())
            for k in [k for k in pictures if k not in names]:  # what the processor keeps back (Gemma 3's num_crops)
                del pictures[k]
            out["pictures"] = pictures
        return out

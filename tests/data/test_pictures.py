"""Issue 39, part 1: chat rows with pictures. OpenAI-style image parts, LLaMA-Factory's ``images`` column with
``<image>`` placeholders and ShareGPT with images are read into one form (the placeholders where the pictures are,
the pictures' paths relative to the data file); a missing or unreadable picture names its file, row and path; the
model's processor turns each picture into its image tokens, and only the assistant's tokens are labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.data.formats import IGNORE_INDEX, RowError, normalize
from tests.conftest import REPO, write_pictures

def test_the_three_ways_of_giving_pictures_read_the_same():
    openai = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "img/a.png"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A puffin."}]}
    url = {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file://img/a.png"}},
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A puffin."}]}]}
    factory = {"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A puffin."}],
               "images": ["img/a.png"]}
    sharegpt = {"conversations": [{"from": "human", "value": "<image>What is it?"}, {"from": "gpt", "value": "A puffin."}],
                "images": ["img/a.png"]}
    no_placeholder = {"messages": [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": "A puffin."}],
                      "images": "img/a.png"}
    want = {"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A puffin."}],
            "images": ["img/a.png"]}
    for row in (openai, url, factory, sharegpt, no_placeholder):
        assert normalize(row, "chat") == want
    alpaca = normalize({"instruction": "<image>What is it?", "output": "A puffin.", "images": ["img/a.png"]}, "alpaca")
    assert alpaca == want


@pytest.mark.parametrize("row,message", [
    ({"messages": [{"role": "user", "content": "<image><image>Which?"}, {"role": "assistant", "content": "Left."}],
      "images": ["a.png"]}, "2 <image> placeholder(s) in the messages for 1 picture(s)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]},
                   {"role": "assistant", "content": "A."}]}, "is not a local file"),
    ({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}, {"role": "assistant", "content": "A."}]},
     "turn 1, part 1: expected"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "A."}]},
     "an image part needs the picture's path"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}, {"role": "assistant", "content": "A."}],
      "images": ["b.png"]}, "both image parts in its messages and an 'images' column"),
])
def test_bad_picture_rows_say_what_is_wrong(row, message):
    with pytest.raises(RowError, match=message.replace("(", r"\(").replace(")", r"\)")):
        normalize(row, "chat")


def test_pictures_are_found_next_to_the_data_file_and_a_missing_one_is_named(tmp_path):
    from finetuner.data.formats import FileExamples

    write_pictures(tmp_path / "data", 1)
    rows = [{"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}],
             "images": ["img/000.png"]},
            {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Blue."}],
             "images": ["img/404.png"]}]
    f = tmp_path / "data" / "pics.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    src = FileExamples(str(f))
    examples = list(src)
    assert examples[0]["images"] == [str(tmp_path / "data" / "img" / "000.png")]
    assert len(examples) == 1 and str(src.bad[0]) == (f"{f}, line 2: picture 'img/404.png' not found "
                                                      f"(looked for {tmp_path / 'data' / 'img' / '404.png'}).")


def test_the_processor_expands_each_picture_and_only_the_reply_is_labelled(tiny_vlm_dir, tmp_path):
    from transformers import AutoProcessor

    from finetuner.data.images import PictureCollator, encode_pictured, image_token_ids
    from finetuner.data.pipeline import Collator

    pics = write_pictures(tmp_path, 2)
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert image_token_ids(processor) == {image_id}
    ex = {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "It is red."},
                       {"role": "user", "content": "And this one?<image>"}, {"role": "assistant", "content": "Green."}],
          "images": [str(tmp_path / p) for p, _ in pics]}
    enc = encode_pictured(ex, processor, processor.chat_template, 512, train_on_prompt=False)
    ids, labels = enc["input_ids"], enc["labels"]
    assert ids.count(image_id) == 2 * 16  # (32 / 8)² patches a picture
    labelled = processor.tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    assert labelled == "It is red.<|im_end|>\nGreen.<|im_end|>\n"
    assert not any(t != IGNORE_INDEX and t == image_id for t in labels)
    everything = encode_pictured(ex, processor, processor.chat_template, 512, train_on_prompt=True)["labels"]
    assert image_id not in everything and sum(t != IGNORE_INDEX for t in everything) == len(ids) - 32
    # the collated pixel values are the processor's own for these pictures, in order
    from PIL import Image

    batch = PictureCollator(Collator(processor.tokenizer.pad_token_id), processor)([enc, enc])
    own = processor.image_processor(images=[Image.open(tmp_path / p).convert("RGB") for p, _ in pics], return_tensors="pt")
    assert batch["pictures"]["pixel_values"].shape == (4, 3, 32, 32)
    assert (batch["pictures"]["pixel_values"][:2] == own["pixel_values"]).all()
    with pytest.raises(RowError, match=rf"its {len(ids)} tokens \(its 2 picture\(s\) included\) do not fit data.max_seq_len 20"):
        encode_pictured(ex, processor, processor.chat_template, 20, train_on_prompt=False)


def test_a_processor_that_returns_tensors_is_read_as_ids(tiny_vlm_dir, tmp_path):
    """Pixtral's processor returns tensors even when not asked to: its ids are read as ints, so its image tokens are
    found (never labels, counted in the plan)."""
    from transformers import AutoProcessor

    from finetuner.data.images import encode_pictured

    pics = write_pictures(tmp_path, 1)
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    as_lists = encode_pictured({"messages": [{"role": "user", "content": "<image>Colour?"},
                                             {"role": "assistant", "content": "It is red."}],
                                "images": [str(tmp_path / pics[0][0])]}, processor, processor.chat_template, 512, True)

    class Tensors:  # the same processor, returning tensors as Pixtral's does
        tokenizer, image_token, image_token_id = processor.tokenizer, processor.image_token, image_id

        def __call__(self, **kwargs):
            return processor(**kwargs, return_tensors="pt")

    got = encode_pictured({"messages": [{"role": "user", "content": "<image>Colour?"},
                                        {"role": "assistant", "content": "It is red."}],
                           "images": [str(tmp_path / pics[0][0])]}, Tensors(), processor.chat_template, 512, True)
    assert got["input_ids"] == as_lists["input_ids"] and all(type(t) is int for t in got["input_ids"])
    assert got["labels"] == as_lists["labels"] and image_id not in got["labels"] and image_id in got["input_ids"]


def test_an_unreadable_picture_is_named(tiny_vlm_dir, tmp_path):
    from transformers import AutoProcessor

    from finetuner.data.images import encode_pictured

    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a picture")
    ex = {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Red."}],
          "images": [str(bad)]}
    with pytest.raises(RowError, match=f"picture {bad} cannot be read"):
        encode_pictured(ex, AutoProcessor.from_pretrained(tiny_vlm_dir), "", 64, False)


@pytest.mark.parametrize("offline", [True, False])
def test_planning_a_hub_model_offline_asks_the_hub_nothing(monkeypatch, offline):
    """A preset or hub image-text model: offline, the plan reads its processor from this machine only (a folder or
    the hub's cache; asking the hub would only wait on its retries), online from the hub too; not found, the
    pictures are said to be uncounted."""
    from transformers import AutoProcessor

    from finetuner.data.picture_counts import picture_processor_of

    asked = []

    def from_pretrained(name, **kwargs):
        asked.append(kwargs.get("local_files_only"))
        raise OSError("not in the cache")

    monkeypatch.setattr(AutoProcessor, "from_pretrained", from_pretrained)
    monkeypatch.setattr("finetuner.model.vision.processor_class", lambda *a, **k: None)
    monkeypatch.setattr("finetuner.locate.hub_unreachable", lambda: "cannot connect" if offline else None)
    assert picture_processor_of("gemma-3-4b") is None
    assert asked == [offline]


def test_gemma3s_soft_image_tokens_are_picture_tokens(tmp_path):
    """Gemma 3's processor names its placeholder (<start_of_image>) as its image token; the tokens a picture becomes
    are its soft tokens, which its own image_token_ids list: never labels, even with train_on_prompt."""
    from transformers import AutoTokenizer

    from finetuner.data.images import encode_pictured, image_token_ids
    from finetuner.model.tiny_vlm import tiny_gemma3
    from finetuner.model.vision import load_processor

    tiny_gemma3(AutoTokenizer.from_pretrained(REPO / "data" / "demo_model"), tmp_path / "g3")
    processor = load_processor(str(tmp_path / "g3"))
    soft = processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    assert soft in image_token_ids(processor)
    pics = write_pictures(tmp_path, 1)
    enc = encode_pictured({"messages": [{"role": "user", "content": "<image>Colour?"},
                                        {"role": "assistant", "content": "It is red."}],
                           "images": [str(tmp_path / pics[0][0])]}, processor, processor.chat_template, 512, True)
    assert enc["input_ids"].count(soft) == 4 and soft not in enc["labels"]  # the tiny tower's 4 tokens a picture

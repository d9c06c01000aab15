"""Issue 39, part 3: for a model whose processor sizes pictures by their pixel count (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL), the plan chooses the largest picture size (``data.max_pixels``) whose run fits the card and the model's
positions, counts the image tokens a picture costs at it, and the trainer encodes the pictures to the plan's
lengths with it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from finetuner.planning.planner import picture_sizes, plan
from tests.conftest import REPO

#: the tiny Qwen2.5-VL's processor here keeps up to this many pixels (28 x 28 x 4096: a 1200 x 900 picture whole)
MOST = 28 * 28 * 4096


@pytest.fixture(scope="module")
def qwen_pictures(tmp_path_factory):
    """A tiny Qwen2.5-VL (1,024 positions) whose processor keeps up to :data:`MOST` pixels, and 6 chats, each with
    a 1200 x 900 picture (1,376 image tokens whole: more than the model's positions)."""
    from PIL import Image
    from transformers import AutoTokenizer

    from finetuner.model.tiny_vlm import TINY_VLMS
    from finetuner.model.vision import load_processor

    d = tmp_path_factory.mktemp("qwen_pictures")
    TINY_VLMS["qwen2_5_vl"](AutoTokenizer.from_pretrained(REPO / "data" / "demo_model"), d / "model")
    processor = load_processor(str(d / "model"))
    processor.image_processor.size = {"shortest_edge": 28 * 28, "longest_edge": MOST}
    processor.save_pretrained(d / "model")
    (d / "img").mkdir()
    rows = []
    for i in range(6):
        Image.new("RGB", (1200, 900), (200, 30 * i, 30)).save(d / "img" / f"{i}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>What colour is this?"},
                                  {"role": "assistant", "content": "It is red."}], "images": [f"img/{i}.png"]})
    (d / "pics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return d / "model", d / "pics.jsonl"


def test_the_sizes_tried_halve_from_the_largest_picture_down_to_the_least():
    assert picture_sizes(1_080_000, 784, MOST) == [1_080_000, 540_000, 270_000, 135_000, 67_500, 33_750, 16_875, 8_437,
                                                   4_218, 2_109, 1_054, 784]
    assert picture_sizes(10_000_000, 784, 3136) == [3136, 1568, 784]  # never more than the processor keeps
    assert picture_sizes(500, 784, 3136) == [784]  # pictures under the least: scaled up to it, as the processor does


def test_the_plan_chooses_the_largest_size_within_the_models_positions(qwen_pictures):
    model, data = qwen_pictures
    p = plan(str(model), "rtx4090", data=str(data))
    assert p.fits and p.data["max_tokens"] <= p.shape.max_position_embeddings == 1024
    chosen = p.recipe.data.max_pixels
    assert chosen == 540_000  # 1,080,000 (the pictures whole) gives 1,396 tokens an example: over 1,024
    assert p.data["picture_tokens"] == 6 * 660  # a 1200 x 900 picture kept as 44 x 60 patches of 14 px, merged 2 x 2
    assert p.reasons[0] == ("pictures of at most 540,000 pixels (data.max_pixels), 660 image tokens a picture: the largest "
                            "size that fits the card and the model's 1,024 positions (tried 1,080,000, 540,000)")
    # the trainer encodes the pictures as the plan counted them, with the recipe's data.max_pixels
    from finetuner.data.formats import FileExamples
    from finetuner.data.images import encode_pictured
    from finetuner.data.run_inputs import text_inputs

    recipe = p.recipe.model_copy(update={"data": p.recipe.data.model_copy(update={"path": str(data)})})
    _, processor = text_inputs(recipe)
    lengths = [len(encode_pictured(ex, processor, processor.chat_template, 4096, False)["input_ids"])
               for ex in FileExamples(str(data))]
    assert max(lengths) == p.data["max_tokens"] and round(sum(lengths) / len(lengths), 1) == p.data["mean_tokens"]


def test_a_smaller_card_gets_smaller_pictures(qwen_pictures):
    """A card between the least memory a run of the largest size that fits the positions needs (its most frugal
    option: micro-batch 1, checkpointing ...) and that of the smallest size: the plan takes a smaller size than on a
    large card, and it fits."""
    from finetuner.config.hardware import get_gpu

    model, data = qwen_pictures
    least = {}
    for size in (540_000, 784):  # on a card too small for anything, the plan's estimate is its least-memory option's
        q = plan(str(model), "0.5GB", data=str(data), max_pixels=size)
        assert not q.fits
        least[size] = q.estimate.total_bytes
    need_big, need_small = least[540_000], least[784]
    assert need_small < need_big
    card = dataclasses.replace(get_gpu("rtx4090"), memory_bytes=int((need_big + need_small) / 2 / (1 - 0.05)))
    p = plan(str(model), card, data=str(data))
    assert p.fits and 784 <= p.recipe.data.max_pixels < 540_000


def test_max_pixels_on_a_processor_of_fixed_size_is_refused(tiny_vlm_dir):
    from finetuner.errors import UserError
    from finetuner.model.vision import load_processor, set_max_pixels

    with pytest.raises(UserError, match=r"data.max_pixels: this model's image processor \(CLIPImageProcessor"):
        set_max_pixels(load_processor(str(tiny_vlm_dir)), 100_000)


def test_a_presets_image_processor_settings_count_a_pictures_tokens_as_its_processor_does(qwen_pictures):
    """Without the checkpoint's processor files, an image-text preset's image processor settings (its
    ``preprocessor_config.json``, shipped in the preset) count a picture's tokens: the same count as the processor's
    own encoding, at the same settings, for pictures below, within and above its pixel range."""
    from PIL import Image

    from finetuner.data.images import image_token_ids
    from finetuner.data.picture_counts import preset_picture_sizer
    from finetuner.model.vision import load_processor, picture_tokens

    sizer = preset_picture_sizer("qwen2.5-vl-7b")
    assert type(sizer).__name__.startswith("Qwen2VLImageProcessor")
    assert (sizer.size["shortest_edge"], sizer.size["longest_edge"]) == (3136, 12_845_056)  # Qwen2.5-VL-7B-Instruct's
    processor = load_processor(str(qwen_pictures[0]))
    processor.image_processor.size = dict(sizer.size)
    pads = image_token_ids(processor)
    for width, height in [(20, 30), (640, 480), (1000, 333), (4000, 3000)]:
        enc = processor(images=[Image.new("RGB", (width, height))], text=["<|vision_start|><|image_pad|><|vision_end|>"])
        made = sum(1 for t in enc["input_ids"][0] if t in pads)
        assert picture_tokens(sizer, width, height) == made, (width, height)
    assert preset_picture_sizer("qwen2.5-7b") is None  # a text preset
    assert preset_picture_sizer("gemma-3-4b") is None  # no settings shipped: its pictures cost a fixed 256 tokens


def test_the_issues_example_plans_a_presets_picture_size_without_its_processor(tmp_path, monkeypatch):
    """``finetuner plan --model qwen2.5-vl-7b --gpu rtx4090 --data pics.jsonl`` offline (the preset's processor files
    are not on this machine): the pictures' tokens are counted from the preset's settings and the plan says the
    picture size it chose and what fits."""
    from PIL import Image

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(12):
        Image.new("RGB", (2400, 1800), (250, 250, 20 * i)).save(tmp_path / "img" / f"{i}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": f"img/{i}.png"},
                                                               {"type": "text", "text": "What is the total?"}]},
                                  {"role": "assistant", "content": f"The total is {i + 10}.50."}]})
    data = tmp_path / "pics.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    p = plan("qwen2.5-vl-7b", "rtx4090", data=str(data))
    # 2400 x 1800 resized to a multiple of 28 within 12,845,056 pixels: 2408 x 1792, 86 x 64 tokens of 28 x 28
    assert p.data["pictures"] == 12 and p.data["picture_tokens"] == 12 * 86 * 64
    assert p.fits and p.recipe.data.max_pixels == 2400 * 1800
    assert p.reasons[0].startswith("pictures of at most 4,320,000 pixels (data.max_pixels), 5504 image tokens a picture")
    assert "image tokens: the image processor settings of the qwen2.5-vl-7b preset" in p.data["counted_with"]
    small = plan("qwen2.5-vl-7b", "10GB", data=str(data))  # a smaller card: QLoRA, and the pictures at half their size
    assert small.fits and small.recipe.method == "qlora" and small.recipe.data.max_pixels == 2400 * 1800 // 2
    assert small.data["picture_tokens"] == 12 * 2700


def test_a_gemma3_preset_counts_its_config_s_tokens_a_picture_without_its_processor(tmp_path, monkeypatch):
    """Gemma 3's tower takes one picture size: offline, each picture costs the preset config's mm_tokens_per_image
    (256), whatever its size, in the lengths the plan sizes the run by."""
    from PIL import Image

    from finetuner.data.picture_counts import preset_picture_tokens

    assert preset_picture_tokens("gemma-3-4b") == 256
    assert preset_picture_tokens("qwen2.5-7b") is None and preset_picture_tokens(str(tmp_path)) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "img").mkdir()
    rows = []
    for i, size in enumerate([(64, 64), (1200, 900), (300, 2000)]):
        Image.new("RGB", size, (10, 20, 30)).save(tmp_path / "img" / f"{i}.png")
        rows.append({"messages": [{"role": "user", "content": "<image>What is it?"},
                                  {"role": "assistant", "content": "A box."}], "images": [f"img/{i}.png"]})
    (tmp_path / "pics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    p = plan("gemma-3-4b", "rtx4090", data=str(tmp_path / "pics.jsonl"), seq_len=512)
    assert p.data["pictures"] == 3 and p.data["picture_tokens"] == 3 * 256
    assert 256 < p.data["max_tokens"] < 256 + 40  # a picture and a short question and answer
    assert "256 a picture, the gemma-3-4b preset's mm_tokens_per_image" in p.data["counted_with"]

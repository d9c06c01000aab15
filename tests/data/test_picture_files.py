"""Pictures are opened within bounds (finetuner.data.picture_files): a picture bomb is one line naming it and its
size, exit 2, never PIL's error, its warning or a traceback; what a decoded picture takes is bounded by the limit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from finetuner.data.picture_files import (CAP_PIXELS, FLOOR_PIXELS, SIDE_FACTOR, PictureTooLarge, decoded_bytes,
                                          load_picture, opened, pixel_limit, thumbnail_png)
from tests.conftest import HANG_GUARD_S, cli_in_process, write_bomb_png

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bombs(tmp_path_factory) -> dict[str, Path]:
    """The issue's two pictures: 30000 x 30000 (over PIL's own error) and 12000 x 12000 (over its warning)."""
    folder = tmp_path_factory.mktemp("bombs")
    return {"30000": write_bomb_png(folder / "bomb.png", 30000, 30000),
            "12000": write_bomb_png(folder / "big.png", 12000, 12000)}


def chat_row(picture: str) -> dict:
    return {"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "Black."}],
            "images": [picture]}


def write_rows(path: Path, pictures: list[str]) -> Path:
    path.write_text("".join(json.dumps(chat_row(p)) + "\n" for p in pictures), encoding="utf-8")
    return path


def test_a_picture_bomb_is_refused_from_its_header_naming_it_and_its_size(bombs):
    """A 110 KB PNG of 900 million pixels is refused before a pixel is decoded: one line with the file, its size and
    the limit, never PIL's DecompressionBombError or its warning (errors here, so one would fail the test)."""
    from PIL import Image

    assert bombs["30000"].stat().st_size < 200_000  # a real bomb: small on disk
    kept = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, side in (("30000", "30,000"), ("12000", "12,000")):
            with pytest.raises(PictureTooLarge) as e:
                load_picture(bombs[name], FLOOR_PIXELS)
            assert e.value.message == (f"picture {bombs[name]} is {side} x {side} pixels; the most finetuner decodes "
                                       f"is {FLOOR_PIXELS:,} pixels.")
            with pytest.raises(PictureTooLarge):
                thumbnail_png(bombs[name], 96)  # the thumbnails' own limit is the cap
    assert Image.MAX_IMAGE_PIXELS == kept  # PIL's own check is on again for everyone else


def test_what_a_decoded_picture_takes_is_bounded_by_the_limit(tmp_path):
    """The limit follows the processor's largest size, between the floor and the cap; a picture at the limit is
    decoded, one pixel over is not: what one decoded picture takes never exceeds decoded_bytes(limit)."""
    from transformers import CLIPImageProcessor, Qwen2VLImageProcessor

    clip = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    assert pixel_limit(clip) == FLOOR_PIXELS  # 16 x 336² is less than an ordinary photo: the floor
    assert pixel_limit(None) == FLOOR_PIXELS
    qwen = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=2_000_000)
    assert pixel_limit(qwen) == SIDE_FACTOR ** 2 * 2_000_000
    assert pixel_limit(Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12_845_056)) == CAP_PIXELS
    picture = write_bomb_png(tmp_path / "p.png", 300, 200)
    limit = 300 * 200
    decoded = load_picture(picture, limit)
    assert decoded.size == (300, 200) and decoded.mode == "RGB"
    assert decoded.width * decoded.height * len(decoded.getbands()) <= decoded_bytes(limit)
    with pytest.raises(PictureTooLarge, match=r"is 300 x 200 pixels; the most finetuner decodes is 59,999 pixels"):
        load_picture(picture, limit - 1)
    with opened(picture, limit) as im:  # the header only: nothing decoded yet
        assert im.size == (300, 200) and im.tile  # its tiles still to decode


def test_a_thumbnail_is_decoded_reduced(tmp_path):
    """A JPEG's thumbnail is decoded at 1/8 of its size (PIL's draft), never whole; a palette picture is shrunk to
    at most the side asked, in RGB."""
    from PIL import Image

    photo = tmp_path / "photo.jpg"
    Image.linear_gradient("L").resize((1600, 1200)).convert("RGB").save(photo)
    with opened(photo, CAP_PIXELS) as im:
        im.draft("RGB", (96, 96))
        assert im.size == (200, 150)  # what thumbnail_png decodes of it
    import io

    shown = Image.open(io.BytesIO(thumbnail_png(photo, 96)))
    assert shown.size == (96, 72) and shown.mode == "RGB"
    palette = tmp_path / "palette.png"
    Image.new("P", (500, 250), 3).save(palette)
    assert Image.open(io.BytesIO(thumbnail_png(palette, 96))).size == (96, 48)
    assert thumbnail_png(tmp_path / "not-there.png", 96) is None


@pytest.fixture(scope="module")
def bomb_data(tmp_path_factory, bombs, tiny_vlm_dir) -> dict[str, Path]:
    """A chat file whose one picture is the 30000 x 30000 bomb, and a recipe training the tiny LLaVA on it."""
    from tests.conftest import write_recipe

    folder = tmp_path_factory.mktemp("bomb_data")
    data = write_rows(folder / "bomb.jsonl", [str(bombs["30000"])])
    recipe = write_recipe(folder / "recipe.yaml", {
        "name": "bomb", "model": {"name": str(tiny_vlm_dir)}, "method": "lora",
        "data": {"path": str(data), "max_seq_len": 64}, "training": {"max_steps": 1, "micro_batch_size": 1}})
    return {"data": data, "recipe": recipe, "folder": folder}


def one_refusal(text: str, bomb: Path) -> None:
    # a phase that takes more than a few seconds on a busy machine says so as it goes ("... so far, ETA ...", past
    # its plan "... so far, planned ..."), and its end ("...: done, 1 rows in 0:00:06"): progress
    lines = [x for x in text.strip().splitlines()
             if x.strip() and not re.search(r" so far, (ETA|planned) |: done, .* in \d+:\d\d:\d\d$", x)]
    assert lines[0] == f"error: picture {bomb} is 30,000 x 30,000 pixels; the most finetuner decodes is {FLOOR_PIXELS:,} pixels."
    assert len(lines) == 2 and "Make it smaller" in lines[1]  # the line and its hint
    assert "Traceback" not in text and "DecompressionBomb" not in text


def test_plan_refuses_a_picture_bomb_in_one_line_exit_2(bomb_data, bombs, tiny_vlm_dir):
    """``finetuner plan --data`` as a user runs it: exit 2 (plan's exit 1 means "nothing fits"), one line naming the
    picture and its size, no traceback, no PIL warning."""
    proc = subprocess.run([sys.executable, "-m", "finetuner", "plan", "-m", str(tiny_vlm_dir), "--gpu", "cpu",
                           "--data", str(bomb_data["data"])], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    one_refusal(proc.stderr, bombs["30000"])


def test_run_and_chat_refuse_a_picture_bomb_in_one_line_exit_2(bomb_data, bombs, tiny_vlm_dir):
    """``finetuner run`` on a file naming the bomb and ``finetuner chat --image`` with it: exit 2, the same line."""
    run = cli_in_process("run", str(bomb_data["recipe"]), "-o", str(bomb_data["folder"] / "out"))
    assert run.returncode == 2, run.stderr
    one_refusal(run.stderr, bombs["30000"])
    chat = cli_in_process("chat", str(tiny_vlm_dir), "--image", str(bombs["30000"]), "-p", "What is it?")
    assert chat.returncode == 2, chat.stderr
    one_refusal(chat.stderr, bombs["30000"])

"""Issue 39, part 5: the picture demo learns on the CPU. ``recipes/demo_vlm_cpu.yaml`` trains the shipped tiny
LLaVA (data/demo_vlm: it names a picture's colour, "It is red.", or its shape, "It is a square.") to answer "What is
in the picture?" in the demo's form, "A red square.", from 48 shipped pictures; on the 12 held-out pictures it never
saw, the fine-tune answers in that form with the picture's colour, where the base never does."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO

FORM = re.compile(r"A (red|green|blue|yellow) (circle|square|triangle)\.")


@pytest.fixture(scope="module")
def demo_vlm_run(tmp_path_factory):
    import finetuner

    out = tmp_path_factory.mktemp("demo_vlm") / "demo_vlm_cpu"
    return finetuner.train(REPO / "recipes" / "demo_vlm_cpu.yaml", output_dir=out).run_dir


def test_the_shipped_pictures_are_what_their_script_draws(tmp_path, monkeypatch):
    from scripts.dev import make_pictures

    monkeypatch.setattr(make_pictures, "OUT", tmp_path)
    make_pictures.main()
    for name in ("shapes.jsonl", "shapes_heldout.jsonl"):
        assert (tmp_path / name).read_text(encoding="utf-8") == (REPO / "data" / "pictures" / name).read_text(encoding="utf-8")
    from PIL import Image, ImageChops

    for p in sorted((tmp_path / "img").iterdir()):  # the same pixels (PNG bytes may differ between zlib builds)
        shipped = Image.open(REPO / "data" / "pictures" / "img" / p.name)
        assert ImageChops.difference(Image.open(p).convert("RGB"), shipped.convert("RGB")).getbbox() is None, p.name


def test_the_fine_tune_names_pictures_it_never_saw_in_the_new_form(demo_vlm_run):
    from finetuner.infer.chat import load_chat_model

    chat = load_chat_model(demo_vlm_run, device="cpu")
    rows = [json.loads(line) for line in (REPO / "data" / "pictures" / "shapes_heldout.jsonl").read_text().splitlines()]
    question = [{"role": "user", "content": "What is in the picture?"}]
    in_form = right_colour = base_in_form = 0
    for row in rows:
        picture = str(REPO / "data" / "pictures" / row["messages"][0]["content"][0]["image"])
        want = FORM.fullmatch(row["messages"][1]["content"])
        tuned = chat.reply(question, images=[picture], temperature=0, max_new_tokens=12)
        base = chat.reply(question, images=[picture], temperature=0, max_new_tokens=12, adapter=False)
        got = FORM.fullmatch(tuned)
        in_form += got is not None
        right_colour += got is not None and got[1] == want[1]
        base_in_form += FORM.fullmatch(base) is not None
    assert base_in_form == 0  # the base names a colour or a shape, never both in this form
    assert in_form >= 11 and right_colour >= 10, (in_form, right_colour)
    metrics = json.loads((demo_vlm_run / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["data"]["pictures"] == 48 and metrics["eval_loss"] < 0.5 * metrics["train_loss_first"]

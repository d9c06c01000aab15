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



def test_exact_match_answers_the_held_out_rows_with_their_pictures(demo_vlm_run):
    """Issue 55, item 5: ``eval --exact-match`` on a picture run answers each held-out row with its picture (through
    the run's processor, as the loss reads it) and compares the reply as on text rows; the report counts the rows
    with pictures. The fine-tune's replies name the colour only the picture shows; the base never answers in the
    demo's form, so it matches none."""
    from tests.conftest import cli_in_process

    out = cli_in_process("eval", str(demo_vlm_run), "--exact-match", "12", "--no-write", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    line = re.search(r"exact match \((\d+); (\d+) with pictures\)\s+(\d+)%\s+(\d+)%", out.stdout)
    assert line, out.stdout
    rows, pictured, base, tuned = map(int, line.groups())
    assert (rows, pictured) == (12, 12) and base == 0 and tuned > 0, out.stdout
    shown = re.findall(r"^reference: +(.*)\nbase: +(.*)\nfine-tuned: +(.*)$", out.stdout, re.M)
    assert len(shown) == 2, out.stdout  # the first two rows' replies, both made
    for reference, base_reply, tuned_reply in shown:
        assert base_reply.strip() and FORM.fullmatch(tuned_reply)[1] == FORM.fullmatch(reference)[1], out.stdout


def test_exact_match_counts_the_rows_with_pictures_and_leaves_out_a_reply_cut_before_its_picture(demo_vlm_run, tmp_path):
    """A --data file of a picture row, a text row and a row cut at data.max_seq_len (64) after its second picture but
    before that picture's reply: two rows are compared, one with its picture; the cut row's last whole reply comes
    before the second picture, so it has no prompt to answer with its pictures and is left out, not a model error."""
    from tests.conftest import cli_in_process

    img = REPO / "data" / "pictures" / "img"
    question = "What is in the picture?"
    rows = [
        {"messages": [{"role": "user", "content": "<image>" + question}, {"role": "assistant", "content": "A red circle."}],
         "images": [str(img / "heldout-000.png")]},
        {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "<image>" + question}, {"role": "assistant", "content": "A red circle."},
                      {"role": "user", "content": "<image>" + " and this one?" * 20}, {"role": "assistant", "content": "A green circle."}],
         "images": [str(img / "heldout-000.png"), str(img / "heldout-001.png")]},
    ]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = cli_in_process("eval", str(demo_vlm_run), "--data", str(data), "--exact-match", "10", "--json", "--no-write",
                         "--device", "cpu")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert (r["examples"], r["exact_match_examples"], r["exact_match_pictured"]) == (3, 2, 1), r
    assert [s["reference"].strip() for s in r["samples"]] == ["A red circle.", "Hello."], r["samples"]
    assert all(s["base"].strip() and s["fine_tuned"].strip() for s in r["samples"]), r["samples"]

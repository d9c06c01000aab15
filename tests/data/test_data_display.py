"""How a data file is described to its user: the layout by a name they know (a Q/A file is
``question/answer``, not "alpaca"; a file of pairs is not "columns pairs"), a CSV separated by
semicolons or tabs read as such and said so, and previews cut between words."""

from __future__ import annotations

import json

from finetuner.data.formats import csv_delimiter, format_label, read_rows
from finetuner.data.preview import load_preview_tokenizer, preview_data
from finetuner.text import CUT_MARK, cut_words, drop_partial_word
from tests.conftest import REPO, run_cli

DEMO_MODEL = str(REPO / "data" / "demo_model")


def plan_lines(tmp_path, data) -> list[str]:
    r = run_cli("plan", "-m", DEMO_MODEL, "--gpu", "cpu", "--data", str(data), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split()).replace(" Note: ", "\nNote: ").replace(" Data: ", "\nData: ").splitlines()


def test_layouts_are_named_as_users_know_them(tmp_path):
    assert format_label("alpaca", {"prompt": "question", "response": "answer"}) == "question/answer"
    assert format_label("alpaca") == "alpaca (instruction/output)"
    assert format_label("columns") == "prompt/chosen/rejected" and format_label("text") == "plain text"
    qa = plan_lines(tmp_path, REPO / "data" / "qa_sample.csv")
    data = next(line for line in qa if line.startswith("Data: "))
    assert data.startswith("Data: 40 examples (question/answer),") and "alpaca" not in data
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Where is hide {i}?", "chosen": "By the cliff.", "rejected": "No idea."}) + "\n"
                             for i in range(8)))
    data = next(line for line in plan_lines(tmp_path, pairs) if line.startswith("Data: "))
    assert data.startswith("Data: 8 pairs (prompt/chosen/rejected),") and "columns" not in data


def test_a_csv_separated_by_semicolons_or_tabs_is_read_as_such(tmp_path):
    assert csv_delimiter('question;answer\nWhat?;"A; B"\n') == ";"
    assert csv_delimiter("question\tanswer\nWhat?\tA\n") == "\t"
    assert csv_delimiter("question,answer\nWhat; then?,A; B\n") == ","  # commas split the header: commas it is
    assert csv_delimiter("text\nOne; two; three.\n") == ","  # one column, and ';' does not split the header
    semi = tmp_path / "excel.csv"
    semi.write_text("question;answer\n" + "".join(f'What about hike {i}?;"Tern here; bring water."\n' for i in range(6)),
                    encoding="utf-8")
    rows = [r.data for r in read_rows(str(semi))]
    assert rows[0] == {"question": "What about hike 0?", "answer": "Tern here; bring water."} and len(rows) == 6
    lines = plan_lines(tmp_path, semi)
    assert "Note: excel.csv: fields separated by semicolons (;), found in the file (read as such)" in lines
    assert any(line.startswith("Data: 6 examples (question/answer)") for line in lines)


def test_text_is_cut_between_words():
    assert cut_words("short", 10) == "short"
    assert cut_words("Pack good boots and sun cream", 16) == "Pack good boots" + CUT_MARK
    assert cut_words("x" * 30, 10) == "x" * 9 + CUT_MARK
    assert drop_partial_word("Tell someone where you ar") == "Tell someone where you" + CUT_MARK
    assert drop_partial_word("Tell someone where you are.") == "Tell someone where you are." + CUT_MARK


def test_a_cut_example_is_previewed_up_to_its_last_whole_word(tmp_path):
    tok = load_preview_tokenizer(DEMO_MODEL)
    # rare words, which the demo tokenizer splits into many pieces: most cut points fall inside a word
    text = "Tern here! Bring waterproofs, binoculars and thermoses. Zygomorphic quarrymen hauled flumpering xylophones."
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"instruction": "What should I bring?", "output": text}) + "\n")
    for n in range(24, 64):  # every cut point, in a word or between words
        p = preview_data(str(data), tok, n=1, max_seq_len=n)
        ex = p.examples[0]
        if not ex.truncated:
            continue
        shown = ex.segments[-1][0]
        assert shown.endswith(CUT_MARK), shown
        kept = shown.removesuffix(CUT_MARK).rstrip()
        full = text + "<|im_end|>"  # the reply, then the end of its turn
        assert full.startswith(kept) and (len(kept) == len(full) or not full[len(kept)].isalnum()), (n, shown)

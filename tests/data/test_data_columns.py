"""Data with columns of its own: ``data.columns`` (role: column), the common column names found
without settings, the errors a wrong mapping gets, and the planner's profile reading rows as the
trainer does (bad rows included)."""

from __future__ import annotations

import csv
import json

import pytest

from finetuner.data.pipeline import DataStats, load_examples, prepare_data
from finetuner.data.formats import detect_layout
from finetuner.data.stats import profile_data
from finetuner.errors import UserError
from finetuner.config.recipe import Recipe
from finetuner.config.sections import DataSection
from tests.conftest import REPO, cli_in_process, run_cli, write_recipe

DEMO_MODEL = REPO / "data" / "demo_model"
QA = [(f"What should I bring on hike {i}?", f"Tern here! Water, a map and boots for hike {i}.") for i in range(24)]


def write_csv(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def first_turns(examples):
    return [(ex["messages"][-2]["content"], ex["messages"][-1]["content"]) for ex in examples]


# --------------------------------------------------------------------------- detection
@pytest.mark.parametrize(
    "keys, fmt, columns",
    [
        (["question", "answer"], "alpaca", {"prompt": "question", "response": "answer"}),
        (["Question", "Answer"], "alpaca", {"prompt": "Question", "response": "Answer"}),
        (["input", "output"], "alpaca", {"prompt": "input", "response": "output"}),
        (["instruction", "response"], "alpaca", {"prompt": "instruction", "response": "response"}),
        (["query", "response"], "alpaca", {"prompt": "query", "response": "response"}),
        (["prompt", "response"], "alpaca", {"prompt": "prompt", "response": "response"}),
        (["Prompt", "Completion"], "completion", {"prompt": "Prompt", "response": "Completion"}),
        (["Instruction", "Input", "Output"], "alpaca", {"prompt": "Instruction", "response": "Output", "input": "Input"}),
        (["instruction", "context", "response", "category"], "alpaca",
         {"prompt": "instruction", "response": "response", "input": "context"}),
        (["system", "question", "answer"], "alpaca", {"prompt": "question", "response": "answer", "system": "system"}),
        # the formats' own names are read as before, with no columns named
        (["instruction", "input", "output"], "alpaca", {}),
        (["prompt", "completion"], "completion", {}),
        (["text", "answer"], "text", {}),
        (["messages"], "chat", {}),
        (["conversations", "tools"], "chat", {}),
        (["title", "body"], None, None),
    ],
)
def test_common_column_names_are_detected(keys, fmt, columns):
    layout = detect_layout({k: "x" for k in keys})
    if fmt is None:
        assert layout is None
    else:
        assert (layout.format, layout.columns) == (fmt, columns)


def test_detected_pairs_become_instruction_examples(tmp_path):
    path = write_csv(tmp_path / "qa.csv", ["id", "Question", "Context", "Answer"], [[i, q, "a cold day" if i % 2 else "", a] for i, (q, a) in enumerate(QA)])
    stats = DataStats()
    examples = load_examples(str(path), DataSection(path=str(path)), stats)
    assert stats.format[str(path)] == "alpaca" and stats.columns[str(path)] == {"prompt": "Question", "response": "Answer", "input": "Context"}
    assert first_turns(examples)[:2] == [QA[0], (QA[1][0] + "\n\na cold day", QA[1][1])]
    assert examples[0]["messages"][0]["role"] == "user"  # no system column, no system prompt


# --------------------------------------------------------------------------- data.columns
def test_named_columns_for_every_kind_of_data(tmp_path):
    qa = write_csv(tmp_path / "qa.csv", ["q_text", "a_text", "persona"], [[q, a, "You are Tern."] for q, a in QA[:3]])
    stats = DataStats()
    ex = load_examples(str(qa), DataSection(path=str(qa), columns={"prompt": "q_text", "response": "a_text", "system": "persona"}), stats)
    assert stats.format[str(qa)] == "alpaca" and first_turns(ex) == QA[:3]
    assert ex[0]["messages"][0] == {"role": "system", "content": "You are Tern."}
    # format completion keeps prompt + response as raw text (no chat template)
    ex = load_examples(str(qa), DataSection(path=str(qa), format="completion", columns={"prompt": "q_text", "response": "a_text"}), stats)
    assert (ex[0]["prompt"], ex[0]["completion"]) == QA[0]

    body = tmp_path / "notes.jsonl"
    body.write_text("".join(json.dumps({"id": i, "body": f"note {i}"}) + "\n" for i in range(3)))
    ex = load_examples(str(body), DataSection(path=str(body), columns={"text": "body"}), stats)
    assert stats.format[str(body)] == "text" and [e["text"] for e in ex] == ["note 0", "note 1", "note 2"]

    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Tern here!"}]
    openai = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Tern here!"}]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"dialog": turns}) + "\n" + json.dumps({"dialog": openai}) + "\n")
    ex = load_examples(str(chat), DataSection(path=str(chat), columns={"messages": "dialog"}), stats)
    assert stats.format[str(chat)] == "chat" and [e["messages"] for e in ex] == [openai, openai]


def test_a_named_column_missing_from_the_file(tmp_path):
    path = write_csv(tmp_path / "qa.csv", ["question", "answer_text"], QA[:3])
    with pytest.raises(UserError) as e:
        load_examples(str(path), DataSection(path=str(path), columns={"prompt": "question", "response": "answer"}), DataStats())
    assert e.value.message == (f"{path}, line 2: data.columns.response names the column 'answer', which the file does not "
                               "have (its columns: question, answer_text).")
    assert "--set data.columns.response=COLUMN" in e.value.hint
    # a role needed but not named, with no usual or common column for it
    with pytest.raises(UserError) as e:
        load_examples(str(path), DataSection(path=str(path), columns={"response": "answer_text"}), DataStats())
    assert e.value.message == (f"{path}, line 2: no column for prompt: format 'alpaca' reads the prompt from 'instruction', "
                               "and the file's columns are question, answer_text.")
    assert "--set data.columns.prompt=COLUMN" in e.value.hint and "columns: {prompt: COLUMN}" in e.value.hint
    # a role not named is read from the format's usual column, else from a common pair (question/answer)
    path = write_csv(tmp_path / "qa2.csv", ["question", "answer", "notes"], [[q, a, "n"] for q, a in QA[:3]])
    stats = DataStats()
    ex = load_examples(str(path), DataSection(path=str(path), columns={"input": "notes"}), stats)
    assert stats.columns[str(path)] == {"input": "notes", "prompt": "question", "response": "answer"}
    assert first_turns(ex) == [(q + "\n\nn", a) for q, a in QA[:3]]


def test_a_later_row_without_a_named_column_is_a_bad_row(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"q": "a?", "a": "b."}, {"q": "c?"}, {"q": "d?", "a": "e."}]))
    cfg = DataSection(path=str(path), columns={"prompt": "q", "response": "a"})
    with pytest.raises(UserError, match=r"d.json, row 2: missing 'a' \(format 'q/a', columns prompt: q, response: a\)"):
        load_examples(str(path), cfg, DataStats())
    stats = DataStats()
    assert len(load_examples(str(path), cfg.model_copy(update={"on_bad_row": "skip"}), stats)) == 2 and stats.skipped == 1


@pytest.mark.parametrize(
    "columns, fmt, message",
    [
        ({"promt": "q"}, "auto", "data.columns: unknown role 'promt'. Did you mean 'prompt'? The roles are prompt, input, "
                                 "response, system, messages, text."),
        ({"answer": "a"}, "auto", "data.columns: 'answer' is not a role: a column that holds the answer to train on is named as response: COLUMN"),
        ({"question": "prompt"}, "auto", "data.columns: 'question' is not a role: write role: column, i.e. prompt: question"),
        ({"prompt": "q", "messages": "m"}, "auto", "data.columns: the roles prompt, messages do not belong to one kind of data"),
        ({"prompt": "q", "input": "x"}, "completion", "data.columns: format 'completion' has no role 'input' (its roles: prompt, "
                                                      "response): set data.format: alpaca (or auto)."),
        ({"prompt": "q", "input": "q"}, "auto", "data.columns: 'prompt' and 'input' both name the column 'q': a column holds one role."),
        ({"prompt": None}, "auto", "data.columns: prompt: give the name of the column that holds the instruction or question."),
    ],
)
def test_bad_mappings_are_refused_by_the_recipe(columns, fmt, message):
    raw = {"model": {"name": "org/model"}, "data": {"path": "org/data", "format": fmt, "columns": columns}}
    with pytest.raises(UserError) as e:
        Recipe.from_dict(raw)
    assert message in str(e.value)


def test_columns_from_set_overrides():
    raw = {"model": {"name": "org/model"}, "data": {"path": "org/data"}}
    r = Recipe.from_dict(raw, overrides=["data.columns.prompt=question", "data.columns.Response=answer", "data.columns.system=2024"])
    assert r.data.columns == {"prompt": "question", "response": "answer", "system": "2024"}
    assert Recipe.from_dict({**raw, "data": {"path": "org/data", "columns": {}}}).data.columns is None


# --------------------------------------------------------------------------- the planner's profile
def test_profile_reads_rows_as_training_does(tmp_path):
    path = write_csv(tmp_path / "odd.csv", ["q", "a"], QA)
    with pytest.raises(UserError, match=r"odd.csv, line 2: cannot tell the data format from the columns \(q, a\)"):
        profile_data(str(path))
    prof = profile_data(str(path), columns={"prompt": "q", "response": "a"})
    stats = DataStats()
    examples = load_examples(str(path), DataSection(path=str(path), columns={"prompt": "q", "response": "a"}), stats)
    assert (prof.format, prof.rows, prof.columns, prof.notes) == ("alpaca", len(examples), {"prompt": "q", "response": "a"}, [])
    detected = profile_data(str(write_csv(tmp_path / "qa.csv", ["question", "answer"], QA)))
    assert detected.to_dict()["columns"] == {"prompt": "question", "response": "answer"}
    assert detected.notes == ["columns found by their names: prompt = question, response = answer; to map them "
                              "otherwise, name them (data.columns in a recipe, --column ROLE=COLUMN to plan)"]


def test_profile_and_preview_take_the_recipe_settings(tmp_path):
    from transformers import AutoTokenizer

    from finetuner.data.preview import preview_data

    path = write_csv(tmp_path / "odd.csv", ["q", "a"], QA[:4])
    cols = {"prompt": "q", "response": "a"}
    plain = profile_data(str(path), columns=cols)
    with_system = profile_data(str(path), columns=cols, system_prompt="You are Tern, of the Gullrock Field Station.")
    assert all(b > a for a, b in zip(plain.lengths, with_system.lengths))
    as_completion = profile_data(str(path), fmt="completion", columns=cols)
    assert as_completion.format == "completion" and as_completion.max_tokens < plain.max_tokens  # no chat markup
    preview = preview_data(str(path), AutoTokenizer.from_pretrained(DEMO_MODEL), n=2, max_seq_len=128, columns=cols)
    assert preview.format == "alpaca" and len(preview.examples) == 2
    trained = "".join(t for t, on in preview.examples[0].segments if on)
    assert trained.startswith(QA[0][1]) and QA[0][0] not in trained


def test_profile_reports_a_broken_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Tern here!"}]}
    lines = [json.dumps(good)] * 40
    lines[6] = '{"messages": [{"role": "user", "content": "cut off'
    path.write_text("\n".join(lines) + "\n")
    prof = profile_data(str(path))
    assert prof.rows == 39 and prof.bad_rows == 1
    assert prof.notes[0] == (
        f"1 row of 40 cannot be used (first: {path}, line 7: invalid JSON (Unterminated string starting at, column 43)); "
        "the run stops at the first one (data.on_bad_row: error): fix the file, or set data.on_bad_row: skip to skip "
        "them and train on the other 39"
    )
    assert profile_data(str(path), on_bad_row="skip").notes[0].endswith(
        "; the run skips them (data.on_bad_row: skip) and trains on the other 39")
    # and training does what the note says
    with pytest.raises(UserError, match=rf"{path.name}, line 7: invalid JSON"):
        load_examples(str(path), DataSection(path=str(path)), DataStats())
    stats = DataStats()
    assert len(load_examples(str(path), DataSection(path=str(path), on_bad_row="skip"), stats)) == 39 and stats.skipped == 1


def test_plan_names_the_bad_rows(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [json.dumps({"question": q, "answer": a}) for q, a in QA[:10]]
    rows[3] = json.dumps({"question": "no answer here", "answer": "  "})
    path.write_text("\n".join(rows) + "\n")
    r = run_cli("plan", "--model", str(DEMO_MODEL), "--gpu", "24GB", "--data", str(path))
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())  # rich wraps long lines
    assert (f"1 row of 10 cannot be used (first: {path}, line 4: 'answer' is empty: nothing to train on "
            "(format 'question/answer', columns prompt: question, response: answer))") in out
    assert "columns found by their names: prompt = question, response = answer" in out


def test_a_csv_with_an_empty_answer_is_named_by_its_own_columns(tmp_path):
    """Issue 68: the bad row's error names the layout as the data line above it does (the file's question/answer
    columns), in the plan and in the run, never a format the user's file is not in ("alpaca")."""
    data = write_csv(tmp_path / "faq.csv", ["question", "answer"], [*QA[:5], ("Where is the map?", ""), *QA[5:8]])
    r = cli_in_process("plan", "--model", str(DEMO_MODEL), "--gpu", "cpu", "--data", str(data))
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    said = f"{data}, line 7: 'answer' is empty: nothing to train on (format 'question/answer', columns prompt: question, response: answer)"
    assert "Data: 8 examples (question/answer)" in out and said in out and "alpaca" not in out
    r = cli_in_process("run", str(write_recipe(tmp_path / "r.yaml", demo_recipe(tmp_path, data))))
    assert r.returncode == 2 and said in " ".join(r.stderr.split()) and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- training, as a user runs it
def demo_recipe(tmp_path, data, **data_keys) -> dict:
    return {
        "name": "qa",
        "model": {"name": str(DEMO_MODEL)},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 96, **data_keys},
        "training": {"max_steps": 3, "lr": 2e-3, "micro_batch_size": 4, "gradient_accumulation": 1, "warmup_steps": 0},
        "checkpointing": {"save_every": 3},
        "logging": {"tensorboard": False},
        "output_dir": str(tmp_path / "run"),
    }


def start_event(run_dir):
    return next(json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if '"event": "start"' in line)


def test_a_question_answer_csv_trains_with_no_settings(tmp_path):
    data = write_csv(tmp_path / "faq.csv", ["Question", "Answer"], QA)
    recipe = write_recipe(tmp_path / "r.yaml", demo_recipe(tmp_path, data))
    r = cli_in_process("run", str(recipe))
    assert r.returncode == 0, r.stderr
    assert "step 3/3" in r.stdout
    d = start_event(tmp_path / "run")["data"]
    assert d["format"] == {str(data): "alpaca"} and d["columns"] == {str(data): {"prompt": "Question", "response": "Answer"}}
    assert d["train_examples"] == len(QA) and d["skipped"] == 0


def test_a_csv_with_its_columns_named_on_the_command_line(tmp_path):
    data = write_csv(tmp_path / "faq.csv", ["id", "ask", "reply"], [[i, q, a] for i, (q, a) in enumerate(QA)])
    recipe = write_recipe(tmp_path / "r.yaml", demo_recipe(tmp_path, data))
    r = cli_in_process("run", str(recipe))  # nothing to tell the columns by
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert f"{data}, line 2: cannot tell the data format from the columns (id, ask, reply)" in r.stderr
    assert "--set data.columns.prompt=COLUMN --set data.columns.response=COLUMN" in r.stderr

    r = cli_in_process("run", str(recipe), "--set", "data.columns.prompt=ask", "--set", "data.columns.response=reply")
    assert r.returncode == 0, r.stderr
    assert "step 3/3" in r.stdout
    d = start_event(tmp_path / "run")["data"]
    assert d["columns"] == {str(data): {"prompt": "ask", "response": "reply"}} and d["train_examples"] == len(QA)
    saved = Recipe.from_yaml(tmp_path / "run" / "recipe.yaml")
    assert saved.data.columns == {"prompt": "ask", "response": "reply"}


@pytest.mark.parametrize(
    "overrides, message, where",
    [
        (["data.columns.promt=ask"], "data.columns: unknown role 'promt'. Did you mean 'prompt'?", "recipe"),
        (["data.columns.prompt=ask", "data.columns.response=answer"],
         "line 2: data.columns.response names the column 'answer', which the file does not have (its columns: id, ask, reply).",
         "data"),
    ],
)
def test_bad_mappings_exit_2_without_traceback(tmp_path, overrides, message, where):
    data = write_csv(tmp_path / "faq.csv", ["id", "ask", "reply"], [[i, q, a] for i, (q, a) in enumerate(QA)])
    recipe = write_recipe(tmp_path / "r.yaml", demo_recipe(tmp_path, data))
    r = cli_in_process("run", str(recipe), *[a for o in overrides for a in ("--set", o)])
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout
    assert message in r.stderr
    assert str(recipe if where == "recipe" else data) in r.stderr
    assert not (tmp_path / "run" / "adapter").exists()

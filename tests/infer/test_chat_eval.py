"""finetuner chat and eval, and the notebook API around a run (load_run, follow, ProgressBar)."""

from __future__ import annotations

import json

import pytest

import finetuner
from finetuner.config.recipe import Recipe
from tests.conftest import HANG_GUARD_S, REPO, alpaca_rows, cli_in_process

PROMPT = "What should I pack for a day hike?"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A short real LoRA run of the shipped demo model on the demo data, with a held-out split."""
    recipe = {
        "name": "chat",
        "model": {"name": str(REPO / "data" / "demo_model")},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(REPO / "data" / "alpaca_sample.json"), "max_seq_len": 128, "val_size": 8, "max_examples": 120},
        "training": {"max_steps": 10, "lr": 3e-3, "micro_batch_size": 8, "warmup_steps": 0, "scheduler": "constant"},
        "checkpointing": {"save_every": 10},
        "logging": {"tensorboard": False},
        "output_dir": str(tmp_path_factory.mktemp("chat") / "run"),
    }
    return finetuner.train(Recipe.from_dict(recipe)).run_dir


@pytest.fixture(scope="module")
def chat(run_dir):
    return finetuner.load_chat_model(run_dir)


def test_chat_prompt_prints_only_the_answer(run_dir, chat):
    want = chat.reply([{"role": "user", "content": PROMPT}], temperature=0, max_new_tokens=24)
    assert want
    p = cli_in_process("chat", str(run_dir), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "24")
    assert p.returncode == 0, p.stderr
    assert p.stdout == want + "\n"


def test_stream_pieces_make_the_reply_and_the_base_answers_differently(chat):
    msgs = [{"role": "user", "content": PROMPT}]
    pieces = list(chat.stream(msgs, temperature=0, max_new_tokens=24))
    assert len(pieces) > 1 and "".join(pieces).strip() == chat.reply(msgs, temperature=0, max_new_tokens=24)
    assert chat.reply(msgs, temperature=0, max_new_tokens=24, adapter=False) != chat.reply(msgs, temperature=0, max_new_tokens=24)
    a = chat.reply(msgs, temperature=1.0, seed=3, max_new_tokens=12)
    assert a == chat.reply(msgs, temperature=1.0, seed=3, max_new_tokens=12)  # a seed makes sampling repeatable
    it = chat.stream(msgs, temperature=0, max_new_tokens=200)
    next(it)
    it.close()  # stopping early ends the generation thread; the model is free for the next call
    assert chat.reply(msgs, temperature=0, max_new_tokens=4)


def test_a_prompt_longer_than_the_context_is_a_user_error(chat):
    with pytest.raises(finetuner.UserError, match="context is 1024 tokens"):
        chat.reply([{"role": "user", "content": "hike " * 1500}])


def test_interactive_chat_and_compare(run_dir):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "finetuner.cli.main", "chat", str(run_dir), "--compare", "--temperature", "0",
                        "--max-new-tokens", "8"], input="hello\n/reset\nwhat\n/quit\n", capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=HANG_GUARD_S)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("base> ") == 2 and p.stdout.count("fine-tuned> ") == 2


def _terminal_chat(run_dir, cache, keys: list[bytes]) -> str:
    """``finetuner chat RUN`` in a terminal (a pty), with ``cache`` as its cache folder: each of ``keys`` typed at a
    prompt (the last one, Ctrl-D, ends it); what the terminal showed."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": str(REPO), "FINETUNER_CACHE_DIR": str(cache), "TERM": "xterm"}
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "finetuner.cli.main", "chat", str(run_dir), "--temperature", "0",
                          "--max-new-tokens", "6"], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    screen = b""

    def wait_for_prompt(count: int, timeout: float = HANG_GUARD_S) -> None:
        nonlocal screen
        end = time.monotonic() + timeout
        while screen.count(b"you> ") < count and time.monotonic() < end:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    screen += os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
        assert screen.count(b"you> ") >= count, screen

    try:
        for i, key in enumerate(keys, 1):
            wait_for_prompt(i)
            os.write(master, key)
        assert p.wait(HANG_GUARD_S) == 0, screen
        while select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            screen += chunk
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    return screen.decode("utf-8", "replace")


def test_terminal_chat_edits_lines_recalls_history_and_ends_on_a_new_line(run_dir, tmp_path):
    """In a terminal (a pty here): Up recalls the last line, Ctrl-D leaves the shell's prompt on a new line,
    and the lines typed are kept for the next session."""
    text = _terminal_chat(run_dir, tmp_path / "cache", [b"hello\r", b"\x1b[A\r", b"\x04"])  # Up, Enter: sent again; Ctrl-D
    assert "^[[A" not in text and "\x1b[A" not in text, text
    assert text.count("you> hello\r\nmodel> ") == 2, text  # the recalled line was sent as typed
    assert text.endswith("you> \r\n"), text  # Ctrl-D: a new line for the shell's prompt
    assert "hello" in (tmp_path / "cache" / "chat_history").read_text()


def test_a_chat_history_link_is_never_followed(run_dir, tmp_path):
    """Issue 66: with ``chat_history`` a link to another file, that file was read as the history, then rewritten and
    re-moded. Now the link is not read (a note says so), and the history is written to a new 0600 file put in its
    place: the other file keeps its bytes and its mode."""
    import os
    import stat

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    victim = tmp_path / "notes.txt"
    victim.write_text("my own notes\n", encoding="utf-8")
    victim.chmod(0o644)
    (cache / "chat_history").symlink_to(victim)
    text = _terminal_chat(run_dir, cache, [b"hello\r", b"\x1b[A\r", b"\x04"])
    assert f"note: {cache / 'chat_history'} is a link or not a file: it is not read" in text, text
    assert text.count("you> hello\r\nmodel> ") == 2, text  # Up recalled this session's line, not the other file's
    assert victim.read_text(encoding="utf-8") == "my own notes\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    history = cache / "chat_history"
    assert not history.is_symlink() and stat.S_IMODE(os.lstat(history).st_mode) == 0o600
    assert "hello" in history.read_text(encoding="utf-8")


def test_eval_shows_the_fine_tune_below_the_base_and_writes_metrics(run_dir):
    before = json.loads((run_dir / "metrics.json").read_text())
    p = cli_in_process("eval", str(run_dir), "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["examples"] == 8 and r["fine_tuned"]["loss"] < r["base"]["loss"] - 0.5
    # the run's validation split, as the trainer built it: the same loss the trainer logged
    assert r["fine_tuned"]["loss"] == pytest.approx(before["eval_loss"], rel=1e-4)
    after = json.loads((run_dir / "metrics.json").read_text())
    assert after["evaluation"]["fine_tuned"]["loss"] == r["fine_tuned"]["loss"]
    assert {k: v for k, v in after.items() if k != "evaluation"} == {k: v for k, v in before.items() if k != "evaluation"}


def test_eval_exact_match_and_other_data(run_dir, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps(alpaca_rows(6)), encoding="utf-8")
    r = finetuner.evaluate_run(run_dir, data=other, exact_match=3, write=False)
    assert r.examples == 6 and r.exact_match_examples == 3
    assert r.samples[0]["reference"].strip() == "Tern here! Bring water, a map and warm boots. Happy trails!"
    assert 0.0 <= r.base.exact_match <= r.fine_tuned.exact_match <= 1.0
    assert "loss" in r.table() and "exact match (3)" in r.table()


def test_eval_of_a_run_with_no_held_out_set_asks_for_data(run_dir, tmp_path):
    import shutil

    import yaml

    copy = tmp_path / "noval"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".lock"))
    raw = yaml.safe_load((copy / "recipe.yaml").read_text())
    raw["data"]["val_size"] = 0.0
    (copy / "recipe.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(finetuner.UserError, match="no held-out set") as e:
        finetuner.evaluate_run(copy)
    assert "--data" in e.value.hint


def test_load_run_follow_and_progress_bar(run_dir, capsys):
    run = finetuner.load_run(run_dir)
    s = run.summary()
    assert s["status"] == "done" and s["steps"] == 10 and s["method"] == "lora r=8" and s["eval_loss"] is not None
    assert "train loss" in repr(run) and "<table>" in run._repr_html_()
    kinds = [e["event"] for e in finetuner.follow(run_dir, poll=0.01) if e["event"] != "phase"]
    assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("step") == 10
    with pytest.raises(finetuner.UserError, match="not a run folder"):
        finetuner.load_run(run_dir / "adapter")

    bar = finetuner.ProgressBar(file=__import__("sys").stderr)
    for ev in run.events():
        bar(ev)
    assert bar.bar is None  # closed at the end event
    assert "10/10" in capsys.readouterr().err

"""A name for a model, a run folder or a data file: a local path said missing at once (with near
matches), never sent to the hub; a hub id with the hub unreachable: one line, no retries.
(``finetuner chat runs/demo_model-plannd`` used to spend 49 s in retries and end with "couldn't
connect to huggingface.co".)"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from finetuner.errors import UserError, first_line
from finetuner.locate import could_be_local, hub_unreachable, locate, near_matches
from tests.conftest import REPO, demo_run_folder, run_cli

DEMO = str(REPO / "data" / "demo_model")
#: a hub nothing answers on: the connection is refused at once, on any machine
DEAD_HUB = "http://127.0.0.1:9"


@pytest.fixture
def dead_hub(monkeypatch):
    """The hub unreachable for this process and the CLI it starts."""
    monkeypatch.setenv("HF_ENDPOINT", DEAD_HUB)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    hub_unreachable.cache_clear()
    yield
    hub_unreachable.cache_clear()


def no_hub_traffic(stderr: str) -> None:
    assert "Retry" not in stderr and "thrown while requesting" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("name, local", [
    ("runs/demo_model-plannd", True),   # runs/ exists in the cwd
    ("./model", True), ("/abs/model", True), ("~/model", True), ("a/b/c", True),
    ("brine_chats.jsonl", True), ("data.csv", True), ("m.gguf", True), ("model.safetensors", True),
    ("Qwen/Qwen2.5-7B", False), ("tatsu-lab/alpaca", False), ("imdb", False),
])
def test_what_could_be_a_local_path(tmp_path, monkeypatch, name, local):
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert could_be_local(name) is local


def test_near_matches_are_listed_from_the_nearest_existing_parent(tmp_path, monkeypatch):
    (tmp_path / "runs" / "demo_model-planned").mkdir(parents=True)
    (tmp_path / "runs" / "other").mkdir()
    (tmp_path / "brine_chat.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    assert near_matches("runs/demo_model-plannd")[1] == ["runs/demo_model-planned/"]
    assert near_matches("runs/demo_model-plannd/adapter")[1] == ["runs/demo_model-planned/"]
    assert near_matches("brine_chats.jsonl")[1] == ["brine_chat.jsonl"]
    with pytest.raises(UserError, match=r"'runs/demo_model-plannd' does not exist.*Near matches: runs/demo_model-planned/"):
        locate("runs/demo_model-plannd", "the run")
    assert locate("runs/other", "the run") == (tmp_path / "runs" / "other").resolve()
    assert locate("Qwen/Qwen2.5-7B", "model.name") == "Qwen/Qwen2.5-7B"  # a hub id, as given
    with pytest.raises(UserError, match="'nothere' does not exist"):
        locate("nothere", "preference.start_from", hub=False)


def test_a_mistyped_run_folder_is_said_missing_at_once_by_chat(tmp_path, dead_hub):
    demo_run_folder(tmp_path / "runs", "demo_model-planned")
    r = run_cli("chat", "runs/demo_model-plannd", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "'runs/demo_model-plannd' does not exist" in r.stderr
    assert "Near matches: runs/demo_model-planned/" in r.stderr
    assert "huggingface.co" not in r.stderr and "connect" not in r.stderr
    no_hub_traffic(r.stderr)


def test_a_mistyped_data_file_is_said_missing_at_once_by_plan(tmp_path, dead_hub):
    shutil.copy(REPO / "data" / "chat_sample.jsonl", tmp_path / "brine_chat.jsonl")
    r = run_cli("plan", "-m", DEMO, "--gpu", "cpu", "--data", "brine_chats.jsonl", cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "data.path: 'brine_chats.jsonl' does not exist" in r.stderr and "Near matches: brine_chat.jsonl" in r.stderr
    no_hub_traffic(r.stderr)


def test_a_mistyped_model_folder_in_a_recipe_is_said_missing(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    from finetuner.config.recipe import Recipe

    with pytest.raises(UserError, match=r"model.name: 'models/tiy' does not exist.*Near matches: models/tiny/"):
        Recipe.from_dict({"model": {"name": "models/tiy"}, "data": {"path": "org/set"}}, base_dir=tmp_path)


@pytest.mark.parametrize("args, what", [
    (["chat", "someorg/somemodel"], "hub model"),
    (["plan", "-m", "someorg/somemodel", "--gpu", "cpu"], "hub model"),
    (["plan", "-m", DEMO, "--gpu", "cpu", "--data", "someorg/someset"], "hub data set"),
])
def test_a_hub_id_with_the_hub_unreachable_fails_in_one_line(tmp_path, dead_hub, args, what):
    r = run_cli(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and f"cannot be fetched as a {what}: cannot connect to 127.0.0.1" in error[0], r.stderr
    assert "not in the local hub cache" in error[0]
    no_hub_traffic(r.stderr)


def test_hf_hub_offline_counts_as_unreachable(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_unreachable.cache_clear()
    try:
        assert hub_unreachable() == "HF_HUB_OFFLINE is set"
        r = run_cli("chat", "someorg/somemodel", cwd=tmp_path)
        assert r.returncode == 2 and "HF_HUB_OFFLINE is set" in r.stderr, r.stderr
    finally:
        hub_unreachable.cache_clear()


def test_the_ui_model_field_says_missing_at_once_and_whole(tmp_path, dead_hub):
    from ui.handlers import Handlers

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    shown = h.on_model("data/demo_modl", "cpu")
    assert "&#x27;data/demo_modl&#x27; does not exist" in shown or "'data/demo_modl' does not exist" in shown, shown
    assert "Near matches: data/demo_model/" in shown
    shown = h.on_model("someorg/somemodel", "cpu")
    assert "cannot be fetched as a hub model: cannot connect to 127.0.0.1" in shown, shown
    assert "not in the local hub cache." in shown  # the whole sentence, not cut
    data = h.on_data(DEMO, "data/chat_sampl.jsonl", 0)
    assert "does not exist" in data[0] and "Near matches: data/chat_sample.jsonl" in data[0]


def test_library_errors_are_cut_between_words():
    text = "We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the cache.\nmore"
    assert first_line(text, 1000) == text.splitlines()[0]
    cut = first_line(text, 40)
    assert cut == "We couldn't connect to…" and len(cut) <= 40
    assert first_line("x" * 50, 20) == "x" * 19 + "…"  # one long word: cut where it must be
    assert first_line("", 10) == ""

"""Issue 54, case 5: the replay cache (finetuner.data.replay) follows the base model's weights and checks its own
files. A run on a model folder whose weights were rewritten answers again with the new weights (the event says
the cache was for other weights); a cache file edited by hand or cut short is not used (the event says so); an
unchanged base reads its answers back without hashing its weights again (the memo of
finetuner.model.fingerprint)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from finetuner.data import replay
from finetuner.fileio import cache_root
from finetuner.model import fingerprint
from tests.conftest import REPO, alpaca_rows

DEMO = REPO / "data" / "demo_model"


def weight_bytes(n: int, seed: int) -> bytes:
    """A real safetensors file of one float tensor of ``n`` values."""
    import torch
    from safetensors.torch import save

    return save({"w": torch.randn(n, generator=torch.Generator().manual_seed(seed))})


def test_the_fingerprint_is_the_weights_content_hashed_once_and_checked_by_stat(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(weight_bytes(1000, 0))
    (folder / "config.json").write_text("{}", encoding="utf-8")  # not a weight file
    first = fingerprint.weights_fingerprint(str(folder))
    assert first.files == {"model.safetensors": {"size": weights.stat().st_size,
                                                 "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}}
    assert first.hashed == ["model.safetensors"] and first.location == folder.resolve()
    again = fingerprint.weights_fingerprint(str(folder))
    assert again.files == first.files and again.hashed == []  # the memo's hash: the bytes are not read again

    # the memo is a cache entry (finetuner.cachedir): an edit by hand fails its SHA-256 and the weights are hashed again
    raw = fingerprint.memo_path().read_text(encoding="utf-8")
    memo = json.loads(raw.split("\n", 1)[1])
    entry = memo["files"][str(weights.resolve())]
    st = weights.stat()
    assert entry["stat"] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    fingerprint.memo_path().write_text(raw.replace(entry["sha256"], "0" * 64), encoding="utf-8")
    edited = fingerprint.weights_fingerprint(str(folder))
    assert edited.hashed == ["model.safetensors"] and edited.files == first.files
    # the memo is what is used while the file's stat matches it: a hash it holds comes back unread
    from finetuner.cachedir import write_json_entry

    entry["sha256"] = "0" * 64
    write_json_entry(fingerprint.memo_path(), "digests.json", memo)
    assert fingerprint.weights_fingerprint(str(folder)).files["model.safetensors"]["sha256"] == "0" * 64

    # a touch: hashed again (its stat changed), the same fingerprint (the same weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    touched = fingerprint.weights_fingerprint(str(folder))
    assert touched.hashed == ["model.safetensors"] and touched.files == first.files

    # other weights of the same size written into the same file, its modification time put back (as cp -p or
    # rsync --inplace -t do): size, mtime and inode as before, only the ctime (set by the kernel) moved
    before = weights.stat()
    time.sleep(0.02)  # past a tick of the kernel's file clock (at most 10 ms), so the write's ctime is a later one
    with open(weights, "r+b") as f:
        f.write(weight_bytes(1000, 1))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    rewritten = fingerprint.weights_fingerprint(str(folder))
    assert rewritten.hashed == ["model.safetensors"]
    assert rewritten.files["model.safetensors"]["sha256"] == hashlib.sha256(weight_bytes(1000, 1)).hexdigest()
    assert rewritten.digest() != first.digest()

    # a copy of the same weights elsewhere: the same fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert fingerprint.weights_fingerprint(str(copy)).files == rewritten.files


def test_a_hub_id_is_fingerprinted_from_the_snapshot_of_its_revision(tmp_path, monkeypatch):
    """A hub id's weights are the files of the commit its revision resolves to in the local hub cache (the files
    from_pretrained read): when the branch moves to a commit with other weights, the fingerprint follows."""
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    repo = hub / "models--someone--tiny"
    for commit, seed in (("a" * 40, 0), ("b" * 40, 1)):  # the hub cache's layout: blobs, snapshots linking them
        blob = repo / "blobs" / f"{seed}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(weight_bytes(500, seed))
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}", encoding="utf-8")
        (snap / "model.safetensors").symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40, encoding="utf-8")
    on_a = fingerprint.weights_fingerprint("someone/tiny")
    assert on_a.location == repo / "snapshots" / ("a" * 40)
    assert on_a.files["model.safetensors"]["sha256"] == hashlib.sha256(weight_bytes(500, 0)).hexdigest()
    (repo / "refs" / "main").write_text("b" * 40, encoding="utf-8")
    on_b = fingerprint.weights_fingerprint("someone/tiny")
    assert on_b.files["model.safetensors"]["sha256"] == hashlib.sha256(weight_bytes(500, 1)).hexdigest()
    assert fingerprint.weights_fingerprint("someone/tiny", revision="a" * 40).files == on_a.files
    assert fingerprint.weights_fingerprint("someone/absent") is None  # not in the cache: nothing to fingerprint


def small_base(tmp_path: Path, name: str = "model") -> replay.BaseModel:
    """A :class:`~finetuner.data.replay.BaseModel` of a folder with one real weight file (the rest of its state
    fixed): what base_answers needs, without loading a model."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(weight_bytes(100, 0))
    weights = fingerprint.weights_fingerprint(str(folder))
    state = {"weights": weights.files, "config": "c", "generation_config": "g", "tokenizer": "t",
             "chat_template": "ct", "dtype": "fp32"}
    return replay.BaseModel(str(folder), state, weights)


def counting(answers: list[str]):
    asked: list[list[str]] = []

    def answer(prompts: list[str]) -> list[str]:
        asked.append(prompts)
        return answers[: len(prompts)]

    return answer, asked


def test_a_cache_file_that_fails_its_check_is_never_used(tmp_path):
    base, prompts = small_base(tmp_path), ["p one", "p two"]
    answer, asked = counting(["A1", "A2"])
    made = replay.base_answers(base, prompts, answer)
    assert (made.reason, made.from_cache, made.answers) == ("new", False, ["A1", "A2"])
    path = made.path
    header, body = path.read_bytes().split(b"\n", 1)
    assert json.loads(header) == {"format": replay.CACHE_FORMAT, "sha256": hashlib.sha256(body).hexdigest()}
    assert replay.base_answers(base, prompts, answer).answers == ["A1", "A2"] and len(asked) == 1  # read back

    damaged = {
        "cut short": path.read_bytes()[: len(path.read_bytes()) // 2],
        "no header": body,
        "an answer edited": path.read_bytes().replace(b'"A1"', b'"planted"'),
    }
    for what, content in damaged.items():
        path.write_bytes(content)
        got = replay.base_answers(base, prompts, answer)
        assert (got.reason, got.from_cache, got.answers) == ("damaged", False, ["A1", "A2"]), what
        assert f"{path} failed its check" in got.message and "answered its 2 prompts again, the file rewritten." in got.message, what
        assert replay.read_cache(path, prompts)["answers"] == ["A1", "A2"]  # written again, whole
    assert "edited or cut short" in got.message

    # a whole, checked file of other prompts put in this file's place: not these prompts' answers
    others = replay.base_answers(base, ["q"], counting(["Q"])[0]).path
    shutil.copyfile(others, path)
    got = replay.base_answers(base, prompts, answer)
    assert got.reason == "damaged" and "does not hold answers to these prompts" in got.message


def test_another_state_of_the_base_and_no_fingerprint_are_said(tmp_path, monkeypatch):
    base, prompts = small_base(tmp_path), ["p"]
    replay.base_answers(base, prompts, counting(["old"])[0])
    retemplated = replay.BaseModel(base.source, {**base.state, "chat_template": "other", "dtype": "bf16"}, base.weights)
    got = replay.base_answers(retemplated, prompts, counting(["new"])[0])
    assert (got.reason, got.answers, got.changed) == ("model_changed", ["new"], ["chat template", "dtype (fp32 -> bf16)"])
    assert "was made with other chat template, dtype (fp32 -> bf16)" in got.message

    unpinned = replay.BaseModel("someone/absent", {**base.state, "weights": None}, None)
    before = sorted((cache_root() / "replay").iterdir())
    got = replay.base_answers(unpinned, prompts, counting(["x"])[0])
    assert (got.reason, got.from_cache, got.path) == ("unpinned", False, None) and "not cached" in got.message
    assert sorted((cache_root() / "replay").iterdir()) == before  # nothing written

    blocker = tmp_path / "a-file"  # a cache folder that cannot be made: the answers are used, the message says so
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(blocker / "cache"))
    got = replay.base_answers(small_base(tmp_path, "other"), prompts, counting(["y"])[0])
    assert got.answers == ["y"] and got.reason == "new" and "not cached:" in got.message and "could not be written" in got.message


# --------------------------------------------------------------------------- a real run's set-up
@pytest.fixture
def hashes(monkeypatch) -> list[str]:
    """The weight files whose bytes finetuner.model.fingerprint reads (hashes), in order."""
    seen: list[str] = []
    real = fingerprint.file_digest

    def digest(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(fingerprint, "file_digest", digest)
    return seen


def set_up(base: Path, data: Path, run: Path) -> dict:
    """A run's set-up on the model folder ``base`` with data.replay (the trainer's own: the base loaded, the
    replay answers read or generated, its ``replay`` event written); returns that event."""
    from finetuner.config.recipe import Recipe
    from finetuner.runs.events import read_events
    from finetuner.training.trainer import Trainer

    recipe = Recipe.from_dict({"name": "r", "model": {"name": str(base)}, "device": "cpu", "output_dir": str(run),
                               "data": {"path": str(data), "max_seq_len": 128, "val_size": 0, "replay": 0.5},
                               "training": {"max_steps": 1, "micro_batch_size": 2, "gradient_accumulation": 1}})
    trainer = Trainer(recipe, run)
    try:
        trainer.setup()
    finally:
        trainer.cleanup()
    (event,) = [e for e in read_events(run / "events.jsonl") if e["event"] == "replay"]
    assert {k: event[k] for k in trainer.replay} == trainer.replay  # what metrics.json records
    return event


def greedy_answers(base: Path, prompts: list[str]) -> list[str]:
    """The answers of the model in ``base`` to ``prompts``, as the replay generates them."""
    from finetuner.infer.chat import load_chat_model

    chat = load_chat_model(base, device="cpu")
    return chat.greedy_replies([[{"role": "user", "content": p}] for p in prompts], adapter=False,
                               max_new_tokens=replay.MAX_NEW_TOKENS, batch=replay.BATCH)


def cached_answers(event: dict) -> tuple[list[str], list[str]]:
    body = json.loads(Path(event["cache"]).read_text(encoding="utf-8").split("\n", 1)[1])
    return body["prompts"], body["answers"]


def test_a_run_answers_again_when_the_weights_change_or_the_file_was_edited_and_says_why(tmp_path, hashes):
    import torch
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    shutil.copytree(DEMO, base)
    data = tmp_path / "d.json"
    data.write_text(json.dumps(alpaca_rows(4)), encoding="utf-8")

    first = set_up(base, data, tmp_path / "run1")
    assert (first["reason"], first["from_cache"], first["rows"], first["changed"]) == ("new", False, 2, [])
    assert hashes == ["model.safetensors"]
    prompts, old = cached_answers(first)  # the base's own answers: tests/data/test_replay.py

    hashes.clear()
    same = set_up(base, data, tmp_path / "run2")
    assert (same["reason"], same["from_cache"], same["cache"], same["weights"]) == ("cached", True, first["cache"], first["weights"])
    assert hashes == []  # unchanged: the memo's hash, the weights not read

    # other weights written into the same folder (as `merge --overwrite` or a retrained base would): a nudge that
    # changes the answers and keeps them short (they end as the demo model's do: quick to generate)
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.01)
    model.save_pretrained(base)
    changed = set_up(base, data, tmp_path / "run3")
    assert (changed["reason"], changed["from_cache"], changed["changed"]) == ("model_changed", False, ["weights (model.safetensors changed)"])
    assert changed["cache"] == first["cache"] and changed["weights"] != first["weights"]
    assert ("was made with other weights (model.safetensors changed); the base model answered its 2 prompts again"
            in changed["message"])
    assert hashes == ["model.safetensors"]
    new = greedy_answers(base, prompts)
    assert cached_answers(changed) == (prompts, new) and new != old  # the new weights' own answers

    # the cache file edited by hand: not used, answered again, said
    path = Path(changed["cache"])
    header, body = path.read_text(encoding="utf-8").split("\n", 1)
    stored = json.loads(body)
    stored["answers"][0] = "Planted answer."  # its header (and SHA-256) left as they were
    path.write_text(header + "\n" + json.dumps(stored, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    edited = set_up(base, data, tmp_path / "run4")
    assert (edited["reason"], edited["from_cache"]) == ("damaged", False)
    assert "its contents do not match the SHA-256 in its header: edited or cut short" in edited["message"]
    assert cached_answers(edited) == (prompts, new)

    # the web UI's Train tab (the run's notes): why the answers were made again; nothing for the routine ones
    from finetuner.runs.jobs import run_status

    assert changed["message"] in run_status(tmp_path / "run3").notes and edited["message"] in run_status(tmp_path / "run4").notes
    assert not [n for n in run_status(tmp_path / "run2").notes + run_status(tmp_path / "run1").notes if "replay" in n]



def test_the_cli_says_where_the_answers_came_from_and_warns_when_they_were_made_again(tmp_path):
    """``finetuner run`` as a user runs it: the routine line on the console (answered, cached), then, after the
    cache file was edited, the warning that it failed its check and was made again (exit 0: the run goes on)."""
    from tests.conftest import run_cli, write_recipe

    base = tmp_path / "base"
    shutil.copytree(DEMO, base)
    data = tmp_path / "d.json"
    data.write_text(json.dumps(alpaca_rows(4)), encoding="utf-8")
    recipe = {"name": "r", "model": {"name": str(base)}, "device": "cpu", "output_dir": str(tmp_path / "run1"),
              "data": {"path": str(data), "max_seq_len": 128, "val_size": 0, "replay": 0.5},
              "training": {"max_steps": 1, "micro_batch_size": 2, "gradient_accumulation": 1}, "samples": {"prompts": []}}
    first = run_cli("run", str(write_recipe(tmp_path / "r1.yaml", recipe)))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "data.replay: the base model answered 2 prompts, cached in" in first.stdout
    from finetuner.runs.events import read_events

    (event,) = [e for e in read_events(tmp_path / "run1" / "events.jsonl") if e["event"] == "replay"]
    path = Path(event["cache"])
    path.write_text(path.read_text(encoding="utf-8").replace('"answers": [', '"answers": ["Planted.", ', 1), encoding="utf-8")
    recipe["output_dir"] = str(tmp_path / "run2")
    second = run_cli("run", str(write_recipe(tmp_path / "r2.yaml", recipe)))
    assert second.returncode == 0, second.stderr[-3000:]
    assert (f"WARNING: data.replay: {path} failed its check (its contents do not match the SHA-256 in its header: "
            "edited or cut short); the base model answered its 2 prompts again, the file rewritten.") in second.stderr
    assert "Traceback" not in second.stderr and "data.replay" not in second.stdout


def test_the_fingerprint_benchmark_runs(capsys):
    """scripts/bench/weights_fingerprint.py (the figures in finetuner/model/fingerprint.py's docstring), small."""
    from scripts.bench import weights_fingerprint

    before = os.environ["FINETUNER_CACHE_DIR"]
    result = weights_fingerprint.main(["--mb", "2", "--runs", "1"])
    assert json.loads(capsys.readouterr().out) == result and result["mib"] == 2
    assert os.environ["FINETUNER_CACHE_DIR"] == before  # its memo was its own

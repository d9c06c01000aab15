"""Overwrite replaces only what finetuner itself wrote (issue 23, item 1).

``merge``, ``export --format gguf|ollama`` and the UI's Export tab with overwrite: a folder is
replaced only when a finetuner merge or export wrote it (its ``.finetuner-export.json`` lists
everything in it), a ``.gguf`` file only when its metadata says finetuner exported it. Anything
else (a folder of the user's, a run, a run's ``adapter/`` or ``checkpoints/``, uploads, the home
folder, system folders) is refused, overwrite or not, and left as it was.

The checks on real system folders (``/``, ``/etc``, the real home) call the check alone, which
writes nothing: a broken guard fails the test there without harming the machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.errors import UserError
from finetuner.export.merge import EXPORT_MARKER, check_output_dir, merge_adapter
from finetuner.infer.loading import resolve_source
from tests.conftest import REPO, cli_in_process, demo_run_folder


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run folder of the demo model with a real LoRA adapter."""
    return demo_run_folder(tmp_path_factory.mktemp("runs"), "guarded", adapter=True)


def _users_folder(folder: Path) -> dict[str, bytes]:
    """A folder of the user's: notes and an ``.ssh`` key; returns what it holds."""
    (folder / ".ssh").mkdir(parents=True)
    (folder / "notes.txt").write_text("my notes", encoding="utf-8")
    (folder / ".ssh" / "id_ed25519").write_text("secret key", encoding="utf-8")
    return _tree(folder)


def _tree(folder: Path) -> dict[str, bytes]:
    """Every entry under ``folder`` and its bytes (``b"/"`` for a folder)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/" for p in sorted(folder.rglob("*"))}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".replaced-" in p.name)


# --------------------------------------------------------------------------- merge, CLI
def test_cli_merge_overwrite_refuses_a_folder_of_the_users_and_names_what_is_in_it(run, tmp_path):
    out = tmp_path / "v"
    before = _users_folder(out)
    p = cli_in_process("merge", str(run), "-o", str(out), "--overwrite")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    first = p.stderr.splitlines()[1]  # after "Merging ... → ..."
    assert first.startswith(f"error: The output folder {out} is not empty") and "notes.txt" in first and ".ssh/" in first, p.stderr
    assert "empty that folder yourself" in p.stderr
    assert _tree(out) == before and _leftovers(tmp_path) == []


def test_cli_merge_twice_into_one_folder_the_second_replaces_the_first(run, tmp_path):
    out = tmp_path / "merged"
    p = cli_in_process("merge", str(run), "-o", str(out))
    assert p.returncode == 0, p.stderr
    marker = json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8"))
    assert marker["kind"] == "merge" and marker["source"] == str(run) and marker["time"]
    assert set(marker["files"]) == {x.name for x in out.iterdir()} - {EXPORT_MARKER}
    assert "config.json" in marker["files"] and "model.safetensors" in marker["files"]

    again = cli_in_process("merge", str(run), "-o", str(out))  # without --overwrite: refused, the first kept
    assert again.returncode == 2 and "earlier finetuner merge" in again.stderr and "--overwrite" in again.stderr

    p = cli_in_process("merge", str(run), "-o", str(out), "--overwrite", "--dtype", "bf16")
    assert p.returncode == 0, p.stderr
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"  # the second merge's model
    assert json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8"))["time"]
    assert _leftovers(tmp_path) == []


def test_a_file_added_to_an_export_folder_makes_it_the_users(run, tmp_path):
    out = tmp_path / "merged"
    merge_adapter(run, out, verify=False)
    (out / "notes.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(UserError, match=r"not empty.*notes\.txt.*no finetuner merge or export wrote"):
        merge_adapter(run, out, overwrite=True, verify=False)
    assert (out / "notes.txt").read_text(encoding="utf-8") == "mine"
    (out / "notes.txt").unlink()
    (out / "sub").mkdir()  # an export has no sub-folders: a folder in it is the user's
    with pytest.raises(UserError, match=r"sub/"):
        merge_adapter(run, out, overwrite=True, verify=False)
    assert (out / "sub").is_dir()


def test_a_file_arriving_while_the_merge_runs_stops_the_replacement(run, tmp_path, monkeypatch):
    """The folder is checked again right before the swap: what the user put there meanwhile stays."""
    from finetuner.export import merge

    out = tmp_path / "merged"
    merge_adapter(run, out, verify=False)
    first = _tree(out)
    real = merge.write_export_marker

    def user_writes_meanwhile(folder, kind, source):
        real(folder, kind, source)
        (out / "draft.txt").write_text("written during the merge", encoding="utf-8")

    monkeypatch.setattr(merge, "write_export_marker", user_writes_meanwhile)
    with pytest.raises(UserError, match="draft.txt"):
        merge_adapter(run, out, overwrite=True, verify=False)
    assert _tree(out) == {**first, "draft.txt": b"written during the merge"} and _leftovers(tmp_path) == []


def test_an_empty_folder_is_used_without_overwrite(run, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    r = merge_adapter(run, out, verify=False)
    assert (out / "config.json").is_file() and EXPORT_MARKER in r.files


# --------------------------------------------------------------------------- what is always refused
def _refused(run: Path, out: Path, match: str | None = None) -> None:
    """``check_output_dir`` with overwrite refuses ``out`` (it writes nothing either way)."""
    src = resolve_source(run)
    with pytest.raises(UserError, match=match) as e:
        check_output_dir(out.expanduser().resolve(), True, src)
    assert "\n" not in e.value.message


@pytest.mark.parametrize("folder", ["/", "/etc", "/usr", "~", str(REPO / "finetuner"), str(REPO / "data"), str(REPO)])
def test_system_home_and_repo_folders_are_refused_with_overwrite(run, folder):
    _refused(run, Path(folder))


def test_a_runs_adapter_checkpoints_uploads_and_a_fake_home_are_refused(run, tmp_path, monkeypatch):
    from ui.handlers import Handlers

    other = demo_run_folder(tmp_path / "runs", "other")
    (other / "checkpoints" / "step-4").mkdir(parents=True)
    (other / "checkpoints" / "step-4" / "trainer_state.json").write_text("{}", encoding="utf-8")
    (other / "events.jsonl").write_text('{"event": "start"}\n', encoding="utf-8")
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    h.uploads.mkdir(parents=True, exist_ok=True)
    (h.uploads / "mine.jsonl").write_text('{"text": "mine"}\n', encoding="utf-8")
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    _users_folder(home)
    for folder, what in [(other / "adapter", "adapter_config.json"), (other / "checkpoints", "step-4/"),
                         (other, "holds a finetuner run"), (h.uploads, "mine.jsonl"), (Path("~"), ".ssh/")]:
        before = _tree(folder.expanduser())
        _refused(run, folder, what)
        with pytest.raises(UserError, match="not empty|holds a finetuner run"):  # and the merge itself
            merge_adapter(run, folder, overwrite=True, verify=False)
        assert _tree(folder.expanduser()) == before
    with pytest.raises(UserError, match="holds the model being merged"):
        merge_adapter(run, run, overwrite=True)
    with pytest.raises(UserError, match="holds the model being merged"):
        merge_adapter(run, run / "adapter", overwrite=True)


# --------------------------------------------------------------------------- GGUF and Ollama
def test_gguf_overwrite_replaces_only_a_file_finetuner_exported(run, tmp_path):
    from finetuner.export.gguf import MARKER_KEY, gguf_marker

    theirs = tmp_path / "theirs.gguf"
    theirs.write_text("a file of the user's", encoding="utf-8")
    p = cli_in_process("export", str(run), "-o", str(theirs), "--overwrite", "--no-verify")
    assert p.returncode == 2 and f"The output {theirs} exists and is not a GGUF file finetuner exported" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and theirs.read_text(encoding="utf-8") == "a file of the user's"

    out = tmp_path / "model.gguf"
    assert cli_in_process("export", str(run), "-o", str(out), "--quant", "f16", "--no-verify").returncode == 0
    assert gguf_marker(out)["kind"] == "gguf" and gguf_marker(out)["source"] == str(run)
    refused = cli_in_process("export", str(run), "-o", str(out), "--quant", "q8_0", "--no-verify")
    assert refused.returncode == 2 and "exists" in refused.stderr
    p = cli_in_process("export", str(run), "-o", str(out), "--quant", "q8_0", "--overwrite", "--no-verify", "--json")
    assert p.returncode == 0, p.stderr
    import gguf

    assert gguf.GGUFReader(str(out)).fields["general.file_type"].contents() == 7 and MARKER_KEY in gguf.GGUFReader(str(out)).fields
    assert _leftovers(tmp_path) == []


def test_ollama_overwrite_refuses_a_folder_of_the_users_and_replaces_its_own(run, tmp_path):
    out = tmp_path / "ollama"
    before = _users_folder(out)
    p = cli_in_process("export", str(run), "--format", "ollama", "-o", str(out), "--overwrite", "--no-verify")
    assert p.returncode == 2 and "notes.txt" in p.stderr and ".ssh/" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert _tree(out) == before

    mine = tmp_path / "mine"
    assert cli_in_process("export", str(run), "--format", "ollama", "-o", str(mine), "--no-verify").returncode == 0
    assert sorted(x.name for x in mine.iterdir()) == sorted([EXPORT_MARKER, "Modelfile", "model.gguf"])
    assert json.loads((mine / EXPORT_MARKER).read_text(encoding="utf-8"))["kind"] == "ollama"
    p = cli_in_process("export", str(run), "--format", "ollama", "--quant", "q8_0", "-o", str(mine), "--overwrite", "--no-verify")
    assert p.returncode == 0, p.stderr
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- the UI
def test_the_ui_overwrite_checkbox_does_not_replace_a_folder_of_the_users(tmp_path):
    from ui.handlers import Handlers

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    run = demo_run_folder(h.runs, adapter=True)
    out = tmp_path / "v"
    before = _users_folder(out)
    shown = list(h.on_merge(run.name, str(out), "auto", True))
    assert "is not empty" in shown[-1] and "notes.txt" in shown[-1] and "empty that folder yourself" in shown[-1]
    assert "--overwrite" not in shown[-1] and not shown[-1].startswith("✓")
    assert _tree(out) == before
    done = list(h.on_gguf(run.name, "ollama", "f16", str(out), True))[-1]
    assert "notes.txt" in done and not done.startswith("✓") and _tree(out) == before


def test_the_marker_rule_itself(run, tmp_path):
    """A folder is replaceable when its marker (a plain file) lists every entry, each a plain file."""
    src = resolve_source(run)
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"weights")
    (out / EXPORT_MARKER).write_text(json.dumps({"kind": "merge", "source": "x", "time": "t", "files": ["model.safetensors"]}))
    check_output_dir(out, True, src)  # finetuner's own: replaced with overwrite
    with pytest.raises(UserError, match="earlier finetuner merge"):
        check_output_dir(out, False, src)
    real = tmp_path / "marker.json"
    (out / EXPORT_MARKER).rename(real)
    (out / EXPORT_MARKER).symlink_to(real)  # a link is not finetuner's marker
    with pytest.raises(UserError, match="no finetuner merge or export wrote"):
        check_output_dir(out, True, src)
    (out / EXPORT_MARKER).unlink()
    (out / EXPORT_MARKER).write_text("not json")
    with pytest.raises(UserError, match="no finetuner merge or export wrote"):
        check_output_dir(out, True, src)

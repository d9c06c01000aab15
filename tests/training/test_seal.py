"""Sealed sharded checkpoints (finetuner.training.seal): resumed only when this user's key sealed them, unchanged.

The multi-process runs that write and resume sealed checkpoints are in test_fsdp.py (a received
folder is refused before anything is unpickled; a damaged shard sends the resume to the checkpoint
before) and test_distributed.py (ZeRO's checkpoints are sealed)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import stat
from pathlib import Path

import pytest

from finetuner.errors import UserError
from finetuner.training import seal
from finetuner.training.checkpoint import CheckpointUnreadable


@pytest.fixture
def key_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "config"
    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(home))
    monkeypatch.delenv(seal.TRUST_ENV, raising=False)
    return home


def _checkpoint(folder: Path) -> Path:
    (folder / "fsdp").mkdir(parents=True)
    (folder / "fsdp" / ".metadata").write_bytes(pickle.dumps({"shapes": [1, 2, 3]}))
    (folder / "fsdp" / "__0_0.distcp").write_bytes(b"\x00" * 4096)
    (folder / "trainer_state.json").write_text('{"step": 3}', encoding="utf-8")
    return folder


def test_a_checkpoint_this_user_sealed_passes_and_its_key_is_private(tmp_path, key_home):
    ckpt = _checkpoint(tmp_path / "step-00000003")
    seal.write(ckpt)
    seal.check(ckpt)
    assert seal.is_ours(ckpt) and seal.unsealed(tmp_path) == []
    key = key_home / seal.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_text().strip()) == 64
    listed = json.loads((ckpt / seal.SEAL).read_text())["files"]
    assert sorted(listed) == ["fsdp/.metadata", "fsdp/__0_0.distcp", "trainer_state.json"]
    assert listed["fsdp/__0_0.distcp"]["size"] == 4096


@pytest.mark.parametrize("damage", ["truncated", "replaced", "deleted", "added"])
def test_a_sealed_checkpoint_whose_files_changed_is_unreadable(tmp_path, key_home, damage):
    """Unreadable (the resume takes the checkpoint before), not foreign: the seal itself is ours."""
    ckpt = _checkpoint(tmp_path / "step-00000003")
    seal.write(ckpt)
    shard = ckpt / "fsdp" / "__0_0.distcp"
    if damage == "truncated":
        shard.write_bytes(b"\x00" * 100)
    elif damage == "replaced":  # same size, other bytes: a garbage .metadata
        meta = ckpt / "fsdp" / ".metadata"
        meta.write_bytes(bytes(len(meta.read_bytes())))
    elif damage == "deleted":
        shard.unlink()
    else:
        (ckpt / "fsdp" / "__1_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointUnreadable, match="missing or changed since it was written"):
        seal.check(ckpt)
    with pytest.raises(CheckpointUnreadable):  # trusting where it came from does not make a damaged file whole
        seal.check(ckpt, trusted=True)


def test_a_checkpoint_without_this_users_seal_is_refused_unless_trusted(tmp_path, key_home, monkeypatch):
    ckpt = _checkpoint(tmp_path / "step-00000003")
    with pytest.raises(seal.NotOurs, match=r"\(it has no seal\): resuming it unpickles") as e:
        seal.check(ckpt)
    assert "--trust-checkpoints" in e.value.hint and "--no-resume" in e.value.hint
    seal.write(ckpt)
    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(tmp_path / "someone-else"))  # another user's key
    with pytest.raises(seal.NotOurs, match="its seal was not made with this user's key"):
        seal.check(ckpt)
    assert not seal.is_ours(ckpt)
    # a forged seal: the file list edited to match a planted file, the HMAC kept
    monkeypatch.setenv("FINETUNER_CONFIG_DIR", str(key_home))
    (ckpt / "fsdp" / ".metadata").write_bytes(b"planted")
    forged = json.loads((ckpt / seal.SEAL).read_text())
    forged["files"]["fsdp/.metadata"] = {"size": 7, "sha256": hashlib.sha256(b"planted").hexdigest()}
    (ckpt / seal.SEAL).write_text(json.dumps(forged))
    with pytest.raises(seal.NotOurs):
        seal.check(ckpt)
    seal.check(ckpt, trusted=True)  # the user's opt-in: the listed files match
    monkeypatch.setenv(seal.TRUST_ENV, "1")  # how the launcher passes --trust-checkpoints to the ranks
    seal.check(ckpt)


def test_unsealed_lists_the_sharded_checkpoints_a_resume_would_unpickle(tmp_path, key_home):
    run = tmp_path / "run"
    ours = _checkpoint(run / "checkpoints" / "step-00000002")
    seal.write(ours)
    theirs = _checkpoint(run / "checkpoints" / "step-00000004")
    plain = run / "checkpoints" / "step-00000006"  # one process / DDP: safetensors and weights_only state dicts
    plain.mkdir()
    (plain / "trainer_state.json").write_text('{"step": 6}', encoding="utf-8")
    assert seal.unsealed(run) == [theirs]


def test_a_damaged_key_file_is_reported_with_what_to_do(tmp_path, key_home):
    key_home.mkdir()
    (key_home / seal.KEY_FILE).write_text("not a key\n")
    (key_home / seal.KEY_FILE).chmod(0o600)
    ckpt = _checkpoint(tmp_path / "step-00000003")
    with pytest.raises(UserError, match="is not a finetuner checkpoint key") as e:
        seal.write(ckpt)
    assert "Delete it" in e.value.hint


def test_the_planted_pickle_of_the_refusal_tests_runs_code_when_loaded(tmp_path):
    """What test_fsdp.py and test_distributed.py plant would have run, had it been unpickled."""
    import torch

    from tests.conftest import Planted

    marker = tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": Planted(marker)}, tmp_path / "state.pt")
    torch.load(tmp_path / "state.pt", weights_only=False)  # as DeepSpeed loads its state files
    assert marker.exists()
    marker.unlink()
    pickle.loads(pickle.dumps(Planted(marker)))  # as torch.distributed.checkpoint reads .metadata
    assert marker.exists()


def _resigned_with(key_file: Path, ckpt: Path) -> None:
    """What anyone who can read ``key_file`` can do: plant a file in ``ckpt`` and seal it again with that key."""
    (ckpt / "fsdp" / ".metadata").write_bytes(b"planted")
    key = bytes.fromhex(key_file.read_text().strip())
    files = seal._files(ckpt)
    (ckpt / seal.SEAL).write_text(json.dumps({"version": seal.VERSION, "files": files, "hmac": seal._mac(key, files)}))


def _expose(how: str, key: Path, tmp_path: Path) -> str:
    """Make this user's key readable or replaceable by others, as ``how`` says; the refusal's words for it."""
    if how == "mode 0644":
        key.chmod(0o644)
        return r"it is readable or writable by group or others \(mode 0644\)"
    if how == "folder 0777":
        key.parent.chmod(0o777)
        return r"its folder is writable by group or others \(mode 0777\)"
    if how == "link to a 0666 file":
        target = tmp_path / "shared-key"
        target.write_text(key.read_text())
        target.chmod(0o666)
        key.unlink()
        key.symlink_to(target)
        return r"it is a link \(finetuner reads its key only from a regular file\)"
    if how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("giving the key to another user needs root (CI runs as root)")
        os.chown(key, 65534, 65534)
        return r"it is owned by uid 65534, not by you \(uid 0\)"
    if how == "a fifo":
        key.unlink()
        os.mkfifo(key, 0o600)
        return "it is not a regular file"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["mode 0644", "folder 0777", "link to a 0666 file", "another owner", "a fifo"])
def test_a_key_others_could_read_is_refused_and_so_is_every_seal_made_with_it(tmp_path, key_home, how):
    """Issue 54, case 4: with the key readable by others, a crafted FSDP ``.metadata`` re-signed with it passed the
    check. Now the key is refused (as ssh refuses an open private key), on checking and on sealing, with one line
    naming the file, why, and the fix (a new key: a chmod afterwards would not undo a copy already read)."""
    ckpt = _checkpoint(tmp_path / "step-00000003")
    seal.write(ckpt)  # sealed while the key was private
    key = key_home / seal.KEY_FILE
    assert stat.S_IMODE(key_home.stat().st_mode) == 0o700
    if how != "a fifo":
        _resigned_with(key, ckpt)
    words = _expose(how, key, tmp_path)
    for act in (lambda: seal.check(ckpt), lambda: seal.write(ckpt), lambda: seal.is_ours(ckpt), seal.private_key):
        with pytest.raises(seal.KeyExposed, match=rf"^{key}: {words}, so a checkpoint seal made with it cannot be trusted") as e:
            act()
        assert "\n" not in e.value.message and f"rm {key}" in e.value.hint and "--trust-checkpoints" in e.value.hint
    assert isinstance(e.value, seal.NotOurs)  # the ranks' verdict on it: stop, as for a checkpoint not ours
    if how != "a fifo":
        seal.check(ckpt, trusted=True)  # the user's opt-in needs no key: the files match the (re-signed) list
    # the fix the message names: remove it; a new private key is made, and the old seals are not ours
    key.unlink()
    key_home.chmod(0o700)
    with pytest.raises(seal.NotOurs, match="its seal was not made with this user's key"):
        seal.check(ckpt)
    seal.private_key()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and not key.is_symlink()
    with pytest.raises(seal.NotOurs, match="its seal was not made with this user's key"):
        seal.check(ckpt)


def test_a_run_with_sharded_checkpoints_stops_at_once_on_an_exposed_key(tmp_path, key_home, recipe_dict):
    """`finetuner run --gpus 2` with fsdp and a readable key ends in one line, exit 2, before the model loads (rank 0
    checks the key first: the launcher cannot ask the strategies without an import circle through the trainer)."""
    from finetuner.runs.events import read_events

    from tests.conftest import cli_in_process, write_recipe

    key_home.mkdir(mode=0o700)
    seal.private_key()
    (key_home / seal.KEY_FILE).chmod(0o640)
    recipe = write_recipe(tmp_path / "r.yaml", dict(recipe_dict, output_dir=str(tmp_path / "run")))
    out = cli_in_process("run", str(recipe), "--gpus", "2", "--set", "distributed.strategy=fsdp", "--quiet")
    assert out.returncode == 2, out.stdout + out.stderr
    first = out.stderr.strip().splitlines()[0]
    assert first.startswith(f"error: {key_home / seal.KEY_FILE}: it is readable or writable by group or others (mode 0640)")
    assert "Traceback" not in out.stderr
    assert [e["event"] for e in read_events(tmp_path / "run" / "events.jsonl")] == ["error"]

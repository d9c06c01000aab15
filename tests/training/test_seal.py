"""Sealed sharded checkpoints (finetuner.training.seal): resumed only when this user's key sealed them, unchanged.

The multi-process runs that write and resume sealed checkpoints are in test_fsdp.py (a received
folder is refused before anything is unpickled; a damaged shard sends the resume to the checkpoint
before) and test_distributed.py (ZeRO's checkpoints are sealed)."""

from __future__ import annotations

import hashlib
import json
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

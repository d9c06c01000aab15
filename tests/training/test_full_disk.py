"""A disk that fills up while a run writes a checkpoint, on a real file system: a 12 MiB tmpfs (tests/small_disk.py).

Each run is held after step 1, its checkpoint written (``HOLD@1``: a pause, no fault), while the test fills the
disk to leave half of that checkpoint's size free; the checkpoint of step 2 then fails part-way through, as the
kernel refuses a write (``ENOSPC``), whichever library was writing: safetensors, torch.save, DeepSpeed's engine,
``torch.distributed.checkpoint``. On one process, FSDP's two and ZeRO's two (gloo, on the CPU), the run ends with
one line naming the folder, the space free and what to free, nothing half-written is left, the ranks' output is
kept, and once the filler is removed the command the message gives resumes from the checkpoint of step 1 and
finishes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from finetuner.fileio import size_text, tree_bytes
from finetuner.runs.events import read_events
from tests.conftest import HANG_GUARD_S, run_cli, write_recipe
from tests.small_disk import PAGE, fill, free
from tests.training.test_distributed import deepspeed, reference_recipe, without_deepspeed  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir) -> dict:
    """The multi-process tests' recipe (tests/training/test_distributed.py) for 3 steps, a checkpoint after each
    (the one kept: the last complete), every step logged."""
    raw = reference_recipe(tmp_path_factory.mktemp("full_disk"), tiny_model_dir)
    return dict(raw, training=dict(raw["training"], max_steps=3), checkpointing={"save_every": 1, "keep_last": 1},
                logging={"tensorboard": False, "every": 1})


def _run_until_the_disk_fills(disk: Path, raw: dict, monkeypatch, *args: str) -> tuple[Path, subprocess.CompletedProcess]:
    """``finetuner run RECIPE ARGS`` into a run folder on ``disk``, held after step 1 (its checkpoint written) while
    the disk is filled to leave half of that checkpoint's size: the checkpoint of step 2 fails part-way through."""
    run_dir = disk / "run"
    recipe = write_recipe(disk.parent / "recipe.yaml", dict(raw, output_dir=str(run_dir)))
    gate = disk.parent / "hold"
    gate.touch()
    monkeypatch.setenv("FINETUNER_FAULT", "HOLD@1")
    monkeypatch.setenv("FINETUNER_HOLD_FILE", str(gate))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_cli, "run", str(recipe), *args, "--quiet")
        deadline = time.monotonic() + HANG_GUARD_S
        while not any(e["event"] == "checkpoint" and e["step"] == 1 for e in read_events(run_dir / "events.jsonl")):
            assert not running.done() and time.monotonic() < deadline, running.result() if running.done() else "no checkpoint"
            time.sleep(0.2)
        fill(disk, leave=tree_bytes(run_dir / "checkpoints" / "step-00000001") // 2)
        gate.unlink()
        out = running.result()
    monkeypatch.delenv("FINETUNER_FAULT")
    return run_dir, out


def _one_line_and_nothing_half_written(out: subprocess.CompletedProcess, disk: Path, run_dir: Path) -> list[str]:
    """The run ended with the one-line error (and its hint: what to free, the command that resumes), exit 2; the
    checkpoint it was writing is gone and the one of step 1 is whole. Returns the lines from the error on."""
    assert out.returncode == 2, out.stderr + out.stdout
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("error: ")):]
    staging = run_dir / "checkpoints" / ".tmp-step-00000002"
    said = re.fullmatch(rf"error: No space left on device while writing {re.escape(str(staging))} \((.+) free\)\.", lines[0])
    assert said, out.stderr
    # the space it says is free is what the disk has now, give or take the page or two its error event took after
    assert said.group(1) in {size_text(free(disk) + k * PAGE) for k in range(3)}, (said.group(1), free(disk))
    assert re.fullmatch(r"Free at least .+ more on that disk \(.+ free in all\), then resume with "
                        rf"`finetuner run {re.escape(str(run_dir / 'recipe.yaml'))} -o {re.escape(str(run_dir))}` "
                        r"\(the run continues from its last checkpoint \(step-00000001\);.*", lines[1]), lines[1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000001"]
    return lines


def _resumes_after_freeing_the_disk(disk: Path, run_dir: Path) -> None:
    """The filler removed, the command the message gave finishes the run from the checkpoint of step 1."""
    (disk / "filler").unlink()
    done = run_cli("run", str(run_dir / "recipe.yaml"), "-o", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stderr + done.stdout
    events = read_events(run_dir / "events.jsonl")
    assert [e["resumed_from_step"] for e in events if e["event"] == "start"] == [None, 1]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 2, 3]  # step 2 again: its checkpoint was lost
    assert events[-1]["event"] == "done" and (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def _the_ranks_output_is_kept(lines: list[str], run_dir: Path) -> None:
    """The ranks' report of the full disk is in ``launch.log`` or, where its disk refused it, in the file the
    error's hint names; that one is in a folder only this user can enter."""
    logs = [run_dir / "distributed" / "launch.log"]
    moved = re.fullmatch(r"The ranks' output is in .* up to where its disk was full, then in (.+)\.", lines[-1])
    if moved:
        logs.append(Path(moved.group(1)))
        assert logs[1].parent.stat().st_mode & 0o777 == 0o700
    text = "".join(p.read_text(encoding="utf-8") for p in logs)
    for p in logs[1:]:
        shutil.rmtree(p.parent)
    assert re.search(r'^\{"kind": "error", "rank": \d, "message": "No space left on device while writing', text, re.M), text


def test_a_full_disk_during_a_checkpoint_on_one_process(base, small_disk, monkeypatch):
    run_dir, out = _run_until_the_disk_fills(small_disk, base, monkeypatch)
    lines = _one_line_and_nothing_half_written(out, small_disk, run_dir)
    assert len(lines) == 2, out.stderr
    _resumes_after_freeing_the_disk(small_disk, run_dir)


def test_a_full_disk_during_an_fsdp_checkpoint(base, small_disk, monkeypatch, without_deepspeed):  # noqa: F811
    """The ranks fail together inside ``torch.distributed.checkpoint``, which gathers their errors into one
    that is no ``Exception`` (finetuner.training.strategies.fsdp)."""
    run_dir, out = _run_until_the_disk_fills(small_disk, base, monkeypatch, "--gpus", "2", "--set", "distributed.strategy=fsdp")
    lines = _one_line_and_nothing_half_written(out, small_disk, run_dir)
    _the_ranks_output_is_kept(lines, run_dir)
    _resumes_after_freeing_the_disk(small_disk, run_dir)


def test_a_full_disk_during_a_zero_checkpoint(base, small_disk, monkeypatch, deepspeed):  # noqa: F811
    """DeepSpeed's engine writes each rank's optimizer states with torch.save (whose own error says only that a
    write failed); a rank that fails alone ends, and the other one then loses its peer: the launcher reports
    the full disk, a user's error, before any rank's error that is not."""
    run_dir, out = _run_until_the_disk_fills(small_disk, base, monkeypatch, "--gpus", "2", "--set", "distributed.strategy=zero2")
    lines = _one_line_and_nothing_half_written(out, small_disk, run_dir)
    _the_ranks_output_is_kept(lines, run_dir)
    _resumes_after_freeing_the_disk(small_disk, run_dir)


def test_a_checkpoint_cut_short_is_removed_before_the_resume_counts_the_free_space(base, small_disk, monkeypatch):
    """A process killed while it wrote the checkpoint of step 2 (``KILL@save``: its adapter written) leaves that
    staging folder. The disk then filled to leave less than the resume's space check asks for, but more once the
    folder is removed: the resume removes it first (and says so), passes the check and finishes."""
    import signal

    from finetuner.config.recipe import Recipe
    from finetuner.config.runtime import resolve_runtime
    from finetuner.model.loading import load_base_model, prepare_for_training
    from finetuner.runs.folder import disk_space_needed

    run_dir = small_disk / "run"
    recipe = write_recipe(small_disk.parent / "recipe.yaml", dict(base, output_dir=str(run_dir)))
    monkeypatch.setenv("FINETUNER_FAULT", "KILL@save:2")
    killed = run_cli("run", str(recipe), "--quiet")
    monkeypatch.delenv("FINETUNER_FAULT")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    cut = tree_bytes(run_dir / "checkpoints" / ".tmp-step-00000002")
    assert cut > 8 * PAGE  # room for what the resume writes before its check (recipe.yaml, its first events)
    # what the resume's check asks for (finetuner.runs.folder.check_disk_space), with the model as the run builds it
    saved = Recipe.from_yaml(run_dir / "recipe.yaml")
    model = prepare_for_training(load_base_model(saved, resolve_runtime(saved)), saved)
    need = disk_space_needed(run_dir, model, saved.training.optimizer, saved.checkpointing.keep_last)[2]
    fill(small_disk, leave=need - cut // 2)
    done = run_cli("run", str(run_dir / "recipe.yaml"), "-o", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"Removed .tmp-step-00000002 ({size_text(cut)}), a checkpoint that was never completed." in done.stderr
    events = read_events(run_dir / "events.jsonl")
    assert [e["resumed_from_step"] for e in events if e["event"] == "start"] == [None, 1] and events[-1]["event"] == "done"


def test_a_full_disk_while_writing_the_final_adapter(base, small_disk, monkeypatch):
    """The run held as it starts its final adapter (``HOLD@adapter``: ``.tmp-adapter`` made, nothing in it yet)
    while the disk is filled to leave two pages: safetensors' writer fails (``os error 28``). One line naming the
    folder, the space free and what to free, no adapter half-written, the last checkpoint kept; once the filler
    is gone the command the message gives writes the adapter."""
    run_dir = small_disk / "run"
    recipe = write_recipe(small_disk.parent / "recipe.yaml", dict(base, output_dir=str(run_dir)))
    gate = small_disk.parent / "hold"
    gate.touch()
    monkeypatch.setenv("FINETUNER_FAULT", "HOLD@adapter")
    monkeypatch.setenv("FINETUNER_HOLD_FILE", str(gate))
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_cli, "run", str(recipe), "--quiet")
        deadline = time.monotonic() + HANG_GUARD_S
        while not (run_dir / ".tmp-adapter").is_dir():
            assert not running.done() and time.monotonic() < deadline, running.result() if running.done() else "no adapter"
            time.sleep(0.05)
        fill(small_disk, leave=2 * PAGE)
        gate.unlink()
        out = running.result()
    monkeypatch.delenv("FINETUNER_FAULT")
    assert out.returncode == 2, out.stderr + out.stdout
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("error: ")):]
    said = re.fullmatch(rf"error: No space left on device while writing {re.escape(str(run_dir / '.tmp-adapter'))} "
                        r"\((.+) free\)\.", lines[0])
    assert said, out.stderr
    assert said.group(1) in {size_text(free(small_disk) + k * PAGE) for k in range(3)}, (said.group(1), free(small_disk))
    assert re.fullmatch(r"Free at least .+ more on that disk \(.+ free in all\), then resume with "
                        rf"`finetuner run {re.escape(str(run_dir / 'recipe.yaml'))} -o {re.escape(str(run_dir))}` "
                        r"\(the run continues from its last checkpoint \(step-00000003\);.*", lines[1]), lines[1]
    assert not (run_dir / ".tmp-adapter").exists() and not (run_dir / "adapter").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000003"]
    (small_disk / "filler").unlink()
    done = run_cli("run", str(run_dir / "recipe.yaml"), "-o", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stderr + done.stdout
    assert read_events(run_dir / "events.jsonl")[-1]["event"] == "done"
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


_PRINTS = """
from finetuner.fileio import DiskFull
from finetuner.training.rank_output import report_failure
for i in range(40):
    print(f"line {i} " + "x" * 200)
report_failure(DiskFull("/runs/r/checkpoints/.tmp-step-00000002", "resume", 10 * 2**20), 1)
print("the last line")
"""


def test_the_ranks_output_goes_on_elsewhere_when_the_run_folders_disk_is_full(small_disk, tmp_path, monkeypatch):
    """The launcher's reader of torchrun's output (finetuner.training.rank_output), on a pipe from a real process,
    its log on the full disk: the log goes on in a folder of its own under the temporary folder, which the note
    names; when that disk is full too, the last lines stay in memory. The ranks' reports are picked out either way."""
    import tempfile

    from finetuner.training.rank_output import TAIL_LINES, RankOutput
    from tests.conftest import REPO

    fill(small_disk, leave=0)
    (tmp_path / "tmp").mkdir()
    for temporary, lost in ((tmp_path / "tmp", False), (small_disk, True)):
        monkeypatch.setattr(tempfile, "tempdir", str(temporary))
        log = small_disk / f"launch-{lost}.log"
        output = RankOutput(log)
        proc = subprocess.Popen([sys.executable, "-c", _PRINTS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        output.start(proc.stdout)
        assert proc.wait(HANG_GUARD_S) == 0
        output.join()
        assert log.stat().st_size == 0  # nothing of it fitted
        (report,) = output.reports
        assert report["rank"] == 1 and report["disk_full"]["path"] == "/runs/r/checkpoints/.tmp-step-00000002"
        assert list(output.tail) == [f"line {i} " + "x" * 200 for i in range(40 - TAIL_LINES + 2, 40)] + [
            output.tail[-2], "the last line"]
        assert output.lost is lost
        if not lost:
            assert output.moved.parent.parent == tmp_path / "tmp" and output.moved.parent.stat().st_mode & 0o777 == 0o700
            text = output.moved.read_text(encoding="utf-8").splitlines()
            assert text[0] == f"(the start of this log is in {log}, whose disk was full from here on)"
            assert text[1:] == [f"line {i} " + "x" * 200 for i in range(40)] + [text[-2], "the last line"]
            assert output.note() == f"The ranks' output is in {log} up to where its disk was full, then in {output.moved}."
        else:
            assert output.note().startswith(f"The ranks' output could not all be written: the disk of {log} is full")
        assert output.where().endswith("Its end:\n" + "\n".join(output.tail))

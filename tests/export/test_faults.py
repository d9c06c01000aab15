"""A merge or an export cut short, as users meet it: the ``finetuner`` command in a process of its own.

A full disk is a real one: a small tmpfs (tests/small_disk.py) that this process, another than the command's,
fills while the command writes. The command is held inside its write once its staging exists (``HOLD@merge``:
the merge's hidden folder made; ``HOLD@export``: the GGUF file's header written; a pause, no fault:
finetuner.training.faults), the disk is filled to leave a few pages, and the write goes on: the kernel refuses
it (``ENOSPC``; the gguf package's numpy writer says only ``N requested and M written``). The command ends with
one line naming the output, the space free and how much to free in all, leaves nothing hidden behind, and the
same command, once the space is free, succeeds within what the message asked for.

A stop is a real signal (SIGTERM, as ``kill`` or a service manager sends it; SIGINT, Ctrl-C) sent to the command
held the same way: its staging files and folders are removed and it exits 128 + the signal with "aborted.".
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from finetuner.children import module_command
from finetuner.export.merge import space_needed
from finetuner.fileio import size_text
from tests.conftest import HANG_GUARD_S, REPO, demo_run_folder, run_cli
from tests.small_disk import PAGE, fill, free


def _start(point: str, gate: Path, *args: str) -> subprocess.Popen:
    """``finetuner ARGS`` in a process of its own, held at ``point`` of its write while ``gate`` exists."""
    gate.touch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "200", "FINETUNER_FAULT": f"HOLD@{point}", "FINETUNER_HOLD_FILE": str(gate)}
    return subprocess.Popen(module_command("finetuner.cli.main", *args), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_staging(proc: subprocess.Popen, folder: Path, pattern: str) -> None:
    """Until a file or folder matching ``pattern`` is under ``folder`` (the command then waits at its hold)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not list(folder.glob(pattern)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no staging appeared"
        time.sleep(0.05)


def _bytes(text: str) -> float:
    """``size_text``'s words back to bytes (to its three digits)."""
    number, unit = text.split()
    return float(number) * {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def _full_disk_said(proc: subprocess.Popen, disk: Path, out: Path) -> int:
    """The command ended with exit status 2 and the two lines of a full disk, nothing else after the first:
    the output named, the space free as the disk has it now, how much to free. Returns the bytes it asks for in
    all. Nothing it staged is left on the disk: only the filler."""
    stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 2, (stdout, stderr)
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("error: ")):]
    assert len(lines) == 2, stderr
    said = re.fullmatch(rf"error: No space left on device while writing {re.escape(str(out))} \((.+) free\)\.", lines[0])
    assert said, lines[0]
    assert said.group(1) in {size_text(free(disk) + k * PAGE) for k in range(2)}, (said.group(1), free(disk))
    hint = re.fullmatch(r"Free at least (.+) more on that disk \((.+) free in all\), then run the same command again "
                        rf"\(nothing was written to {re.escape(str(out))}\)\.", lines[1])
    assert hint, lines[1]
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]
    return int(_bytes(hint.group(2)) * 1.005)


@pytest.fixture
def disk_64(tmp_path):
    """A real 64 MiB file system: a merge asks for its weights and 50 MiB more before it writes."""
    from tests import small_disk as disks

    reason = disks.mountable()
    if reason:
        pytest.skip(reason)
    with disks.small_disk(tmp_path / "disk", 64) as disk:
        yield disk


@pytest.mark.parametrize("fmt", ["gguf", "ollama"])
def test_a_disk_that_fills_during_the_gguf_write_is_one_line_and_leaves_nothing(fmt, tiny_model_dir, small_disk, tmp_path):
    out = small_disk / ("tiny.gguf" if fmt == "gguf" else "tiny")
    args = ("export", str(tiny_model_dir), "-o", str(out), "--format", fmt)
    proc = _start("export", tmp_path / "gate", *args)
    _wait_for_staging(proc, small_disk, "**/*.gguf")  # its header written: the tensors come next
    fill(small_disk, leave=2 * PAGE)
    (tmp_path / "gate").unlink()
    need = _full_disk_said(proc, small_disk, out)
    (small_disk / "filler").unlink()
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    gguf_file = out if fmt == "gguf" else out / "model.gguf"
    assert 0 < sum(p.stat().st_size for p in small_disk.rglob("*") if p.is_file()) <= need
    assert gguf_file.stat().st_size > 8 * PAGE  # far more than the disk had left


def test_a_disk_that_fills_during_a_merge_is_one_line_and_leaves_nothing(disk_64, tmp_path):
    run = demo_run_folder(tmp_path / "runs", adapter=True)
    out = disk_64 / "merged"
    proc = _start("merge", tmp_path / "gate", "merge", str(run), "-o", str(out))
    _wait_for_staging(proc, disk_64, ".merged.tmp-merge-*")  # the merge's space check passed: it writes next
    fill(disk_64, leave=4 * PAGE)  # room for its config files, not for its weights
    (tmp_path / "gate").unlink()
    need = _full_disk_said(proc, disk_64, out)
    (disk_64 / "filler").unlink()
    done = run_cli("merge", str(run), "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr
    weights = json.loads(done.stdout)["weight_bytes"]
    assert size_text(need / 1.005) == size_text(space_needed(weights))  # what its space check asks for, no less


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_a_merge_removes_its_staging_folder(sig, tmp_path):
    run = demo_run_folder(tmp_path / "runs", adapter=True)
    exports = tmp_path / "exports"
    exports.mkdir()
    proc = _start("merge", tmp_path / "gate", "merge", str(run), "-o", str(exports / "merged"))
    _wait_for_staging(proc, exports, ".merged.tmp-merge-*")
    proc.send_signal(sig)  # tests/zygote_child.py passes it on to the command
    _stopped(proc, sig)
    assert sorted(p.name for p in exports.iterdir()) == []  # no hidden staging folder, no output


@pytest.mark.parametrize("fmt, sig", [("gguf", signal.SIGTERM), ("ollama", signal.SIGTERM), ("gguf", signal.SIGINT)],
                         ids=["gguf-SIGTERM", "ollama-SIGTERM", "gguf-SIGINT"])
def test_a_stop_signal_during_an_export_removes_its_staging(fmt, sig, tmp_path):
    """The export of a run holds two staged things at once: the merged model's hidden folder and the GGUF file
    being written (in a hidden folder of its own for Ollama)."""
    run = demo_run_folder(tmp_path / "runs", adapter=True)
    exports = tmp_path / "exports"
    exports.mkdir()
    out = exports / ("demo.gguf" if fmt == "gguf" else "demo")
    proc = _start("export", tmp_path / "gate", "export", str(run), "-o", str(out), "--format", fmt)
    _wait_for_staging(proc, exports, "**/*.gguf")
    assert len([p for p in exports.iterdir() if p.name.startswith(".")]) == 2  # the merged folder and the GGUF staging
    proc.send_signal(sig)
    _stopped(proc, sig)
    assert sorted(p.name for p in exports.iterdir()) == []


def _stopped(proc: subprocess.Popen, sig: int) -> None:
    """The command ended at the signal with exit status 128 + its number and one line, "aborted.", no traceback."""
    stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 128 + sig, (proc.returncode, stdout, stderr)
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "aborted.", stderr
    assert stderr.count("aborted.") == 1 and "error:" not in stderr, stderr


def test_sigterm_to_the_export_worker_removes_the_merges_staging_and_answers_interrupted(tmp_path):
    """The web UI's merges and exports run in ``python -m finetuner.export.worker``: a SIGTERM sent to it mid-write
    cleans up as the CLI does and its last message says "interrupted" (exit status 2, a stop, not a bug)."""
    run = demo_run_folder(tmp_path / "runs", adapter=True)
    exports = tmp_path / "exports"
    exports.mkdir()
    gate = tmp_path / "gate"
    gate.touch()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "FINETUNER_FAULT": "HOLD@merge", "FINETUNER_HOLD_FILE": str(gate)}
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"source": str(run), "output_dir": str(exports / "merged")}), encoding="utf-8")
    with request.open(encoding="utf-8") as stdin:
        proc = subprocess.Popen(module_command("finetuner.export.worker"), cwd=REPO, env=env, stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_staging(proc, exports, ".merged.tmp-merge-*")
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 2, (stdout, stderr)
    answer = json.loads(stdout.strip().splitlines()[-1])
    assert (answer["kind"], answer["message"], answer["user_error"]) == ("error", "interrupted", True), answer
    assert "Traceback" not in stderr, stderr
    assert sorted(p.name for p in exports.iterdir()) == []

"""One-line errors where tracebacks were (issue 23, item 8): non-finite and out-of-range recipe
values, broken model folders, a full disk while saving, weights that became NaN, a corrupt
reference file, Ctrl-C while tokenizing; and no folder left behind by a run that failed before
its first step. Each is met as a user meets it: the CLI in a subprocess, or the function it calls."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.runs.events import read_events
from tests.conftest import REPO, cli_in_process, write_recipe, HANG_GUARD_S


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The CLI failed with exit status 2, an ``error:`` line holding every needle, and no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("error: "))
    for needle in needles:
        assert needle in line, (needle, line)
    return line


# --------------------------------------------------------------------------- recipe values
@pytest.mark.parametrize(
    "override, message",
    [
        ("training.epochs=.inf", "training.epochs: must be a finite number > 0 and ≤ 9007199254740992; got inf."),
        ("data.val_size=.inf", "data.val_size: must be a finite number ≥ 0; got inf."),
        ("training.lr=inf", "training.lr: must be a finite number > 0; got 'inf'."),
        ("training.lr=.nan", "training.lr: must be a finite number > 0; got nan."),
        ("training.max_grad_norm=.inf", "training.max_grad_norm: must be a finite number > 0; got inf."),
        ("training.seed=-1", "training.seed: must be a whole number from 0 to 4294967295; got -1."),
        ("training.seed=1e23", "training.seed: must be a whole number from 0 to 4294967295; got 1e+23."),
        ("training.seed=1.0e+23", "training.seed: must be a whole number from 0 to 4294967295; got 1e+23."),
        ("training.seed=4294967296", "training.seed: must be a whole number from 0 to 4294967295; got 4294967296."),
        ("lora.r=true", "lora.r: must be a number, not true."),
        ("lora.alpha=false", "lora.alpha: must be a number, not false."),
        ("training.micro_batch_size=true", "training.micro_batch_size: must be a number, not true."),
    ],
)
def test_recipe_refuses_non_finite_numbers_bad_seeds_and_booleans(recipe_dict, override, message):
    with pytest.raises(UserError) as e:
        Recipe.from_dict(recipe_dict, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("seed", [0, 2**32 - 1])
def test_every_seed_torch_and_numpy_take_is_accepted(recipe_dict, seed):
    assert Recipe.from_dict(recipe_dict, [f"training.seed={seed}"]).training.seed == seed


def test_lr_inf_is_refused_by_the_cli_before_anything_is_written(recipe_dict, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict)
    r = cli_in_process("run", str(recipe), "--set", "training.lr=inf")
    assert "training.lr: must be a finite number > 0; got 'inf'." in r.stderr
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- broken model folders
def _break(folder: Path, how: str) -> str:
    """Damage a copy of the tiny model the way downloads and edits do; returns what the error must name."""
    weights = folder / "model.safetensors"
    if how == "truncated":
        os.truncate(weights, weights.stat().st_size // 3)
        return f"the weight file {weights} ({weights.stat().st_size} bytes) is truncated or corrupt"
    if how == "zero-byte":
        weights.write_bytes(b"")
        return f"the weight file {weights} (0 bytes) is truncated or corrupt"
    config = json.loads((folder / "config.json").read_text())
    if how == "no-model_type":
        config.pop("model_type")
        (folder / "config.json").write_text(json.dumps(config))
        return f"'{folder}': config.json names no model_type this transformers knows"
    config["intermediate_size"] *= 2  # shape mismatch
    (folder / "config.json").write_text(json.dumps(config))
    return f"the weights in '{folder}' do not have the shapes its config.json describes"


@pytest.mark.parametrize("how", ["truncated", "zero-byte", "no-model_type", "shape-mismatch"])
def test_a_broken_model_folder_is_one_line_naming_it_and_leaves_no_run_folder(recipe_dict, tiny_model_dir, tmp_path, how):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    expected = _break(model, how)
    recipe = write_recipe(tmp_path / "r.yaml", dict(recipe_dict, model={"name": str(model)}))
    r = cli_in_process("run", str(recipe))
    _one_line_error(r, "model.name: ", expected)
    assert not (tmp_path / "run").exists()  # the folder this run made holds nothing of use: removed


def test_chat_with_a_broken_base_is_one_line(tiny_model_dir, tmp_path):
    """The inference loaders (chat, eval, merge) say the same as training."""
    from finetuner.infer.loading import load_pretrained

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    expected = _break(model, "truncated")
    with pytest.raises(UserError, match="the base model: the weight file") as e:
        load_pretrained(str(model), "the base model")
    assert expected in e.value.message


def test_a_failed_start_in_an_empty_folder_leaves_it_empty_and_a_used_folder_is_kept(recipe_dict, tmp_path):
    from finetuner.run_marker import mark_run_folder

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "hi", "output": 3}]), encoding="utf-8")
    empty = tmp_path / "mine"
    empty.mkdir()
    with pytest.raises(UserError, match="bad.json"):
        finetuner.train(Recipe.from_dict(dict(recipe_dict, data={"path": str(bad)}, output_dir=str(empty))))
    assert empty.is_dir() and list(empty.iterdir()) == []
    # a run folder that already holds a run (here: the recipe the web UI writes before it starts a job) is left as it is
    ui_made = tmp_path / "ui-run"
    ui_made.mkdir()
    mark_run_folder(ui_made)  # as runs.jobs.start_job marks the folder it makes for a job
    Recipe.from_dict(dict(recipe_dict, data={"path": str(bad)}, output_dir=str(ui_made))).save(ui_made / "recipe.yaml")
    with pytest.raises(UserError, match="bad.json"):
        finetuner.train(ui_made / "recipe.yaml")
    said = [(e["event"], e.get("phase"), e.get("state")) for e in read_events(ui_made / "events.jsonl")]
    assert said == [("phase", "tokenize", "start"), ("error", None, None)]  # tokenizing began, and failed on the row


# --------------------------------------------------------------------------- a full disk
_FULL_DISK = textwrap.dedent('''
    """Run the finetuner CLI with one writer failing as it does on a full disk."""
    import errno, os, sys
    where = os.environ["FULL_AT"]
    if where == "torch.save":  # torch's zip writer: its own RuntimeError, raised while an OSError ENOSPC is handled
        import torch
        def save(*a, **k):
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 960 vs 0")
        torch.save = save
    elif where == "metrics.json":  # a write no caller guards: the CLI's last resort
        import finetuner.fileio as fileio
        real = fileio.atomic_write_text
        def write(path, text):
            if str(path).endswith("metrics.json"):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(path, text)
        fileio.atomic_write_text = write
    from finetuner.cli.main import main
    sys.exit(main(sys.argv[1:]))
''')


def _run_with_full_disk(where: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "200", "FULL_AT": where}
    return subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_the_run_resumes(recipe_dict, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", dict(recipe_dict, checkpointing={"save_every": 2, "keep_last": 2},
                                                    training=dict(recipe_dict["training"], max_steps=4)))
    run_dir = tmp_path / "run"
    r = _run_with_full_disk("torch.save", tmp_path, "run", str(recipe), "--quiet")
    _one_line_error(r, f"No space left on device while writing {run_dir / 'checkpoints' / '.tmp-step-00000002'} (", "free).")
    assert "Free at least " in r.stderr and f"resume with `finetuner run {run_dir / 'recipe.yaml'} -o {run_dir}`" in r.stderr
    assert list((run_dir / "checkpoints").iterdir()) == []  # the half-written checkpoint is gone: its space given back
    events = read_events(run_dir / "events.jsonl")
    assert events[-1]["event"] == "error" and events[-1]["message"].startswith("No space left on device")
    # the command the message gives finishes the run
    done = cli_in_process("run", str(run_dir / "recipe.yaml"), "-o", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stderr
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_a_full_disk_anywhere_else_is_still_one_line(recipe_dict, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", dict(recipe_dict, training=dict(recipe_dict["training"], max_steps=2)))
    r = _run_with_full_disk("metrics.json", tmp_path, "run", str(recipe), "--quiet")
    _one_line_error(r, f"No space left on device while writing {tmp_path / 'run' / 'metrics.json'}")
    assert "run the same command again" in r.stderr


def test_a_merge_onto_a_really_small_disk_is_one_line_before_anything_is_written(tmp_path, small_disk):
    """On a real 12 MiB file system: `finetuner merge` measures the disk before it writes (the merged weights and
    room for the rest), says so in one line, exit 2, and writes nothing; with room (-o elsewhere) it merges. The
    writer's own ENOSPC mid-write (the check passed, then the disk filled) is tests/export/test_faults.py's."""
    from tests.conftest import demo_run_folder

    run = demo_run_folder(tmp_path / "runs", adapter=True)
    out = small_disk / "merged"
    r = cli_in_process("merge", str(run), "-o", str(out))
    _one_line_error(r, f"Not enough free disk space for {out}: ", " free, the merged weights need ")
    assert "choose another output folder (-o)" in r.stderr
    assert sorted(p.name for p in small_disk.iterdir()) == []
    done = cli_in_process("merge", str(run), "-o", str(tmp_path / "merged"))
    assert done.returncode == 0, done.stderr


def test_disk_full_is_recognised_in_each_writers_words(tmp_path):
    import errno

    from safetensors import SafetensorError

    from finetuner.fileio import is_disk_full, size_text

    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, ... })"))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 960 vs 0")
    except RuntimeError as chained:
        assert is_disk_full(chained)
    assert not is_disk_full(RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 960 vs 0"), tmp_path)  # disk not full
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    # numpy's tofile (the gguf package's tensor writer) on a full disk: a short write, no errno; taken for a full
    # disk only where the disk has less free than the bytes it could not write (tests/export/test_faults.py)
    short = OSError("145024 requested and 132384 written")
    assert short.errno is None and not is_disk_full(short) and not is_disk_full(short, tmp_path)
    assert [size_text(n) for n in (0, 1000, 812 * 2**10, 3.4 * 2**20, 1.25 * 2**30, 250 * 2**30)] == [
        "0 bytes", "1000 bytes", "812 KiB", "3.40 MiB", "1.25 GiB", "250 GiB"]


def test_the_disk_space_check_says_a_size_that_means_something(recipe_dict, monkeypatch):
    from collections import namedtuple

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 300_000, 300_000))
    with pytest.raises(UserError, match=r"Not enough free disk space in .*: 293 KiB free, but 2 checkpoints of \d+\.\d+ MiB each") as e:
        finetuner.train(Recipe.from_dict(recipe_dict))
    assert "0.00 GiB" not in str(e.value)


# --------------------------------------------------------------------------- non-finite weights
def test_weights_that_became_nan_are_never_saved_and_the_run_resumes_from_the_last_good_checkpoint(recipe_dict, tmp_path, monkeypatch):
    import torch

    from finetuner.training import optimizer as optimizer_mod

    real = optimizer_mod.optimizer_step
    steps = []

    def poisoning_step(optimizer, *a, **k):  # step 2's update turns one LoRA weight into NaN (the loss of step 2 is finite)
        out = real(optimizer, *a, **k)
        steps.append(1)
        if len(steps) == 2:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(optimizer_mod, "optimizer_step", poisoning_step)
    d = dict(recipe_dict, checkpointing={"save_every": 1, "keep_last": 3})
    with pytest.raises(UserError, match=r"After step 2 the trained weights hold NaN or inf values \(.*lora_A.*\); nothing was saved "
                                        r"\(the run folder keeps its last good checkpoint \(step-00000001\)\)") as e:
        finetuner.train(Recipe.from_dict(d))
    assert e.value.hint.startswith("Likely cause: ")
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000001"]
    assert not (tmp_path / "run" / "adapter").exists()
    monkeypatch.setattr(optimizer_mod, "optimizer_step", real)
    res = finetuner.train(Recipe.from_dict(d))
    assert [ev for ev in read_events(tmp_path / "run" / "events.jsonl") if ev["event"] == "start"][-1]["resumed_from_step"] == 1
    assert res.metrics["steps"] == 8 and all(math.isfinite(x) for x in res.losses)


def test_a_checkpoint_with_nan_weights_from_before_is_skipped_on_resume(recipe_dict, tmp_path):
    from safetensors.torch import load_file, save_file

    stop = threading.Event()
    d = dict(recipe_dict, checkpointing={"save_every": 2, "keep_last": 3})
    finetuner.train(Recipe.from_dict(d), stop_event=stop,
                    callbacks=[lambda ev: ev["event"] == "step" and ev["step"] == 4 and stop.set()])
    weights = tmp_path / "run" / "checkpoints" / "step-00000004" / "adapter" / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors[next(iter(tensors))].fill_(float("inf"))
    save_file(tensors, weights)
    res = finetuner.train(Recipe.from_dict(d))
    events = read_events(tmp_path / "run" / "events.jsonl")
    invalid = [ev for ev in events if ev["event"] == "checkpoint_invalid"]
    assert "step-00000004" in invalid[0]["path"] and "hold NaN or inf values" in invalid[0]["reason"]
    assert [ev for ev in events if ev["event"] == "start"][-1]["resumed_from_step"] == 2
    assert res.metrics["steps"] == 8 and all(math.isfinite(x) for x in res.losses)


def test_a_loss_that_is_nan_from_the_first_step_names_the_base_model(recipe_dict, tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))  # a base model whose outputs are NaN
    model.save_pretrained(tmp_path / "nan-model")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "nan-model")
    recipe = write_recipe(tmp_path / "r.yaml", dict(recipe_dict, model={"name": str(tmp_path / "nan-model")}))
    r = cli_in_process("run", str(recipe), "--quiet")
    _one_line_error(r, "The loss became nan at step 1")
    assert "the loss is not finite at the first step, before any update: the base model's own outputs are" in r.stderr
    assert "training.lr" not in r.stderr  # not the learning rate: nothing was updated yet


def test_the_hint_names_a_very_high_learning_rate(recipe_dict, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", dict(recipe_dict, training=dict(
        recipe_dict["training"], lr=1e30, optimizer="sgd", max_grad_norm=None, max_steps=4)))
    r = cli_in_process("run", str(recipe), "--quiet")
    _one_line_error(r, "The loss became nan at step 2")
    assert "training.lr 1e+30 is very high for lora" in r.stderr and "gradient clipping is off" in r.stderr


def test_the_progress_line_prints_non_finite_numbers(capsys):
    from rich.console import Console

    from finetuner.cli.progress import ProgressPrinter

    printer = ProgressPrinter(Console(width=200))
    printer({"event": "step", "step": 1, "max_steps": 2, "loss": "inf", "lr": "inf", "tokens_per_s": 3.0, "eta_s": 1.0})
    printer({"event": "eval", "step": 1, "eval_loss": None, "eval_ppl": "inf"})
    out = capsys.readouterr().out
    assert "loss inf  lr inf" in out and "eval at step 1: loss nan, perplexity inf" in out


# --------------------------------------------------------------------------- the reference scores file
def test_a_planted_or_truncated_reference_file_is_recomputed_and_runs_no_code(tiny_model_dir, tmp_path, monkeypatch):
    import torch

    from tests.training.test_preference import pair_rows, pref_recipe

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in pair_rows()), encoding="utf-8")

    def recipe(name, steps):
        raw = pref_recipe(tiny_model_dir, pairs, tmp_path, name=name, max_steps=steps, scheduler="constant")  # lr not tied to max_steps
        raw["preference"] = {"reference": "precomputed"}
        return Recipe.from_dict(raw)

    whole = finetuner.train(recipe("whole", 4)).losses
    finetuner.train(recipe("cut", 2))
    ref = tmp_path / "cut" / "reference_logps.pt"
    marker = tmp_path / "code-ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"train": Planted(), "val": Planted()}, ref)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # the reproduction: torch's default turned off
    third = finetuner.train(recipe("cut", 3))
    assert not marker.exists()
    assert third.losses[-1] == pytest.approx(whole[2], abs=1e-5)  # the recomputed scores are the same
    ref.write_bytes(ref.read_bytes()[:50])  # truncated
    fourth = finetuner.train(recipe("cut", 4))
    assert fourth.losses[-1] == pytest.approx(whole[3], abs=1e-5)
    assert set(torch.load(ref, weights_only=True)) == {"train", "val"}  # written again, readable


# --------------------------------------------------------------------------- signals
def test_ctrl_c_while_workers_tokenize_stops_at_once_with_one_message(recipe_dict, tmp_path):
    """Ctrl-C in a terminal reaches the whole process group: the CLI and datasets' worker processes."""
    import random

    import psutil

    rng = random.Random(0)
    words = "the a hike bird sea rain sun pack water map boots trail tern gull wind cold warm".split()
    rows = [{"instruction": " ".join(rng.choices(words, k=20)), "output": " ".join(rng.choices(words, k=150))} for _ in range(12_000)]
    data = tmp_path / "big.json"
    data.write_text(json.dumps(rows), encoding="utf-8")
    cache = tmp_path / "cache"
    recipe = write_recipe(tmp_path / "r.yaml", dict(recipe_dict, data={"path": str(data), "max_seq_len": 256, "num_proc": 2}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "COLUMNS": "200", "FINETUNER_CACHE_DIR": str(cache)}
    proc = subprocess.Popen([sys.executable, "-m", "finetuner.cli.main", "run", str(recipe)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        parent = psutil.Process(proc.pid)
        while len(parent.children()) < 2 and proc.poll() is None:  # the pool's workers are up: tokenizing
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, (out, err)
    assert out.count("Stopped before the first training step: there is nothing to save.") == 1, out
    assert "Stopping after this step" not in out
    assert "Traceback" not in err and err.strip() == "aborted.", err
    assert not (tmp_path / "run").exists()  # nothing was saved, and no folder holding only the error is left
    assert not cache.exists() or not any(cache.rglob("meta.json"))  # tokenization did not run to its end


def test_the_stop_handler_of_a_forked_worker_leaves_the_decision_to_its_parent(recipe_dict, tmp_path):
    """A process forked by ``finetuner run`` ignores SIGINT (nothing printed, nothing stopped: the
    parent decides) and dies of SIGTERM (how a pool ends its workers), even blocked in a lock."""
    script = tmp_path / "fork.py"
    script.write_text(textwrap.dedent('''
        import os, signal, sys, time
        import finetuner.cli.main as cli
        import finetuner.training.run as run

        def train(recipe, callbacks, stop_event, **kw):
            pid = os.fork()
            if pid == 0:  # a worker: SIGINT is ignored, SIGTERM ends it
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
                print("worker alive", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            print("worker exit", os.waitstatus_to_exitcode(status), "stop set:", stop_event.is_set(), flush=True)
            sys.exit(0)

        run.train = train
        sys.exit(cli.main(sys.argv[1:]))
    '''), encoding="utf-8")
    r = _run_patched_cli(script, write_recipe(tmp_path / "r.yaml", recipe_dict))
    assert r.stdout.splitlines() == ["worker alive", "worker exit -15 stop set: False"], (r.stdout, r.stderr)  # killed by SIGTERM


def test_a_sigterm_that_reaches_a_worker_before_its_handlers_are_set_still_ends_it(recipe_dict, tmp_path):
    """A pool ends a worker its handler thread has just forked (a Ctrl-C's clean-up): the SIGTERM waits, blocked,
    until the worker's own handlers are set, and then ends it (the kernel's default, -15). Unblocked, it lands while
    the parent's handler is still the worker's and Python drops it (without the block this test's worker lives on
    and exits 0), leaving the pool to wait for that worker forever (seen in CI)."""
    script = tmp_path / "fork_early.py"
    script.write_text(textwrap.dedent('''
        import os, signal, sys, threading, time
        import finetuner.cli.main as cli
        import finetuner.training.run as run

        os.register_at_fork(after_in_child=lambda: time.sleep(0.5))  # runs first in the new worker: a slow start

        def train(recipe, callbacks, stop_event, **kw):
            exits = []

            def fork_and_end():  # as a pool's worker-handler thread forks a worker, and the pool then ends it
                pid = os.fork()
                if pid == 0:
                    time.sleep(5)
                    os._exit(0)
                os.kill(pid, signal.SIGTERM)
                exits.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

            t = threading.Thread(target=fork_and_end)
            t.start()
            t.join()
            print("worker exit", exits[0], flush=True)
            sys.exit(0)

        run.train = train
        sys.exit(cli.main(sys.argv[1:]))
    '''), encoding="utf-8")
    r = _run_patched_cli(script, write_recipe(tmp_path / "r.yaml", recipe_dict))
    assert r.stdout.splitlines() == ["worker exit -15"], (r.stdout, r.stderr)


def _run_patched_cli(script, recipe) -> subprocess.CompletedProcess:
    """``finetuner run RECIPE`` through ``script``, which patches the trainer before calling the CLI."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(script), "run", str(recipe)], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_a_ctrl_c_that_lands_in_a_finalizer_still_stops(recipe_dict, tmp_path):
    """Python drops an exception raised inside ``__del__``: the stop is raised again outside it,
    with no "Exception ignored" traceback (under load, datasets' pool hit this in about one run in two)."""
    script = tmp_path / "finalizer.py"
    script.write_text(textwrap.dedent('''
        import os, signal, sys, time
        import finetuner.cli.main as cli
        import finetuner.training.run as run

        class Finalized:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(10000):  # the handler runs here, inside the finalizer
                    pass

        def train(recipe, callbacks, stop_event, **kw):
            Finalized()  # collected at once
            for _ in range(200):
                time.sleep(0.05)
            print("not interrupted", flush=True)
            sys.exit(0)

        run.train = train
        sys.exit(cli.main(sys.argv[1:]))
    '''), encoding="utf-8")
    r = _run_patched_cli(script, write_recipe(tmp_path / "r.yaml", recipe_dict))
    assert r.returncode == 130, (r.stdout, r.stderr)
    assert r.stdout.count("Stopped before the first training step") == 1 and "not interrupted" not in r.stdout, r.stdout
    assert r.stderr.strip() == "aborted.", r.stderr

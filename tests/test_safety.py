"""Safe defaults: no remote code unless asked, safetensors only unless asked, no secrets in run
folders, and a web UI that listens on this machine only and never calls out."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port, run_cli, write_recipe, HANG_GUARD_S
from finetuner.errors import UserError
from finetuner.config.recipe import Recipe


def test_trust_remote_code_is_off_unless_the_recipe_says_so_and_then_warns(recipe_dict, caplog):
    from finetuner.model.loading import load_tokenizer

    assert Recipe.from_dict(recipe_dict).model.trust_remote_code is False
    assert Recipe.from_dict(recipe_dict).model.allow_pickle is False
    on = Recipe.from_dict({**recipe_dict, "model": {**recipe_dict["model"], "trust_remote_code": True}})
    with caplog.at_level(logging.WARNING, logger="finetuner.model.loading"):
        load_tokenizer(on)
    warned = [r.getMessage() for r in caplog.records if "trust_remote_code" in r.getMessage()]
    assert warned and recipe_dict["model"]["name"] in warned[0]


@pytest.fixture
def pickle_model_dir(tiny_model_dir, tmp_path) -> Path:
    """The tiny model with its weights as a pickle file (pytorch_model.bin) and no safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, out)
    for f in out.glob("*.safetensors*"):
        f.unlink()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def test_pickle_weights_are_refused_unless_allowed(recipe_dict, pickle_model_dir, caplog):
    from finetuner.model.loading import load_base_model
    from finetuner.config.runtime import resolve_runtime

    recipe = Recipe.from_dict({**recipe_dict, "model": {"name": str(pickle_model_dir)}})
    rt = resolve_runtime(recipe)
    with pytest.raises(UserError) as e:
        load_base_model(recipe, rt)
    assert str(pickle_model_dir) in e.value.message and "model.allow_pickle: true" in e.value.hint

    allowed = Recipe.from_dict({**recipe_dict, "model": {"name": str(pickle_model_dir), "allow_pickle": True}})
    with caplog.at_level(logging.WARNING, logger="finetuner.model.loading"):
        model = load_base_model(allowed, rt)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert any("allow_pickle" in r.getMessage() for r in caplog.records)


def test_pickle_refusal_from_the_cli_is_a_clear_error(recipe_dict, pickle_model_dir, tmp_path):
    r = write_recipe(tmp_path / "r.yaml", {**recipe_dict, "model": {"name": str(pickle_model_dir)}})
    res = run_cli("run", str(r))
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "allow_pickle" in res.stderr
    assert (pickle_model_dir / "pytorch_model.bin").is_file()  # the user's files are untouched


def test_hub_token_is_never_written_to_the_run_folder(recipe_dict, tmp_path):
    secret = "hf_finetunerTestSecret0123456789abcdef"
    recipe_dict["training"]["max_steps"] = 2
    recipe_dict["checkpointing"] = {"save_every": 1, "keep_last": 2}
    recipe_dict["logging"] = {"tensorboard": True, "every": 1}
    r = write_recipe(tmp_path / "r.yaml", recipe_dict)
    env = dict(os.environ, HF_TOKEN=secret, HUGGING_FACE_HUB_TOKEN=secret,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-m", "finetuner.cli.main", "run", str(r)], env=env, capture_output=True,
                         text=True, timeout=HANG_GUARD_S, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert secret not in res.stdout + res.stderr
    run_dir = Path(recipe_dict["output_dir"])
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert len(files) > 5  # recipe, events, checkpoints, adapter, metrics, tensorboard
    for p in files:
        assert secret.encode() not in p.read_bytes(), p


_NO_CALLS_OUT = textwrap.dedent(
    """
    import ipaddress, json, os, socket, sys, threading, time, urllib.request
    seen = []
    def _remote(host):
        try:
            return not ipaddress.ip_address(host).is_loopback and host != "0.0.0.0"
        except ValueError:
            return host not in ("localhost",)
    _connect, _gai, _bind = socket.socket.connect, socket.getaddrinfo, socket.socket.bind
    bound = []
    def bind(self, address):
        if isinstance(address, tuple):
            bound.append(address[0])
        return _bind(self, address)
    def connect(self, address):
        if isinstance(address, tuple) and _remote(address[0]):
            seen.append(f"connect {address[0]}:{address[1]}")
        return _connect(self, address)
    def getaddrinfo(host, *a, **k):
        if isinstance(host, (str, bytes)) and _remote(host.decode() if isinstance(host, bytes) else host):
            seen.append(f"resolve {host}")
        return _gai(host, *a, **k)
    socket.socket.connect, socket.getaddrinfo, socket.socket.bind = connect, getaddrinfo, bind
    port, runs, out = sys.argv[1], sys.argv[2], sys.argv[3]
    from finetuner.cli.main import main
    threading.Thread(target=main, args=(["ui", "--port", port, "--runs-dir", runs],), daemon=True).start()
    deadline = time.monotonic() + 1800  # the suite's hang guard (tests/conftest.py: HANG_GUARD_S)
    while time.monotonic() < deadline:
        try:
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60).read()
            break
        except OSError:
            time.sleep(0.2)
    time.sleep(3)  # anything gradio would send after start-up (version check, telemetry)
    json.dump({"seen": seen, "page": len(page), "bound": bound}, open(out, "w"))
    os._exit(0)
    """
)


def test_ui_listens_on_localhost_and_never_calls_out(tmp_path):
    port = free_port()
    script = tmp_path / "probe.py"
    script.write_text(_NO_CALLS_OUT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADIO_")}  # not even the user's setting
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out = tmp_path / "seen.json"
    res = subprocess.run([sys.executable, str(script), str(port), str(tmp_path / "runs"), str(out)],
                         env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    assert report["page"] > 0
    assert report["seen"] == [], report["seen"]
    # served on the loopback interface only (by default), so no other machine can reach it
    assert report["bound"] and set(report["bound"]) <= {"127.0.0.1"}, report["bound"]

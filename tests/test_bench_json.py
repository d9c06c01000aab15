"""scripts/bench/train.py writes its GPU figures as data (speed_<device>.json rows), checked on the
CPU through --smoke (a tiny model) into a temporary path: never into docs/. The longest-sequence rows
(``--max-seq``) come from the same functions that ``scripts/validate/gpu_all.py --smoke`` runs, whose rows
tests/test_gpu_all_smoke.py checks key by key: a second smoke run of them here cost a minute and a half of
CPU and showed nothing more (issue 34)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from scripts.bench import train as bench
from tests.conftest import HANG_GUARD_S, run_module

REPO = Path(__file__).resolve().parents[1]
SPEED_KEYS = ["config", "device", "finetuner_tokens_per_s", "baseline_tokens_per_s", "finetuner_peak_bytes",
              "baseline_peak_bytes", "mfu"]


def _bench(*args: str, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return run_module("scripts.bench.train", *args, cwd=REPO, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def docs_before():
    folder = REPO / "docs" / "validation"
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("speed_*.json")}


def _assert_docs_untouched(before):
    after = {p.name: p.stat().st_mtime_ns for p in (REPO / "docs" / "validation").glob("speed_*.json")}
    assert after == before


def test_smoke_gpu_mode_writes_throughput_rows_with_exactly_the_keys(tmp_path, docs_before):
    out = tmp_path / "speed.json"
    p = _bench("--gpu", "--smoke", "--methods", "lora", "--variants", "baseline,finetuner", "--reps", "1",
               "--steps", "3", "--warmup", "1", "--work", str(tmp_path / "work"), "--json", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert isinstance(rows, list) and len(rows) == 1
    row = rows[0]
    assert list(row) == SPEED_KEYS
    assert "tiny lora seq 256" in row["config"] and row["device"]
    for k in ("finetuner_tokens_per_s", "baseline_tokens_per_s"):
        assert isinstance(row[k], float) and row[k] > 0
    for k in ("finetuner_peak_bytes", "baseline_peak_bytes"):
        assert isinstance(row[k], int) and row[k] > 0
    assert row["mfu"] is None  # no card profile on the CPU: no peak to divide by
    _assert_docs_untouched(docs_before)


def test_json_without_a_gpu_mode_is_refused(tmp_path):
    p = _bench("--json", str(tmp_path / "x.json"))
    assert p.returncode != 0 and "--gpu or --max-seq" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "x.json").exists()


def test_rows_replace_the_same_config_and_device_and_keep_the_others(tmp_path):
    path = tmp_path / "s.json"
    a = dict.fromkeys(SPEED_KEYS, 1) | {"config": "a", "device": "h100"}
    b = dict(a, config="b")
    bench.write_speed_json(path, [a, b])
    bench.write_speed_json(path, [dict(a, mfu=0.5), dict(a, device="rtx4090")])
    rows = json.loads(path.read_text())
    assert [(r["config"], r["device"], r["mfu"]) for r in rows] == [("b", "h100", 1), ("a", "h100", 0.5), ("a", "rtx4090", 1)]
    path.write_text("{not json")
    with pytest.raises(SystemExit):
        bench.write_speed_json(path, [a])


def test_mfu_formula():
    assert bench.mfu(8_030_261_248, 3839.0, 989e12) == pytest.approx(6 * 8_030_261_248 * 3839 / 989e12)
    assert 0.18 < bench.mfu(8_030_261_248, 3839.0, 989e12) < 0.19  # the "about a fifth"
    assert bench.mfu(8e9, None, 989e12) is None and bench.mfu(8e9, 1000.0, None) is None


def test_default_path_is_docs_only_for_a_real_gpu_run():
    ns = argparse.Namespace(json=None, smoke=True)
    assert bench.speed_json_path(ns, cuda=True) is None
    assert bench.speed_json_path(argparse.Namespace(json=None, smoke=False), cuda=False) is None
    assert bench.speed_json_path(argparse.Namespace(json="x.json", smoke=True), cuda=False) == Path("x.json")
    assert bench.device_slug() == "cpu"  # this test machine has no CUDA device


def test_predicted_max_seq_is_the_planners_longest_sequence_for_the_capped_card():
    from dataclasses import replace

    from finetuner.config.hardware import get_gpu
    from finetuner.memory.model import CUDA_CONTEXT_BYTES
    from finetuner.planning.longest import longest_sequence

    spec = {"gradient_checkpointing": True, "optimizer": "paged_adamw_8bit"}
    got = bench.predicted_max_seq(Path("llama-3.1-8b"), spec, 24.0, True, "chunked_ce")
    card = replace(get_gpu("24GB"), memory_bytes=24 * 2**30 + CUDA_CONTEXT_BYTES)
    # the MLP as the run has it: whole unless the run tiles it (a prediction for a tiled MLP
    # against an untiled run once claimed 60 % more tokens than the run could reach)
    want = longest_sequence("llama-3.1-8b", card, "qlora4", margin=0.0, lora_dropout=0.0, gradient_checkpointing=True,
                            offload_activations=True, optimizer="paged_adamw_8bit", kernels="none", tiled_mlp=False)
    assert got == want.max_seq and want.candidate.offload_activations and not want.candidate.tiled_mlp
    assert bench.predicted_max_seq(Path("llama-3.1-8b"), spec, 24.0, False, "chunked_ce") < got
    tiled = bench.predicted_max_seq(Path("llama-3.1-8b"), spec, 24.0, True, "chunked_ce", tiled_mlp=True)
    want_tiled = longest_sequence("llama-3.1-8b", card, "qlora4", margin=0.0, lora_dropout=0.0, gradient_checkpointing=True,
                                  offload_activations=True, optimizer="paged_adamw_8bit", kernels="none", tiled_mlp=True)
    assert tiled == want_tiled.max_seq > got and want_tiled.candidate.tiled_mlp


def test_the_gpu_scripts_build_every_preset_shape():
    """The GPU validation and bench scripts build their random-weight models from the shipped presets
    (scripts.validate.train_gpu.preset_config): each gives the parameter count finetuner's shapes give."""
    import torch

    from finetuner.model.inventory import auto_class
    from finetuner.model.shapes import preset_names, resolve_shape
    from scripts.validate.train_gpu import preset_config

    for name in preset_names():
        cfg = preset_config(name)
        with torch.device("meta"):
            model = auto_class(cfg.model_type).from_config(cfg)  # an image-text preset: its image-text model
        assert sum(p.numel() for p in model.parameters()) == resolve_shape(name).num_params, name

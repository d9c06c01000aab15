"""scripts/validate/gpu_all.py, the one command for every owed GPU measurement, known to work
before a GPU is lent: ``--smoke`` runs every part on the CPU at toy size (the same functions, a
tiny model) into a temporary folder, and each part's JSON is checked here for its keys and sane
values; docs/ stays untouched. The rest (part selection, the device-call packing, the tables,
collecting a call's files) is checked without running anything."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from scripts.validate import gpu_all
from tests.conftest import HANG_GUARD_S, run_module


REPO = Path(__file__).resolve().parents[1]
SPEED_KEYS = ["config", "device", "finetuner_tokens_per_s", "baseline_tokens_per_s", "finetuner_peak_bytes",
              "baseline_peak_bytes", "mfu"]
LONG_KEYS = SPEED_KEYS + ["finetuner_max_seq", "baseline_max_seq", "predicted_max_seq"]
MEMORY_FILES = {"default-loss", "savers", "dpo", "fsdp", "moe", "gemma3", "linear-attention", "mamba-hybrid"}
WATCHED = [REPO / "docs" / name for name in ("planning.md", "compare.md", "memory.md", "benchmarks.md")]


def _cli(*args: str, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    return run_module("scripts.validate.gpu_all", *args, cwd=REPO, env=env, timeout=timeout)


def _stamps() -> dict[str, int]:
    files = [*WATCHED, *sorted((REPO / "docs" / "validation").iterdir())]
    return {str(p): p.stat().st_mtime_ns for p in files}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One ``--smoke`` run of every part (a few minutes on two busy cores)."""
    tmp = tmp_path_factory.mktemp("gpu_all")
    before = _stamps()
    p = _cli("--smoke", "--out", str(tmp / "out"), "--work", str(tmp / "work"), timeout=HANG_GUARD_S)
    return {"proc": p, "out": tmp / "out", "before": before, "after": _stamps()}


def test_smoke_runs_every_part_without_a_failure(smoke):
    p = smoke["proc"]
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    done = json.loads((smoke["out"] / "gpu_all_smoke_parts.json").read_text())
    assert [d["name"] for d in done] == [part.name for part in gpu_all.PARTS]
    assert [d["error"] for d in done] == [None] * len(gpu_all.PARTS)
    assert all(d["files"] for d in done), done


def test_smoke_memory_rows_are_in_the_validation_format(smoke):
    out = smoke["out"]
    assert {p.name for p in out.glob("validate_*.json")} == {f"validate_smoke-{t}.json" for t in MEMORY_FILES}
    rows = {}
    for tag in MEMORY_FILES:
        doc = json.loads((out / f"validate_smoke-{tag}.json").read_text())
        assert doc["device"] == "cpu" and doc["preset"] == "smoke" and doc["steps"] == 3
        assert doc["results"], tag
        for r in doc["results"]:
            assert "error" not in r, r
            assert r["measured_allocated_bytes"] > 0 and r["measured_reserved_bytes"] > 0, r
            assert r["predicted_allocated_bytes"] > 0 and r["predicted_reserved_bytes"] >= r["predicted_allocated_bytes"], r
            assert r["tokens_per_step"] > 0 and isinstance(r["error_allocated_pct"], float), r
            assert r["predicted_settings"]["platform"] == "cpu" and r["predicted_settings"]["fused_ce"] is False, r
            rows[r["config"]] = r
    # what each part is for reached the recipe the run trained
    assert rows["qlora-seq16384-gc-tiled-paged8"]["predicted_settings"]["tiled_mlp"] > 0
    assert rows["qlora-seq16384-gc-tiled-paged8"]["predicted_settings"]["method"] == "qlora"
    dpo = rows["dpo-lora-seq1024-gc-adamw"]
    assert dpo["predicted_settings"]["objective"] == "dpo" and dpo["predicted_settings"]["reference"] == "adapter_off"
    assert dpo["tokens_per_step"] == 2 * dpo["predicted_settings"]["seq_len"]  # both sequences of the pair, each full
    fsdp = rows["fsdp1-lora-seq2048-gc-adamw"]
    assert fsdp["distributed"] == {"strategy": "fsdp", "world_size": 1, "offload": "none"}
    assert rows["lora-seq2048-gc-adamw"]["overrides"][-1] == "training.kernels=none"
    # the families' part trained QLoRA of a tiny mixture of experts and of Gemma 3's language model
    for tag, family in (("moe", "olmoe"), ("gemma3", "gemma3")):
        row = json.loads((out / f"validate_smoke-{tag}.json").read_text())["results"][0]
        assert row["predicted_settings"]["method"] == "qlora" and row["predicted_settings"]["quant_bits"] == 4
        assert json.loads((out.parent / "work" / f"tiny-{'olmoe-1b-7b' if tag == 'moe' else 'gemma-3-4b'}"
                                       / "config.json").read_text())["model_type"] == family


def test_smoke_linear_attention_rows_keep_their_config_and_replay_on_it(smoke):
    """Part 10's models are transformers' default configs (no preset): each file keeps the config the run trained,
    and the replay re-predicts a row from it as from the model's own folder."""
    from scripts.validate.memory import recompute

    out = smoke["out"]
    for tag, model_type, method in (("linear-attention", "qwen3_5_text", "qlora"), ("mamba-hybrid", "falcon_h1", "lora")):
        doc = json.loads((out / f"validate_smoke-{tag}.json").read_text())
        folder = out.parent / "work" / f"tiny-{model_type}"
        assert doc["config"] == json.loads((folder / "config.json").read_text())
        assert doc["config"]["model_type"] == model_type
        (row,) = doc["results"]
        assert row["predicted_settings"]["method"] == method
        again = recompute(doc["preset"], row, doc["device"], doc["config"])
        assert again["predicted_allocated_bytes"] == recompute(str(folder), row, doc["device"])["predicted_allocated_bytes"] > 0
    assert "config" not in json.loads((out / "validate_smoke-moe.json").read_text())  # a preset's shape is its name's


def test_the_linear_attention_part_refuses_a_gpu_with_the_kernels(monkeypatch, tmp_path):
    """Its rows are for transformers' PyTorch path: on a CUDA machine where a kernel package imports (transformers
    would take it) the part stops before building anything, naming the package."""
    from finetuner.planning import scans

    monkeypatch.setattr(scans, "kernels_installed", lambda: {"flash-linear-attention": False, "mamba-ssm": True,
                                                              "causal-conv1d": False})
    ctx = gpu_all.Context(out=tmp_path / "out", work=tmp_path / "work", smoke=False, cuda=True)
    with pytest.raises(RuntimeError, match="mamba-ssm installed: .* PyTorch path"):
        gpu_all.memory_linear_attention(ctx)
    assert not (tmp_path / "work").exists()


def test_smoke_oom_backoff_recovered(smoke):
    r = json.loads((smoke["out"] / "oom_backoff_smoke.json").read_text())
    assert r["recovered"] is True and r["mode"].startswith("smoke")
    assert [(b["old_micro_batch_size"], b["micro_batch_size"]) for b in r["limited"]["backoffs"]] == [(4, 2), (2, 1)]
    assert r["reference"]["peak_allocated_bytes"] > 0


def test_smoke_speed_rows_have_the_keys_and_both_sides(smoke):
    rows = json.loads((smoke["out"] / "speed_cpu.json").read_text())
    speed = [r for r in rows if "finetuner_max_seq" not in r]
    long = [r for r in rows if "finetuner_max_seq" in r]
    assert len(speed) == 2 and len(long) == 1, rows
    assert any("planned" in r["config"] for r in speed) and any("qlora" in r["config"] for r in speed)
    for r in speed:
        assert list(r) == SPEED_KEYS
        assert r["finetuner_tokens_per_s"] > 0 and r["baseline_tokens_per_s"] > 0, r
        assert r["finetuner_peak_bytes"] > 0 and r["baseline_peak_bytes"] > 0, r
        assert r["mfu"] is None  # no card profile on the CPU
    (r,) = long
    assert list(r) == LONG_KEYS
    assert "tiled MLP" in r["config"] and "activation offload" in r["config"]
    for k in ("finetuner_max_seq", "baseline_max_seq", "predicted_max_seq"):
        assert isinstance(r[k], int) and r[k] >= 16, r
    assert r["finetuner_tokens_per_s"] > 0 and r["finetuner_peak_bytes"] > 0 and r["baseline_peak_bytes"] > 0, r


def test_smoke_writes_its_tables_and_leaves_docs_alone(smoke):
    assert smoke["after"] == smoke["before"]
    text = (smoke["out"] / "tables.md").read_text()
    assert "| smoke | dpo-lora-seq1024-gc-adamw |" in text and "finetuner longest" in text and "recovered" in text


def test_smoke_needs_an_out_folder_outside_docs_validation():
    p = _cli("--smoke")
    assert p.returncode == 2 and "--out" in p.stderr and "Traceback" not in p.stderr
    p = _cli("--smoke", "--out", str(REPO / "docs" / "validation" / "x"))
    assert p.returncode == 2 and "never go into docs/validation" in p.stderr and "Traceback" not in p.stderr
    assert not (REPO / "docs" / "validation" / "x").exists()


def test_parts_fit_the_device_calls():
    """Each part fits one 10-minute command (a session's device time holds some of them, run in order)."""
    assert all(p.minutes <= gpu_all.CALL_MINUTES for p in gpu_all.PARTS)
    groups = gpu_all.calls(gpu_all.PARTS)
    assert sorted(i for g in groups for i in g) == list(range(1, len(gpu_all.PARTS) + 1))
    assert all(sum(gpu_all.PARTS[i - 1].minutes for i in g) <= gpu_all.CALL_MINUTES for g in groups)
    listing = gpu_all.listing()
    assert all(f"| {p.name} |" in listing for p in gpu_all.PARTS)
    assert "--part " + ",".join(map(str, groups[0])) in listing


def test_parts_are_chosen_by_number_or_name():
    names = [p.name for p in gpu_all.select(["2,longest", "2"])]
    assert names == ["oom-backoff", "longest"]
    assert gpu_all.select(None) == gpu_all.PARTS
    with pytest.raises(SystemExit, match="no such part"):
        gpu_all.select(["99"])
    p = _cli("--part", "nope", "--smoke", "--out", "/tmp/x")
    assert p.returncode != 0 and "no such part" in p.stderr and "Traceback" not in p.stderr


def test_longest_search_finds_the_threshold_from_above_or_below():
    from scripts.bench.train import search_longest

    for threshold in (5000, 93000, 130000):
        for start in (4096, 90112, 98304):
            tried = []

            def fits(n, t=threshold):
                tried.append(n)
                return n <= t

            best, probes = search_longest(fits, start, 262144, 1024, 1.05)
            assert best <= threshold < best + 1024, (threshold, start, probes)
            assert all(n % 1024 == 0 for n in tried)


def test_benchmarks_gpu_section_is_made_from_docs_validation():
    import re

    text = (REPO / "docs" / "benchmarks.md").read_text()
    m = re.search(r"<!-- gpu-all:start -->\n(.*?)<!-- gpu-all:end -->", text, re.S)
    assert m and m.group(1) == gpu_all.gpu_section(gpu_all.VALIDATION), (
        "docs/benchmarks.md's GPU section is stale: run `python -m scripts.validate.gpu_all --tables`")


def test_readme_sentence_is_rewritten_from_the_replay():
    from scripts.validate.memory import replay

    text = (REPO / "docs" / "compare.md").read_text()
    rows = replay()
    assert gpu_all.readme_sentence(text, rows) == text  # the page states the replay today
    worse = [dict(r, error_allocated_pct=-1.0 if i == 0 else abs(r["error_allocated_pct"])) for i, r in enumerate(rows)]
    new = gpu_all.readme_sentence(text, worse)
    assert "(largest" in new and "one run 1.0 % under)" in " ".join(new.split())
    h100 = [dict(r, device="NVIDIA H100 80GB HBM3") for r in rows]
    assert "models on an H100 (" in " ".join(gpu_all.readme_sentence(text, h100).split())
    assert gpu_all.devices([*h100, dict(rows[0], device="NVIDIA H200"), dict(rows[0], device="NVIDIA A100-SXM4-80GB")]) == (
        "an A100 and an H100 and an H200")
    plain = [r for r in rows if r["predicted_settings"]["seq_len"] in (512, 2048) and not r["predicted_settings"].get("activation_offload")
             and not r["predicted_settings"].get("tiled_mlp") and r["predicted_settings"].get("objective", "sft") == "sft"
             and not r.get("distributed")]
    assert gpu_all.coverage(plain) == "LoRA and QLoRA, 512 and 2,048 tokens, with and without checkpointing"
    extra = dict(rows[0], predicted_settings={**rows[0]["predicted_settings"], "seq_len": 16384, "objective": "dpo", "tiled_mlp": 2048},
                 distributed={"strategy": "fsdp", "world_size": 1, "offload": "none"})
    assert gpu_all.coverage([*plain, extra]) == ("LoRA and QLoRA, 512 to 16,384 tokens, with and without checkpointing, "
                                                 "the tiled MLP, DPO, fsdp")


def _speed_row(config, device, tps):
    return {"config": config, "device": device, "finetuner_tokens_per_s": tps, "baseline_tokens_per_s": 1.0,
            "finetuner_peak_bytes": 1, "baseline_peak_bytes": 1, "mfu": None}


def test_collect_merges_a_device_calls_files(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.mkdir()
    dest.mkdir()
    (dest / "speed_h100-80gb.json").write_text(json.dumps([_speed_row("a", "H100", 1.0), _speed_row("b", "H100", 2.0)]))
    (src / "speed_h100-80gb.json").write_text(json.dumps([_speed_row("a", "H100", 3.0)]))
    (dest / "validate_llama-3.1-8b-savers.json").write_text(json.dumps(
        {"device": "H100", "preset": "llama-3.1-8b", "steps": 3, "results": [{"config": "x", "v": 1}, {"config": "y", "v": 1}]}))
    (src / "validate_llama-3.1-8b-savers.json").write_text(json.dumps(
        {"device": "H100", "preset": "llama-3.1-8b", "steps": 3,
         "results": [{"config": "x", "v": 2}, {"config": "z", "error": "CUDA out of memory"}]}))
    (src / "oom_backoff.json").write_text(json.dumps({"recovered": True}))
    (src / "gpu_all_parts.json").write_text("[]")
    written = gpu_all.collect(src, dest)
    assert sorted(p.name for p in written) == ["oom_backoff.json", "speed_h100-80gb.json", "validate_llama-3.1-8b-savers.json"]
    speed = json.loads((dest / "speed_h100-80gb.json").read_text())
    assert [(r["config"], r["finetuner_tokens_per_s"]) for r in speed] == [("b", 2.0), ("a", 3.0)]
    mem = json.loads((dest / "validate_llama-3.1-8b-savers.json").read_text())["results"]
    assert mem == [{"config": "y", "v": 1}, {"config": "x", "v": 2}]  # the failed row is left out
    assert not (dest / "gpu_all_parts.json").exists()
    (src / "validate_smoke-dpo.json").write_text("{}")
    with pytest.raises(SystemExit, match="smoke"):
        gpu_all.collect(src, dest)


def test_without_work_and_cache_folders_gpu_all_makes_private_ones_of_fresh_names(monkeypatch):
    """Issue 66: the device command used fixed names (``FINETUNER_CACHE_DIR=/tmp/ftcache``, ``--work /tmp/gpu_all``)
    that another user of the machine could make first and fill. Now each call makes its own with ``mkdtemp``: mode
    0700, a fresh name, this user's; the commands in its docstring and docs/benchmarks.md name no fixed /tmp folder."""
    import stat
    import tempfile

    monkeypatch.delenv("FINETUNER_CACHE_DIR", raising=False)
    work, cache = gpu_all.private_dirs()
    monkeypatch.delenv("FINETUNER_CACHE_DIR", raising=False)
    work2, cache2 = gpu_all.private_dirs()
    assert len({work, cache, work2, cache2}) == 4
    for d in (work, cache, work2, cache2):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert d.parent == Path(tempfile.gettempdir())
    assert os.environ["FINETUNER_CACHE_DIR"] == str(cache2)
    monkeypatch.setenv("FINETUNER_CACHE_DIR", "/somewhere/of/mine")
    assert gpu_all.private_dirs()[1] == Path("/somewhere/of/mine")  # a cache folder the user names is kept
    bench = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    for text in (gpu_all.__doc__, bench):
        assert "/tmp/ftcache" not in text and "/tmp/gpu_all" not in text and "--target /tmp/" not in text

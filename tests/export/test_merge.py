"""finetuner merge: a plain transformers folder that matches the adapter; QLoRA onto a full-precision base; bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import finetuner
from finetuner.export.merge import merge_adapter, parse_size, saved_dtype
from finetuner.config.recipe import Recipe
from finetuner.fileio import file_mode
from tests.conftest import alpaca_rows, cli_in_process, run_cli

REPO = Path(__file__).resolve().parents[2]


def _train(tmp_path_factory, tiny_model_dir, name, overrides=()):
    data = tmp_path_factory.mktemp(f"{name}-data") / "alpaca.json"
    data.write_text(json.dumps(alpaca_rows(24)), encoding="utf-8")
    recipe = {
        "name": name,
        "model": {"name": str(tiny_model_dir)},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 64},
        "training": {"max_steps": 3, "lr": 2e-2, "micro_batch_size": 4, "warmup_steps": 0},
        "checkpointing": {"save_every": 3},
        "logging": {"tensorboard": False},
        "output_dir": str(tmp_path_factory.mktemp(name) / "run"),
    }
    return finetuner.train(Recipe.from_dict(recipe, list(overrides))).run_dir


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir):
    return _train(tmp_path_factory, tiny_model_dir, "lora")


def _probe():
    import torch

    return torch.tensor([[5, 17, 42, 99, 150, 7, 230, 12]])


def test_merged_folder_loads_with_plain_transformers_and_matches_the_adapter(lora_run, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    r = merge_adapter(lora_run, out, dtype="fp32", shard_size="100KB")
    assert r.max_abs_diff is not None and r.max_abs_diff < 1e-4 and r.top1_agreement == 1.0
    assert r.adapter_effect > 100 * r.max_abs_diff  # the check compares something the adapter changes
    assert r.shards > 1 and (out / "model.safetensors.index.json").is_file()
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja", "finetuner_merge.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt"))]
    assert not list(tmp_path.glob(".merged.tmp-*"))
    # every file with the umask's mode, the weights too (transformers writes its safetensors 0600), and the
    # run's own files alike: the adapter's weights and what finetuner writes atomically (recipe, metrics)
    mode = file_mode()
    written = [*out.iterdir(), *(lora_run / "adapter").iterdir(), lora_run / "recipe.yaml", lora_run / "metrics.json"]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {p.name: oct(mode) for p in written}

    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_run / "adapter").eval()
    with torch.no_grad():
        a, b = merged(input_ids=_probe()).logits, tuned(input_ids=_probe()).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    tok = AutoTokenizer.from_pretrained(out)
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_qlora_run_merges_onto_the_full_precision_base(tmp_path_factory, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = _train(tmp_path_factory, tiny_model_dir, "qlora", ["method=qlora", "quantization.compute_dtype=fp32"])
    out = tmp_path / "merged"
    r = merge_adapter(run, out, dtype="fp32")
    assert r.max_abs_diff < 1e-4 and any("4-bit" in n for n in r.notes)

    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert all(type(m).__name__ != "Linear4bit" for m in merged.modules())
    lora = load_file(run / "adapter" / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = lora[f"{key}.lora_A.weight"], lora[f"{key}.lora_B.weight"]
    want = base.model.layers[0].self_attn.q_proj.weight + (b @ a) * (16 / 8)  # W + B·A·alpha/r, unquantized W
    assert torch.allclose(merged.model.layers[0].self_attn.q_proj.weight, want, atol=1e-6)


def test_the_default_merge_keeps_an_fp32_base_in_fp32_and_matches_the_adapter(lora_run, tiny_model_dir, tmp_path):
    """``dtype="auto"`` (the default) merges in the dtype the base was saved in: an fp32 base
    (the tiny test model, and the demo model) gives an fp32 model whose logits are the adapter's
    to fp32 rounding; a bf16 merge of the same run (the old default) is far outside that."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert saved_dtype(tiny_model_dir) == "fp32" and saved_dtype(REPO / "data" / "demo_model") == "fp32"
    r = merge_adapter(lora_run, tmp_path / "auto")
    cfg = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert r.dtype == "fp32" and cfg.get("dtype", cfg.get("torch_dtype")) == "float32"

    def logits(model) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=_probe()).logits.double()  # differences taken in float64: no rounding of their own

    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                        lora_run / "adapter").eval()
    want = logits(adapter)
    # The two fp32 forward passes differ only by rounding: the merged weight W + B·A·s is rounded
    # once (relative error 2**-24 ~ 6e-8), and W·x + B·(A·x)·s is summed in another order than
    # (W + B·A·s)·x; over dot products of at most 384 terms (the MLP), a few layers and the LM head
    # that stays within ~1e-5 of the logits' scale (measured here: 3e-7). 1e-4 of the scale leaves
    # room for that, and is far below what rounding the weights to bf16 (2**-8 ~ 4e-3 relative)
    # does to these logits (measured: 1.8e-3): the bf16 merge below must fall outside it.
    tol = 1e-4 * max(1.0, float(want.abs().max()))
    diff = float((logits(AutoModelForCausalLM.from_pretrained(tmp_path / "auto")) - want).abs().max())
    assert diff <= tol, (diff, tol)
    assert r.adapter_effect > 100 * tol  # the adapter moves the logits far more than the tolerance

    merge_adapter(lora_run, tmp_path / "bf16", dtype="bf16")
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)  # bf16 weights, fp32 maths
    assert float((logits(bf16) - want).abs().max()) > 10 * tol


def test_bf16_merge_from_the_cli_and_refusing_a_non_empty_folder(lora_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (tmp_path / "beside.txt").write_text("also mine")
    p = cli_in_process("merge", str(lora_run), "-o", str(out))
    assert p.returncode == 2 and "not empty" in p.stderr and "empty that folder yourself" in p.stderr
    assert f"→ {out} (auto) ..." in p.stderr  # the default: the base's own dtype
    assert (out / "notes.txt").read_text() == "mine"

    p = cli_in_process("merge", str(lora_run), "-o", str(out), "--overwrite", "--dtype", "bf16")
    assert p.returncode == 2 and "no finetuner merge or export wrote" in p.stderr  # overwrite replaces only an export
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert cli_in_process("merge", str(lora_run), "-o", str(out)).returncode == 0  # an empty folder: no overwrite needed

    p = run_cli("merge", str(lora_run), "-o", str(out), "--overwrite", "--dtype", "bf16")  # a process: its output is all there
    assert p.returncode == 0, p.stderr
    assert "max |logit difference|" in p.stdout and "peak RAM" in p.stdout
    # nothing but finetuner's own lines: no library warnings (DeepSpeed's "Setting accelerator to CPU"
    # when accelerate imports it on a machine without a GPU), no progress bars
    assert p.stdout.startswith(f"merged model: {out}\n"), p.stdout
    assert p.stderr.splitlines() == [f"Merging {lora_run} → {out} (bf16) ..."], p.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert (tmp_path / "beside.txt").read_text() == "also mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beside.txt", "out"]  # no temporary folders left

    other_run = tmp_path / "other-run"
    other_run.mkdir()
    (other_run / "recipe.yaml").write_text("name: x\n")
    with pytest.raises(finetuner.UserError, match="holds a finetuner run"):
        merge_adapter(lora_run, other_run, overwrite=True)
    with pytest.raises(finetuner.UserError, match="holds the model being merged"):
        merge_adapter(lora_run, lora_run, overwrite=True)


def test_a_run_with_no_adapter_and_a_missing_base_are_clear_errors(lora_run, tiny_model_dir, tmp_path):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(lora_run / "recipe.yaml", unfinished / "recipe.yaml")
    shutil.copytree(lora_run / "checkpoints", unfinished / "checkpoints")
    p = cli_in_process("merge", str(unfinished), "-o", str(tmp_path / "m"))
    assert p.returncode == 2 and "has no adapter/ folder" in p.stderr and "step-00000003" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "m").exists()

    adapter = tmp_path / "adapter"
    shutil.copytree(lora_run / "adapter", adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(finetuner.UserError, match="base_model_name_or_path.*does not exist") as e:
        merge_adapter(adapter, tmp_path / "m")
    assert "--base" in e.value.hint
    with pytest.raises(finetuner.UserError, match="nothing to merge"):
        merge_adapter(tiny_model_dir, tmp_path / "m")


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100KB") == 100_000
    assert parse_size(123) == 123
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(finetuner.UserError, match="not a size"):
            parse_size(bad)

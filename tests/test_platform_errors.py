"""Failures of the platform rather than the recipe get a clear word too: bitsandbytes that cannot
be imported (macOS, an unsupported GPU, a broken install), a gated model without a token."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, write_recipe, HANG_GUARD_S

from finetuner.errors import UserError
from finetuner.config.recipe import Recipe


@pytest.fixture
def no_bitsandbytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError


def test_qlora_without_bitsandbytes_names_the_key_and_the_way_out(recipe_dict, no_bitsandbytes):
    from finetuner.model.loading import load_base_model
    from finetuner.config.runtime import resolve_runtime

    recipe = Recipe.from_dict({**recipe_dict, "method": "qlora"})
    with pytest.raises(UserError) as e:
        load_base_model(recipe, resolve_runtime(recipe))
    assert "quantization.bits: 4 (method qlora) needs bitsandbytes" in e.value.message
    assert "method: lora" in e.value.hint


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
def test_8bit_optimizers_without_bitsandbytes(recipe_dict, no_bitsandbytes, optimizer):
    import torch

    from finetuner.training.optimizer import build_optimizer

    recipe = Recipe.from_dict({**recipe_dict, "training": {**recipe_dict["training"], "optimizer": optimizer}})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match=rf"training.optimizer: {optimizer} needs bitsandbytes"):
        build_optimizer(model, recipe.training, on_cuda=False)


def test_qlora_with_a_broken_bitsandbytes_from_the_cli(recipe_dict, tmp_path):
    """A bitsandbytes whose native library does not load (as on an unsupported platform)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "bitsandbytes.py").write_text("raise OSError('libbitsandbytes_cpu.so: cannot open shared object file')\n")
    r = write_recipe(tmp_path / "r.yaml", {**recipe_dict, "method": "qlora"})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), str(REPO)]))
    res = subprocess.run([sys.executable, "-m", "finetuner.cli.main", "run", str(r)], env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "needs bitsandbytes" in res.stderr and "libbitsandbytes_cpu.so" in res.stderr


def test_gated_model_errors_say_how_to_log_in(recipe_dict, monkeypatch):
    import transformers

    from finetuner.model.loading import load_tokenizer

    def refuse(*_a, **_k):
        raise OSError("You are trying to access a gated repo. 401 Client Error: Unauthorized for url: "
                      "https://huggingface.co/meta-llama/Llama-2-7b-hf/resolve/main/config.json")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    recipe = Recipe.from_dict(recipe_dict)
    with pytest.raises(UserError) as e:
        load_tokenizer(recipe)
    assert "hf auth login" in e.value.hint and "HF_TOKEN" in e.value.hint

"""objective neftune (finetuner/objectives/specs/neftune.py, the whole objective): SFT with NEFTune's noise on the input embeddings, the noise
transformers' own hook draws, in training mode only; trained and planned through the CLI like any objective."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, cli_in_process, write_recipe

DEMO = REPO / "data" / "demo_model"


def _recipe(tmp_path, name: str, **top) -> dict:
    return {
        "name": name, "model": {"name": str(DEMO)}, "method": "lora",
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(REPO / "data" / "alpaca_sample.json"), "max_seq_len": 64, "val_size": 4},
        "training": {"max_steps": 2, "lr": 1e-2, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0,
                     "eval_every": 2, "seed": 3, "general_probe": 0},
        "logging": {"tensorboard": False}, "output_dir": str(tmp_path / name), "device": "cpu", **top,
    }


@pytest.fixture
def demo_lora():
    """The demo model with a LoRA adapter on, as the trainer hands it to the objective (no dropout anywhere)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    return get_peft_model(AutoModelForCausalLM.from_pretrained(DEMO), LoraConfig(r=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def _logits(model, ids, seed: int):
    import torch

    torch.manual_seed(seed)
    return model(input_ids=ids).logits


def test_the_noise_is_what_transformers_neftune_hook_draws_and_none_in_eval_mode(demo_lora):
    """The hook NEFTune's description puts on the model when SFT's trainer has loaded it (alpha from the recipe) gives, from the same generator state, the logits
    transformers' activate_neftune gives (equal tensors); in eval mode the logits of the model without any hook."""
    import torch
    from transformers.integrations.neftune import activate_neftune

    from finetuner.config.recipe import Recipe
    from finetuner.objectives import build_objective

    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    model = demo_lora
    model.eval()
    plain_eval = _logits(model, ids, 0)
    model.train()
    plain = _logits(model, ids, 0)
    reference = activate_neftune(model, 7.5)
    theirs = _logits(model, ids, 0)
    reference.remove()

    recipe = Recipe.from_dict({"model": {"name": str(DEMO)}, "data": {"path": str(REPO / "data" / "alpaca_sample.json")},
                               "objective": "neftune", "neftune": {"alpha": 7.5}})
    objective = build_objective(recipe)
    assert type(objective).__name__ == "SFTObjective"
    objective.model_loaded(model)
    embeddings = model.get_input_embeddings()
    ours = _logits(model, ids, 0)
    assert torch.equal(ours, theirs) and not torch.allclose(ours, plain)
    # the noise itself: within alpha / sqrt(L x d) of the embeddings, and drawn anew each forward
    torch.manual_seed(1)
    noisy = embeddings(ids)
    bound = 7.5 / (ids.shape[1] * noisy.shape[2]) ** 0.5
    assert 0 < (noisy - embeddings.weight[ids]).abs().max() <= bound
    assert not torch.equal(noisy, embeddings(ids))
    model.eval()
    assert torch.equal(_logits(model, ids, 5), plain_eval)
    assert torch.equal(embeddings(ids), embeddings.weight[ids])


def test_without_a_neftune_section_alpha_is_the_papers_5_and_the_section_belongs_to_neftune(tmp_path):
    from finetuner.config.recipe import Recipe
    from finetuner.errors import UserError

    base = {"model": {"name": str(DEMO)}, "data": {"path": str(REPO / "data" / "alpaca_sample.json")}}
    r = Recipe.from_dict({**base, "objective": "neftune"})
    assert r.neftune is None and "neftune" not in r.to_dict()
    from finetuner.objectives.specs.neftune import NEFTuneSection

    assert NEFTuneSection().alpha == 5.0
    with pytest.raises(UserError, match=r"neftune: set, but objective is 'sft': set objective to neftune, or remove the neftune section"):
        Recipe.from_dict({**base, "neftune": {"alpha": 5}})
    with pytest.raises(UserError, match=r"neftune\.alpha"):
        Recipe.from_dict({**base, "objective": "neftune", "neftune": {"alpha": 0}})


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()]


def test_two_steps_through_the_cli_train_with_noise_and_evaluate_without(tmp_path):
    """`finetuner run` of a neftune recipe on the demo model: its first step's loss is not SFT's (the same seed,
    data and adapter: only the noise differs), and `finetuner plan` plans it as SFT, called NEFTune."""
    runs = {}
    for name, top in (("neftune", {"objective": "neftune", "neftune": {"alpha": 5}}), ("sft", {})):
        out = cli_in_process("run", str(write_recipe(tmp_path / f"{name}.yaml", _recipe(tmp_path, name, **top))), "--quiet")
        assert out.returncode == 0, out.stderr
        runs[name] = _events(tmp_path / name)
    start = next(e for e in runs["neftune"] if e["event"] == "start")
    assert start["objective"] == "neftune"
    steps = {n: [e["loss"] for e in ev if e["event"] == "step"] for n, ev in runs.items()}
    assert len(steps["neftune"]) == 2 and steps["neftune"][0] != steps["sft"][0]
    assert (tmp_path / "neftune" / "adapter" / "adapter_model.safetensors").exists()
    assert [e for e in runs["neftune"] if e["event"] == "eval"]

    plan = cli_in_process("plan", "--model", str(DEMO), "--data", str(REPO / "data" / "alpaca_sample.json"),
                          "--objective", "neftune", "--gpu", "cpu", "-o", str(tmp_path / "plan.yaml"), cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "Plan: NEFTune with LORA" in plan.stdout
    assert "objective: neftune" in (tmp_path / "plan.yaml").read_text(encoding="utf-8")

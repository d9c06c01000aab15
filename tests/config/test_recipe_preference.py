"""The recipe's ``objective`` and ``preference`` section: defaults, and errors that name the key."""

from __future__ import annotations

import pytest

from finetuner.config.recipe import Recipe
from finetuner.errors import UserError

BASE = {"model": {"name": "org/model"}, "data": {"path": "org/dataset"}}


def err(overrides) -> str:
    with pytest.raises(UserError) as e:
        Recipe.from_dict(BASE, overrides=overrides)
    return str(e.value)


def test_sft_is_the_default_and_each_objective_has_its_beta():
    r = Recipe.from_dict(BASE)
    assert r.objective == "sft" and r.preference.reference == "adapter_off"
    assert Recipe.from_dict(BASE, ["objective=dpo"]).preference.beta_for("dpo") == 0.1
    assert Recipe.from_dict(BASE, ["objective=simpo"]).preference.beta_for("simpo") == 2.0
    assert Recipe.from_dict(BASE, ["objective=dpo", "preference.beta=0.3"]).preference.beta_for("dpo") == 0.3


@pytest.mark.parametrize("overrides, expected", [
    (["objective=dop"], "objective: invalid value 'dop'. Did you mean 'dpo'? Valid choices: sft, neftune, dpo, orpo, simpo, kto, grpo."),
    (["preference.beta=0.2"], "preference.beta: set, but objective is 'sft': set objective to dpo, orpo, simpo or kto"),
    (["objective=dpo", "preference.gamma=0.5"], "preference.gamma: applies to simpo, not to objective 'dpo'"),
    (["objective=simpo", "preference.reference=precomputed"], "preference.reference: applies to dpo, kto, not to objective 'simpo'"),
    (["objective=orpo", "preference.desirable_weight=2"], "preference.desirable_weight: applies to kto"),
    (["objective=dpo", "preference.loss_type=ipo", "preference.label_smoothing=0.1"], "preference.label_smoothing: applies to loss_type sigmoid"),
    (["objective=dpo", "preference.label_smoothing=0.5"], "preference.label_smoothing: must be a number ≥ 0 and < 0.5; got 0.5."),
    (["objective=dpo", "preference.loss_type=hinge"], "preference.loss_type: invalid value 'hinge'. Valid choices: sigmoid, ipo."),
    (["objective=simpo", "preference.beta=0"], "preference.beta: must be a number > 0; got 0."),
    (["objective=dpo", "preference.reference=adapter_off", "method=full"], "no adapter to switch off; set reference: precomputed"),
    (["objective=dpo", "preference.start_from=x", "method=full"], "preference.start_from: starts from a LoRA run's adapter"),
    (["objective=dpo", "data.packing=true"], "data.packing: objective 'dpo' scores each response as a whole sequence"),
    (["objective=kto", "data.train_on_prompt=true"], "data.train_on_prompt: objective 'kto' scores only the responses"),
    (["pref_beta=0.1"], "pref_beta: unknown key. Did you mean 'preference.beta'?"),
    (["preference.simpo_gamma=1"], "preference.simpo_gamma: unknown key. Did you mean 'gamma'?"),
    (["rl=dpo"], "rl: unknown key. Did you mean 'objective'?"),
])
def test_errors_name_the_key(overrides, expected):
    assert expected in err(overrides)


def test_full_fine_tune_scores_the_reference_once():
    r = Recipe.from_dict(BASE, ["objective=dpo", "method=full"])
    assert r.preference.reference == "precomputed"
    assert Recipe.from_dict(r.to_dict()).preference.reference == "precomputed"  # the saved recipe reads back


def test_a_saved_sft_recipe_reads_back():
    """A run folder's recipe.yaml holds every key of the preference section, at its default."""
    r = Recipe.from_dict(BASE)
    assert Recipe.from_dict(r.to_dict()).objective == "sft"


def test_start_from_names_a_finished_run(tmp_path):
    (tmp_path / "sft" / "adapter").mkdir(parents=True)
    (tmp_path / "unfinished").mkdir()
    r = Recipe.from_dict(BASE, ["objective=dpo", "preference.start_from=sft"], base_dir=tmp_path)
    assert r.preference.start_from == str(tmp_path / "sft") and r.preference.reference == "precomputed"
    with pytest.raises(UserError, match="holds no adapter/ folder"):
        Recipe.from_dict(BASE, ["objective=dpo", "preference.start_from=unfinished"], base_dir=tmp_path)
    with pytest.raises(UserError, match="preference.start_from: 'missing' does not exist"):
        Recipe.from_dict(BASE, ["objective=dpo", "preference.start_from=missing"], base_dir=tmp_path)
    with pytest.raises(UserError, match="would give the base model, not the SFT model"):
        Recipe.from_dict(BASE, ["objective=dpo", "preference.start_from=sft", "preference.reference=adapter_off"], base_dir=tmp_path)

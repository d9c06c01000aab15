"""The objectives' descriptions (finetuner.objectives.specs): read without torch and without the recipe, one per
objective the trainer builds, and the recipe's schema takes its names and preference settings from them."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_descriptions_import_without_torch_or_the_recipe():
    code = ("import sys, finetuner.objectives.specs as s; "
            "print(sorted(m for m in ('torch', 'finetuner.config.recipe', 'finetuner.config.sections') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(REPO), "PATH": ""}, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_every_described_objective_has_a_trainer_and_the_recipe_accepts_exactly_those():
    from typing import get_args

    from finetuner.config.sections import Objective, PreferenceSection
    from finetuner.objectives import build_objective  # noqa: F401 - the package stays importable
    from finetuner.objectives import grpo, preference, sft  # noqa: F401 - register the trainers
    from finetuner.objectives.base import REGISTRY
    from finetuner.objectives.specs import SPECS

    assert set(SPECS) == set(REGISTRY) == set(get_args(Objective))
    for name, spec in SPECS.items():
        assert spec.name == name
        if spec.section != "preference":  # (the preference trainer takes its kind per objective, when built)
            assert REGISTRY[name].data_kind == spec.data_kind
        for key in spec.settings:
            assert name in PreferenceSection.APPLIES_TO[key]
    assert {n for n, s in SPECS.items() if s.default_beta is not None} == set(PreferenceSection.DEFAULT_BETA)

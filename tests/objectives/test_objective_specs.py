"""The objectives' descriptions (finetuner.objectives.specs): read without torch and without the recipe, one per
objective the trainer builds, and the recipe's schema takes its names and preference settings from them."""

from __future__ import annotations

import re
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

    from finetuner.config.recipe import Recipe
    from finetuner.config.sections import Objective
    from finetuner.objectives import trainers
    from finetuner.objectives.specs import SPECS
    from finetuner.objectives.specs.preference import PreferenceSection

    REGISTRY = trainers()

    # every objective has a trainer of its own, or is a variant (NEFTune) that trains with its variant_of's and
    # changes the model through its description's hook; nothing is registered that is not described
    assert set(SPECS) == set(get_args(Objective)) and set(REGISTRY) <= set(SPECS)
    assert {n for n in SPECS if n not in REGISTRY} == {"neftune"}
    for name, spec in SPECS.items():
        assert spec.name == name
        trainer = REGISTRY.get(name) or REGISTRY[spec.variant_of]
        assert name in REGISTRY or spec.on_model is not None
        if spec.section != "preference":  # (the preference trainer takes its kind per objective, when built)
            assert trainer.data_kind == spec.data_kind
        if spec.section is not None:  # its section is a recipe section that holds its settings
            field = Recipe.model_fields[spec.section]
            schema = next(a for a in (field.annotation, *get_args(field.annotation)) if hasattr(a, "model_fields"))
            assert set(spec.settings) <= set(schema.model_fields)
        for key in spec.settings if spec.section == "preference" else ():
            assert name in PreferenceSection.APPLIES_TO[key]
    assert {n for n, s in SPECS.items() if s.default_beta is not None} == set(PreferenceSection.DEFAULT_BETA)


def test_the_worked_example_of_docs_extending(monkeypatch):
    """The description docs/extending.md gives, put in the registry, is what sizing, the memory and speed models
    and the plan's words read: no other module names it."""
    from finetuner.memory.model import Settings, preference_cost
    from finetuner.model.shapes import resolve_shape
    from finetuner.objectives import specs
    from finetuner.objectives.specs.preference import LEARNING_RATES, MAX_EPOCHS
    from finetuner.planning.sizing import learning_rate, replay_share, size_run
    from finetuner.planning.speed import has_reference_pass, rows_per_micro_batch

    text = (REPO / "docs" / "extending.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(block, scope)
    cpo = scope["CPO"]
    monkeypatch.setitem(specs.SPECS, "cpo", cpo)

    shape = resolve_shape("llama-3.1-8b")  # a preset: hidden size 4096, the learning rates' reference
    lr, why = learning_rate("lora", shape, "cpo")
    assert lr == LEARNING_RATES["lora"] and why.startswith("learning rate 5e-06: the usual CPO LoRA (the alignment handbook")
    assert specs.spec_of("cpo").max_epochs == MAX_EPOCHS and replay_share(None, 10, "cpo")[0] == 0.0
    sized = size_run(shape, None, objective="cpo")
    assert not sized.packing and "cpo scores each response as a whole sequence" in sized.reasons[0]
    assert specs.spec_of("cpo").label == "CPO"  # finetuner plan: "CPO with LoRA"
    s = Settings(objective="cpo", micro_batch=3, seq_len=64, reference="adapter_off")
    assert rows_per_micro_batch(s) == 6 and not has_reference_pass(s)
    cost = preference_cost(shape, s)
    assert cost.rows == 6 and cost.reference_pass_bytes == 0


#: an objective's name as code writes it, or the sets of them that modules used to keep
#: (the grep of issue 57: ``grep -rnE '"(grpo|dpo|...)"|PREFERENCE_OBJECTIVES|...' finetuner ui``)
OBJECTIVE_NAMED = re.compile(r'"(grpo|dpo|orpo|simpo|kto|sft|neftune)"|PREFERENCE_OBJECTIVES|PAIRED_OBJECTIVES|is_grpo|== "grpo"')
#: where objectives are described and their losses written: the only places that name one
OWN_PLACES = ("finetuner/objectives/", "finetuner/losses/")


def objective_named_outside(root) -> list[str]:
    """The ``path:line: text`` of each line under ``root``'s finetuner/ and ui/ (objectives/ and losses/ left out)
    that names an objective."""
    found = []
    for pkg in ("finetuner", "ui"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(OWN_PLACES):
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if OBJECTIVE_NAMED.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_no_code_outside_the_objectives_names_one(tmp_path):
    """A new objective is its description and its trainer: the planner, memory, data, CLI and UI ask the
    descriptions (finetuner.objectives.specs) what an objective does, never which one it is."""
    found = objective_named_outside(REPO)
    assert not found, ("these lines name an objective; ask its description (spec_of, names_where, first_for_kind) "
                       "instead:\n" + "\n".join(found))
    (tmp_path / "ui").mkdir()  # and the check sees such a line where one is written
    (tmp_path / "ui" / "views.py").write_text('if objective == "grpo":\n    pass\n', encoding="utf-8")
    (tmp_path / "finetuner" / "losses").mkdir(parents=True)
    (tmp_path / "finetuner" / "losses" / "dpo.py").write_text('NAME = "dpo"\n', encoding="utf-8")
    assert objective_named_outside(tmp_path) == ['ui/views.py:1: if objective == "grpo":']

"""An objective is added by its modules alone, written into a copy of the package with no other file of it edited:
a variant of SFT is one description module in ``finetuner/objectives/specs/`` (with its recipe section's schema and
its model hook) and trains with SFT's trainer; an objective with a loss of its own adds a trainer module in
``finetuner/objectives/``. Each is listed, gets its recipe section, is offered by ``finetuner plan --help``, is
planned and is built for training (docs/extending.md)."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys

from tests.conftest import REPO

DEMO = REPO / "data" / "demo_model"

#: a test objective as one module: SFT with a setting of its own and a model hook that reads it, listed after neftune
SPEC_MODULE = '''
from dataclasses import replace

from pydantic import Field

from finetuner.objectives.specs.sft import SFT
from finetuner.schema import Section


class CalmSection(Section):
    """Settings of objective calm."""

    scale: float = Field(1.0, gt=0, description="A test setting.")


CALM = replace(SFT, name="calm", order=25, variant_of=SFT.name, section="calm", section_schema=CalmSection,
               section_help="Settings of objective calm (its scale).", label="Calm", settings=("scale",),
               description="a test objective, SFT with a scale", on_model=lambda model, section: setattr(model, "calm_scale", section.scale))

SPECS = (CALM,)
'''

#: a second test objective with a trainer of its own (two modules): its description ...
LOUD_SPEC_MODULE = '''
from dataclasses import replace

from finetuner.objectives.specs.sft import SFT

SPECS = (replace(SFT, name="loud", order=26, label="Loud", description="a test objective with its own trainer"),)
'''

#: ... and its trainer module: SFT's trainer under the new name
TRAINER_MODULE = '''
from finetuner.objectives.base import register
from finetuner.objectives.sft import SFTObjective


@register("loud")
class LoudObjective(SFTObjective):
    """SFT, registered as objective loud."""
'''

#: what the copy answers, in one process: the descriptions, the recipe's schema, the help, a plan, the trainer
CHECKS = '''
import contextlib, io, json, sys
from finetuner.cli.main import main
from finetuner.config.recipe import KEY_ORDER, OPTIONAL_SECTIONS, Recipe
from finetuner.errors import UserError
from finetuner.objectives import build_objective, trainers
from finetuner.objectives.specs import SPECS

demo, data, out = sys.argv[1:4]
raw = {"model": {"name": demo}, "data": {"path": data}, "device": "cpu"}
recipe = Recipe.from_dict({**raw, "objective": "calm", "calm": {"scale": 2}})
try:
    Recipe.from_dict({**raw, "calm": {"scale": 2}})
    refused = ""
except UserError as e:
    refused = str(e)
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    main(["plan", "--help"])
plan_text = io.StringIO()
with contextlib.redirect_stdout(plan_text):
    status = main(["plan", "--model", demo, "--data", data, "--objective", "calm", "--gpu", "cpu", "-o", out])
class Model:
    pass


model = Model()
build_objective(recipe).model_loaded(model)
defaults = Model()
build_objective(Recipe.from_dict({**raw, "objective": "calm"})).model_loaded(defaults)
print(json.dumps({
    "specs": list(SPECS), "fields": list(Recipe.model_fields), "key_order": list(KEY_ORDER),
    "optional": list(OPTIONAL_SECTIONS), "scale": recipe.calm.scale, "refused": refused,
    "help": " ".join(help_text.getvalue().split()), "plan_status": status, "plan": plan_text.getvalue(),
    "trainer": type(build_objective(recipe)).__name__, "registered": sorted(trainers()),
    "hooked": model.calm_scale, "hooked_default": defaults.calm_scale,
    "loud_trainer": type(build_objective(Recipe.from_dict({**raw, "objective": "loud"}))).__name__,
    "objective_help": Recipe.model_json_schema()["properties"]["objective"]["description"],
}))
'''


def test_an_objective_added_as_one_module_is_described_sectioned_offered_planned_and_built(tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(REPO / "finetuner", root / "finetuner", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "finetuner" / "objectives" / "specs" / "calm.py").write_text(SPEC_MODULE, encoding="utf-8")
    (root / "finetuner" / "objectives" / "specs" / "loud.py").write_text(LOUD_SPEC_MODULE, encoding="utf-8")
    (root / "finetuner" / "objectives" / "loud.py").write_text(TRAINER_MODULE, encoding="utf-8")
    # nothing else of the package differs from the repository's: calm's one module and loud's two are the whole change
    compared = filecmp.dircmp(REPO / "finetuner", root / "finetuner", ignore=["__pycache__"])

    def differences(c: filecmp.dircmp, where: str = "") -> list[str]:
        found = [where + n for n in c.left_only + c.right_only + c.diff_files + c.funny_files]
        for name, sub in c.subdirs.items():
            found += differences(sub, f"{where}{name}/")
        return found

    assert sorted(differences(compared)) == ["objectives/loud.py", "objectives/specs/calm.py", "objectives/specs/loud.py"]

    plan_file = tmp_path / "plan.yaml"
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", CHECKS, str(DEMO), str(REPO / "data" / "alpaca_sample.json"),
                          str(plan_file)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # listed in its order, after neftune
    assert got["specs"] == ["sft", "neftune", "calm", "loud", "dpo", "orpo", "simpo", "kto", "grpo"]
    # its section is a field of the recipe (an optional one, after the sections every recipe has), read and checked
    assert got["fields"][:7] == ["name", "model", "method", "objective", "preference", "neftune", "calm"]
    assert got["optional"] == ["neftune", "calm", "grpo"] and "calm" in got["key_order"]
    assert got["scale"] == 2.0
    assert "calm: set, but objective is 'sft': set objective to calm, or remove the calm section" in got["refused"]
    # offered by the recipe's help and by finetuner plan --objective
    assert "calm: a test objective, SFT with a scale" in got["objective_help"]
    assert "calm: a test objective, SFT with a scale" in got["help"]
    # planned (called by its label) and built for training
    assert got["plan_status"] == 0 and "Plan: Calm with LORA" in got["plan"]
    assert "objective: calm" in plan_file.read_text(encoding="utf-8")
    # calm trains with SFT's trainer, which puts its hook on the model with the recipe's section (or its defaults);
    # loud with the trainer its module registers
    assert got["trainer"] == "SFTObjective" and "calm" not in got["registered"]
    assert got["hooked"] == 2.0 and got["hooked_default"] == 1.0
    assert got["loud_trainer"] == "LoudObjective" and "loud" in got["registered"]

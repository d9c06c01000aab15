"""The preference objectives (:mod:`finetuner.objectives.preference`): DPO, ORPO and SimPO on pairs of a chosen
and a rejected response, KTO on single rated responses, and their shared ``preference`` section. Their planned
learning rates are the alignment handbook's Zephyr-7B DPO recipes' (5e-6 with QLoRA, 5e-7 full); a run is sized to
about one epoch, at most 3."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from finetuner.objectives.specs.base import ObjectiveSpec
from finetuner.schema import Section

LEARNING_RATES = {"lora": 5e-6, "qlora": 5e-6, "full": 5e-7}
MAX_EPOCHS = 3
#: each preference objective's own keys of the ``preference`` section, and those every one of them takes
SETTINGS = {"dpo": ("beta", "loss_type", "label_smoothing", "reference"), "orpo": ("orpo_weight",),
            "simpo": ("beta", "gamma"), "kto": ("beta", "desirable_weight", "undesirable_weight", "reference")}
SHARED = ("start_from",)
#: ``preference.beta`` when the recipe leaves it out, by objective (ORPO takes no beta)
DEFAULT_BETA = {"dpo": 0.1, "simpo": 2.0, "kto": 0.1}


class PreferenceSection(Section):
    """Settings of the preference objectives (``objective: dpo | orpo | simpo | kto``).

    Each key applies to the objectives its description names; setting one the recipe's objective
    does not use is an error (it would silently do nothing).
    """

    #: the objectives each key applies to (the check in :func:`finetuner.config.recipe.Recipe`'s combinations),
    #: from each objective's settings (:data:`SETTINGS`)
    APPLIES_TO: ClassVar[dict[str, tuple[str, ...]]] = {
        key: tuple(n for n, keys in SETTINGS.items() if key in keys + SHARED)
        for key in ("beta", "loss_type", "label_smoothing", "gamma", "orpo_weight", "desirable_weight",
                    "undesirable_weight", "reference", "start_from")
    }
    #: ``beta`` when the recipe leaves it out
    DEFAULT_BETA: ClassVar[dict[str, float]] = DEFAULT_BETA

    beta: float | None = Field(
        None, gt=0, description="dpo, kto: strength of the pull towards the reference (default 0.1); simpo: reward scale (default 2.0)."
    )
    loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid", description="dpo: sigmoid (the DPO paper) or ipo (squared loss, IPO paper).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo sigmoid: assumed fraction of pairs whose labels are flipped (cDPO).")
    gamma: float = Field(1.0, ge=0, description="simpo: target reward margin.")
    orpo_weight: float = Field(0.1, gt=0, description="orpo: weight (lambda) of the odds-ratio term added to the SFT loss of the chosen response.")
    desirable_weight: float = Field(1.0, gt=0, description="kto: weight of desirable (label true) examples.")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: weight of undesirable (label false) examples.")
    reference: Literal["adapter_off", "precomputed"] = Field(
        "adapter_off",
        description=(
            "dpo, kto: the reference model. adapter_off: the same base with the adapter switched off, each step; "
            "precomputed: the model as training starts, scored once before the first step (required with start_from "
            "and method full)."
        ),
    )
    start_from: str | None = Field(
        None, description="A finished SFT run folder: its adapter is where training starts, and the reference is that SFT model."
    )

    def beta_for(self, objective: str) -> float:
        """``beta``, or the objective's default."""
        return self.beta if self.beta is not None else self.DEFAULT_BETA.get(objective, 0.1)


def preference(name: str, data_kind: str, reference_model: bool, default_beta: float | None,
               settings: tuple[str, ...], description: str, order: int = 100) -> ObjectiveSpec:
    """A preference objective: two sequences an example, whole responses scored, the ``preference`` section."""
    return ObjectiveSpec(
        name=name, order=order, data_kind=data_kind, section="preference", section_schema=PreferenceSection,
        section_always=True, label=name.upper(), reference_model=reference_model,
        sequences_per_example=2, whole_sequences=True, learning_rates=LEARNING_RATES,
        lr_source=dict.fromkeys(LEARNING_RATES, "the alignment handbook's Zephyr-7B DPO recipes"), max_epochs=MAX_EPOCHS, scorer="preference",
        default_beta=default_beta, settings=settings + SHARED, description=description,
    )


DPO = preference("dpo", "pairs", True, DEFAULT_BETA["dpo"], SETTINGS["dpo"],
                 "direct preference optimisation against a reference", order=30)
ORPO = preference("orpo", "pairs", False, None, SETTINGS["orpo"], "odds-ratio preference optimisation (no reference)",
                  order=40)
SIMPO = preference("simpo", "pairs", False, DEFAULT_BETA["simpo"], SETTINGS["simpo"],
                   "simple preference optimisation (no reference)", order=50)
KTO = preference("kto", "rated", True, DEFAULT_BETA["kto"], SETTINGS["kto"],
                 "Kahneman-Tversky optimisation on rated responses", order=60)

SPECS = (DPO, ORPO, SIMPO, KTO)

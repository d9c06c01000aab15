"""The preference objectives (:mod:`finetuner.objectives.preference`): DPO, ORPO and SimPO on pairs of a chosen
and a rejected response, KTO on single rated responses. Their planned learning rates are the alignment
handbook's Zephyr-7B DPO recipes' (5e-6 with QLoRA, 5e-7 full); a run is sized to about one epoch, at most 3."""

from __future__ import annotations

from finetuner.objectives.specs.base import ObjectiveSpec

LEARNING_RATES = {"lora": 5e-6, "qlora": 5e-6, "full": 5e-7}
MAX_EPOCHS = 3


def preference(name: str, data_kind: str, reference_model: bool, default_beta: float | None,
               settings: tuple[str, ...], description: str) -> ObjectiveSpec:
    """A preference objective: two sequences an example, whole responses scored, the ``preference`` section."""
    return ObjectiveSpec(
        name=name, data_kind=data_kind, section="preference", label=name.upper(), reference_model=reference_model,
        sequences_per_example=2, whole_sequences=True, learning_rates=LEARNING_RATES,
        lr_source=dict.fromkeys(LEARNING_RATES, "the alignment handbook's Zephyr-7B DPO recipes"), max_epochs=MAX_EPOCHS, scorer="preference",
        default_beta=default_beta, settings=settings + ("start_from",), description=description,
    )


DPO = preference("dpo", "pairs", True, 0.1, ("beta", "loss_type", "label_smoothing", "reference"),
                 "direct preference optimisation against a reference")
ORPO = preference("orpo", "pairs", False, None, ("orpo_weight",), "odds-ratio preference optimisation (no reference)")
SIMPO = preference("simpo", "pairs", False, 2.0, ("beta", "gamma"), "simple preference optimisation (no reference)")
KTO = preference("kto", "rated", True, 0.1, ("beta", "desirable_weight", "undesirable_weight", "reference"),
                 "Kahneman-Tversky optimisation on rated responses")

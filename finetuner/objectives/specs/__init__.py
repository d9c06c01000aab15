"""The objectives' descriptions (:class:`~finetuner.objectives.specs.base.ObjectiveSpec`), one module each, and the
questions the rest of finetuner asks of them. An objective is added by a description here and its trainer
(:mod:`finetuner.objectives`): docs/extending.md."""

from __future__ import annotations

from finetuner.objectives.specs.base import ObjectiveSpec
from finetuner.objectives.specs.grpo import GRPO
from finetuner.objectives.specs.neftune import NEFTUNE
from finetuner.objectives.specs.preference import DPO, KTO, ORPO, SIMPO
from finetuner.objectives.specs.sft import SFT

__all__ = ["DEFAULT", "SPECS", "ObjectiveSpec", "first_for_kind", "in_words", "names", "names_where", "offered_for_kind",
           "spec_of"]

#: objective name → its description, in the order the recipe's help lists them
SPECS: dict[str, ObjectiveSpec] = {s.name: s for s in (SFT, NEFTUNE, DPO, ORPO, SIMPO, KTO, GRPO)}
#: the objective a recipe trains when it names none
DEFAULT = SFT.name


def spec_of(name: str | None) -> ObjectiveSpec:
    """The description of objective ``name`` (None: the default objective's)."""
    return SPECS[name or DEFAULT]


def names() -> tuple[str, ...]:
    """Every objective's name."""
    return tuple(SPECS)


def first_for_kind(data_kind: str) -> str:
    """The objective a kind of data is trained with when none is asked for: the first listed that takes it."""
    return next(n for n, s in SPECS.items() if s.data_kind == data_kind)


def names_where(**fields) -> tuple[str, ...]:
    """The objectives whose description has these field values (``names_where(section="preference")``)."""
    return tuple(n for n, s in SPECS.items() if all(getattr(s, k) == v for k, v in fields.items()))


def offered_for_kind(data_kind: str) -> tuple[str, ...]:
    """The objectives offered for a kind of data (the data errors and the Data tab name them): those that take it,
    variants of another (NEFTune) left out."""
    return names_where(data_kind=data_kind, variant_of=None)


def in_words(objectives: tuple[str, ...]) -> str:
    """Objective names as a sentence lists them: ``dpo, orpo or simpo``; ``kto``."""
    return " or ".join(filter(None, (", ".join(objectives[:-1]), objectives[-1])))

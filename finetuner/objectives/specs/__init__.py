"""The objectives' descriptions (:class:`~finetuner.objectives.specs.base.ObjectiveSpec`), one module each, and the
questions the rest of finetuner asks of them. An objective is added by a description here and its trainer
(:mod:`finetuner.objectives`): docs/extending.md."""

from __future__ import annotations

from finetuner.objectives.specs.base import ObjectiveSpec
from finetuner.objectives.specs.grpo import GRPO
from finetuner.objectives.specs.neftune import NEFTUNE
from finetuner.objectives.specs.preference import DPO, KTO, ORPO, SIMPO
from finetuner.objectives.specs.sft import SFT

__all__ = ["DEFAULT", "SPECS", "ObjectiveSpec", "first_for_kind", "names", "names_where", "spec_of"]

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

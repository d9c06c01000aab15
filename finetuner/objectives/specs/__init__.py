"""The objectives' descriptions (:class:`~finetuner.objectives.specs.base.ObjectiveSpec`), found in the modules of
this package, and the questions the rest of finetuner asks of them.

Each module here (but ``base``) exports its descriptions as ``SPECS = (...)`` (one objective, or a family that
shares a section: :mod:`~finetuner.objectives.specs.preference`), with the recipe section its objective reads and
that section's schema; :data:`SPECS` is every module's, in their ``order``. So an objective is added by one module
here (a variant with a model hook, NEFTune) or one here plus its trainer (:mod:`finetuner.objectives`), and nothing
else edited: docs/extending.md."""

from __future__ import annotations

import importlib
import pkgutil

from finetuner.objectives.specs.base import ObjectiveSpec

__all__ = ["DEFAULT", "SPECS", "ObjectiveSpec", "described", "discover", "first_for_kind", "in_words", "names",
           "names_where", "offered_for_kind", "spec_of", "sections"]


def discover(package: str = __name__, paths: list[str] | None = None) -> dict[str, ObjectiveSpec]:
    """Objective name → description, from the ``SPECS`` of every module of ``package`` (found in ``paths``, default
    the package's own folder), ordered by their ``order`` (then name). A name described twice is a mistake said
    at once."""
    found: dict[str, ObjectiveSpec] = {}
    for info in pkgutil.iter_modules(paths if paths is not None else __path__, package + "."):
        for spec in getattr(importlib.import_module(info.name), "SPECS", ()):
            if spec.name in found:
                raise ValueError(f"objective '{spec.name}' is described twice (the second in {info.name})")
            found[spec.name] = spec
    return {s.name: s for s in sorted(found.values(), key=lambda s: (s.order, s.name))}


#: objective name → its description, in the order the recipe's help lists them
SPECS: dict[str, ObjectiveSpec] = discover()
#: the objective a recipe trains when it names none: the first listed (sft)
DEFAULT = next(iter(SPECS))


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


def described() -> str:
    """Every objective with its description, as the recipe's help and ``finetuner plan --objective`` list them:
    ``sft: supervised fine-tuning on examples; neftune: ...``."""
    return "; ".join(f"{s.name}: {s.description}" for s in SPECS.values())


def sections() -> dict[str, ObjectiveSpec]:
    """Each objectives' section (``preference``, ``neftune``, ``grpo``) → the first description naming it (which
    holds its schema, its help and whether every recipe has it): the sections every recipe has first, then those
    only a recipe of their objective has (so a saved recipe's keys keep one order), each in the order of the
    descriptions. Descriptions sharing a section share its schema."""
    out: dict[str, ObjectiveSpec] = {}
    for spec in SPECS.values():
        if spec.section is None:
            continue
        first = out.setdefault(spec.section, spec)
        if first.section_schema is not spec.section_schema:
            raise ValueError(f"objectives '{first.name}' and '{spec.name}' name section '{spec.section}' with "
                             "different schemas: give them one")
    return dict(sorted(out.items(), key=lambda item: not item[1].section_always))

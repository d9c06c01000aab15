"""The base of every recipe section's schema (:class:`Section`): unknown keys refused, assignments validated, numbers
taken as written and kept within :data:`MAX_WHOLE`; and how a message shows a value (:func:`shown`).

It sits below the objectives' descriptions (:mod:`finetuner.objectives.specs`), whose modules hold their own
recipe sections (``grpo``, ``neftune``, ``preference``), and below the recipe (:mod:`finetuner.config`), which holds
the others: one base for both.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

#: The longest a value may be where an error message shows it (the rest is cut, with "…").
MAX_SHOWN_CHARS = 120


def shown(value: Any, quote: bool = True) -> str:
    """``value`` as an error message shows it (``repr``, or ``str`` with ``quote=False``), cut to
    :data:`MAX_SHOWN_CHARS`: a message never echoes a whole hostile input back."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 1] + "…"


def union_members(tp: Any) -> tuple[Any, ...] | None:
    """The members of a union type (``X | Y``, ``Optional[X]``), else None."""
    import types
    import typing

    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return None


#: the largest whole number a recipe key takes: 2**53, the largest up to which a float holds every whole number
#: exactly. YAML reads ``1e16`` (and the web UI's JSON any number) as a float, so a larger value is not the one
#: written; no count in a recipe comes near it (what a run can finish: :mod:`finetuner.planning.bounds`).
MAX_WHOLE = 2**53


#: a number in exponent notation without a dot (``1e12``, ``-2E-4``): text to YAML 1.1, a number to YAML 1.2
EXPONENT_NUMBER = re.compile(r"[+-]?\d+[eE][+-]?\d+")


def _numeric_kinds(annotation: Any) -> set[type]:
    """``int`` and ``float`` among the kinds of value a field's annotation accepts (unions and
    ``Annotated`` looked into); ``bool`` too where the field takes true/false."""
    import typing

    if typing.get_origin(annotation) is typing.Annotated:
        return _numeric_kinds(typing.get_args(annotation)[0])
    members = union_members(annotation)
    if members is not None:
        return set().union(*(_numeric_kinds(m) for m in members))
    return {annotation} & {int, float, bool}


def _has_upper_bound(field: Any) -> bool:
    """Whether a field states its own largest value (``le``/``lt``, e.g. ``training.seed``): its message says it."""
    return any(getattr(c, "le", None) is not None or getattr(c, "lt", None) is not None for c in field.metadata)


#: The base of every section and of the recipe itself: unknown keys refused, assignments validated, numbers
#: taken as written.
class Section(BaseModel):
    # inf and nan are never a sensible setting (``training.lr: .inf`` trained a model of NaNs)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_as_written(cls, v: Any, info: ValidationInfo) -> Any:
        """``true``/``false`` where a number belongs is a mistake (pydantic would read it as 1/0:
        ``lora.r: true`` trained with r=1); so is a whole number above :data:`MAX_WHOLE` (pydantic takes the
        float ``1e20`` as the int 100000000000000000000, not a value anyone wrote). A number written with an
        exponent and no dot (``1e12``, ``2e-4``) is text to YAML 1.1, which PyYAML reads; where a number belongs it
        is read as the number it is (YAML 1.2 and JSON read it so), and then checked as any other."""
        field = cls.model_fields.get(info.field_name or "")
        kinds = _numeric_kinds(field.annotation) if field else set()
        if isinstance(v, str) and kinds - {bool} and EXPONENT_NUMBER.fullmatch(v.strip()):
            v = float(v)
        if not isinstance(v, int | float):
            return v
        if isinstance(v, bool):
            if kinds and bool not in kinds:
                raise ValueError(f"must be a number, not {str(v).lower()}")
        elif abs(v) > MAX_WHOLE and int in kinds and float not in kinds and not _has_upper_bound(field):
            raise ValueError(f"must be a whole number of at most {MAX_WHOLE:,} (2**53: a larger one is not exact once "
                             f"YAML or JSON reads it); got {shown(v)}")
        return v

"""The recipe reference of docs/recipes.md, written from the recipe schema (``finetuner.config.recipe.Recipe`` and the
section models of ``finetuner/config/sections.py`` and ``finetuner/objectives/specs/``): every key, its type, its
default and the schema's own description, so the page never drifts from what ``finetuner run`` accepts.
``python -m scripts.docs.references --write`` puts it into the page.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from scripts.docs.markdown_text import inline


def type_text(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML: ``lora | qlora | full | auto``, ``int``, ``list of str``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return type_text(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in typing.get_args(annotation) if a is not type(None)]
        return " | ".join(dict.fromkeys(parts)) + (" | null" if type(None) in typing.get_args(annotation) else "")
    if origin in (list, tuple):
        return "list of " + type_text(typing.get_args(annotation)[0])
    if origin is dict:
        key, value = typing.get_args(annotation)
        return f"mapping {type_text(key)} → {type_text(value)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("PositiveInt", "int > 0")


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        made = field.default_factory()
        return "(section defaults)" if isinstance(made, BaseModel) else f"`{made!r}`"
    value = field.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return "`" + (value if isinstance(value, str) else repr(value)) + "`"


def section_model(field: FieldInfo) -> type[BaseModel] | None:
    """The section model of a top-level field (``grpo: GRPOSection | None``), or None for a plain value."""
    return next((a for a in (field.annotation, *typing.get_args(field.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)), None)


def rows(model: type[BaseModel], prefix: str) -> list[str]:
    return [f"| `{prefix}{name}` | {inline(type_text(f.annotation), table=True)} | {inline(default_text(f), table=True)} | {inline(f.description or '', table=True)} |"
            for name, f in model.model_fields.items()]


def reference() -> str:
    """Every recipe key: the top-level keys, then one table per section, in the schema's order."""
    from finetuner.config.recipe import Recipe

    head = "| key | type | default | description |\n|---|---|---|---|"
    top = [name for name, f in Recipe.model_fields.items() if section_model(f) is None]
    out = ["### Top-level keys", "", head,
           *[r for r in rows(Recipe, "") if r.split("`")[1] in top], ""]
    for name, field in Recipe.model_fields.items():
        model = section_model(field)
        if model is None:
            continue
        doc = inline(" ".join((model.__doc__ or "").split()))
        out += [f"### `{name}`", "", *([doc, ""] if doc else []), head, *rows(model, f"{name}."), ""]
    return "\n".join(out)

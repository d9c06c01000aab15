"""The generated parts of the documentation site (``mkdocs.yml``'s ``hooks``). The recipe reference, written from the recipe schema (``finetuner.config.recipe.Recipe`` and the
section models of ``finetuner/config/sections.py``) each time the documentation site is built, so it never
drifts from what ``finetuner run`` accepts: every key, its type, its default and the schema's own description.

``mkdocs build`` calls :func:`on_page_markdown` (``mkdocs.yml``'s ``hooks``), which puts :func:`reference` where
``docs/recipes.md`` holds :data:`MARKER`; ``python -m scripts.docs.hooks`` prints the same text. The
Python API reference: one mkdocstrings entry per name of ``finetuner.__all__`` where ``docs/python-api.md`` holds
:data:`API_MARKER`.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

#: where docs/recipes.md receives the generated reference
MARKER = "<!-- recipe-reference -->"


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


def cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*").strip()


def section_model(field: FieldInfo) -> type[BaseModel] | None:
    """The section model of a top-level field (``grpo: GRPOSection | None``), or None for a plain value."""
    return next((a for a in (field.annotation, *typing.get_args(field.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)), None)


def rows(model: type[BaseModel], prefix: str) -> list[str]:
    return [f"| `{prefix}{name}` | {cell(type_text(f.annotation))} | {cell(default_text(f))} | {cell(f.description or '')} |"
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
        doc = " ".join((model.__doc__ or "").split())
        out += [f"### `{name}`", "", *([doc, ""] if doc else []), head, *rows(model, f"{name}."), ""]
    return "\n".join(out)


#: where docs/python-api.md receives the mkdocstrings entries of the public API
API_MARKER = "<!-- api-reference -->"


def api_reference() -> str:
    """One mkdocstrings entry for each name ``finetuner`` exports, at the module that defines it, so a name added
    to the API is documented at the next build."""
    import finetuner

    out = []
    for name in finetuner.__all__:
        obj = getattr(finetuner, name)
        out += [f"### `finetuner.{name}`", "", f"::: {obj.__module__}.{obj.__qualname__}", "    options:",
                "      show_root_heading: false", "      heading_level: 4", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """mkdocs hook: the generated references in place of their markers (docs/recipes.md, docs/python-api.md), and
    ```` ```bash runnable```` fences (the blocks tests/test_readme.py marks as run) shown as the bash they are:
    Markdown takes one word after the fence, and would read the block's closing fence as an opening one."""
    markdown = re.sub(r"^```bash runnable[ \t]*$", "```bash", markdown, flags=re.M)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, reference())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_reference())
    return markdown


if __name__ == "__main__":
    print(reference())

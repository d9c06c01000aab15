"""Reading YAML from the user safely: a recipe file, the web UI's editor, a run folder's ``recipe.yaml``, a
``--set`` value. PyYAML's safe loader (no Python objects), with the document's aliases bounded (no "billion laughs")
and a key given twice in one mapping refused; every problem a :class:`~finetuner.errors.UserError` naming the
source, the line and the column.
"""

from __future__ import annotations

from typing import Any

import yaml

from finetuner.schema import shown
from finetuner.errors import UserError

#: The most nodes (mappings, lists, scalars) a recipe's YAML may stand for once its aliases are
#: expanded. A recipe has a few hundred; an alias bomb ("billion laughs") stands for billions in a
#: few hundred bytes, and every consumer of the parsed value (validation, its error messages, the
#: run folder's copy) walks it expanded.
MAX_YAML_NODES = 10_000


class _RecipeYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no Python objects) that builds a document only after checking its node
    graph: :func:`_check_nodes`."""


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Refuse a document that stands for more than :data:`MAX_YAML_NODES` nodes once its aliases are
    expanded, or that gives one key twice in a mapping (YAML keeps the last silently)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:  # an alias: the same node object again, counted again in full
            return sizes[id(node)]
        sizes[id(node)] = MAX_YAML_NODES + 1  # a node that contains itself (a recursive alias) is too big
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], yaml.Node] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    first = seen.setdefault((key.tag, key.value), key)
                    if first is not key:
                        raise UserError(
                            f"{source}: line {key.start_mark.line + 1}: the key '{shown(key.value, quote=False)}' is given twice "
                            f"in one section (first on line {first.start_mark.line + 1}); YAML would keep only the last.",
                            hint="Keep one of them.",
                        )
                total += size(key) + size(value)
                if total > MAX_YAML_NODES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item)
                if total > MAX_YAML_NODES:
                    break
        sizes[id(node)] = total
        return total

    if size(root) > MAX_YAML_NODES:
        raise UserError(
            f"{source}: the YAML stands for more than {MAX_YAML_NODES:,} values once its aliases (*name) are expanded; "
            "a recipe has a few hundred.",
            hint="Write the values out instead of repeating anchors (&name) many times over.",
        )


def load_yaml(text: str, source: str) -> Any:
    """The value of one YAML document read safely (no Python objects), with aliases bounded and
    duplicate keys refused (:func:`_check_nodes`): every YAML finetuner reads from the user (a
    recipe file, the UI's editor, a run folder's ``recipe.yaml``, a ``--set`` value) goes
    through here. A :class:`UserError` naming ``source`` (and the line and column) when it is not
    valid YAML."""
    loader = None
    try:
        loader = _RecipeYamlLoader(text)  # its reader already refuses unprintable characters
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, source)
        return loader.construct_document(node)
    except RecursionError:
        raise UserError(f"{source}: invalid YAML: lists or mappings nested too deeply.") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise UserError(f"{source}:{where} invalid YAML: {shown(problem, quote=False)}.") from None
    finally:
        if loader is not None:
            loader.dispose()


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The mapping in a recipe's YAML text (:func:`load_yaml`); a :class:`UserError` naming ``source``
    (and the line and column) when it is not valid YAML, is empty, or is not a mapping of sections."""
    raw = load_yaml(text, source)
    if raw is None:
        raise UserError(f"{source}: the recipe is empty.", hint="See recipes/demo_cpu.yaml for an example.")
    if not isinstance(raw, dict):
        raise UserError(f"{source}: a recipe must be a mapping of sections (model:, data:, ...).")
    return raw

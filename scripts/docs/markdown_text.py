"""Docstring and schema text as Markdown that reads the same on GitHub and on the documentation site
(Python-Markdown): reStructuredText's roles and double backticks as code spans, and the characters either renderer
would take for markup shown as they are."""

from __future__ import annotations

import re

#: a Sphinx role (``:func:`x```, ``:class:`~a.b.C```): a code span of its target (after ``~``, its last part)
ROLE = re.compile(r":(?:py:)?(?:func|meth|class|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")
DOUBLE = re.compile(r"``([^`]+?)``")
#: an inline code span
CODE_SPAN = re.compile(r"(`[^`\n]+`)")


def code_spans(text: str) -> str:
    """Roles and ````x```` as Markdown's ```x```."""
    text = ROLE.sub(lambda m: "``" + (m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)) + "``", text)
    return DOUBLE.sub(lambda m: f"`{m.group(1)}`", text)


def escape_plain(text: str, table: bool = False) -> str:
    """Text outside code as both renderers show it literally: ``<``, ``>`` and ``*`` escaped (and ``|`` in a table)."""
    text = text.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    return text.replace("|", "\\|") if table else text


def inline(text: str, table: bool = False) -> str:
    """``text`` (roles, double backticks, markup characters) as Markdown; ``table``: for one table cell, its
    whitespace joined, and a code span holding ``|`` written without backticks (GitHub splits a cell at a pipe
    inside code, Python-Markdown shows an escaped one with its backslash)."""
    text = code_spans(text)
    if table:
        text = re.sub(r"\s+", " ", text).strip()
    parts = CODE_SPAN.split(text)
    return "".join(escape_plain(p.strip("`") if i % 2 else p, table) if i % 2 == 0 or (table and "|" in p) else p
                   for i, p in enumerate(parts))

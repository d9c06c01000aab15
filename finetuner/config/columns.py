"""The roles of ``data.columns`` (role: column) and the formats they belong to: part of the recipe's data section,
checked when the section is validated (:class:`finetuner.config.sections.DataSection`) and read by the data formats
(:mod:`finetuner.data.formats`), which sit above config and read the rows by them."""

from __future__ import annotations

from finetuner.errors import closest

#: What each role of ``data.columns`` holds.
ROLES = {
    "prompt": "the instruction or question",
    "input": "optional context, added after the prompt",
    "response": "the answer to train on",
    "system": "an optional system prompt",
    "messages": "a list of chat turns (OpenAI role/content or ShareGPT from/value)",
    "text": "plain text, trained on whole",
}
#: The roles in a line, for hints.
ROLES_LINE = (
    "Roles: prompt (the instruction or question), input (optional context), response (the answer), system; "
    "chat data: messages; plain text: text."
)
#: The column each format reads a role from when ``data.columns`` does not name one (chat also
#: reads ShareGPT's ``conversations``).
FORMAT_COLUMNS = {
    "alpaca": {"prompt": "instruction", "input": "input", "response": "output", "system": "system"},
    "completion": {"prompt": "prompt", "response": "completion"},
    "chat": {"messages": "messages", "system": "system"},
    "text": {"text": "text"},
}
REQUIRED_ROLES = {"alpaca": ("prompt", "response"), "completion": ("prompt", "response"), "chat": ("messages",), "text": ("text",)}
#: Formats ``data.columns`` implies, tried in order: the first whose roles cover the named ones.
IMPLIED_ORDER = ("chat", "text", "alpaca")
#: Column names written as a role by mistake, and the role they usually hold.
ROLE_OF_COLUMN = {
    "instruction": "prompt", "question": "prompt", "query": "prompt", "output": "response", "answer": "response",
    "completion": "response", "conversations": "messages", "context": "input",
}

def check_columns(columns: dict[str, str], fmt: str = "auto") -> str:
    """The format ``data.columns`` is read as; a ``ValueError`` saying what to change if it cannot be."""
    roles = ", ".join(ROLES)
    for role, col in columns.items():
        if role in ROLES:
            if not isinstance(col, str) or not col.strip():
                raise ValueError(f"{role}: give the name of the column that holds {ROLES[role]}")
            continue
        if isinstance(col, str) and col in ROLES:  # written the other way round: column: role
            raise ValueError(f"'{role}' is not a role: write role: column, i.e. {col}: {role} (roles: {roles})")
        if str(role).lower() in ROLE_OF_COLUMN:
            meant = ROLE_OF_COLUMN[str(role).lower()]
            raise ValueError(f"'{role}' is not a role: a column that holds {ROLES[meant]} is named as {meant}: COLUMN (roles: {roles})")
        best = closest(str(role), ROLES)
        guess = f" Did you mean '{best}'?" if best else ""
        raise ValueError(f"unknown role '{role}'.{guess} The roles are {roles}")
    seen: dict[str, str] = {}
    for role, col in columns.items():
        if col in seen:
            raise ValueError(f"'{seen[col]}' and '{role}' both name the column '{col}': a column holds one role")
        seen[col] = role
    if fmt != "auto":
        extra = [r for r in columns if r not in FORMAT_COLUMNS[fmt]]
        if extra:
            fits = implied_format(columns)
            fix = f"set data.format: {fits} (or auto)" if fits else f"drop data.columns.{extra[0]}"
            raise ValueError(
                f"format '{fmt}' has no role '{extra[0]}' (its roles: {', '.join(FORMAT_COLUMNS[fmt])}): {fix}"
            )
        return fmt
    implied = implied_format(columns)
    if implied is None:
        raise ValueError(
            f"the roles {', '.join(columns)} do not belong to one kind of data: chat data has messages (and system); "
            "instruction data prompt, input, response, system; plain text only text"
        )
    return implied


def implied_format(columns: dict[str, str]) -> str | None:
    """The first format of :data:`IMPLIED_ORDER` whose roles cover ``columns``' (None: none does)."""
    return next((f for f in IMPLIED_ORDER if set(columns) <= set(FORMAT_COLUMNS[f])), None)

"""User-facing errors.

A :class:`UserError` is a mistake the user can fix (a bad recipe key, a malformed data row,
a missing file). The CLI prints its message without a traceback and exits non-zero;
anything else is a bug and shows a traceback with ``--debug``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from finetuner.surface import current as current_surface


class UserError(Exception):
    """An error caused by the user's input, with a message that says what to do."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None, settings: dict[str, str | int] | None = None):
        self.message = message
        #: recipe settings that fix it (``{"data.columns.prompt": "COLUMN"}``, ``{"training.max_steps": 100}``): each
        #: place that shows the error says how to set them there (:meth:`hint_for`)
        self.settings = dict(settings or {})
        self.plain_hint = hint
        self.hint = self.hint_for(None)
        super().__init__(message if not self.hint else f"{message}\n{self.hint}")

    def add_hint(self, text: str | None) -> None:
        """Say ``text`` (if any) after the hint: what the code that reports the error knows and the code
        that raised it did not (where a multi-process run's output went, say)."""
        if text:
            self.plain_hint = "\n".join(filter(None, (self.plain_hint, text)))
            self.hint = self.hint_for(None)
            self.args = (f"{self.message}\n{self.hint}",)

    def hint_for(self, command: str | None) -> str | None:
        """The hint as shown by ``command`` (``run``, ``plan``, ``eval``, ``ui``...; None: anywhere):
        the settings written the way that command takes them (:func:`how_to_set`), then the rest."""
        if command is None and current_surface() == "ui":  # raised where the web UI shows it (a UI-started worker)
            command = "ui"
        how = how_to_set(self.settings, command) if self.settings else None
        return "\n".join(x for x in (how, self.plain_hint) if x) or None


#: Commands that take any recipe setting as ``--set KEY=VALUE``.
SET_COMMANDS = ("run", "estimate")
#: Settings other commands take as flags of their own (``*``: the last key, e.g. a data.columns role).
COMMAND_FLAGS: dict[str, dict[str, str]] = {
    "plan": {"data.columns.*": "--column {leaf}={value}", "objective": "--objective {value}",
             "data.max_seq_len": "--seq-len {value}", "method": "--method {value}",
             "training.effective_batch": "--effective-batch {value}"},
    "eval": {"data.columns.*": "--column {leaf}={value}"},
}


#: Where the web UI (``command`` ``ui``) takes a setting (data.columns: :data:`UI_COLUMN_MENUS`).
UI_CONTROLS: dict[str, str] = {
    "objective": "the Plan tab's Objective menu",
    "method": "the Plan tab's Method menu",
    "data.max_seq_len": "the Data tab's Sequence length box",
}
UI_COLUMN_MENUS = "the Data tab's column menus (under the data file)"


def _in_the_ui(settings: dict[str, str | int]) -> str | None:
    """``settings`` as the web UI takes them (its menus), or None when one has no control there."""
    roles = [k.rpartition(".")[2] for k in settings if k.startswith("data.columns.")]
    said = [f"choose the column{'s' if len(roles) > 1 else ''} for {' and '.join(roles)} in {UI_COLUMN_MENUS}"] if roles else []
    for key, value in settings.items():
        if key.startswith("data.columns."):
            continue
        if key not in UI_CONTROLS:
            return None
        said.append(f"choose {value} in {UI_CONTROLS[key]}")
    return "In the web UI: " + "; ".join(said) + "."


def _flag(command: str, key: str, value: str | int) -> str | None:
    flags = COMMAND_FLAGS.get(command, {})
    head, _, leaf = key.rpartition(".")
    form = flags.get(key) or flags.get(f"{head}.*")
    return form.format(leaf=leaf, value=value) if form else None


def recipe_form(settings: dict[str, str | int]) -> str:
    """``settings`` as recipe YAML, indented two spaces: dotted keys nested, the innermost level on
    one line (``columns: {prompt: COLUMN, response: COLUMN}``)."""
    import yaml

    tree: dict = {}
    for key, value in settings.items():
        node = tree
        *parents, leaf = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value

    def lines(node: dict, depth: int) -> list[str]:
        out = []
        for k, v in node.items():
            pad = "  " * depth
            if isinstance(v, dict) and any(isinstance(x, dict) for x in v.values()):
                out += [f"{pad}{k}:", *lines(v, depth + 1)]
            else:
                out.append(f"{pad}{yaml.safe_dump({k: v}, default_flow_style=True, sort_keys=False, width=1000).strip()[1:-1]}")
        return out

    return "\n".join(lines(tree, 1))


def how_to_set(settings: dict[str, str | int], command: str | None) -> str:
    """How to give recipe ``settings`` where ``command`` shows the error: ``--set`` for ``run`` and
    ``estimate``, the command's own flags (``plan --column``, ``--objective``), else the recipe; with no
    command known, the recipe and which command takes which flag; ``ui``: the web UI's menus
    (:data:`UI_CONTROLS`), else its recipe editor."""
    recipe = f"in the recipe:\n{recipe_form(settings)}"
    if command == "ui":
        ui = _in_the_ui(settings)
        if ui is not None:
            return ui
        return "In the recipe editor (Plan tab):\n" + recipe_form(settings)
    if command in SET_COMMANDS:
        return "On the command line: " + " ".join(f"--set {k}={v}" for k, v in settings.items()) + f"\nor {recipe}"
    flags = [_flag(command, k, v) for k, v in settings.items()] if command else [None]
    if all(flags):
        return f"On the command line (finetuner {command}): " + " ".join(flags)  # type: ignore[arg-type]
    if command:
        return recipe[0].upper() + recipe[1:]
    sets = " ".join(f"--set {k}={v}" for k, v in settings.items())
    plan = [_flag("plan", k, v) for k, v in settings.items()]
    cli = f"`finetuner run` and `estimate` take {sets}" + (f"; `finetuner plan` takes {' '.join(plan)}" if all(plan) else "")
    return f"In the recipe:\n{recipe_form(settings)}\n(on the command line, {cli})"


class OutOfMemory(UserError):
    """Training could not fit on the device even after backing off."""

    exit_code = 3


class RewardError(UserError):
    """A reward function failed on a batch of completions (it raised, or returned the wrong number of
    rewards, or something that is not a number): the message names the function and the row."""

    def __init__(self, message: str, *, function: str, row: int | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.function, self.row = function, row


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The closest valid spelling of ``word`` among ``choices``, if any is close enough."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ``" Did you mean 'x'?"`` suffix, or a list of valid choices when nothing is close."""
    choices = sorted(set(choices))
    best = closest(word, choices)
    if best:
        return f" Did you mean '{best}'?"
    return f" Valid choices: {', '.join(choices)}."


def interruption(error: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (``KeyboardInterrupt``) that ``error`` was raised while handling, if any: a library's
    clean-up can replace it with an error of its own (``datasets.map`` with worker processes raises
    a ``TimeoutError`` from its ``finally``), which must still stop the program as a Ctrl-C does."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def first_line(text: str, limit: int = 200) -> str:
    """The first line of a library's error text, at most ``limit`` characters, cut between words
    (with "…") and never inside one."""
    from finetuner.text import cut_words

    return cut_words(text.strip().splitlines()[0].strip() if text.strip() else "", limit)

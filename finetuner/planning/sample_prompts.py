"""The sample prompts of a planned recipe: two prompts of the rows the run holds out.

At the end of a run the trainer answers each of ``samples.prompts`` with the fine-tune and the base model
(:func:`finetuner.training.samples.answer_samples`); a recipe without them shows no answer. The plan fills them
with the user's text of the first held-out rows, in the order the run's split holds them out
(:mod:`finetuner.data.split`, the same functions the pipelines split with), so the answers shown are to prompts
the run did not train on. A data file the run holds nothing out of gives its first rows, and the plan says so.

Only the user's message is taken (a chat row's last user turn, an instruction with its input, a completion
row's prompt, a preference row's prompt): the samples are answered as one user message in the chat template.
Rows with pictures and plain-text rows (no user message) are passed over, since a sample is a text prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetuner.data.formats import SUPERVISED
from finetuner.data.split import held_out_positions, held_out_rows, shuffled_split
from finetuner.objectives.specs import spec_of

if TYPE_CHECKING:
    from finetuner.config.recipe import Recipe
    from finetuner.config.sections import DataSection

#: how many prompts a plan writes
SAMPLE_PROMPTS = 2


def _user_text(messages: list[dict[str, Any]] | None) -> str | None:
    users = [m["content"] for m in messages or [] if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) and users[-1].strip() else None


def _example_prompt(ex: dict[str, Any]) -> str | None:
    """The user's text of one example as its pipeline loads it; None for a pictured or plain-text row."""
    if ex.get("images"):
        return None
    prompt = ex.get("prompt")
    if isinstance(prompt, list):  # a preference row: the prompt's messages
        return _user_text(prompt)
    if isinstance(prompt, str):  # a completion row
        return prompt if prompt.strip() else None
    return _user_text(ex.get("messages"))


def _examples(path: str, objective: str, cfg: DataSection) -> list[dict[str, Any]]:
    """The examples of ``path`` as the run's pipeline for ``objective`` lists them (bad rows skipped), so
    that a position of the split names the same row here and in the run."""
    from finetuner.data.pipeline import DataStats

    if spec_of(objective).generates:
        from finetuner.data.formats import RowError, read_rows
        from finetuner.data.prompts import prompt_of

        out = []
        for raw in read_rows(path, cfg.split, []):
            try:
                out.append({"messages": prompt_of(raw.data, cfg.columns, cfg.system_prompt).messages})
            except RowError:
                continue
        return out
    if spec_of(objective).data_kind == SUPERVISED:
        from finetuner.data.pipeline import load_examples

        return load_examples(path, cfg, DataStats())
    from finetuner.data.preference import load_preference_examples

    return load_preference_examples(path, objective, cfg, DataStats())


def held_out_prompts(recipe: Recipe) -> tuple[list[str], str]:
    """Up to :data:`SAMPLE_PROMPTS` distinct prompts for ``recipe.samples.prompts`` and the plan's line saying
    where they come from: the held-out file's first rows (``data.val_path``), else the first rows of the
    split ``data.val_size`` holds out, else (nothing held out) the data file's first rows."""
    d = recipe.data.model_copy(update={"on_bad_row": "skip"})
    seed, objective = recipe.training.seed, recipe.objective
    if d.val_path:
        examples, where = _examples(d.val_path, objective, d), f"the held-out file {d.val_path}"
        order = list(range(len(examples)))
    else:
        examples = _examples(d.path, objective, d)
        n_val = held_out_rows(d.val_size, len(examples))
        if n_val == 0:
            order, where = list(range(len(examples))), "the data's first rows (the run holds none out: it trains on these too)"
        elif spec_of(objective).data_kind == SUPERVISED:
            order, where = held_out_positions(len(examples), n_val, seed), f"the {n_val} rows the run holds out"
        else:
            held = shuffled_split(len(examples), n_val, seed)[0]
            order, where = held if not spec_of(objective).generates else sorted(held), f"the {n_val} rows the run holds out"
    prompts: list[str] = []
    for i in order:
        text = _example_prompt(examples[i])
        if text is not None and text not in prompts:
            prompts.append(text)
        if len(prompts) == SAMPLE_PROMPTS:
            break
    if not prompts:
        return [], f"samples: none: no row of {where} has a text prompt (rows with pictures or plain text are passed over)"
    n = len(prompts)
    return prompts, (f"samples: {n} prompt{'s' if n > 1 else ''} from {where}, answered by the base model and the "
                     "fine-tune at the end of the run")

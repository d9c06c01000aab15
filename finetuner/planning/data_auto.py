"""A recipe's data ``auto`` values, resolved from its own data when a run starts.

``data.max_seq_len``, ``data.packing`` and ``data.replay`` may be ``auto``: the run then takes what ``finetuner plan``
would write for the same file and model, from the same functions (:func:`finetuner.planning.sizing.size_run` for the
sequence and packing, :func:`~finetuner.planning.sizing.data_sequence` for a sequence beside an explicit packing,
:func:`~finetuner.planning.sizing.replay_share` for the replay guard), so a shipped recipe pointed at your file with
``--set data.path=...`` gets the guards a plan of it would have. An explicit value, in the recipe or on the command,
always wins, and the values next to it are sized around it (a given sequence decides the packing at that length).
What each ``auto`` became and why goes into the run's ``start`` event (``resolved``) and its first console line.

The data are measured as the plan measures them (:func:`finetuner.data.stats.profile_data`, GRPO's prompts by
:func:`~finetuner.data.stats.profile_prompts`), read with the recipe's format, columns, system prompt, chat
template and picture size; the training rows are the recipe's (its held-out file, or ``data.val_size`` of the rows).
Data that cannot be measured here (a hub data set) take the plan's values for no data.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetuner.config.sections import DATA_AUTO_KEYS
from finetuner.objectives.specs import spec_of
from finetuner.data.split import held_out_rows
from finetuner.errors import UserError
from finetuner.planning.sizing import PACKED_SEQ_LEN, data_sequence, replay_reason, replay_share, size_run

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe
    from finetuner.data.stats import DataProfile

#: Said for each ``auto`` when the data cannot be measured here.
UNMEASURED = "the data cannot be measured here (not one local file): the plan's value for no data"


def data_auto_keys(recipe: Recipe) -> list[str]:
    """The recipe's data keys that are ``auto``."""
    return [k for k in DATA_AUTO_KEYS if getattr(recipe.data, k.split(".")[1]) == "auto"]


def measure(recipe: Recipe) -> DataProfile | None:
    """The recipe's data measured as the plan measures a file, None when it is not one local file readable here."""
    from finetuner.data.stats import profile_data, profile_prompts

    d = recipe.data
    if not isinstance(d.path, str) or not Path(d.path).expanduser().is_file():
        return None
    path = str(Path(d.path).expanduser())
    try:
        if spec_of(recipe.objective).generates:
            return profile_prompts(path, recipe.model.name, columns=d.columns, on_bad_row=d.on_bad_row,
                                   system_prompt=d.system_prompt, chat_template=d.chat_template)
        return profile_data(path, recipe.model.name, fmt=d.format, columns=d.columns, on_bad_row=d.on_bad_row,
                            system_prompt=d.system_prompt, chat_template=d.chat_template, max_pixels=d.max_pixels,
                            thinking=d.thinking, reasoning=d.reasoning)
    except (UserError, OSError, ValueError):  # the trainer reads the file again and names what is wrong
        return None


def resolve_data(recipe: Recipe) -> tuple[Recipe, dict[str, dict[str, Any]]]:
    """``recipe`` with its data ``auto`` values resolved (module doc), and ``{key: {"value", "reason"}}`` for each;
    the recipe unchanged and ``{}`` when none is ``auto``."""
    keys = data_auto_keys(recipe)
    if not keys:
        return recipe, {}
    from finetuner.model.shapes import resolve_shape

    d, t = recipe.data, recipe.training
    shape = resolve_shape(recipe.model.name, recipe.model.revision)
    positions = shape.max_position_embeddings
    new_tokens = recipe.grpo.max_new_tokens if spec_of(recipe.objective).generates and recipe.grpo else 0
    given_seq = None if d.max_seq_len == "auto" else d.max_seq_len
    profile = measure(recipe)
    sizing = size_run(shape, profile, seq_len=given_seq, effective_batch=t.effective_batch_size,
                      gpus=recipe.distributed.world_size, objective=recipe.objective, seed=t.seed,
                      max_new_tokens=new_tokens)
    seq_reason = next((r for r in sizing.reasons if r.startswith("sequence ")), "")
    pack_reason = next((r for r in sizing.reasons if r.startswith("no packing")), "")
    out: dict[str, dict[str, Any]] = {}
    packing = sizing.packing if d.packing == "auto" else bool(d.packing)
    if d.packing == "auto":
        out["data.packing"] = {"value": packing, "reason": _packing_reason(packing, profile, sizing.seq_len, seq_reason,
                                                                         pack_reason)}
    if given_seq is None:
        if packing == sizing.packing or profile is None:
            seq, why = sizing.seq_len, seq_reason if profile is not None else UNMEASURED
        else:  # packing given against the plan's choice: the sequence the rows need, filled to PACKED_SEQ_LEN if packed
            seq, why, cap = data_sequence(profile, positions, recipe.objective, new_tokens)
            why = cap.reason() if cap is not None else f"sequence {seq}: {why}"
            if packing:
                seq = max(seq, min(PACKED_SEQ_LEN, positions))
                why = f"sequence {seq}: packed rows (data.packing: true) filled to {seq} tokens"
        out["data.max_seq_len"] = {"value": seq, "reason": why}
    if d.replay == "auto":
        out["data.replay"] = _replay(recipe, profile)
    raw = recipe.to_dict()
    for key, choice in out.items():
        raw["data"][key.split(".")[1]] = choice["value"]
    return type(recipe).model_validate(raw), out


def _packing_reason(packing: bool, profile: DataProfile | None, seq: int, seq_reason: str, no_pack: str) -> str:
    if profile is None:
        return UNMEASURED
    if packing:
        return seq_reason
    return no_pack or (f"no packing: examples average {profile.mean_tokens:.0f} tokens, not under half the "
                       f"sequence ({seq})")


def _replay(recipe: Recipe, profile: DataProfile | None) -> dict[str, Any]:
    """``data.replay: auto`` for the recipe's own training rows (its held-out file, or ``data.val_size`` of them)."""
    if profile is None:
        return {"value": 0.0, "reason": UNMEASURED}
    d = recipe.data
    rows = min(profile.rows, d.max_examples or profile.rows)
    train = max(1, rows - (0 if d.val_path else held_out_rows(d.val_size, rows)))
    share, why_not = replay_share(profile, train, recipe.objective, recipe.distributed.world_size)
    if not share:
        return {"value": 0.0, "reason": f"no replay: {why_not}"}
    from finetuner.data.replay import load_prompts, replay_count

    return {"value": share, "reason": replay_reason(share, replay_count(share, train, len(load_prompts())), train)}


def resolved_line(resolved: dict[str, dict[str, Any]]) -> str:
    """The one line a run's console says of its resolved data ``auto`` values (the ``start`` event's ``resolved``)."""
    return "auto from the data: " + "; ".join(f"{key} {choice['value']} ({choice['reason']})"
                                              for key, choice in resolved.items())

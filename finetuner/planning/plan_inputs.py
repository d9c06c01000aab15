"""What :func:`finetuner.planning.planner.plan` starts from: its arguments checked and turned into a recipe with
``auto`` values — the run's name and folder, the objective (asked, or what the data hold), the GRPO section, the
machine's CPU memory, and the sequence length the data need."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetuner.errors import UserError
from finetuner.surface import say
from finetuner.model.shapes import preset_model, resolve_shape
from finetuner.objectives.specs import DEFAULT as DEFAULT_OBJECTIVE
from finetuner.objectives.specs import first_for_kind, spec_of
from finetuner.planning.sizing import Sizing, size_run

if TYPE_CHECKING:  # pragma: no cover
    from finetuner.config.recipe import Recipe

#: The data set the written recipe trains on when the user gives none (public, instruction data).
DEFAULT_DATA = "yahma/alpaca-cleaned"


def recipe_model_name(model: str) -> str:
    """What the written recipe loads: a local folder's or GGUF file's absolute path, a preset's packaged GGUF
    file or hub id (:func:`~finetuner.model.shapes.preset_model`), else as given."""
    local = Path(model).expanduser()
    if local.exists():
        return str(local.resolve())
    return preset_model(model) or model


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in text.lower()).strip("-._")


def default_run_name(model: str, data: str | None, objective: str) -> str:
    """``<model>-<data>-<objective>`` for the model as the user named it (a preset, a hub id or a folder),
    the data file's stem (or the default data set's name) and the objective: plans of other data or
    another objective never share a run folder."""
    from finetuner.runs.jobs import safe_name

    data_name = Path(str(data)).stem if data else Path(DEFAULT_DATA).name
    return safe_name("-".join([_slug(Path(model).name) or "model", _slug(data_name) or "data", objective]))


def free_name(name: str, runs_dir: Path) -> tuple[str, str | None]:
    """``name``, or the first ``name-2``, ``name-3``... that no folder in ``runs_dir`` has yet, and the
    note that says so (a finished run's folder is never reused silently)."""
    from finetuner.runs.jobs import free_run_name

    free = free_run_name(runs_dir, name)
    if free == name:
        return name, None
    return free, (f"run named {free}: {runs_dir / name} already holds a run (this plan's run gets a folder of its own, "
                  f"{runs_dir / free}; --name NAME to choose another)")


def base_recipe(model: str, sizing: Sizing, data: str | None, name: str, device: str,
                 columns: dict[str, str] | None = None, objective: str = DEFAULT_OBJECTIVE, grpo: dict[str, Any] | None = None,
                 max_pixels: int | None = None) -> Recipe:
    from finetuner.config.recipe import Recipe

    training: dict[str, Any] = {
        "epochs": sizing.epochs or 1,
        "micro_batch_size": "auto",
        "gradient_accumulation": "auto",
        "effective_batch": sizing.effective_batch,
        "optimizer": "auto",
        "gradient_checkpointing": "auto",
        "offload_activations": "auto",
        "eval_every": sizing.eval_every,
    }
    raw = {
        "name": name,
        "model": {"name": model},
        "method": "auto",
        **({"objective": objective} if objective != DEFAULT_OBJECTIVE else {}),
        **({spec_of(objective).section: grpo} if grpo is not None else {}),
        "data": {"path": data or DEFAULT_DATA, "max_seq_len": sizing.seq_len, "val_size": sizing.val_size,
                 "packing": sizing.packing, **({"columns": columns} if columns else {}),
                 **({"replay": sizing.replay} if sizing.replay else {}),
                 **({"max_pixels": max_pixels} if max_pixels else {})},
        "training": training,
        "checkpointing": {"save_every": sizing.save_every, "keep_last": 2},
        "device": device,
    }
    from pydantic import ValidationError

    from finetuner.config.recipe import format_validation_error

    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:  # e.g. a --name that cannot name a folder
        raise UserError(format_validation_error(e, "the planned recipe")) from None


def data_seq_len(model: str, profile, max_new_tokens: int | None = None) -> int:
    """The sequence length :func:`~finetuner.planning.planner.plan` chooses for ``model`` on the data of ``profile``
    when none is asked for (:func:`~finetuner.planning.sizing.size_run`): what the web UI's Data tab shows for 0. A
    profile of prompts (objective grpo) adds ``max_new_tokens`` (default: the recipe's ``grpo.max_new_tokens``)."""
    from finetuner.objectives.specs.grpo import GRPOSection

    if profile.kind == "prompts":
        new = GRPOSection.model_fields["max_new_tokens"].default if max_new_tokens is None else max_new_tokens
        return size_run(resolve_shape(model), profile, objective=first_for_kind("prompts"), max_new_tokens=new).seq_len
    return size_run(resolve_shape(model), profile, objective=first_for_kind(profile.kind)).seq_len


def cpu_memory_of(cpu_memory: int | str | None) -> tuple[int, str]:
    """The machine's CPU memory a plan is for, and where the figure came from."""
    from finetuner.config.hardware import machine_memory_bytes, parse_memory_size

    if cpu_memory is None:
        return machine_memory_bytes(), "this machine's RAM; --cpu-memory SIZE plans for another machine"
    if isinstance(cpu_memory, str):
        return parse_memory_size(cpu_memory), "--cpu-memory"
    if cpu_memory <= 0:
        raise UserError(f"cpu_memory {cpu_memory}: must be a positive number of bytes.")
    return int(cpu_memory), "--cpu-memory"


def grpo_section(grpo: dict[str, Any] | None) -> dict[str, Any]:
    """The ``grpo`` section a plan writes into its recipe: ``grpo`` validated as the recipe validates it
    (:class:`~finetuner.objectives.specs.grpo.GRPOSection`, TRL's names accepted), its rewards checked without
    running them (:func:`finetuner.rewards.specs.check_reward_specs`: each file made absolute and checked
    to define its function, each built-in checked by name). A :class:`UserError` naming what is wrong."""
    from pydantic import ValidationError

    from finetuner.config.recipe import format_validation_error
    from finetuner.objectives.specs.grpo import GRPOSection
    from finetuner.rewards.specs import SPEC_FORM, check_reward_specs

    raw = dict(grpo or {})
    if not raw.get("rewards"):
        raise UserError("objective grpo: GRPO trains on rewards, and none is named.",
                        hint=say(cli=f"Name one with --reward {SPEC_FORM}.", ui=f"Name one in Rewards: {SPEC_FORM}."))
    raw["rewards"] = check_reward_specs(raw["rewards"])
    try:
        section = GRPOSection.model_validate(raw)
    except ValidationError as e:
        name = spec_of(first_for_kind("prompts")).section  # the section of the objective that trains on prompts
        raise UserError(format_validation_error(e, name).replace("\n  - ", f"\n  - {name}.")) from None
    out = section.model_dump(mode="json", exclude_unset=True)
    out["rewards"] = [r.model_dump(mode="json", exclude_defaults=True) | {"function": r.function} for r in section.rewards]
    out.setdefault("max_new_tokens", section.max_new_tokens)
    out.setdefault("num_generations", section.num_generations)
    return out


def check_objective(objective: str | None) -> str | None:
    """``objective`` as :func:`~finetuner.planning.planner.plan` takes it from every front: ``None`` for ``auto`` (the
    CLI's ``--objective auto``, the UI's menu, the API's None; empty alike), else a known objective."""
    from typing import get_args

    from finetuner.config.sections import Objective

    if objective in (None, "", "auto"):
        return None
    planned = list(get_args(Objective))
    if objective not in planned:
        raise UserError(f"--objective {objective}: not an objective; choose auto, {', '.join(planned)}.")
    return objective


def objective_for(objective: str | None, profile) -> tuple[str, str | None]:
    """The objective of a plan on data ``profile`` (``objective`` as asked, ``None``: from the data),
    and the reason to print when it came from the data. A :class:`UserError` when the data do not fit it."""
    from finetuner.data.formats import AUTO_OBJECTIVE, KIND_WORDS, OBJECTIVES_OF_KIND, wrong_objective

    kind = profile.kind
    if objective is not None and spec_of(objective).generates:  # any file with prompts: profile_prompts read it as the GRPO trainer will
        return objective, None
    if objective is None:
        chosen = AUTO_OBJECTIVE[kind]
        if not spec_of(chosen).whole_sequences:  # supervised examples: nothing to say
            return chosen, None
        others = say(cli=" (orpo and simpo need no reference model: --objective orpo|simpo)",
                     ui=" (orpo and simpo need no reference model: choose one in the Objective menu)") if kind == "pairs" else ""
        return chosen, f"objective {chosen}: {profile.path} holds {KIND_WORDS[kind]}{others}"
    need = spec_of(objective).data_kind
    if kind != need:
        e = wrong_objective(profile.path, kind, objective)
        where = say(cli="--objective", ui="the Objective menu")
        raise UserError(e.message, hint=f"Plan with objective {OBJECTIVES_OF_KIND[kind]}, or auto ({where}), or give "
                        f"data for '{objective}'.") from None
    return objective, None


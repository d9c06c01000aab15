"""How a recipe's problems are said: pydantic's validation errors as one line per key, naming the key, what it
must be and, for a misspelt key or value, the closest valid one (or the key finetuner uses for another tool's name:
:data:`SYNONYMS`); every value it shows is cut short (:func:`finetuner.schema.shown`).

The rendering walks the schema it is given (``root``): :func:`finetuner.config.recipe.format_validation_error`
gives it the :class:`~finetuner.config.recipe.Recipe`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from finetuner.errors import closest, did_you_mean
from finetuner.schema import shown, union_members

#: The longest one line of a validation error may be, and the most lines it has.
MAX_ERROR_LINE = 400
MAX_ERROR_LINES = 40


#: Names other fine-tuning tools (transformers' TrainingArguments, peft, LLaMA-Factory, Axolotl)
#: use for a recipe key, and the key finetuner uses for it.
SYNONYMS: dict[str, str] = {
    **dict.fromkeys(["learning_rate", "learningrate"], "training.lr"),
    **dict.fromkeys(["batch_size", "per_device_train_batch_size", "train_batch_size", "micro_batch",
                     "micro_batch_per_gpu", "train_micro_batch_size_per_gpu"], "training.micro_batch_size"),
    **dict.fromkeys(["gradient_accumulation_steps", "grad_accum", "accumulation_steps", "grad_accumulation"],
                    "training.gradient_accumulation"),
    **dict.fromkeys(["global_batch_size", "total_batch_size", "effective_batch_size"], "training.effective_batch"),
    **dict.fromkeys(["num_train_epochs", "num_epochs", "epoch", "n_epochs"], "training.epochs"),
    **dict.fromkeys(["steps", "num_steps", "train_steps", "max_iters", "total_steps"], "training.max_steps"),
    **dict.fromkeys(["lr_scheduler_type", "lr_scheduler", "scheduler_type"], "training.scheduler"),
    **dict.fromkeys(["warmup", "num_warmup_steps"], "training.warmup_steps"),
    **dict.fromkeys(["optim", "optimizer_type"], "training.optimizer"),
    **dict.fromkeys(["grad_clip", "gradient_clipping", "clip_grad_norm"], "training.max_grad_norm"),
    **dict.fromkeys(["activation_checkpointing"], "training.gradient_checkpointing"),
    **dict.fromkeys(["bf16", "fp16", "mixed_precision"], "training.precision"),
    **dict.fromkeys(["torch_compile"], "training.compile"),
    **dict.fromkeys(["eval_steps", "evaluation_steps"], "training.eval_every"),
    **dict.fromkeys(["save_steps"], "checkpointing.save_every"),
    **dict.fromkeys(["save_total_limit"], "checkpointing.keep_last"),
    **dict.fromkeys(["logging_steps"], "logging.every"),
    **dict.fromkeys(["rank", "lora_r", "lora_rank"], "lora.r"),
    **dict.fromkeys(["lora_alpha"], "lora.alpha"),
    **dict.fromkeys(["lora_dropout"], "lora.dropout"),
    **dict.fromkeys(["lora_target", "lora_target_modules", "target", "targets", "modules"], "lora.target_modules"),
    **dict.fromkeys(["cutoff_len", "max_length", "sequence_len", "seq_len", "max_seq_length", "max_len",
                     "block_size", "context_length", "sequence_length"], "data.max_seq_len"),
    **dict.fromkeys(["dataset", "datasets", "data_path", "train_file", "dataset_path", "file"], "data.path"),
    **dict.fromkeys(["val_set_size", "validation_split", "val_split", "eval_split", "test_size"], "data.val_size"),
    **dict.fromkeys(["eval_dataset", "val_file", "validation_file", "eval_file"], "data.val_path"),
    **dict.fromkeys(["template", "prompt_template"], "data.chat_template"),
    **dict.fromkeys(["sample_packing", "pack", "packed"], "data.packing"),
    **dict.fromkeys(["max_samples", "num_samples"], "data.max_examples"),
    **dict.fromkeys(["system", "system_message"], "data.system_prompt"),
    **dict.fromkeys(["preprocessing_num_workers", "dataset_num_proc", "num_workers"], "data.num_proc"),
    **dict.fromkeys(["model_name_or_path", "base_model", "model_name", "model_id", "model_path"], "model.name"),
    **dict.fromkeys(["torch_dtype"], "model.dtype"),
    **dict.fromkeys(["flash_attention", "flash_attn"], "model.attn_implementation"),
    **dict.fromkeys(["load_in_4bit", "load_in_8bit", "quantization_bit"], "quantization.bits"),
    **dict.fromkeys(["bnb_4bit_quant_type"], "quantization.quant_type"),
    **dict.fromkeys(["bnb_4bit_use_double_quant"], "quantization.double_quant"),
    **dict.fromkeys(["bnb_4bit_compute_dtype"], "quantization.compute_dtype"),
    **dict.fromkeys(["finetuning_type", "finetune_type", "adapter"], "method"),
    **dict.fromkeys(["output", "output_path", "save_dir"], "output_dir"),
    **dict.fromkeys(["run_name"], "name"),
    **dict.fromkeys(["rl", "rl_type", "pref_loss", "training_objective", "stage"], "objective"),
    **dict.fromkeys(["pref_beta", "rl_beta", "dpo_beta"], "preference.beta"),
    **dict.fromkeys(["dpo_loss", "dpo_loss_type"], "preference.loss_type"),
    **dict.fromkeys(["dpo_label_smoothing", "cdpo_label_smoothing"], "preference.label_smoothing"),
    **dict.fromkeys(["simpo_gamma"], "preference.gamma"),
    **dict.fromkeys(["orpo_alpha", "orpo_lambda", "orpo_beta"], "preference.orpo_weight"),
    **dict.fromkeys(["kto_chosen_weight", "kto_desirable_weight"], "preference.desirable_weight"),
    **dict.fromkeys(["kto_rejected_weight", "kto_undesirable_weight"], "preference.undesirable_weight"),
    **dict.fromkeys(["ref_model", "reference_model", "precompute_ref_log_probs"], "preference.reference"),
    **dict.fromkeys(["sft_run", "init_from", "adapter_name_or_path"], "preference.start_from"),
    **dict.fromkeys(["group_size", "n_samples_per_prompt"], "grpo.num_generations"),
    **dict.fromkeys(["max_completion_length", "generate_max_length", "response_length"], "grpo.max_new_tokens"),
    **dict.fromkeys(["reward_funcs", "reward_functions", "reward_fn", "reward_model"], "grpo.rewards"),
    **dict.fromkeys(["cliprange", "clip_range", "clip_eps"], "grpo.epsilon"),
    **dict.fromkeys(["clip_ratio_high"], "grpo.epsilon_high"),
    **dict.fromkeys(["ppo_epochs", "mu"], "grpo.num_iterations"),
    **dict.fromkeys(["kl_coef", "init_kl_coef", "kl_beta"], "grpo.beta"),
}


def _unwrap_optional(tp: Any) -> Any:
    members = union_members(tp)
    if members is not None:
        rest = [m for m in members if m is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


_TAGS = ("function-", "json-", "lax-", "literal[", "constrained-", "nullable[", "default[")


def _error_key(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any, list[Any]]:
    """The recipe key an error location in ``root`` names, the type expected there and its constraints.

    pydantic puts the union member it tried into the location (``('method', "literal['auto']")``,
    ``('training', 'micro_batch_size', 'constrained-int')``): those tags are left out, and an
    error inside any member of a union is about the whole union (its key is the field's).
    The type is None where it is not known.
    """
    import typing

    node: Any = root
    metadata: list[Any] = []
    key: list[Any] = []
    for part in loc:
        node = _unwrap_optional(node)
        if union_members(node) is not None:  # the rest of the location is inside one member
            break
        if isinstance(part, str) and part.startswith(_TAGS):
            continue
        key.append(part)
        if isinstance(node, type) and issubclass(node, BaseModel):
            field = node.model_fields.get(part) if isinstance(part, str) else None
            node, metadata = (field.annotation, list(field.metadata)) if field else (None, [])
        elif typing.get_origin(node) in (list, dict):
            node, metadata = typing.get_args(node)[-1], []
        else:
            node, metadata = None, []
    return tuple(key), _unwrap_optional(node), metadata


def _bounds(metadata: list[Any], whole: bool) -> str:
    """`` ≥ 1``, `` ≥ 0 and < 1``, `` from 1 to 1024``: a number's constraints in words."""
    lo = hi = None
    for m in metadata:
        for c in getattr(m, "metadata", None) or [m]:  # a Field(...) inside Annotated holds its own
            if getattr(c, "gt", None) is not None:
                lo = ("≥", c.gt + 1) if whole else (">", c.gt)
            elif getattr(c, "ge", None) is not None:
                lo = ("≥", c.ge)
            if getattr(c, "lt", None) is not None:
                hi = ("≤", c.lt - 1) if whole else ("<", c.lt)
            elif getattr(c, "le", None) is not None:
                hi = ("≤", c.le)
    if whole and lo and hi:
        return f" from {lo[1]} to {hi[1]}"
    parts = [f"{op} {v}" for op, v in (b for b in (lo, hi) if b)]
    return " " + " and ".join(parts) if parts else ""


def _expected(tp: Any, metadata: list[Any] | None = None) -> tuple[list[str], list[Any]]:
    """What a type accepts, in words: (descriptions of its kinds of value, its literal choices)."""
    import typing

    metadata = list(metadata or [])
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return _expected(base, metadata + extra)
    members = union_members(tp)
    if members is not None:
        words: list[str] = []
        choices: list[Any] = []
        for m in members:
            if m is type(None):
                continue
            w, c = _expected(m, metadata)
            words += [x for x in w if x not in words]
            choices += [x for x in c if x not in choices]
        return words, choices
    if origin is Literal:
        return [], list(typing.get_args(tp))
    if tp is bool:
        return ["true or false"], []
    if tp is int:
        return ["a whole number" + _bounds(metadata, whole=True)], []
    if tp is float:
        return ["a number" + _bounds(metadata, whole=False)], []
    if tp is str:
        return ["text"], []
    if origin is list:
        return ["a list of texts" if typing.get_args(tp)[0] is str else "a list"], []
    if origin is dict:
        return ["a mapping of keys to values"], []
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [f"a section of keys ({', '.join(list(tp.model_fields)[:3])}, ...)"], []
    return [], []


def _value_message(errs: list[dict[str, Any]], tp: Any, metadata: list[Any]) -> str:
    """One message for every error pydantic reported about one key's value."""
    got = errs[0].get("input")
    custom = [e for e in errs if e["type"] in ("value_error", "assertion_error")]
    if custom:  # a validator of ours said what is wrong
        return custom[0]["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ") + "."
    words, choices = _expected(tp, metadata) if tp is not None else ([], [])
    if not words and not choices:
        ctx_choices = [c for e in errs if e["type"] == "literal_error"
                       for c in re.findall(r"'([^']*)'", e.get("ctx", {}).get("expected", ""))]
        if ctx_choices:
            choices = list(dict.fromkeys(ctx_choices))
        else:
            echo = "" if isinstance(got, dict) else f" (got {shown(got)})"
            return errs[0]["msg"] + echo + "."
    if any(e["type"] == "finite_number" for e in errs):  # inf or nan given (pydantic: allow_inf_nan=False)
        words = [w.replace("a number", "a finite number", 1) for w in words]
    best = closest(got, [c for c in choices if isinstance(c, str)]) if isinstance(got, str) else None
    hint = f" Did you mean '{best}'?" if best else ""
    if not words:  # choices only
        return f"invalid value {shown(got)}.{hint} Valid choices: {', '.join(map(str, choices))}."
    expected = " or ".join(words) + (f" (or {' or '.join(map(str, choices))})" if choices else "")
    return f"must be {expected}; got {shown(got)}.{hint}"


def _unknown_key_message(root: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """``unknown key.`` with the key finetuner uses for it (a synonym or a close spelling)."""
    section = ".".join(str(p) for p in loc[:-1])
    parent = _model_at(root, loc[:-1])
    fields = list(parent.model_fields) if parent else []
    name = str(loc[-1])
    # a name from another tool, or the right name in the wrong section (training.max_seq_len)
    target = SYNONYMS.get(name.strip().lower().replace("-", "_")) or next(
        (k for k in model_keys(root) if k.rsplit(".", 1)[-1] == name), None)
    if target is not None:
        where, _, leaf = target.rpartition(".")
        if where == section:
            return f"unknown key. Did you mean '{leaf}'? (finetuner's name for {name})"
        place = f"in the {where} section" if where else "at the top level of the recipe"
        return f"unknown key. Did you mean '{target}'? (finetuner's name for {name}; it goes {place})"
    return f"unknown key.{did_you_mean(name, fields)}" if fields else "unknown key."


def model_keys(root: type[BaseModel]) -> list[str]:
    """Every key of ``root`` that holds a value, dotted (``training.lr``, ``method``)."""
    out = []
    for name, field in root.model_fields.items():
        section = _unwrap_optional(field.annotation)
        if isinstance(section, type) and issubclass(section, BaseModel):
            out += [f"{name}.{k}" for k in section.model_fields]
        else:
            out.append(name)
    return out


def values_accepted(root: type[BaseModel], key: str) -> tuple[list[str], list[Any]]:
    """What a dotted ``key`` of ``root`` accepts, as the error messages say it: the kinds of value in words
    (``a whole number ≥ 1``) and the named choices (``auto``)."""
    loc, tp, metadata = _error_key(root, tuple(key.split(".")))
    if ".".join(map(str, loc)) != key or tp is None:
        raise KeyError(key)
    return _expected(tp, metadata)


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return model


def render_validation_error(e: ValidationError, source: str, root: type[BaseModel]) -> str:
    """Turn pydantic's errors about ``root`` into lines that name the key, say what it must be and suggest a fix."""
    lines = [f"{source}: the recipe is not valid:"]
    by_key: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    types: dict[tuple[Any, ...], tuple[Any, list[Any]]] = {}
    for err in e.errors():
        loc, tp, metadata = _error_key(root, tuple(err["loc"]))
        by_key.setdefault(loc, []).append(err)
        types.setdefault(loc, (tp, metadata))
    for loc, errs in by_key.items():
        key = ".".join(str(p) if str(p).strip() else repr(str(p)) for p in loc)  # a blank key shown quoted: ''
        if not loc:  # a cross-field check: its message starts with the key it is about
            for err in errs:
                k, _, rest = err["msg"].removeprefix("Value error, ").partition(": ")
                lines.append(f"  - {k}: {rest}.")
            continue
        kinds = {err["type"] for err in errs}
        if "extra_forbidden" in kinds:
            msg = _unknown_key_message(root, loc)
        elif "missing" in kinds:
            msg = "required key is missing."
        else:
            msg = _value_message(errs, *types[loc])
        lines.append(f"  - {key}: {msg}")
    lines = [line if len(line) <= MAX_ERROR_LINE else line[: MAX_ERROR_LINE - 1] + "…" for line in dict.fromkeys(lines)]
    if len(lines) > MAX_ERROR_LINES:
        lines = lines[:MAX_ERROR_LINES] + [f"  ... and {len(lines) - MAX_ERROR_LINES} more."]
    return "\n".join(lines)

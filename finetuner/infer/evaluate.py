"""Held-out loss and perplexity of the base model and the fine-tune, side by side.

Held-out preference pairs (a file of pairs, or a preference run's own split) get preference
accuracy and margin instead (:mod:`finetuner.infer.preference_eval`); a GRPO run's held-out prompts
the mean reward of sampled completions (:mod:`finetuner.infer.reward_eval`).

The held-out set is the run's validation split exactly as the trainer built it (the same
recipe, tokenizer and seed through :func:`finetuner.data.pipeline.prepare_data`), or any data file given
with ``data``. The loss is the trainer's: mean next-token cross-entropy over the trained tokens
(assistant replies, unless the run trained on prompts too). Both numbers come from one loaded
model: the base is the same model with the adapter switched off.

Optionally, for data with references, an exact-match check: the first N held-out examples are
answered greedily and compared with the reference reply (whitespace-normalised). A row's pictures go into the
generation as they go into the loss, through the run's collator (the processor's pixel values with the prompt's
image tokens), so a picture run is compared as a text run is; the result counts the compared rows with pictures.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.objectives.specs import spec_of
from finetuner.errors import UserError
from finetuner.infer.loading import (Source, chat_template, load_model, load_tokenizer, picture_processor, resolve_source,
                                     run_data_stats)
from finetuner.infer.preference_eval import PreferenceEvalResult, describe_examples, evaluate_pairs, examples_are
from finetuner.infer.reward_eval import RewardEvalResult, evaluate_rewards
from finetuner.locate import locate


@dataclass
class ModelScore:
    loss: float
    ppl: float
    tokens: int
    exact_match: float | None = None
    #: on tool-calling data: the shares of held-out calls made right, with the right function, as valid JSON
    #: (:class:`finetuner.infer.tool_eval.ToolScore`)
    tool_calls: dict[str, float] | None = None


@dataclass
class EvalResult:
    """Loss/perplexity of ``base`` and ``fine_tuned`` on ``examples`` held-out examples."""

    source: str
    data: str
    examples: int
    base: ModelScore
    fine_tuned: ModelScore
    exact_match_examples: int = 0
    #: how many of the ``exact_match_examples`` rows had pictures (answered with them)
    exact_match_pictured: int = 0
    samples: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    #: what the examples are to the run: ``held-out`` (its validation split or data.val_path),
    #: ``training`` (a --data file the run trained on) or ``other`` (another --data file)
    examples_are: str = "held-out"
    #: how many held-out calls the tool-call shares are of (0: the data makes none)
    tool_call_requests: int = 0

    def describe(self) -> str:
        """One line on what was scored: ``12 held-out examples from ...``."""
        return describe_examples(self.examples, "examples", self.data, self.examples_are, "the loss shows")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [("", "base", "fine-tuned"), ("loss", f"{self.base.loss:.4f}", f"{self.fine_tuned.loss:.4f}"),
                ("perplexity", f"{self.base.ppl:.2f}", f"{self.fine_tuned.ppl:.2f}")]
        if self.exact_match_examples:
            with_pictures = f"; {self.exact_match_pictured} with pictures" if self.exact_match_pictured else ""
            rows.append((f"exact match ({self.exact_match_examples}{with_pictures})", f"{self.base.exact_match:.0%}", f"{self.fine_tuned.exact_match:.0%}"))
        if self.tool_call_requests:
            for key, what in (("right", "right call"), ("right_function", "right function"), ("valid_json", "valid call JSON")):
                rows.append((f"{what} ({self.tool_call_requests})", f"{self.base.tool_calls[key]:.0%}",
                             f"{self.fine_tuned.tool_calls[key]:.0%}"))
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{w}}  {b:>10}  {c:>10}" for a, b, c in rows)

    def __repr__(self) -> str:
        return (f"EvalResult({self.examples} examples of {self.data}: loss {self.base.loss:.4f} (base) → "
                f"{self.fine_tuned.loss:.4f} (fine-tuned), ppl {self.base.ppl:.2f} → {self.fine_tuned.ppl:.2f})")


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50))


def held_out_set(src: Source, tokenizer, data: str | Path | None, max_seq_len: int | None = None,
                 columns: dict[str, str] | None = None, processor=None):
    """The tokenized examples to score (unpacked), where they came from, and what they are to the run
    (``held-out``, ``training`` or ``other``: see :attr:`EvalResult.examples_are`); ``processor``: a picture
    model's, for data with pictures."""
    from finetuner.data.pipeline import prepare_data
    from finetuner.config.sections import DataSection

    recipe = src.recipe
    if data is not None:
        path = locate(str(data), "--data", hub=False)
        base_cfg = recipe.data.model_dump() if recipe is not None else {}
        # another file: its layout is detected on its own (format and column names go together), or named with columns
        base_cfg.update(path=str(path), format="auto", columns=columns or None, val_size=0.0, val_path=None, packing=False,
                        max_examples=None)
        if max_seq_len:
            base_cfg["max_seq_len"] = max_seq_len
        try:
            cfg = DataSection.model_validate(base_cfg)
        except ValueError as e:
            raise UserError(f"--column: {e}") from None
        prepared = prepare_data(cfg, tokenizer, seed=0, processor=processor)
        return prepared.train, str(path), examples_are(recipe, path)
    if recipe is None:
        raise UserError(f"{src.path} is not a run folder, so it has no held-out set.", hint="Pass a data file with --data.")
    cfg = recipe.data
    if not cfg.val_path and not cfg.val_size:
        raise UserError(
            f"The run {src.path} kept no held-out set (data.val_size is 0 and there is no data.val_path).",
            hint="Pass a data file with --data (rows the run did not train on).",
        )
    for p in [cfg.val_path] if cfg.val_path else ([cfg.path] if isinstance(cfg.path, str) else cfg.path):
        if ("/" in p or p.endswith((".json", ".jsonl", ".csv", ".parquet"))) and not Path(p).exists():
            raise UserError(f"The run's data file {p} is gone, so its held-out split cannot be rebuilt.", hint="Pass a data file with --data.")
    prepared = prepare_data(cfg.model_copy(update={"packing": False}), tokenizer, recipe.training.seed, processor)
    what = f"{cfg.val_path}" if cfg.val_path else f"the run's validation split ({len(prepared.val)} rows of {cfg.path})"
    return prepared.val, what, "held-out"


def _loss(model, collate, examples, batch_size: int, device: str, who: str) -> tuple[float, int]:
    """The mean token loss of ``who`` (the fine-tune, the base model) over ``examples``, and the tokens scored."""
    import torch

    from finetuner.model.scoring import token_loss_sum

    total, n = 0.0, 0
    with torch.no_grad(), phases.phase("eval", total=len(examples), unit="examples", label=f"held-out loss of {who}") as p:
        for i in range(0, len(examples), batch_size):
            batch = collate([examples[j] for j in range(i, min(i + batch_size, len(examples)))])
            batch = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items()}
            loss_sum, count = token_loss_sum(model, batch, 1024)
            total += float(loss_sum)
            n += count
            p.advance(min(i + batch_size, len(examples)) - i)
    return total / max(n, 1), n


@dataclass
class Reference:
    """A held-out row to answer: its prompt's token ids (image tokens expanded), the reference reply's, and the
    row's pictures (paths), which go into the generation with the prompt."""

    prompt: list[int]
    reply: list[int]
    images: list[str] = field(default_factory=list)


def _references(examples, limit: int, pictured: set[int] = frozenset()) -> list[Reference]:
    """The first ``limit`` examples with a prompt to answer: the last trained span is the reference. A row with
    image tokens (``pictured``) after its reference is left out: its later pictures are not the prompt's."""
    from finetuner.data.pipeline import IGNORE_INDEX

    out: list[Reference] = []
    for i in range(len(examples)):
        if len(out) >= limit:
            break
        ids, labels = examples[i]["input_ids"], examples[i]["labels"]
        trained = [j for j, t in enumerate(labels) if t != IGNORE_INDEX]
        if not trained or trained[0] == 0:
            continue  # nothing trained, or everything (text / train_on_prompt): no prompt to answer
        end = trained[-1] + 1
        start = end - 1
        while start - 1 >= 0 and labels[start - 1] != IGNORE_INDEX:
            start -= 1
        if start == 0 or pictured.intersection(ids[end:]):
            continue
        out.append(Reference(ids[:start], ids[start:end], list(examples[i].get("images") or [])))
    return out


def _norm(text: str) -> str:
    return " ".join(text.split())


def _exact_match(model, tokenizer, collate, refs: list[Reference], device: str, adapter: bool,
                 who: str) -> tuple[float, list[str]]:
    """The fraction of ``refs`` answered greedily with exactly their reply, and the answers (``who``: whose, in the
    phase's words). Each prompt goes through ``collate``, the loss's collator: a row's pictures reach the model as
    in the loss (pixel values and what the family adds, under ``pictures``: :class:`finetuner.data.images.PictureCollator`)."""
    import contextlib

    import torch

    from finetuner.token_progress import counted

    answers = []
    ctx = contextlib.nullcontext() if adapter or not hasattr(model, "disable_adapter") else model.disable_adapter()
    with ctx, torch.no_grad(), phases.phase("answers", total=len(refs), unit="answers", label=f"exact-match answers of {who}") as p:
        for ref in refs:
            batch = collate([{"input_ids": ref.prompt, "labels": ref.prompt, "images": ref.images}])
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
            inputs.update(batch.get("pictures") or {})
            inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in inputs.items()}
            out = model.generate(**inputs, max_new_tokens=len(ref.reply) + 8, do_sample=False, temperature=None,
                                 top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id, stopping_criteria=counted(tokenizer.eos_token_id))
            answers.append(tokenizer.decode(out[0, len(ref.prompt):], skip_special_tokens=True))
            p.advance()
    hits = [_norm(a) == _norm(tokenizer.decode(r.reply, skip_special_tokens=True)) for a, r in zip(answers, refs)]
    return sum(hits) / max(len(hits), 1), answers


def evaluate_run(
    run: str | Path,
    data: str | Path | None = None,
    exact_match: int = 0,
    batch_size: int = 8,
    device: str = "auto",
    base_model: str | None = None,
    write: bool = True,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    columns: dict[str, str] | None = None,
) -> EvalResult | PreferenceEvalResult | RewardEvalResult:
    """Loss and perplexity of the base model and the fine-tune on held-out data (on preference
    pairs: preference accuracy and margin, a :class:`PreferenceEvalResult`; for a GRPO run: the mean
    reward of completions of its held-out prompts, or of ``data``'s, a :class:`RewardEvalResult`).

    Args:
        run: a run folder (``runs/<name>``) or its ``adapter/`` folder.
        data: a data file to evaluate on instead of the run's validation split.
        columns: which column of ``data`` holds which role (``{"prompt": "frage"}``), as ``data.columns``.
        exact_match: also answer the first N examples greedily and count exact matches with
            the reference replies (data with prompts and replies: alpaca, chat, completion; a chat's pictures
            go into the generation with its prompt, and ``exact_match_pictured`` counts those rows).
        batch_size: examples per forward pass.
        device: ``auto``, ``cpu`` or ``cuda``.
        base_model: where the base model is, if not where the run says.
        write: store the result under ``evaluation`` in the run's ``metrics.json`` (atomically,
            keeping everything else in it).
        trust_remote_code: allow the model's own code to run (a run whose recipe sets
            ``model.trust_remote_code`` is refused without this).
        allow_pickle: allow pickle weight files (a run whose recipe sets ``model.allow_pickle`` is refused without this).

    Example::

        >>> r = finetuner.evaluate_run("runs/demo_cpu")   # doctest: +SKIP
        >>> r.base.loss, r.fine_tuned.loss                 # doctest: +SKIP
    """
    from finetuner.data.formats import SUPERVISED, file_kind
    from finetuner.data.pipeline import Collator

    t0 = time.perf_counter()
    src = resolve_source(run, base_model, trust_remote_code, allow_pickle)
    if not src.has_adapter and src.kind != "full":
        raise UserError(f"{src.path} is a model with no fine-tune to compare.", hint="Give a run folder (runs/<name>).")
    if data is not None:
        data = locate(str(data), "--data", hub=False)
    processor = picture_processor(src)  # a run trained on pictures, or an image-text-to-text model
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(src)
    tokenizer.chat_template = chat_template(src, processor if processor is not None else tokenizer)
    if src.recipe is not None and spec_of(src.recipe.objective).generates:  # rewards of sampled completions
        if exact_match:
            raise UserError("--exact-match: compares replies with a reference; a GRPO run is scored by its reward functions.")
        result = evaluate_rewards(src, tokenizer, data, batch_size, device, load_model)
        if write and src.run_dir is not None:
            record_in_metrics(src.run_dir, result)
        return result
    kind = file_kind(str(data)) if data is not None else (
        "pairs" if src.recipe is not None and spec_of(src.recipe.objective).data_kind == "pairs" else SUPERVISED)
    if kind == "rated" or (data is None and src.recipe is not None and spec_of(src.recipe.objective).data_kind == "rated"):
        raise UserError("finetuner eval scores preference pairs (chosen and rejected); KTO's rated responses have no pairs.",
                        hint="Pass a file of pairs with --data to measure the preference accuracy of a KTO run.")
    if kind == "pairs":  # preference accuracy and margin instead of loss and perplexity
        if exact_match:
            raise UserError("--exact-match: compares generated replies with one reference; pairs have two responses.")
        result = evaluate_pairs(src, tokenizer, data, batch_size, device, load_model)
        if write and src.run_dir is not None:
            record_in_metrics(src.run_dir, result)
        return result
    examples, what, examples_are = held_out_set(src, tokenizer, data, columns=columns, processor=processor)
    if len(examples) == 0:
        raise UserError(f"No examples to evaluate in {what}.")
    collate = Collator(tokenizer.pad_token_id)
    pictured: set[int] = set()
    if processor is not None:
        from finetuner.data.images import PictureCollator, image_token_ids

        collate = PictureCollator(collate, processor)
        pictured = image_token_ids(processor)
    refs = _references(examples, exact_match, pictured) if exact_match else []
    if exact_match and not refs:
        raise UserError(f"--exact-match: {what} has no prompt/reply pairs to compare (text data trains on every token).")

    scores: dict[str, ModelScore] = {}
    answers: dict[str, list[str]] = {}
    requests = _tool_requests(src, data, columns)
    if src.kind == "full":  # two separate models: the base, then the fine-tuned one
        for name, use_adapter, who in (("base", False, "the base model"), ("fine_tuned", True, "the fine-tune")):
            model, dev = load_model(src, adapter=use_adapter, device=device, pictures=processor is not None)
            loss, n = _loss(model, collate, examples, batch_size, dev, who)
            em, answers[name] = _exact_match(model, tokenizer, collate, refs, dev, True, who) if refs else (None, [])
            scores[name] = ModelScore(loss, _ppl(loss), n, em, _tool_score(src, model, tokenizer, dev, processor, requests, True, who))
            del model
    else:
        model, dev = load_model(src, adapter=True, device=device, pictures=processor is not None)
        loss, n = _loss(model, collate, examples, batch_size, dev, "the fine-tune")
        em, answers["fine_tuned"] = (_exact_match(model, tokenizer, collate, refs, dev, True, "the fine-tune")
                                     if refs else (None, []))
        scores["fine_tuned"] = ModelScore(loss, _ppl(loss), n, em,
                                          _tool_score(src, model, tokenizer, dev, processor, requests, True, "the fine-tune"))
        with model.disable_adapter():
            loss, n = _loss(model, collate, examples, batch_size, dev, "the base model")
        em, answers["base"] = (_exact_match(model, tokenizer, collate, refs, dev, False, "the base model")
                               if refs else (None, []))
        scores["base"] = ModelScore(loss, _ppl(loss), n, em,
                                    _tool_score(src, model, tokenizer, dev, processor, requests, False, "the base model"))
    samples = [
        {"prompt": tokenizer.decode(r.prompt, skip_special_tokens=False),
         "reference": tokenizer.decode(r.reply, skip_special_tokens=True), "base": b, "fine_tuned": f}
        for r, b, f in zip(refs[:5], answers.get("base", []), answers.get("fine_tuned", []))
    ]
    result = EvalResult(
        source=str(src.path), data=what, examples=len(examples), base=scores["base"], fine_tuned=scores["fine_tuned"],
        exact_match_examples=len(refs), exact_match_pictured=sum(bool(r.images) for r in refs), samples=samples, seconds=round(time.perf_counter() - t0, 2),
        examples_are=examples_are, tool_call_requests=len(requests),
    )
    if write and src.run_dir is not None:
        record_in_metrics(src.run_dir, result)
    return result


def _tool_requests(src: Source, data: str | Path | None, columns: dict[str, str] | None):
    """The held-out calls of ``data``, else of the rows the run held out (``data.val_path``'s, or the split it drew
    from its data: :func:`finetuner.infer.tool_eval.held_out_requests`, as the run's own end scored them)."""
    from finetuner.data.formats import FileExamples
    from finetuner.infer.tool_eval import held_out_requests, requests_in

    cfg = src.recipe.data if src.recipe is not None else None
    if data is not None:
        return requests_in(FileExamples(str(data), "auto", columns, cfg.system_prompt if cfg else None))
    if cfg is None:
        return []
    stats = run_data_stats(src) or {}
    counts = [stats.get("train_examples"), stats.get("val_examples")]
    tokenized = sum(counts) if all(isinstance(c, int) for c in counts) else None
    return held_out_requests(src.recipe, tokenized) or []


def _tool_score(src: Source, model, tokenizer, device: str, processor, requests, adapter: bool, who: str):
    """The tool-call shares (:mod:`finetuner.infer.tool_eval`) of ``model`` (adapter on or off), None without requests."""
    if not requests:
        return None
    from finetuner.infer.chat import chat_model_for
    from finetuner.infer.tool_eval import score

    return score(chat_model_for(src, model, tokenizer, device, processor), requests, adapter, who)[0].to_dict()


def record_in_metrics(run_dir: Path, result, key: str = "evaluation") -> None:
    """Add the result (an :class:`EvalResult` and the like, or a probe's) under ``key`` in ``metrics.json``
    (atomic; other keys are kept)."""
    import json

    from finetuner.fileio import atomic_write_json

    path = Path(run_dir) / "metrics.json"
    try:
        metrics = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read it to add the evaluation ({e}); nothing was written.") from None
    entry = result.to_dict()
    entry.pop("samples", None)
    entry.pop("answers", None)
    entry["time"] = round(time.time(), 3)
    metrics[key] = entry
    atomic_write_json(path, metrics)

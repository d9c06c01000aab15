"""What the run's model in memory answers (after training: the weights ``adapter/`` holds, the kept best ones with
``training.keep_best``, :attr:`Trainer.answers_from <finetuner.training.trainer.Trainer>`): ``data.replay``'s general answers of the base before the first step
(:func:`mix_replay_rows`), the general probe after the adapter is saved (:func:`general_probe`), the held-out tool
calls (:func:`held_out_tool_calls`) and
``samples.prompts`` after ``done`` (:func:`answer_samples`), each asked in the form the run's rows trained in
(:meth:`Trainer.prompt_switches <finetuner.training.trainer.Trainer.prompt_switches>`). ``trainer``: the run's
:class:`~finetuner.training.trainer.Trainer` (not imported here: it imports this module)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from finetuner.fileio import atomic_write_json
from finetuner.training.prediction import measured_wait
from finetuner.training.result import TrainResult

log = logging.getLogger(__name__)


def run_chat(trainer, system: str | None, tools: list[dict[str, Any]] | None = None):
    """The model in memory as a :class:`~finetuner.infer.chat.ChatModel` (its adapter switchable), asking as
    ``finetuner chat RUN`` asks (:func:`finetuner.infer.chat.chat_model_for`): the run's template and thinking form,
    ``system`` and ``tools``, the rows' tool format, the model's context."""
    from finetuner.infer.chat import ChatModel
    from finetuner.infer.loading import Source, context_length

    r = trainer.recipe
    renders = (trainer.data.stats.tools or {}).get("renders")
    return ChatModel(model=trainer.model, tokenizer=trainer.tokenizer, template=trainer.data.chat_template,
                     device=str(trainer.rt.device), source=Source(trainer.run_dir, "run", r.model.name, recipe=r),
                     system=system, max_context=context_length(trainer.model, trainer.tokenizer),
                     switches=trainer.prompt_switches(), tools=tools or None, tools_trained=renders)


def run_tools(trainer) -> list[dict[str, Any]] | None:
    """The tool schemas a tool-calling run's rows offered (:func:`finetuner.data.tools.offered_tools`, the data read
    again), None for a run whose rows have no tools."""
    r = trainer.recipe
    if not trainer.data.stats.tools or not r.data.path:
        return None
    from finetuner.data.pipeline import DataStats, load_examples
    from finetuner.data.tools import offered_tools

    quiet = r.data.model_copy(update={"on_bad_row": "skip"})  # what the run refused, it refused already
    return offered_tools(load_examples(r.data.path, quiet, DataStats())) or None


@contextlib.contextmanager
def answering(model):
    """Greedy answers from the model in memory: eval mode (no dropout), the KV cache on; restored after."""
    config = model.config
    was_training, use_cache = model.training, config.use_cache
    model.eval()
    config.use_cache = True
    try:
        yield
    finally:
        config.use_cache = use_cache
        model.train(was_training)


def mix_replay_rows(trainer) -> dict[str, Any] | None:
    """``data.replay``: the base model's answers to general prompts (the model in memory before any step, the
    adapter off, without the user's system prompt) mixed into the training rows (:mod:`finetuner.data.replay`).
    None when the recipe asks for none."""
    r = trainer.recipe
    if not r.data.replay:  # the recipe allows it for SFT on one process only
        return None
    from finetuner.data.replay import BATCH, MAX_NEW_TOKENS, ROUTINE_REASONS, base_model, mix_replay

    chat = run_chat(trainer, system=None)  # never the user's system prompt

    def answer(prompts: list[str]) -> list[str]:
        log.info("data.replay: the base model answers %d general prompts", len(prompts))
        with answering(trainer.model), trainer.phase("replay", total=len(prompts), unit="answers",
                                                     predicted_s=trainer.predicted_part("replay")):
            return chat.greedy_replies([[{"role": "user", "content": p}] for p in prompts], adapter=False,
                                       max_new_tokens=MAX_NEW_TOKENS, batch=BATCH)

    base = base_model(r.model.name, r.model.revision, trainer.rt.base_dtype, trainer.model, trainer.tokenizer,
                      trainer.data.chat_template, trainer.prompt_switches())
    trainer.data, info = mix_replay(trainer.data, r.data, trainer.tokenizer, base, r.training.seed, answer)
    # the answers made again for a reason (another base, a damaged file) or left uncached: a warning (the CLI
    # prints it; the progress printer says the routine ones)
    (log.info if info["reason"] in ROUTINE_REASONS else log.warning)("%s", info["message"])
    trainer.events.emit("replay", rows=info["rows"], ratio=info["ratio"], from_cache=info["from_cache"],
                        reason=info["reason"], changed=info["changed"], message=info["message"], cache=info["cache"],
                        weights=info["weights"], prompts_file=info["prompts_file"])
    return info


def general_probe(trainer):
    """What the fine-tune kept (:mod:`finetuner.infer.probe`): the base (the adapter switched off) and the
    fine-tune answer ``training.general_probe`` general questions with the model in memory; None when the run
    has no adapter to switch off, is spread over processes, or is set to ask none. A failure is a warning:
    the trained adapter is saved already."""
    from finetuner.infer.probe import run_probe_count

    r = trainer.recipe
    n = run_probe_count(r.training.general_probe, cuda=trainer.rt.is_cuda)
    if not n or r.method == "full" or trainer.world_size != 1 or not hasattr(trainer.model, "disable_adapter"):
        return None
    from finetuner.infer.probe import probe_chat

    from finetuner.data.pipeline import run_system_prompt

    # as the run's model is asked (chat's default and the Modelfile's SYSTEM too)
    chat = run_chat(trainer, system=run_system_prompt(r.data.system_prompt, trainer.data.stats.to_dict()))
    try:
        with answering(trainer.model), trainer.phase("probe", unit="answers", predicted_s=trainer.predicted_part("probe")):
            return probe_chat(chat, str(trainer.run_dir), limit=n)  # counts its answers (phases.expect, advance)
    except Exception as e:  # noqa: BLE001 - the run is trained and saved; the probe is a report on it
        log.warning("The general probe failed (%s: %s); `finetuner eval %s --general` runs it again.",
                    type(e).__name__, e, trainer.run_dir)
        return None


def held_out_tool_calls(trainer) -> dict[str, Any] | None:
    """What the fine-tune learned of calling tools (:mod:`finetuner.infer.tool_eval`): the base (the adapter switched
    off) and the fine-tune asked each tool call of the rows the run held out, greedy, as ``finetuner chat --tools``
    asks; None when the rows have no tools, the run has no adapter to switch off or is spread over processes, or
    holds out no call. A failure is a warning: the trained adapter is saved already."""
    r, stats = trainer.recipe, trainer.data.stats
    if not stats.tools or r.method == "full" or trainer.world_size != 1 or not hasattr(trainer.model, "disable_adapter"):
        return None
    from finetuner.data.pipeline import run_system_prompt
    from finetuner.infer import tool_eval

    try:
        requests = tool_eval.held_out_requests(r, tokenized=stats.train_examples + stats.val_examples)
        if requests is None:
            log.info("The held-out tool calls are not scored: the rows the run held out cannot be told apart from "
                     "the rows it skipped; `finetuner eval %s --data FILE` scores a file of them.", trainer.run_dir)
            return None
        if not requests:
            return None
        began = time.perf_counter()
        chat = run_chat(trainer, system=run_system_prompt(r.data.system_prompt, stats.to_dict()))
        with answering(trainer.model), trainer.phase("tool_calls", total=2 * len(requests), unit="answers",
                                                     predicted_s=trainer.predicted_part("tool_calls")) as progress:
            base, _ = tool_eval.score(chat, requests, False, "the base model", progress=progress)
            tuned, _ = tool_eval.score(chat, requests, True, "the fine-tune", progress=progress)
        return tool_eval.scores_entry(len(requests), base, tuned, time.perf_counter() - began)
    except Exception as e:  # noqa: BLE001 - the run is trained and saved; the scores are a report on it
        log.warning("Scoring the held-out tool calls failed (%s: %s); `finetuner eval %s` scores them again.",
                    type(e).__name__, e, trainer.run_dir)
        return None


def answer_samples(trainer, result: TrainResult) -> None:
    """``samples.prompts`` answered greedily by the fine-tune and the base (after ``done``), each asked as
    ``finetuner chat RUN -p`` asks it (:meth:`~finetuner.infer.chat.ChatModel.answer`: the run's system prompt, a
    tool-calling run's tools, its thinking form) with the weights ``adapter/`` holds (the kept best ones with
    ``keep_best``); new tokens from :func:`~finetuner.infer.generate.sample_new_tokens`. Each answer is kept as the
    text after its reasoning (``fine_tuned``, ``base``) and the reasoning apart (``*_reasoning``, when it reasoned).
    Into ``metrics.json`` (``samples``, and how they were asked: ``samples_asked``), with their time, and the
    ``samples`` event."""
    from finetuner.data.pipeline import run_system_prompt
    from finetuner.data.thinking import split_reply
    from finetuner.data.tools import tool_names
    from finetuner.infer.generate import AUTO_ROWS, sample_new_tokens
    from finetuner.planning.wait import sample_answers

    import finetuner.phases as phases

    r = trainer.recipe
    began = time.perf_counter()
    has_adapter = hasattr(trainer.model, "disable_adapter")
    answers = sample_answers(len(r.samples.prompts), "full" if not has_adapter else r.method)
    system = run_system_prompt(r.data.system_prompt, trainer.data.stats.to_dict())
    tools = run_tools(trainer)
    chat = run_chat(trainer, system=system, tools=tools)
    train = trainer.data.train
    labels = (train.select(range(min(AUTO_ROWS, len(train))))["labels"]
              if r.samples.max_new_tokens == "auto" and "labels" in (getattr(train, "column_names", None) or []) else None)
    new_tokens, why = sample_new_tokens(r.samples.max_new_tokens, labels)
    gen = dict(temperature=0, max_new_tokens=new_tokens)
    samples = []
    with answering(trainer.model), trainer.phase("samples", total=answers, unit="answers",
                                                 predicted_s=trainer.predicted_part("samples")):
        for prompt in r.samples.prompts:
            entry: dict[str, Any] = {"prompt": prompt}
            for who, on in (("fine_tuned", True), ("base", False)):
                if not on and not has_adapter:
                    entry[who] = None
                    continue
                reasoning, entry[who] = split_reply(chat.answer(prompt, adapter=on, **gen))
                if reasoning is not None:
                    entry[f"{who}_reasoning"] = reasoning
                phases.advance()  # the "samples" phase's count
            samples.append(entry)
    took = time.perf_counter() - began
    asked = {"system_prompt": system, "tools": tool_names(tools) if tools else None, "max_new_tokens": new_tokens,
             "max_new_tokens_from": why, "thinking": chat.switches or None,
             "answers_from": getattr(trainer, "answers_from", None)}
    result.metrics["samples"] = samples
    result.metrics["samples_asked"] = asked
    result.metrics.setdefault("threads", {})["samples"] = trainer.phase_threads.get("samples")
    if "time" in result.metrics:  # the samples' time, and the total with them
        result.metrics["time"]["measured"] = measured_wait(trainer, took)
    atomic_write_json(trainer.run_dir / "metrics.json", result.metrics)
    trainer.events.emit("samples", samples=samples, asked=asked, samples_s=round(took, 3))

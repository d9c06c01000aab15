"""Talking to a fine-tuned model: streaming replies with the chat template the run trained with.

The engine behind ``finetuner chat``, the notebook's ``Run.generate`` and the web UI's chat
worker::

    from finetuner.infer.chat import load_chat_model
    chat = load_chat_model("runs/demo_cpu")
    for piece in chat.stream([{"role": "user", "content": "What should I pack?"}]):
        print(piece, end="", flush=True)
    chat.reply(messages, adapter=False)      # the base model's answer (adapter switched off)
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import finetuner.phases as phases
from finetuner.errors import UserError
from finetuner.data.thinking import prompt_switches
from finetuner.infer.loading import (Source, chat_template, context_length, load_model, load_tokenizer, picture_processor,
                                    resolve_source, system_prompt, trained_thinking, trained_tools)


@dataclass
class ChatModel:
    """A loaded model ready to chat: the model (a peft model when it has an adapter), its tokenizer,
    the chat template, the device, and the system prompt the run trained with (if any)."""

    model: Any
    tokenizer: Any
    template: str
    device: str
    source: Source
    system: str | None = None
    max_context: int = 2048
    #: an image-text-to-text model's processor (it reads pictures: ``images=`` in :meth:`stream`), else None
    processor: Any = None
    #: the chat template's keyword arguments: the thinking form the run's rows trained in
    #: (:func:`finetuner.data.thinking.prompt_switches`; ``finetuner chat --thinking`` sets another)
    switches: dict[str, Any] = field(default_factory=dict)
    #: tool schemas offered with every prompt (``finetuner chat --tools``, the UI's tools file), None: no tools
    tools: list[dict[str, Any]] | None = None
    #: how the run's rows with tools rendered (``"template"`` or ``"hermes"``, from its ``metrics.json``), which a
    #: prompt with :attr:`tools` follows; None decides from the template as training does
    tools_trained: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def has_adapter(self) -> bool:
        return hasattr(self.model, "disable_adapter")

    def describe(self) -> str:
        """What answers, in one line for people (the web UI's chat status): the run or model, whether its adapter is
        on, the device and the context it takes."""
        what = "its adapter on" if self.has_adapter else "no adapter"
        return f"{self.source.describe()}, {what}, on {self.device}, up to {self.max_context:,} tokens of context"

    def __repr__(self) -> str:
        what = "adapter on" if self.has_adapter else "no adapter"
        return f"ChatModel({self.source.describe()}, {what}, {self.device}, context {self.max_context})"

    # ------------------------------------------------------------------ prompts
    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for ``messages`` (with the run's system prompt when none is given)."""
        if not messages:
            raise UserError("No messages to answer.", hint='Give a list like [{"role": "user", "content": "Hi"}].')
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError(f"message {i + 1} needs 'role' and 'content' keys (got {m!r}).")
        if self.system and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system}, *messages]
        if self.processor is not None:  # pictures (the <image> placeholders) as content parts, as in training
            from finetuner.data.images import message_parts

            messages = message_parts(messages)
        switches = self.switches
        if self.tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            from finetuner.data.tools import prompt_form

            messages, extra = prompt_form(self.tokenizer, self.template, messages, self.tools or [], self.tools_trained)
            switches = {**switches, **extra}
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False, add_generation_prompt=True,
                                                  **switches)

    def with_pictures(self, messages: list[dict[str, str]], images: list[str]) -> list[dict[str, str]]:
        """``messages`` with ``images`` (paths) placed before the last user message's text, unless the messages
        already hold as many ``<image>`` placeholders; a model that reads no pictures, or a missing picture, is a
        :class:`UserError`."""
        from finetuner.data.formats import IMAGE_PLACEHOLDER

        if self.processor is None:
            raise UserError(f"{self.source.describe()} reads no pictures: --image needs an image-text-to-text model "
                            "(or a run trained on pictures).")
        for p in images:
            if not Path(p).expanduser().is_file():
                raise UserError(f"--image {p}: no such file.")
        placed = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if placed == len(images):
            return messages
        if placed:
            raise UserError(f"{placed} {IMAGE_PLACEHOLDER} placeholder(s) in the messages for {len(images)} picture(s).")
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        return [*messages[:last], {**messages[last], "content": IMAGE_PLACEHOLDER * len(images) + messages[last]["content"]},
                *messages[last + 1:]]

    def inputs(self, messages: list[dict[str, str]], images: list[str] | None = None) -> dict[str, Any]:
        """The model's inputs for ``messages``: the prompt's token ids (and, with ``images``, the processor's
        image tokens and pixel values)."""
        import torch

        if not images:
            ids = self.encode(messages)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        from finetuner.data.formats import RowError
        from finetuner.data.picture_files import load_picture, pixel_limit

        messages = self.with_pictures(messages, images)
        limit = pixel_limit(self.processor)
        try:
            pictures = [load_picture(str(Path(p).expanduser()), limit) for p in images]
        except RowError as e:
            raise UserError(f"--image: {e}.") from None
        enc = self.processor(text=[self.render(messages)], images=pictures, return_tensors="pt", add_special_tokens=False)
        if int(enc["input_ids"].shape[1]) >= self.max_context:
            raise UserError(f"The conversation and its pictures are {int(enc['input_ids'].shape[1])} tokens long; the "
                            f"model's context is {self.max_context} tokens.")
        return dict(enc)

    def encode(self, messages: list[dict[str, str]]):
        from finetuner.data.textcut import char_budget

        text = self.render(messages)
        budget = char_budget(self.tokenizer, self.max_context)
        if len(text) > budget:  # more tokens than the context for certain: refused without tokenizing it all
            raise UserError(
                f"The conversation is {len(text):,} characters long; the model's context is {self.max_context} tokens "
                f"(at most {budget:,} characters).",
                hint="Shorten the prompt, or start a new conversation (/reset in `finetuner chat`).",
            )
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        n = int(ids.shape[1])
        if n >= self.max_context:
            raise UserError(
                f"The conversation is {n} tokens long; the model's context is {self.max_context} tokens.",
                hint="Shorten the prompt, or start a new conversation (/reset in `finetuner chat`).",
            )
        return ids

    # ------------------------------------------------------------------ generation
    @contextlib.contextmanager
    def adapter(self, on: bool):
        """The adapter switched on (``True``) or off for what runs inside (nothing to switch on a model without one)."""
        if on or not self.has_adapter:
            yield
        else:
            with self.model.disable_adapter():
                yield

    def stream(
        self,
        messages: list[dict[str, str]],
        max_new_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 0.9,
        seed: int | None = None,
        adapter: bool = True,
        images: list[str] | None = None,
    ) -> Iterator[str]:
        """Yield the reply to ``messages`` piece by piece as it is generated; ``images``: pictures (paths) for a
        model that reads them, placed where the messages' ``<image>`` placeholders are, or before the last user
        message's text.

        ``temperature`` 0 is greedy decoding; ``seed`` makes sampling repeatable; ``adapter=False``
        answers with the base model (the adapter switched off). A conversation longer than the
        model's context raises :class:`~finetuner.errors.UserError`; the reply is cut at the context.
        Byte sequences the model samples that are not valid UTF-8 are dropped, never shown as
        U+FFFD (:func:`finetuner.infer.generate.text_streamer`). Closing the iterator early (``break``)
        stops the generation.

        Example::

            >>> for piece in chat.stream([{"role": "user", "content": "Hi"}], seed=0):  # doctest: +SKIP
            ...     print(piece, end="")
        """
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        from finetuner.infer.generate import text_streamer
        from finetuner.token_progress import counted

        cancel = threading.Event()

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs) -> bool:
                return cancel.is_set()

        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be at least 1 (got {max_new_tokens}).")
        if temperature < 0 or not 0 < top_p <= 1:
            raise UserError(f"temperature must be >= 0 and top_p in (0, 1] (got {temperature}, {top_p}).")
        inputs = self.inputs(messages, images)
        max_new_tokens = min(max_new_tokens, self.max_context - int(inputs["input_ids"].shape[1]))
        streamer = text_streamer(self.tokenizer, timeout=600)  # no U+FFFD: see finetuner.infer.generate
        kwargs: dict[str, Any] = dict(
            **{k: v.to(self.device) for k, v in inputs.items()},
            max_new_tokens=max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self._stop_ids(),
            streamer=streamer,
            # its tokens counted into the phase this thread opened (the tool calls' scores), generated in another
            stopping_criteria=StoppingCriteriaList([_Cancelled(), *counted(self._stop_ids())]),
        )
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=None)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with self._lock, self.adapter(adapter), torch.no_grad():
                    if seed is not None:
                        torch.manual_seed(seed)
                    self.model.generate(**kwargs)
            except BaseException as e:  # re-raised in the caller's thread
                failure.append(e)
                streamer.end()

        worker = threading.Thread(target=run, name="finetuner-generate", daemon=True)
        worker.start()
        try:
            for piece in streamer:
                if piece:
                    yield piece
        finally:  # also when the caller stops early (break, Ctrl-C): generation stops at the next token
            cancel.set()
            worker.join()
        if failure:
            raise failure[0]

    def greedy_replies(self, conversations: list[list[dict[str, str]]], adapter: bool = True, max_new_tokens: int = 32,
                       batch: int = 16) -> list[str]:
        """Greedy replies to many short conversations, ``batch`` at a time in one ``generate`` call each (padded on
        the left): what a probe of many questions needs, several times faster than one :meth:`reply` each on a CPU.
        ``adapter=False``: the base model's."""
        import torch

        from finetuner.infer.generate import clean_text
        from finetuner.token_progress import counted

        tok = self.tokenizer
        out: list[str] = []
        side, pad = tok.padding_side, tok.pad_token
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        try:
            for start in range(0, len(conversations), batch):
                texts = [self.render(c) for c in conversations[start:start + batch]]
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
                with self._lock, self.adapter(adapter), torch.no_grad():
                    ids = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                                              top_p=None, top_k=None, pad_token_id=tok.pad_token_id,
                                              eos_token_id=self._stop_ids(),
                                              stopping_criteria=counted(self._stop_ids()))  # tokens as they come
                width = enc["input_ids"].shape[1]
                out += [clean_text(tok.decode(row[width:], skip_special_tokens=True)).strip() for row in ids]
                phases.advance(len(texts))  # the open phase's count (replay, probe), if one is open
        finally:
            tok.padding_side, tok.pad_token = side, pad
        return out

    def reply(self, messages: list[dict[str, str]], **gen: Any) -> str:
        """The whole reply to ``messages`` as one string (same settings as :meth:`stream`)."""
        return "".join(self.stream(messages, **gen)).strip()

    def tool_reply(self, messages: list[dict[str, Any]], **gen: Any):
        """The reply to ``messages`` (same settings as :meth:`stream`) read for tool calls
        (:func:`finetuner.data.calls.parse_reply`): its calls as ``{"name", "arguments"}`` when it makes any, its
        text otherwise. The reply is decoded without special tokens, so a marker that is one (Mistral's
        ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``) is gone and the call's bare JSON is read."""
        from finetuner.data.calls import parse_reply

        return parse_reply(self.reply(messages, **gen))

    def answer(self, prompt: str, **gen: Any) -> str:
        """The reply to one user ``prompt`` as ``finetuner chat -p`` prints it (same settings as :meth:`stream`):
        asked with the system prompt, the tools and the thinking form this model has (:meth:`render`); offered
        tools, its calls as JSON (one line a call) when it makes any, else its text. The run's sample answers are
        asked here too (:func:`finetuner.training.samples.answer_samples`)."""
        messages = [{"role": "user", "content": prompt}]
        if not self.tools:
            return self.reply(messages, **gen)
        return self.tool_reply(messages, **gen).shown()

    def _stop_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok) if tok in self.tokenizer.get_vocab() else None
            ids.add(tid)
        return sorted(i for i in ids if isinstance(i, int))


def load_chat_model(
    run_or_model: str | Path,
    adapter: bool = True,
    device: str = "auto",
    base_model: str | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
) -> ChatModel:
    """Load a run folder, a peft adapter folder, a model folder or a hub id for chatting.

    Args:
        run_or_model: e.g. ``"runs/demo_cpu"``, ``"runs/demo_cpu/adapter"``, ``"exports/merged"``.
        adapter: attach the run's adapter (``False`` loads the base model alone). With the adapter
            attached, ``stream(..., adapter=False)`` still answers as the base model.
        device: ``auto`` (the GPU if there is one), ``cpu`` or ``cuda``.
        base_model: where the base model is, if not where the run or adapter says.
        trust_remote_code: allow the model's own code to run (needed when the run's recipe sets
            ``model.trust_remote_code``; a run with it on is refused without this).
        allow_pickle: allow pickle weight files to be unpickled (as ``trust_remote_code``, for ``model.allow_pickle``).

    Example::

        >>> chat = load_chat_model("runs/demo_cpu")                                # doctest: +SKIP
        >>> chat.reply([{"role": "user", "content": "Tell me about the puffin."}])  # doctest: +SKIP
    """
    src = resolve_source(run_or_model, base_model, trust_remote_code, allow_pickle)
    processor = picture_processor(src)
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(src)
    model, dev = load_model(src, adapter=adapter, device=device, pictures=processor is not None)
    return chat_model_for(src, model, tokenizer, dev, processor)


def chat_model_for(src: Source, model: Any, tokenizer: Any, device: str, processor: Any = None) -> ChatModel:
    """A :class:`ChatModel` of a model already loaded from ``src`` (``finetuner eval`` asks its tool calls with the
    model it scored): the run's chat template, system prompt, thinking form and tool format."""
    template = chat_template(src, processor if processor is not None else tokenizer)
    return ChatModel(
        model=model,
        tokenizer=tokenizer,
        template=template,
        device=device,
        source=src,
        system=system_prompt(src),
        max_context=context_length(model, tokenizer),
        processor=processor,
        switches=prompt_switches(template, trained_thinking(src)),
        tools_trained=trained_tools(src),
    )

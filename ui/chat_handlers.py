"""What the Chat tab does: one exchange with a finished run, answered beside its base model.
A mixin of :class:`ui.handlers.Handlers`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import gradio as gr

from finetuner.errors import UserError
from finetuner.units import duration_text
from ui.errors import error_md, on_page, steps_in_ui



def message_text(content: Any) -> str:
    """A chat message's text, whether gradio hands it over as a string or as content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    if isinstance(content, (list, tuple)):
        return "".join(message_text(c) for c in content)
    return "" if content is None else str(content)




def settings_text(gen: dict) -> str:
    """The settings an answer was generated with, so that a sampled answer can be repeated."""
    if gen["temperature"] == 0:
        return f"greedy, at most {gen['max_new_tokens']} tokens"
    seed = "no seed" if gen["seed"] is None else f"seed {gen['seed']}"
    return f"temperature {gen['temperature']:g}, top-p {gen['top_p']:g}, {seed}, at most {gen['max_new_tokens']} tokens"



class ChatHandlers:
    """The Chat tab's handlers (a part of :class:`ui.handlers.Handlers`)."""

    # ------------------------------------------------------------------ chat
    def reads_pictures(self, run: str | None) -> bool:
        """Whether the chosen run's model reads pictures (:func:`finetuner.infer.loading.picture_processor_at`, from
        its files: nothing is loaded); False for a run that is not there or not finished."""
        from finetuner.infer.loading import picture_processor_at, resolve_source

        try:
            with on_page(self):
                # only its files are looked at here: loading it still asks for the code box (confirm_code)
                src = resolve_source(self.run_path(run), trust_remote_code=True, allow_pickle=True)
                return picture_processor_at(src) is not None
        except Exception:  # noqa: BLE001 - no run, or one that cannot load: no picture box (chatting says why)
            return False

    def on_chat_run(self, run: str | None):
        """The Chat tab's run chosen: the picture upload is shown only for a model that reads pictures (a picture
        left from another run is dropped with it)."""
        if self.reads_pictures(run):
            return gr.update(visible=True)
        return gr.update(visible=False, value=None)

    def on_chat(self, message: str, tuned_hist: list, base_hist: list, *settings):
        """One exchange in both lanes; an error puts the message and the conversations back as
        they were and says why in the status line."""
        try:
            yield from steps_in_ui(self._chat(message, tuned_hist, base_hist, *settings), self)
        except Exception as e:  # noqa: BLE001
            yield message, tuned_hist, base_hist, error_md(e)

    def _chat(self, message: str, tuned_hist: list, base_hist: list, run: str, compare: bool,
              max_new: float, temperature: float, top_p: float, seed: float | None, allow_code: bool = False,
              picture: str | None = None, tools: str | None = None):
        from finetuner.data.calls import parse_reply
        from finetuner.data.tools import tools_file

        if not (message or "").strip():
            raise UserError("Type a message first.")
        schemas = tools_file(tools) if tools else None  # offered with the message; a reply's calls shown as JSON
        self.confirm_code(run, bool(allow_code), rewards=False)
        source = str(self.run_path(run))
        gen = {"max_new_tokens": int(max_new), "temperature": float(temperature), "top_p": float(top_p),
               "seed": int(seed) if seed not in (None, "") else None}
        if picture:  # the uploaded picture goes with this message (a model that reads pictures; others say so)
            gen["images"] = [str(picture)]
        lanes = [("tuned", True, list(tuned_hist or []))] + ([("base", False, list(base_hist or []))] if compare else [])
        convo = {name: hist + [{"role": "user", "content": message}] for name, _a, hist in lanes}
        shown = {name: convo[name] + [{"role": "assistant", "content": "…"}] for name in convo}
        t0 = time.monotonic()
        allow_code = bool(allow_code)
        fresh = not self.chat_pool.is_loaded(source, allow_code)
        yield "", shown["tuned"], shown.get("base", base_hist), "Loading the model…" if fresh else "Answering…"
        texts = {name: "" for name in convo}
        with self.chat_pool.lease(source, allow_code) as worker:  # not closed under this session while it answers
            for waited in worker.loading(every=1.0):  # a model that loads for minutes is seen loading, not hanging
                yield gr.skip(), shown["tuned"], shown.get("base", base_hist), f"Loading the model… {waited:.0f} s"
            yield gr.skip(), shown["tuned"], shown.get("base", base_hist), "Answering…"
            for name, adapter, _h in lanes:  # one model in one process: the lanes answer in turn
                msgs = [{"role": m["role"], "content": message_text(m["content"])} for m in convo[name]]
                for piece in worker.stream(msgs, adapter=adapter, tools=schemas, **gen):
                    texts[name] += piece
                    shown[name] = convo[name] + [{"role": "assistant", "content": texts[name]}]
                    yield gr.skip(), shown["tuned"], shown.get("base", base_hist), "Answering…"
                called = parse_reply(texts[name]) if schemas else None
                if called is not None and called.calls:
                    texts[name] = f"```json\n{called.to_json()}\n```"
                shown[name] = convo[name] + [{"role": "assistant", "content": texts[name].strip() or "(no answer)"}]
            describe = worker.describe
        took = time.monotonic() - t0
        yield (gr.skip(), shown["tuned"], shown.get("base", base_hist),
               f"Answered in {duration_text(took)}{' (including loading the model)' if fresh else ''} · {settings_text(gen)}"
               f"{' · with the picture ' + Path(picture).name if picture else ''} · {describe}")

    # ------------------------------------------------------------------ export

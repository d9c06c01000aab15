"""Which chat template a run trains with, and why: one decision for training, the run's samples, the plan, chat,
merge, GGUF export (its ``tokenizer.chat_template``) and the Ollama Modelfile.

In order: the recipe's ``data.chat_template``; the tokenizer's own (a run's adapter folder keeps the one it
trained with, so everything read from a run finds it there); else — a base model whose tokenizer has none —
:data:`FALLBACK_CHAT_TEMPLATE`, finetuner's plain template, which the plan states before anything is trained.
A tokenizer that puts its beginning-of-sequence token before every text (Gemma's, Llama 2's: the base model read
all of its pre-training after it) gets the plain template begun with that token, :data:`FALLBACK_BOS_CHAT_TEMPLATE`:
chat-rendered text is tokenized without the tokenizer's own special tokens everywhere, so without it such a model
would train and answer on text it never saw the start of (Gemma 3 270M's GGUF, trained as
tests/model/test_gemma3_gguf_real.py trains it, measured 2026-12-02: first-step loss 8.64 without, 5.10 with).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: Used when neither the recipe nor the tokenizer has a chat template. Turns end with the
#: tokenizer's EOS token so the model learns to stop and generation stops there.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
#: the same, begun with the tokenizer's beginning-of-sequence token (a tokenizer that puts it before every text)
FALLBACK_BOS_CHAT_TEMPLATE = "{{ bos_token }}" + FALLBACK_CHAT_TEMPLATE
#: the templates a run of a base model without one trains with (and saves with its adapter)
FALLBACKS = (FALLBACK_CHAT_TEMPLATE, FALLBACK_BOS_CHAT_TEMPLATE)
#: what the plan and the run call it
FALLBACK_NAME = ("finetuner's plain template ('<|user|>' and '<|assistant|>' lines, each answer ended by the "
                 "tokenizer's end-of-sequence token)")
BOS_NAME = ", begun with the tokenizer's beginning-of-sequence token as every text of its pre-training was"


@dataclass(frozen=True)
class TemplateChoice:
    """The chat template and where it comes from: ``recipe``, ``tokenizer`` or ``fallback``."""

    template: str
    source: str

    @property
    def why(self) -> str:
        """``no chat template in the tokenizer: finetuner's plain template (...)``, as the plan says it."""
        if self.source == "recipe":
            return "the recipe's data.chat_template"
        if self.source == "tokenizer":
            return "the tokenizer's own chat template"
        bos = BOS_NAME if self.template == FALLBACK_BOS_CHAT_TEMPLATE else ""
        return f"no chat template in the tokenizer: {FALLBACK_NAME[:-1]}{bos})"


def choose(recipe_template: str | None, tokenizer_template: Any, adds_bos: bool = False) -> TemplateChoice:
    """The one decision (see the module's docstring); ``adds_bos``: the tokenizer puts its beginning-of-sequence token
    before every text."""
    if recipe_template:
        return TemplateChoice(recipe_template, "recipe")
    if isinstance(tokenizer_template, str) and tokenizer_template and tokenizer_template not in FALLBACKS:
        return TemplateChoice(tokenizer_template, "tokenizer")
    if tokenizer_template in FALLBACKS:  # the fallback a run saved with its adapter: the one it trained with
        return TemplateChoice(tokenizer_template, "fallback")
    return TemplateChoice(FALLBACK_BOS_CHAT_TEMPLATE if adds_bos else FALLBACK_CHAT_TEMPLATE, "fallback")


def adds_token(tokenizer: Any, special_id: int | None, end: bool = False) -> bool:
    """Whether encoding with the tokenizer's special tokens puts ``special_id`` at the start (``end``: the end) of a
    text: what the tokenizer adds by itself (also the GGUF export's ``add_bos_token`` / ``add_eos_token``)."""
    if not isinstance(special_id, int):
        return False
    plain = tokenizer("a b", add_special_tokens=False)["input_ids"]
    full = tokenizer("a b", add_special_tokens=True)["input_ids"]
    if len(full) <= len(plain):
        return False
    return (full[-1] if end else full[0]) == special_id


def adds_bos(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (or a processor's) puts its beginning-of-sequence token before a text it encodes."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    try:
        return adds_token(tok, getattr(tok, "bos_token_id", None))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode two letters trains on nothing either
        return False


def for_tokenizer(recipe_template: str | None, tokenizer: Any) -> TemplateChoice:
    """:func:`choose` for a loaded tokenizer (or processor)."""
    template = getattr(tokenizer, "chat_template", None)
    needs = not recipe_template and not (isinstance(template, str) and template)  # asked only for the fallback
    return choose(recipe_template, template, adds_bos(tokenizer) if needs else False)


def for_model(model: str, recipe_template: str | None = None) -> TemplateChoice | None:
    """:func:`choose` for a model name before its tokenizer is loaded (the plan): the template a GGUF file's header,
    a model folder's tokenizer files or the hub cache's copy of them hold; None when it cannot be told without a
    download."""
    if recipe_template:
        return choose(recipe_template, None)
    stored = _stored(model)
    if stored is ...:
        return None
    return choose(None, stored, _stored_adds_bos(model) if stored is None else False)


_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def _stored(model: str) -> Any:
    """The chat template stored with ``model`` (None: none), or ``...`` when its files are not here."""
    from finetuner.fileio import exists, expand_user
    from finetuner.model import gguf_base
    from finetuner.model.shapes import preset_model

    model = preset_model(model) or model
    if gguf_base.is_gguf_name(model):
        path = expand_user(model)
        return gguf_base.read(path).chat_template if exists(path, "file") else ...
    folder = expand_user(model)
    if exists(folder, "dir"):
        found = {name: folder / name for name in _FILES if exists(folder / name, "file")}
        return _from_files(found) if found else ...
    if "/" not in model:
        return ...
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return ...
    found = {}
    for name in _FILES:
        try:
            hit = try_to_load_from_cache(model, name)
        except Exception:  # noqa: BLE001 - a name that is no repo id
            return ...
        if isinstance(hit, str):
            found[name] = hit
    return _from_files(found) if "tokenizer_config.json" in found else ...


def _stored_adds_bos(model: str) -> bool:
    """Whether the tokenizer of ``model`` (whose files are here, without a chat template) puts its beginning-of-sequence
    token first: a GGUF file's ``tokenizer.ggml.add_bos_token`` (what transformers' GGUF tokenizer follows), a
    folder's tokenizer loaded."""
    from finetuner.fileio import exists, expand_user
    from finetuner.model import gguf_base
    from finetuner.model.shapes import preset_model

    model = preset_model(model) or model
    if gguf_base.is_gguf_name(model):
        return gguf_base.read(expand_user(model)).adds_bos
    name = str(expand_user(model)) if exists(expand_user(model), "dir") else model  # a folder, or the hub cache's copy
    try:
        from transformers import AutoTokenizer

        return adds_bos(AutoTokenizer.from_pretrained(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - files the run itself will refuse with its own message
        return False


def _from_files(found: dict[str, Any]) -> Any:
    """The chat template in a tokenizer's files (the ``.jinja`` file, ``chat_template.json``, or the key of
    ``tokenizer_config.json``), None when none holds one; ``...`` when they cannot be read."""
    from pathlib import Path

    try:
        if "chat_template.jinja" in found:
            return Path(found["chat_template.jinja"]).read_text(encoding="utf-8") or None
        for name in ("chat_template.json", "tokenizer_config.json"):
            if name in found:
                value = json.loads(Path(found[name]).read_text(encoding="utf-8")).get("chat_template")
                if value:
                    return value if isinstance(value, str) else json.dumps(value)
    except (OSError, ValueError):
        return ...
    return None

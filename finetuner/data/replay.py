"""A guard against forgetting: the base model's own answers to general prompts, mixed into the training rows.

``data.replay: 0.25`` adds one row for every four of the user's training rows: a prompt of
``data/replay_prompts.jsonl`` (everyday requests written for this project, none of them a question of the general
probe set) with the answer the base model gives to it, greedy, before any training. Trained on alongside the new
skill, these rows pull the fine-tune back towards what the base already did on general requests, while the user's
rows teach the new. The rows never carry the user's ``data.system_prompt`` (the chat template's own default system
block, if it has one, is the template's), and the held-out rows stay the user's alone.

The answers depend on the base model's weights, config, generation config, tokenizer and chat template, on the
prompts and on how they are generated (:data:`MAX_NEW_TOKENS`, :data:`BATCH`, greedy, no system prompt). They are
generated once and kept under ``<cache>/replay/`` (:func:`finetuner.fileio.cache_root`), one file for each place
the base is read from (a folder, a GGUF file, a hub id and revision), prompts and generation settings. The file
holds the state of the base it was made with: the weights' fingerprint (each weight file's size and SHA-256,
:mod:`finetuner.model.fingerprint`, whose memo makes taking it again cost a ``stat`` a file) and hashes of the
rest. A run reads it only when that state is this base's, and only when the SHA-256 in its first line matches the
rest of it (a file edited by hand or cut short is not used). Otherwise the base answers again and the file is
rewritten; the run's ``replay`` event (:mod:`finetuner.runs.schema`) says which happened and why (``reason``):
``cached``, ``new``, ``model_changed`` (the file was for other weights, or another config, tokenizer, chat
template, dtype: ``changed`` names them), ``damaged`` (the file failed its check) or ``unpinned`` (no weight file
found to fingerprint: the answers are generated and not cached). The trainer generates them with its model in
memory (the adapter off), so the guard costs one batched generation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetuner.data.cache import tokenizer_fingerprint
from finetuner.errors import UserError
from finetuner.cachedir import EntryRejected, cache_folder, read_entry, write_entry
from finetuner.fileio import cache_root
from finetuner.model.fingerprint import Fingerprint, remembered_fingerprint, weights_fingerprint

log = logging.getLogger(__name__)

#: the prompts shipped with the project
PROMPTS_FILE = Path(__file__).resolve().parents[2] / "data" / "replay_prompts.jsonl"
#: tokens a replayed answer may take (a short answer of a chat model; longer ones are cut there)
MAX_NEW_TOKENS = 96
#: prompts answered together in one ``generate`` call (left-padded: a batch's padding can change a greedy answer)
BATCH = 16
#: the layout of a cache file; bump when it changes (a file of another layout is not found: its name differs)
CACHE_FORMAT = 2


def load_prompts(path: str | Path | None = None) -> list[str]:
    """The prompts of ``path`` (default :data:`PROMPTS_FILE`), one ``{"id", "prompt"}`` object a line."""
    path = Path(path or PROMPTS_FILE)
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(str(json.loads(line)["prompt"]))
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{path}, line {i}: not a {{\"id\", \"prompt\"}} object.") from None
    return out


def replay_count(ratio: float, train_rows: int, available: int) -> int:
    """Rows to mix in: ``ratio`` of the training rows, rounded up, at most the prompts there are."""
    return min(available, math.ceil(ratio * train_rows)) if ratio > 0 and train_rows > 0 else 0


def chosen_prompts(prompts: list[str], n: int, seed: int) -> list[str]:
    """``n`` of the prompts, drawn with the run's seed (every kind of request, not the first kind alone)."""
    picked = list(prompts)
    random.Random(seed).shuffle(picked)
    return picked[:n]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def generation_settings() -> dict[str, Any]:
    """How the answers are generated (the trainer's ``greedy_replies`` call): part of the cache file's name."""
    return {"max_new_tokens": MAX_NEW_TOKENS, "batch": BATCH, "greedy": True, "system_prompt": None}


@dataclass(frozen=True)
class BaseModel:
    """The base model as its answers depend on it. ``source``: where it is read from (a folder, a GGUF file, a
    hub id and revision), in the cache file's name; ``state``: what it is there (``weights``: each weight file's
    size and SHA-256; hashes of its ``config``, ``generation_config``, ``tokenizer`` and ``chat_template``; its
    ``dtype``), kept in the file and compared when it is read; ``weights``: the fingerprint, None when no weight
    file was found to take it from."""

    source: str
    state: dict[str, Any]
    weights: Fingerprint | None = None


def base_model(name: str, revision: str | None, dtype: str, model: Any, tokenizer: Any, template: str,
               switches: dict[str, Any] | None = None) -> BaseModel:
    """The :class:`BaseModel` of ``model.name`` (at ``revision``) loaded as ``model`` (its config and generation
    config as loaded: a quantized base's config says so) with ``tokenizer`` and the chat ``template`` in use, with
    its keyword arguments ``switches`` (the run's thinking form, :func:`finetuner.data.thinking.prompt_switches`:
    hashed with the template, so that answers asked in another form are made again)."""
    weights = weights_fingerprint(name, revision)
    generation = getattr(model, "generation_config", None)
    state = {
        "weights": weights.files if weights is not None else None,
        "config": _sha(model.config.to_json_string()),
        "generation_config": _sha(generation.to_json_string()) if generation is not None else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": _sha((template or "") + (json.dumps(switches, sort_keys=True) if switches else "")),
        "dtype": str(dtype),
    }
    return BaseModel(name if revision is None else f"{name}@{revision}", state, weights)


#: the words for each part of a :class:`BaseModel`'s state that differs from the cached one's
_STATE_WORDS = {"config": "config", "generation_config": "generation config", "tokenizer": "tokenizer",
                "chat_template": "chat template", "dtype": "dtype"}


def state_changes(cached: Any, now: dict[str, Any]) -> list[str]:
    """What differs between the state a cache file was made with and ``now``, in words (empty: nothing)."""
    cached = cached if isinstance(cached, dict) else {}
    out = []
    old, new = cached.get("weights"), now["weights"]
    if old != new:
        old, new = old if isinstance(old, dict) else {}, new or {}
        files = ([f"{n} changed" for n in sorted(set(old) & set(new)) if old[n] != new[n]]
                 + [f"{n} added" for n in sorted(set(new) - set(old))]
                 + [f"{n} removed" for n in sorted(set(old) - set(new))])
        out.append(f"weights ({', '.join(files)})" if files else "weights")
    for key, words in _STATE_WORDS.items():
        if cached.get(key) != now[key]:
            out.append(f"{words} ({cached.get(key)} -> {now[key]})" if key == "dtype" else words)
    return out


class CacheDamaged(Exception):
    """A replay cache file that fails its check: the reason, in words."""


def cache_path(base: BaseModel, prompts: list[str]) -> Path:
    """The cache file of the answers of ``base`` (where it is read from) to ``prompts``."""
    blob = json.dumps({"format": CACHE_FORMAT, "source": base.source, "prompts": prompts,
                       "generation": generation_settings()}, sort_keys=True)
    return cache_root() / "replay" / f"answers-{_sha(blob)[:24]}.json"


def write_cache(path: Path, base: BaseModel, prompts: list[str], answers: list[str]) -> None:
    """Write ``answers`` to ``path``: a header line (``format``, the ``sha256`` of the rest) and the body."""
    body = json.dumps({"source": base.source, "model": base.state, "prompts": prompts,
                       "generation": generation_settings(), "answers": answers},
                      indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    cache_folder("replay")  # private to this user, or refused (finetuner.cachedir)
    write_entry(path, json.dumps({"format": CACHE_FORMAT, "sha256": _sha(body)}) + "\n" + body)


def read_cache(path: Path, prompts: list[str]) -> dict[str, Any]:
    """The body of the cache file ``path`` once it has passed its check (raises :class:`CacheDamaged`, or
    ``FileNotFoundError`` when there is none): its SHA-256 matches, and it holds one answer to each of
    ``prompts`` made as :func:`generation_settings` says."""
    try:
        cache_folder("replay")  # private to this user, or refused before anything is read (finetuner.cachedir)
    except OSError:  # no cache folder can be made: none cached
        raise FileNotFoundError(path) from None
    try:
        raw = read_entry(path)  # not through a link, and only a regular file of this user's
    except FileNotFoundError:  # none cached
        raise FileNotFoundError(path) from None
    except EntryRejected as e:
        raise CacheDamaged(str(e)) from None
    except OSError as e:
        raise CacheDamaged(f"it cannot be read ({e.strerror or e})") from None
    head, _, body = raw.partition(b"\n")
    try:
        header = json.loads(head)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != CACHE_FORMAT or not isinstance(header.get("sha256"), str):
        raise CacheDamaged(f"its first line is not the header finetuner writes (format {CACHE_FORMAT} and a SHA-256)")
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise CacheDamaged("its contents do not match the SHA-256 in its header: edited or cut short")
    try:
        stored = json.loads(body)
    except ValueError:
        stored = None
    answers = stored.get("answers") if isinstance(stored, dict) else None
    if (not isinstance(answers, list) or len(answers) != len(prompts) or not all(isinstance(a, str) for a in answers)
            or stored.get("prompts") != prompts or stored.get("generation") != generation_settings()):
        raise CacheDamaged("it does not hold answers to these prompts made with these settings")
    return stored


def cached_before_load(name: str, revision: str | None, prompts: list[str]) -> Path | None:
    """The cache file that holds the answers of base ``name`` (at ``revision``) to ``prompts``, as far as it can
    be told without loading the model (what a plan asks, :mod:`finetuner.planning.wait`): it passes its check
    (:func:`read_cache`) and was made with these weights (their fingerprint from the memo,
    :func:`~finetuner.model.fingerprint.remembered_fingerprint`). The rest of the base's state (its config,
    tokenizer, chat template, dtype) is compared only once it is loaded. None: the run generates them."""
    weights = remembered_fingerprint(name, revision)
    if weights is None or not prompts:
        return None
    path = cache_path(BaseModel(name if revision is None else f"{name}@{revision}", {}), prompts)
    try:
        stored = read_cache(path, prompts)
    except (FileNotFoundError, CacheDamaged):
        return None
    model = stored.get("model")
    return path if isinstance(model, dict) and model.get("weights") == weights.files else None


@dataclass
class Answers:
    """The base model's answers and where they came from. ``reason``: ``cached`` (read from the cache file);
    answered because there was none (``new``), because the file was made with another state of the base
    (``model_changed``: ``changed`` says what differed), because it failed its check (``damaged``), or because the
    weights could not be fingerprinted (``unpinned``: then not cached). ``message``: what happened, in a sentence;
    ``path``: the cache file."""

    answers: list[str]
    from_cache: bool
    reason: str
    message: str
    path: Path | None
    changed: list[str]


#: the reasons that need no one's attention (the others are warned about, and shown in the web UI's notes)
ROUTINE_REASONS = ("cached", "new")


def base_answers(base: BaseModel, prompts: list[str], answer: Callable[[list[str]], list[str]]) -> Answers:
    """The base model's answers to ``prompts``: from the cache when its file passes its check and was made with
    this ``base`` (:func:`read_cache`, :func:`state_changes`), else ``answer(prompts)``, then cached."""
    n = len(prompts)
    if base.weights is None:
        return Answers(answer(prompts), False, "unpinned",
                       f"data.replay: no weight file of {base.source} was found to fingerprint; the base model answered "
                       f"{n} prompts, not cached (a cache could not tell these weights from others).", None, [])
    path = cache_path(base, prompts)
    changed: list[str] = []
    try:
        stored = read_cache(path, prompts)
        changed = state_changes(stored.get("model"), base.state)
        if not changed:
            return Answers(list(stored["answers"]), True, "cached",
                           f"data.replay: the base model's answers to {n} prompts read from {path} (made with these "
                           f"weights, {base.weights.digest()}; its SHA-256 checked).", path, [])
        reason, why = "model_changed", f"{path} was made with other {', '.join(changed)}"
    except FileNotFoundError:
        reason, why = "new", ""
    except CacheDamaged as e:
        reason, why = "damaged", f"{path} failed its check ({e})"
    answers = answer(prompts)
    try:
        write_cache(path, base, prompts, answers)
        failed = None
    except OSError as e:
        log.warning("data.replay: could not write %s (%s); the next run generates the answers again.", path, e)
        failed = e.strerror or str(e)
    if why:  # a file was there and not used
        done = "the file rewritten" if failed is None else f"the file not rewritten ({failed})"
        said = f"data.replay: {why}; the base model answered its {n} prompts again, {done}."
    else:
        done = f"cached in {path}" if failed is None else f"not cached: {path} could not be written ({failed})"
        said = f"data.replay: the base model answered {n} prompts, {done}."
    return Answers(answers, False, reason, said, path, changed)


def replay_rows(prompts: list[str], answers: list[str]) -> list[dict[str, Any]]:
    """Training examples (the pipeline's normalised form) of the prompts and the base's non-empty answers."""
    return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}],
             "_where": f"{PROMPTS_FILE.name}, replayed answer {i + 1}"}
            for i, (p, a) in enumerate(zip(prompts, answers)) if a.strip()]


def mix_replay(data: Any, cfg: Any, tokenizer: Any, base: BaseModel, seed: int,
               answer: Callable[[list[str]], list[str]]) -> tuple[Any, dict[str, Any]]:
    """``data`` (a :class:`~finetuner.data.pipeline.PreparedData`) with the replay rows of ``cfg.replay`` added to
    its training rows (tokenized as the user's are, packed the same way when they are); returns it and what was
    mixed in, the ``replay`` event's fields (``rows``, ``ratio``, ``from_cache``, ``reason``, ``changed``,
    ``message``, ``cache``, ``weights``, ``prompts_file``)."""
    import datasets

    from finetuner.data.pipeline import DataStats, pack, tokenize_examples

    all_prompts = load_prompts()
    n = replay_count(float(cfg.replay), data.stats.train_examples, len(all_prompts))
    prompts = chosen_prompts(all_prompts, n, seed)
    got = base_answers(base, prompts, answer)
    rows = replay_rows(prompts, got.answers)
    info = {"rows": len(rows), "ratio": float(cfg.replay), "from_cache": got.from_cache, "reason": got.reason,
            "changed": got.changed, "message": got.message, "cache": str(got.path) if got.path else None,
            "weights": base.weights.digest() if base.weights is not None else None, "prompts_file": str(PROMPTS_FILE)}
    if not rows:
        return data, info
    side = DataStats()
    replay = tokenize_examples(rows, tokenizer, cfg, side)
    replay = replay.remove_columns([c for c in replay.column_names if c not in ("input_ids", "labels")])
    if data.stats.packing:
        replay = pack(replay, cfg.max_seq_len, seed)
    data.train = datasets.concatenate_datasets([data.train, replay]).shuffle(seed=seed)
    data.stats.replay_rows = len(rows)
    return data, info

"""A guard against forgetting: the base model's own answers to general prompts, mixed into the training rows.

``data.replay: 0.25`` adds one row for every four of the user's training rows: a prompt of
``data/replay_prompts.jsonl`` (everyday requests written for this project, none of them a question of the general
probe set) with the answer the base model gives to it, greedy, before any training. Trained on alongside the new
skill, these rows pull the fine-tune back towards what the base already did on general requests, while the user's
rows teach the new. The rows never carry the user's ``data.system_prompt`` (the chat template's own default system
block, if it has one, is the template's), and the held-out rows stay the user's alone.

The answers depend only on the base model, its chat template and the prompts, so they are generated once and kept
under ``<cache>/replay/`` (:func:`finetuner.fileio.cache_root`); a second run of the same model reads them. The
trainer generates them with its model in memory (the adapter off), so the guard costs one batched generation.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetuner.errors import UserError
from finetuner.fileio import atomic_write_json, cache_root

#: the prompts shipped with the project
PROMPTS_FILE = Path(__file__).resolve().parents[2] / "data" / "replay_prompts.jsonl"
#: tokens a replayed answer may take (a short answer of a chat model; longer ones are cut there)
MAX_NEW_TOKENS = 96


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


def _key(model: str, template: str, prompts: list[str]) -> str:
    blob = json.dumps({"model": model, "template": template, "prompts": prompts, "max_new_tokens": MAX_NEW_TOKENS},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def base_answers(model: str, template: str, prompts: list[str], answer: Callable[[list[str]], list[str]]) -> tuple[list[str], bool]:
    """The base model's answers to ``prompts``: from the cache, or ``answer(prompts)`` (then cached). ``model``
    names the base (its name, revision and config: what makes the answers); returns ``(answers, from_cache)``."""
    path = cache_root() / "replay" / f"answers-{_key(model, template, prompts)}.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("prompts") == prompts:
            return list(stored["answers"]), True
    except (OSError, ValueError, AttributeError):
        pass
    answers = answer(prompts)
    try:
        atomic_write_json(path, {"model": model, "prompts": prompts, "answers": answers})
    except OSError:  # a read-only cache: the next run generates them again
        pass
    return answers, False


def replay_rows(prompts: list[str], answers: list[str]) -> list[dict[str, Any]]:
    """Training examples (the pipeline's normalised form) of the prompts and the base's non-empty answers."""
    return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}],
             "_where": f"{PROMPTS_FILE.name}, replayed answer {i + 1}"}
            for i, (p, a) in enumerate(zip(prompts, answers)) if a.strip()]


def mix_replay(data: Any, cfg: Any, tokenizer: Any, model: str, seed: int,
               answer: Callable[[list[str]], list[str]]) -> tuple[Any, dict[str, Any]]:
    """``data`` (a :class:`~finetuner.data.pipeline.PreparedData`) with the replay rows of ``cfg.replay`` added to
    its training rows (tokenized as the user's are, packed the same way when they are); returns it and what was
    mixed in (``rows``, ``ratio``, ``from_cache``, ``prompts_file``)."""
    import datasets

    from finetuner.data.pipeline import DataStats, pack, tokenize_examples

    all_prompts = load_prompts()
    n = replay_count(float(cfg.replay), data.stats.train_examples, len(all_prompts))
    prompts = chosen_prompts(all_prompts, n, seed)
    answers, cached = base_answers(model, data.chat_template, prompts, answer)
    rows = replay_rows(prompts, answers)
    info = {"rows": len(rows), "ratio": float(cfg.replay), "from_cache": cached, "prompts_file": str(PROMPTS_FILE)}
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

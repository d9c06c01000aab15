"""The tokenized-data cache: a second prepare is served from disk, and any change of the data
files, the tokenizer, the chat template or the settings misses it (never a stale hit)."""

from __future__ import annotations

import json

import pytest

from finetuner.data.pipeline import prepare_data
from finetuner.config.sections import DataSection


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(d))
    return d


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _prepare(path, tokenizer, **kw):
    cfg = DataSection(path=str(path), max_seq_len=64, val_size=4, **kw)
    return prepare_data(cfg, tokenizer, seed=0)


def _rows(p):
    return [list(r["input_ids"]) for r in p.train], [list(r["labels"]) for r in p.train]


def test_second_prepare_is_a_cache_hit_with_the_same_tokens(alpaca_file, tokenizer, cache_dir):
    first = _prepare(alpaca_file, tokenizer)
    second = _prepare(alpaca_file, tokenizer)
    assert (first.stats.cache, second.stats.cache) == ("miss", "hit")
    assert _rows(first) == _rows(second)
    assert [list(r["input_ids"]) for r in first.val] == [list(r["input_ids"]) for r in second.val]
    assert second.stats.train_tokens == first.stats.train_tokens and second.stats.train_examples == first.stats.train_examples
    assert second.chat_template == first.chat_template
    assert len(list((cache_dir / "tokenized").iterdir())) == 1


def test_packed_data_is_cached_with_its_position_ids(alpaca_file, tokenizer, cache_dir):
    first = _prepare(alpaca_file, tokenizer, packing=True)
    second = _prepare(alpaca_file, tokenizer, packing=True)
    assert second.stats.cache == "hit" and second.stats.packing is True
    assert [list(r["position_ids"]) for r in first.train] == [list(r["position_ids"]) for r in second.train]


def test_changed_data_file_misses(alpaca_file, tokenizer, cache_dir):
    _prepare(alpaca_file, tokenizer)
    rows = json.loads(alpaca_file.read_text())
    rows[0]["output"] = "Something else entirely."
    alpaca_file.write_text(json.dumps(rows))
    again = _prepare(alpaca_file, tokenizer)
    assert again.stats.cache == "miss"
    assert _prepare(alpaca_file, tokenizer).stats.cache == "hit"


def test_changed_tokenizer_misses(alpaca_file, tokenizer, cache_dir):
    _prepare(alpaca_file, tokenizer)
    tokenizer.add_tokens(["hike"])  # a new vocabulary entry changes the tokens
    assert _prepare(alpaca_file, tokenizer).stats.cache == "miss"


def test_changed_template_or_settings_miss(alpaca_file, tokenizer, cache_dir):
    _prepare(alpaca_file, tokenizer)
    other = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}" \
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    assert _prepare(alpaca_file, tokenizer, chat_template=other).stats.cache == "miss"
    assert _prepare(alpaca_file, tokenizer, train_on_prompt=True).stats.cache == "miss"
    assert _prepare(alpaca_file, tokenizer, system_prompt="Be brief.").stats.cache == "miss"
    # settings that do not change the tokens share the entry
    assert _prepare(alpaca_file, tokenizer, num_proc=2).stats.cache == "hit"


def test_cache_off_and_damaged_entries(alpaca_file, tokenizer, cache_dir):
    assert _prepare(alpaca_file, tokenizer, cache=False).stats.cache is None
    assert not cache_dir.exists()
    _prepare(alpaca_file, tokenizer)
    (entry,) = (cache_dir / "tokenized").iterdir()
    (entry / "meta.json").write_text("{not json")
    again = _prepare(alpaca_file, tokenizer)  # unreadable: tokenized again, and said
    assert again.stats.cache == "rebuilt" and "header" in again.stats.cache_note
    assert _prepare(alpaca_file, tokenizer).stats.cache == "hit"


def test_second_run_reports_the_cache_hit(recipe_dict, cache_dir):
    """Through the trainer: the start event of the second run says the data came from the cache."""
    import finetuner

    runs = []
    for i in range(2):
        d = dict(recipe_dict, output_dir=recipe_dict["output_dir"] + str(i))
        events = []
        finetuner.train(finetuner.Recipe.from_dict(d, ["training.max_steps=1"]), callbacks=[events.append])
        runs.append(next(e for e in events if e["event"] == "start")["data"]["cache"])
    assert runs == ["miss", "hit"]

"""``data/README.md`` describes the demo model as it is: its vocabulary and parameter count are read
from the README's table and compared with the shipped tokenizer and weights."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "data" / "demo_model"


def number_after(pattern: str) -> int:
    text = (REPO / "data" / "README.md").read_text(encoding="utf-8")
    m = re.search(pattern, text)
    assert m, f"data/README.md no longer says {pattern!r}"
    return int(m.group(1).replace(",", ""))


def test_the_demo_models_vocabulary_is_the_tokenizers():
    from tokenizers import Tokenizer

    said = number_after(r"vocabulary of ([\d,]+)")
    assert said == Tokenizer.from_file(str(DEMO / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def test_the_demo_models_parameter_count_is_the_weights():
    import torch
    from transformers import AutoModelForCausalLM

    said = number_after(r"hidden \d+, ([\d,]+) parameters")
    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32)
    assert said == sum(p.numel() for p in model.parameters())

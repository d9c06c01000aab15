"""Issue 23 items 6 and 9: small hostile inputs cannot exhaust memory (a YAML alias bomb, one huge
data row), error messages do not echo whole inputs, and duplicate YAML keys are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from finetuner.errors import UserError
from tests.conftest import REPO, run_cli, HANG_GUARD_S

DEMO_MODEL = REPO / "data" / "demo_model"

#: 9 anchors of 9 references each: 9**9 (387 million) strings in 500 bytes
BOMB = "".join(
    [f'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n']
    + [f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")]
    + ["model:\n  name: *i\n"]
)

#: Runs a snippet in a fresh interpreter; after its warm-up (``WARM``) the address space is capped
#: at what it uses + ``cap_gib`` (a test that fails fails with MemoryError, not by taking the machine)
#: and it prints the peak resident set (VmHWM) grown since the warm-up, in MiB, as ``grew_mib``.
HARNESS = """
import json, resource, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
{warm}
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + int({cap_gib} * 2**30), resource.RLIM_INFINITY))
base = status("VmHWM")
out = {{}}
{work}
out["grew_mib"] = (status("VmHWM") - base) / 2**20
print(json.dumps(out))
"""


def _measured(warm: str, work: str, cap_gib: float = 3.0) -> dict:
    code = HARNESS.format(warm=textwrap.dedent(warm), work=textwrap.dedent(work), cap_gib=cap_gib)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S,
                       env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- YAML
def test_alias_bomb_is_refused_by_the_cli_with_a_short_message(tmp_path):
    assert len(BOMB) < 600
    (tmp_path / "bomb.yaml").write_text(BOMB)
    r = run_cli("run", str(tmp_path / "bomb.yaml"))
    assert r.returncode == 2
    assert len(r.stderr) < 1024 and "aliases" in r.stderr and "bomb.yaml" in r.stderr, r.stderr[:2000]


def test_alias_bomb_in_the_editor_text_stays_in_bounded_memory():
    """The UI parses its editor's text with Recipe.from_yaml_text on every keystroke."""
    out = _measured(
        "from finetuner.config.recipe import Recipe\nfrom finetuner.errors import UserError",
        f"""
try:
    Recipe.from_yaml_text({BOMB!r}, source="editor")
except UserError as e:
    out["message"] = str(e)
""",
        cap_gib=1.0,
    )
    assert "editor" in out["message"] and len(out["message"]) < 1024
    assert out["grew_mib"] < 50, out


def test_a_run_folder_recipe_is_read_by_the_same_loader(tmp_path):
    from finetuner.infer.loading import resolve_source

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "recipe.yaml").write_text(BOMB)
    with pytest.raises(UserError, match="aliases") as e:
        resolve_source(run)
    assert len(str(e.value)) < 1024


def test_a_few_aliases_are_still_fine(tmp_path):
    from finetuner.config.recipe import Recipe

    text = f"name: t\nmodel:\n  name: &m {DEMO_MODEL}\ndata:\n  path: {REPO / 'data' / 'alpaca_sample.json'}\n" \
           "lora:\n  target_modules: &t [q_proj, v_proj]\nsamples:\n  prompts: [*m]\n"
    assert Recipe.from_yaml_text(text).lora.target_modules == ["q_proj", "v_proj"]


def test_duplicate_keys_are_refused_naming_the_key_and_lines(tmp_path):
    text = (f"name: dup\nmodel:\n  name: {DEMO_MODEL}\ntraining:\n  lr: 1.0e-4\n"
            f"data:\n  path: {REPO / 'data' / 'alpaca_sample.json'}\ntraining:\n  max_steps: 3\n")
    (tmp_path / "dup.yaml").write_text(text)
    r = run_cli("run", str(tmp_path / "dup.yaml"), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    assert "dup.yaml: line 8: the key 'training' is given twice" in r.stderr and "first on line 4" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    from finetuner.config.recipe import Recipe

    with pytest.raises(UserError, match="line 3: the key 'lr' is given twice"):
        Recipe.from_yaml_text(f"model:\n  lr: 1\n  lr: 2\n")


def test_a_validation_error_does_not_echo_a_huge_value():
    from finetuner.config.recipe import Recipe

    huge = "x" * 1_000_000
    with pytest.raises(UserError) as e:
        Recipe.from_dict({"name": "t", "model": {"name": str(DEMO_MODEL), "dtype": huge, "revision": ["y" * 10_000]},
                          "data": {"path": str(REPO / "data" / "alpaca_sample.json")}, "training": {"lr": huge}})
    assert "model.dtype" in str(e.value) and len(str(e.value)) < 2048


# ---------------------------------------------------------------------------- one huge row
def _words(n_chars: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    words = ["puffin", "the", "colony", "nests", "on", "cliffs", "and", "dives", "for", "sand", "eels", "north", "sea"]
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


@pytest.fixture(scope="module")
def huge_row_file(tmp_path_factory) -> Path:
    """A JSONL file whose first row has a 30 MB instruction and a 30 MB output (alpaca), then normal rows."""
    path = tmp_path_factory.mktemp("huge") / "huge.jsonl"
    block = _words(1_000_000)
    big = block * 30
    with path.open("w") as f:
        f.write(json.dumps({"instruction": big, "output": big}) + "\n")
        for i in range(3):
            f.write(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n")
    assert path.stat().st_size > 55 * 2**20
    return path


def test_a_huge_row_is_previewed_tokenized_and_profiled_in_bounded_memory(huge_row_file):
    """Reading the 60 MB row costs a few copies of it (file bytes, decoded text, JSON strings: well
    under 1 GiB); tokenizing it whole took 17 GB for 100 MB. Cut to max_seq_len's characters first,
    the peak grows by less than 1 GiB."""
    out = _measured(
        f"""
from transformers import AutoTokenizer
from finetuner.config.sections import DataSection
from finetuner.data.pipeline import DataStats, load_examples, tokenize_examples
from finetuner.data.preview import preview_data
from finetuner.data.stats import profile_data
tok = AutoTokenizer.from_pretrained({str(DEMO_MODEL)!r})
path = {str(huge_row_file)!r}
""",
        f"""
p = preview_data(path, tok, n=2, max_seq_len=64)
out["preview"] = [(e.n_tokens, e.truncated) for e in p.examples]
cfg = DataSection(path=path, max_seq_len=64, packing=False)
stats = DataStats()
ds = tokenize_examples(load_examples(path, cfg, stats), tok, cfg, stats)
out["lengths"] = [len(x) for x in ds["input_ids"]]
out["truncated"] = stats.truncated
prof = profile_data(path, model={str(DEMO_MODEL)!r}, seq_len=64)
out["max_tokens"] = prof.max_tokens
""",
    )
    # the huge row is cut to 64 tokens of its instruction: no reply token is left, so training drops it
    assert out["preview"][0] == [64, True] and len(out["lengths"]) == 3 and out["truncated"] == 1, out
    assert out["max_tokens"] > 10_000_000  # the planner still sees how long the row is (extrapolated)
    assert out["grew_mib"] < 1024, out


def test_the_cut_keeps_the_same_tokens(monkeypatch):
    """Cut text gives the tokens (and labels, and truncation) the whole text gives."""
    from transformers import AutoTokenizer

    from finetuner.data import pipeline, preference
    from finetuner.data.pipeline import FALLBACK_CHAT_TEMPLATE, encode_example
    from finetuner.data.textcut import char_budget

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    long = _words(200_000, seed=1)
    assert len(long) > 10 * char_budget(tok, 64)
    examples = [
        {"text": long},
        {"prompt": long, "completion": "fine"},
        {"prompt": "hi", "completion": long},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": long},
                      {"role": "user", "content": long}, {"role": "assistant", "content": "bye"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": long},
                      {"role": "assistant", "content": "ok"}]},
    ]
    cut = [encode_example(ex, tok, FALLBACK_CHAT_TEMPLATE, 64, False) for ex in examples]
    pair_cut = [preference.join(*preference.split_tokens(tok, FALLBACK_CHAT_TEMPLATE, [{"role": "user", "content": p}], r, 64), 64)
                for p, r in ((long, "yes"), ("q", long), (long, long))]
    monkeypatch.setattr(pipeline, "char_budget", lambda tokenizer, n: 10**12)
    monkeypatch.setattr(preference, "char_budget", lambda tokenizer, n: 10**12)
    whole = [encode_example(ex, tok, FALLBACK_CHAT_TEMPLATE, 64, False) for ex in examples]
    pair_whole = [preference.join(*preference.split_tokens(tok, FALLBACK_CHAT_TEMPLATE, [{"role": "user", "content": p}], r, 64), 64)
                  for p, r in ((long, "yes"), ("q", long), (long, long))]
    assert cut == whole and all(c["truncated"] for c in cut)
    assert pair_cut == pair_whole and all(c[2] for c in pair_cut)


def test_a_huge_chat_message_is_refused_without_tokenizing_it():
    """A 50 MB message to a chat model is refused as longer than the context, in bounded memory."""
    out = _measured(
        f"""
from finetuner.errors import UserError
from finetuner.infer.chat import load_chat_model
chat = load_chat_model({str(DEMO_MODEL)!r}, device="cpu")
huge = "puffin " * 7_000_000
""",
        """
try:
    chat.encode([{"role": "user", "content": huge}])
except UserError as e:
    out["message"] = str(e)
""",
    )
    assert "the model's context is" in out["message"] and len(out["message"]) < 300
    assert out["grew_mib"] < 200, out

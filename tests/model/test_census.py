"""docs/models.md is the model census's output (scripts/dev/model_census.py) for the installed transformers:
every causal-LM type listed, its numbers those of its rows, and a sample of rows comes out the same again."""

from __future__ import annotations

import json
import re

import pytest

from scripts.dev import model_census, vlm_census
from tests.conftest import REPO


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(model_census.JSON.read_text(encoding="utf-8"))


def test_the_table_lists_every_causal_lm_type_of_the_installed_transformers(recorded):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    minor = lambda v: v.split(".")[:2]  # noqa: E731 - constraints.txt pins transformers==X.Y.*
    assert minor(recorded["transformers"]) == minor(transformers.__version__), "run scripts/dev/model_census.py again"
    assert sorted(r["model_type"] for r in recorded["rows"]) == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    pictures = json.loads(vlm_census.JSON.read_text(encoding="utf-8"))["rows"]  # the page's image-text section
    assert model_census.DOC.read_text(encoding="utf-8") == model_census.write_table(recorded["rows"],
                                                                                   vlm_census.write_table(pictures))


def test_the_headline_counts_the_rows(recorded):
    rows = recorded["rows"]
    inside = [r for r in rows if r["status"] != "outside"]
    supported = [r for r in inside if r["status"] == "supported"]
    head = re.search(r"\*\*(\d+) of the (\d+) decoder-only types", model_census.DOC.read_text(encoding="utf-8"))
    assert head and (int(head[1]), int(head[2])) == (len(supported), len(inside))
    assert all(r.get("reason") for r in rows if r["status"] != "supported")  # every other row says why
    assert {r["model_type"] for r in supported} >= {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}


@pytest.mark.parametrize("model_type", ["llama", "olmo2", "qwen3_moe", "mamba", "bart", "gemma3n"])
def test_a_row_comes_out_again_as_recorded(model_type, recorded, tmp_path):
    """A supported family measured on a GPU, one that was not, a mixture of experts, a refused one, one outside, and
    one transformers builds only with a package CI cannot install (gemma3n: timm, whose torchvision needs CUDA torch)."""
    row = model_census.census_row(model_type, model_census._tokenizer(), tmp_path)
    was = next(r for r in recorded["rows"] if r["model_type"] == model_type)
    assert (row["status"], row.get("gpu_rows"), row.get("traced"), row.get("step"), row.get("reason")) == \
        (was["status"], was.get("gpu_rows"), was.get("traced"), was.get("step"), was.get("reason"))


def test_the_planning_pages_model_list_is_the_tables(recorded):
    page = (REPO / "docs" / "planning.md").read_text(encoding="utf-8")
    assert "(models.md)" in page
    assert model_census.list_block(recorded["rows"]) in page


def test_no_type_is_outside_for_the_shrinkers_sake(recorded):
    """"Outside" is transformers' own failure (or not decoder-only), never a tiny config the shrinker left too large:
    such a row counts in the denominator, refused at step ``tiny``."""
    rows = recorded["rows"]
    outside = [r for r in rows if r["status"] == "outside"]
    assert outside and not [r["model_type"] for r in outside if model_census.TOO_LARGE in r["reason"]]
    assert all(r["reason"].startswith(("an ", "transformers cannot")) for r in outside)
    too_large = [r for r in rows if model_census.TOO_LARGE in r.get("reason", "")]
    assert all((r["status"], r["step"]) == ("refused", "tiny") for r in too_large)


def test_a_type_that_fails_in_transformers_at_any_size_is_outside_with_its_error(tmp_path):
    """Gemma 4's assistant (a drafter that reads its main model's shared keys and values) fails at the tiny widths,
    and its own widths are too large to build on a CPU; on the meta device (any size) its forward fails the same way,
    so it is outside with transformers' error, not refused for the shrinker's sake. A type whose forward runs on
    the meta device gives no such failure."""
    from finetuner.model.tiny import tiny_config

    tok = model_census._tokenizer()
    row = model_census.census_row("gemma4_unified_assistant", tok, tmp_path)
    assert row["status"] == "outside" and "inputs_embeds and shared_kv_states cannot be None" in row["reason"]
    assert model_census._fails_on_meta("llama", tiny_config("llama", len(tok), widths=False), tok) is None

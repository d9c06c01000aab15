"""Image-text-to-text families as a table: the picture census (``scripts/dev/vlm_census.py``) is what
``docs/models.md``'s image-text section shows; three of its fastest families still build tiny, train 2 LoRA steps on pictured chat
rows and answer about a picture; the collator gives every family what its own processor gives the model; a family
whose processor cannot be built here is refused in one line before training."""

from __future__ import annotations

import json
import math

import pytest

from scripts.dev import model_census, vlm_census
from tests.conftest import REPO

#: families whose census row is re-run (the fastest of those that train, and the two families the issue names)
RERUN = ["llava", "qwen2_5_vl", "mllama"]


def test_the_table_is_the_census_json():
    data = json.loads(vlm_census.JSON.read_text(encoding="utf-8"))
    doc = (REPO / "docs" / "models.md").read_text(encoding="utf-8")
    assert model_census.pictures_section(doc) == vlm_census.write_table(data["rows"])
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from finetuner.model.tiny_vlm import TINY_VLMS

    assert sorted(r["model_type"] for r in data["rows"]) == sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    checked = {r["model_type"]: r for r in data["rows"] if r["status"] != vlm_census.NOT_CHECKED}
    assert set(checked) == set(TINY_VLMS) and all(r["status"] in ("trains", "refused") for r in checked.values())
    assert all(r["model_type"] in TINY_VLMS for r in data["rows"] if r["status"] == "trains")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vlm_census")


@pytest.fixture(scope="module", params=RERUN)
def rerun(request, work):
    """A family's census row re-run: built tiny, 2 LoRA steps, one chat turn with a picture (and its run folder)."""
    row, run_dir = vlm_census.census_row(request.param, work)
    return row, run_dir, work / request.param


def test_the_family_still_trains_and_chats(rerun):
    row, run_dir, folder = rerun
    assert row["status"] == "trains", row.get("reason")
    assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])
    assert isinstance(row["answer"], str)
    # the adapter is an ordinary peft adapter on the image-text-to-text model
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(folder), run_dir / "adapter")
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_the_recorded_losses_and_export_are_reproduced(rerun):
    row, _, _ = rerun
    recorded = {r["model_type"]: r for r in json.loads(vlm_census.JSON.read_text(encoding="utf-8"))["rows"]}
    assert row["losses"] == pytest.approx(recorded[row["model_type"]]["losses"], abs=2e-3)
    assert row["gguf"] == recorded[row["model_type"]]["gguf"]  # the files written, or the same one-line refusal


@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl", "qwen3_vl", "llava_next", "llava_onevision", "mllama", "idefics3"])
def test_the_collator_gives_the_model_what_its_processor_gives(family, work):
    """Pictures of different shapes in one micro-batch (LLaVA-NeXT's tiles padded), and the inputs the processor makes
    from the tokens (Qwen's mm_token_type_ids, Gemma 3's token_type_ids, Mllama's cross-attention mask) equal to the
    processor's own for each row."""
    import torch

    from finetuner.data.formats import FileExamples
    from finetuner.data.images import PictureCollator, encode_pictured, message_parts
    from finetuner.data.picture_files import load_picture, pixel_limit
    from finetuner.data.pipeline import Collator
    from finetuner.model.vision import load_processor

    folder, _ = vlm_census.build(family, work / "collated")
    processor = load_processor(str(folder))
    examples = list(FileExamples(str(vlm_census.write_pictures_data(work / "collated" / "data"))))
    encoded = [encode_pictured(ex, processor, processor.chat_template, 512, False) for ex in examples]
    batch = PictureCollator(Collator(processor.tokenizer.pad_token_id), processor)(encoded[1:3])
    pictures = batch["pictures"]
    assert set(pictures) <= set(processor.model_input_names)
    for row, ex in enumerate(examples[1:3]):
        text = processor.tokenizer.apply_chat_template(message_parts(ex["messages"]), chat_template=processor.chat_template,
                                                       tokenize=False)
        own = processor(text=[text], images=[load_picture(p, pixel_limit(processor)) for p in ex["images"]], return_tensors="pt",
                        add_special_tokens=False)
        n = own["input_ids"].shape[1]
        assert batch["input_ids"][row, :n].tolist() == own["input_ids"][0].tolist()
        for key in set(own) - {"input_ids", "attention_mask"}:
            assert key in pictures, key
            if key in ("mm_token_type_ids", "token_type_ids", "cross_attention_mask"):
                assert torch.equal(pictures[key][row, :n], own[key][0]), key
    if family == "llava_next":  # a square picture (1 tile and the base view) padded to a tall one's 2 tiles
        assert pictures["pixel_values"].shape[:2] == (2, 3) and (pictures["pixel_values"][0, 2] == 0).all()


def test_a_family_whose_processor_cannot_be_built_is_refused_in_one_line(work):
    from transformers.utils import is_torchvision_available

    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.errors import UserError

    if is_torchvision_available():
        pytest.skip("PixtralProcessor is built where torchvision is installed")
    folder, _ = vlm_census.build("mistral3", work / "refused")
    data = vlm_census.write_pictures_data(work / "refused" / "data")
    recipe = {"name": "refused", "model": {"name": str(folder)}, "method": "lora",
              "data": {"path": str(data), "max_seq_len": 512, "val_size": 0},
              "training": {"max_steps": 2, "micro_batch_size": 2, "lr": 1e-3}, "logging": {"tensorboard": False},
              "device": "cpu"}
    out = work / "refused" / "run"
    with pytest.raises(UserError) as e:
        finetuner.train(Recipe.from_dict(recipe), output_dir=str(out))
    assert e.value.message == (f"model.name: the processor of '{folder}' needs a package that is not installed "
                               "(PixtralProcessor requires the Torchvision library but it was not found in your "
                               "environment).")
    assert not (out / "adapter").exists()


def test_a_processor_that_requires_its_video_processor_loads_without_it(work):
    """SmolVLM's processor takes its video processor as a required argument, and transformers' video processors need
    torchvision: it loads without one (pictures need none), with its own settings (chat template, image tokens a
    picture), and saves as SmolVLM's."""
    from PIL import Image
    from transformers import AutoTokenizer

    from finetuner.model.tiny_vlm import tiny_smolvlm
    from finetuner.model.vision import load_processor

    folder = work / "smolvlm-processor"
    tiny_smolvlm(AutoTokenizer.from_pretrained(REPO / "data" / "demo_model"), folder)
    processor = load_processor(str(folder))
    assert type(processor).__name__ == "SmolVLMProcessor" and processor.image_seq_len == 4
    assert processor.chat_template and "<image>" in processor.chat_template
    enc = processor(images=[[Image.new("RGB", (40, 30))]], text=["<image>What colour is this?"])
    assert sum(t == processor.image_token_id for t in enc["input_ids"][0]) == 4
    processor.save_pretrained(work / "smolvlm-saved")
    assert json.loads((work / "smolvlm-saved" / "processor_config.json").read_text())["processor_class"] == "SmolVLMProcessor"

"""An image-text-to-text checkpoint fine-tuned on text (Gemma 3): the language model gets LoRA, the vision tower and
projector are loaded as they are and stay frozen and counted, the adapter loads onto the original checkpoint
with peft, and the merged checkpoint is the same image-text-to-text model, with its processor settings."""

from __future__ import annotations

import re

from finetuner.model.shapes import shape_from_config, lora_param_count


def _tiny_gemma3(tok):
    from tests.conftest import tiny_with_ids

    return tiny_with_ids("gemma3", tok)


def test_a_text_fine_tune_of_gemma3_trains_the_language_model_and_keeps_the_vision_tower(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    import finetuner
    from finetuner.model.layout import all_linear_targets
    from finetuner.model.tiny_llama import train_bpe_tokenizer
    from tests.conftest import corpus, two_lora_steps

    tok = train_bpe_tokenizer(corpus(), vocab_size=400)
    cfg = _tiny_gemma3(tok)
    shape = shape_from_config(cfg, name="gemma3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    vision = {n: p.detach().clone() for n, p in model.named_parameters() if "vision_tower" in n or "multi_modal_projector" in n}
    assert shape.text_only_of == "gemma3" and shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.param_counts()["other"] == sum(p.numel() for p in vision.values())
    targets = all_linear_targets(model)
    assert targets.startswith(re.escape("model.language_model.layers"))  # whole paths: never the vision tower's
    folder = tmp_path / "gemma3"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    from transformers import Gemma3ImageProcessor

    Gemma3ImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)  # its processor settings

    result = two_lora_steps(folder, tmp_path)
    assert len(result.losses) == 2

    base = AutoModelForCausalLM.from_pretrained(folder)
    tuned = PeftModel.from_pretrained(base, str(result.run_dir / "adapter"))
    lora = {n for n, _ in tuned.named_parameters() if "lora_" in n}
    assert lora and not any("vision_tower" in n for n in lora)
    assert sum(p.numel() for n, p in tuned.named_parameters() if "lora_" in n) == lora_param_count(shape, 4)

    merged = tmp_path / "merged"
    finetuner.merge_adapter(result.run_dir, merged)
    again = AutoModelForCausalLM.from_pretrained(merged)
    assert type(again).__name__ == "Gemma3ForConditionalGeneration"
    from transformers import AutoImageProcessor

    assert AutoImageProcessor.from_pretrained(merged).size == {"height": 32, "width": 32}  # loads as the original does
    for n, p in again.named_parameters():  # the vision tower as it was
        if n in vision:
            torch.testing.assert_close(p, vision[n], rtol=0, atol=0)

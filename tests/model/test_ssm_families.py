"""State-space and short-convolution families (finetuner/model/tiny.py, layout.py, trace.py): Mamba, Mamba-2 and
their hybrids with attention and experts (Jamba, Bamba, Zamba, Granite 4, Nemotron-H, Falcon-H1) and LFM2's short
convolutions build tiny with their own width settings, their mixers are read from the model, their LoRA
``all-linear`` is counted as peft builds it (peft refuses a Mamba mixer's out_proj), transformers' default Falcon-H1
plans to fit an RTX 4090; each trains 2 LoRA steps whose adapter peft loads in tests/model/test_new_families.py."""

from __future__ import annotations

import json
import math

import pytest

from finetuner.model.shapes import lora_param_count, shape_from_config
from tests.model.test_inventory import _tiny, tok  # noqa: F401 - the tiny BPE tokenizer fixture and its tiny configs

SSM_FAMILIES = ["mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "granitemoehybrid",
                "nemotron_h", "falcon_h1", "lfm2", "lfm2_moe"]


def _build(cfg: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))


@pytest.mark.parametrize("model_type", SSM_FAMILIES)
def test_a_state_space_family_builds_tiny_and_its_lora_is_counted_as_peft_builds_it(model_type, tok):
    import torch
    from peft import LoraConfig, get_peft_model

    from finetuner.model.layout import all_linear_targets, in_mixer, peft_refused

    cfg = _tiny(model_type, tok)
    model = _build(cfg)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000  # its own widths shrunk, not only the depth
    ids = torch.tensor([tok("bring water and a map on the trail")["input_ids"][:12]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # the PyTorch path of the scan (no mamba-ssm, no causal-conv1d here)
    assert math.isfinite(loss.item())

    shape = shape_from_config(cfg, name=model_type)
    assert shape.num_params == sum(p.numel() for p in model.parameters())  # the mixers' own weights counted
    mixers = {p for role, p in shape.roles if role == "mixer"}
    assert mixers and all(in_mixer(p) for p in mixers) and shape.mixer_layers >= 1
    targets = all_linear_targets(model)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    wrapped = {n.split(".")[-1] for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert not wrapped & peft_refused(model_type)  # (peft raises where one is targeted)
    assert wrapped & {"in_proj", "x_proj", "dt_proj"}  # the mixers train
    assert lora_param_count(shape, 4) == lora.get_nb_trainable_parameters()[0]


def test_a_shared_block_gets_no_lora_so_the_merge_equals_the_adapter(tok):
    """Zamba2 calls one transformer block from several layers, through a module per layer that holds the same
    weights: a LoRA on each (peft's way) could not be merged into the one weight (merging added both: the census
    measured max |Δlogit| 0.0011 after 2 steps). ``all-linear`` leaves those linears out, the memory model
    counts them frozen, and the merged model computes what the adapter did (fp32: to rounding)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from finetuner.model.inventory import shared_weights
    from finetuner.model.layout import all_linear_targets

    cfg = _tiny("zamba2", tok)
    model = _build(cfg).float().eval()
    shared = shared_weights(model)
    assert shared  # the shared block's linears, held by layers that call it
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=all_linear_targets(model),
                                            init_lora_weights=False))  # random A and B: the adapter changes the logits
    wrapped = [m for m in lora.modules() if hasattr(m, "lora_A")]
    assert wrapped and not any(id(m.base_layer.weight) in shared for m in wrapped)
    assert lora_param_count(shape_from_config(cfg, name="zamba2"), 4) == lora.get_nb_trainable_parameters()[0]
    ids = torch.tensor([tok("bring water and a map on the trail")["input_ids"][:12]])
    with torch.no_grad():
        adapted = lora(input_ids=ids).logits
        with lora.disable_adapter():
            base = lora(input_ids=ids).logits
        merged = lora.merge_and_unload()(input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-2  # the adapter does something the merge must keep
    # fp32 sums of a few hundred terms of size ~1: rounding well under 1e-4
    assert (merged - adapted).abs().max() < 1e-4


def test_transformers_default_falcon_h1_plans_to_fit_an_rtx4090_at_2048_tokens(tmp_path):
    """The issue's done-when: ``AutoConfig.for_model("falcon_h1").save_pretrained(DIR)`` (whose
    ``time_step_limit`` it writes as ``{"__float__": "Infinity"}``), planned as a user would."""
    from transformers import AutoConfig

    from tests.conftest import cli_in_process

    AutoConfig.for_model("falcon_h1").save_pretrained(tmp_path / "falcon_h1")
    args = ("plan", "--model", str(tmp_path / "falcon_h1"), "--gpu", "rtx4090", "--seq-len", "2048")
    plan = cli_in_process(*args, "--json", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["fits"] is True
    said = " ".join(cli_in_process(*args, cwd=tmp_path).stdout.split())  # as rich wraps it at any width
    assert ("32 of its layers have a state-space mixer or short convolution, counted as transformers' PyTorch path "
            "saves it (its scan traced on the meta device; the mamba-ssm and causal-conv1d kernels not assumed)") in said


def test_a_chunked_scan_is_traced_over_whole_chunks_and_fits_a_straight_line(monkeypatch):
    """Mamba-2's scan pads to whole chunks and keeps a state per chunk: traced at 4, 8 and 16 chunks, a + b·T
    gives at 8,192 tokens what the layer saves when traced at 8,192 tokens itself (within 1 %); fitted inside one
    or two chunks (the lengths of an attention layer's trace) it would not."""
    from transformers import AutoConfig

    from finetuner.model import trace

    cfg = AutoConfig.for_model("nemotron_h").to_dict()  # chunks of 128 tokens; its first layer a Mamba-2 mixer
    assert trace.trace_lengths(cfg) == (512, 1024, 2048)
    fitted = trace.trace_layer(cfg)
    monkeypatch.setattr(trace, "trace_lengths", lambda c: (8192, 16384, 32768))
    saved = trace.trace_layer(cfg).at(8192)  # a point the fit goes through: what it saves at 8,192 tokens
    assert fitted.at(8192) == pytest.approx(saved, rel=0.01)
    monkeypatch.setattr(trace, "trace_lengths", lambda c: trace.LENGTHS)
    assert trace.trace_layer(cfg).at(8192) != pytest.approx(saved, rel=0.1)

"""GRPO's rollout on vLLM (finetuner/objectives/rollout_vllm.py), against a stand-in ``vllm`` package.

vLLM cannot be installed here (CUDA-only wheels, no GPU), so these tests inject a stand-in module under
the name ``vllm`` whose classes have the names, keyword arguments and attributes of vLLM 0.30's
(``LLM(model, **engine args)``, ``LLM.generate(prompts, sampling_params, *, use_tqdm, lora_request)``,
``SamplingParams``, ``TokensPrompt``, ``LoRARequest(lora_name, lora_int_id, lora_path)``,
``RequestOutput.outputs``, ``CompletionOutput.index/token_ids/text/finish_reason/stop_reason``): they test
finetuner's side (the engine's arguments, the adapter handed over at each rollout, the conversion of the
outputs, the refusals, the memory terms), not vLLM. The stand-in's engine samples with transformers from
the base it is given plus the adapter the ``LoRARequest`` names (read from that folder), as vLLM would.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field
from typing import Any, TypedDict

import pytest
import torch

import finetuner
from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner.runs.events import read_events
from finetuner.objectives import rollout_vllm
from finetuner.objectives.rollout_vllm import ADAPTER_DIR, VLLMSampler, completion_rows, engine_args, vllm_lora_rank
from tests.objectives.test_grpo_run import grpo_recipe

GiB = 1024**3

#: vLLM 0.30's ``SamplingParams`` fields that the stand-in takes (the real one is a msgspec Struct:
#: an unknown keyword is a TypeError)
SAMPLING_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
                   "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs")
#: ``LLM``'s own keywords and the ``EngineArgs`` fields the stand-in takes (vLLM 0.30)
ENGINE_FIELDS = ("model", "tokenizer", "revision", "trust_remote_code", "dtype", "quantization", "seed",
                 "gpu_memory_utilization", "max_model_len", "enable_lora", "max_lora_rank", "max_loras", "enforce_eager",
                 "enable_sleep_mode", "tensor_parallel_size")


# --------------------------------------------------------------------------- the stand-in
class SamplingParams:
    def __init__(self, **kw):
        unknown = set(kw) - set(SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"Unexpected keyword arguments {sorted(unknown)}")
        self.n, self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed = 1, 1.0, 1.0, 0, 16, None
        self.stop_token_ids = None
        for k, v in kw.items():
            setattr(self, k, v)


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


class StandIn:
    """What the stand-in engine was asked: its arguments, each ``generate`` call, and the adapter files
    each ``LoRARequest`` named as they were when the call came (read with safetensors)."""

    def __init__(self, respond):
        self.respond = respond  # (prompt ids, SamplingParams, LoRARequest) -> [(token ids, finish_reason, stop_reason)] x n
        self.engines: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []

    def module(self) -> dict[str, types.ModuleType]:
        standin = self

        class LLM:
            def __init__(self, model: str, **kwargs):
                unknown = set(kwargs) - set(ENGINE_FIELDS)
                if unknown:
                    raise TypeError(f"EngineArgs has no {sorted(unknown)}")
                standin.engines.append({"model": model, **kwargs})

            def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                         tokenization_kwargs=None):
                from safetensors.torch import load_file

                params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
                assert len(params) == len(prompts)
                files = sorted(p.name for p in __import__("pathlib").Path(lora_request.lora_path).iterdir())
                adapter = load_file(f"{lora_request.lora_path}/adapter_model.safetensors")
                standin.calls.append({"prompts": prompts, "params": params, "lora": lora_request, "files": files,
                                      "adapter": adapter, "use_tqdm": use_tqdm})
                out = []
                for i, (prompt, p) in enumerate(zip(prompts, params)):
                    done = standin.respond(prompt["prompt_token_ids"], p, lora_request)
                    assert len(done) == p.n
                    comps = [CompletionOutput(j, f"text {j}", ids, finish_reason=why, stop_reason=stop)
                             for j, (ids, why, stop) in enumerate(done)]
                    out.append(RequestOutput(str(i), None, prompt["prompt_token_ids"], outputs=comps[::-1]))  # any order
                return out

        vllm = types.ModuleType("vllm")
        vllm.LLM, vllm.SamplingParams, vllm.RequestOutput, vllm.CompletionOutput = LLM, SamplingParams, RequestOutput, CompletionOutput
        inputs = types.ModuleType("vllm.inputs")
        inputs.TokensPrompt = TokensPrompt
        lora = types.ModuleType("vllm.lora")
        request = types.ModuleType("vllm.lora.request")
        request.LoRARequest = LoRARequest
        outputs = types.ModuleType("vllm.outputs")
        outputs.RequestOutput, outputs.CompletionOutput = RequestOutput, CompletionOutput
        vllm.inputs, vllm.lora, vllm.outputs, lora.request = inputs, lora, outputs, request
        return {"vllm": vllm, "vllm.inputs": inputs, "vllm.lora": lora, "vllm.lora.request": request, "vllm.outputs": outputs}

    def install(self, monkeypatch, cuda: bool = True) -> StandIn:
        for name, mod in self.module().items():
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(rollout_vllm, "cuda_available", lambda: cuda)
        return self


def sampling_respond(model_dir):
    """The stand-in engine's sampling: the base from ``model_dir`` plus the adapter of the request's folder,
    transformers' sampling under the request's seed, the completion up to and with its stop token (vLLM
    keeps the EOS in ``token_ids``), ``finish_reason`` ``stop`` or ``length``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded: dict[int, Any] = {}

    def respond(prompt_ids, p, lora):
        if lora.lora_int_id not in loaded:
            loaded.clear()
            loaded[lora.lora_int_id] = PeftModel.from_pretrained(copy.deepcopy(base), lora.lora_path).eval()
        model = loaded[lora.lora_int_id]
        torch.manual_seed(p.seed)
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([prompt_ids] * p.n), attention_mask=torch.ones(p.n, len(prompt_ids), dtype=torch.long),
                                 do_sample=True, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                 max_new_tokens=p.max_tokens, eos_token_id=p.stop_token_ids, pad_token_id=p.stop_token_ids[0])
        done = []
        for row in out[:, len(prompt_ids):].tolist():
            end = next((i for i, t in enumerate(row) if t in p.stop_token_ids), None)
            done.append((row[: end + 1], "stop", None) if end is not None else (row, "length", None))
        return done

    return respond


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model, tok


def _recipe(tiny_model_dir, tmp_path, **grpo) -> Recipe:
    raw = grpo_recipe(tiny_model_dir, tmp_path)
    raw["device"] = "auto"
    raw["grpo"].update(use_vllm=True, **grpo)
    return Recipe.from_dict(raw)


def _settings(**kw):
    return types.SimpleNamespace(**{"num_generations": 3, "max_new_tokens": 5, "temperature": 0.9, "top_p": 0.95, **kw})


# --------------------------------------------------------------------------- the engine and the requests
def test_the_engine_is_built_once_at_the_first_rollout_with_the_runs_settings(tiny_model_dir, tmp_path, policy, monkeypatch):
    model, tok = policy
    standin = StandIn(lambda ids, p, lora: [([5, tok.eos_token_id], "stop", None)] * p.n).install(monkeypatch)
    recipe = _recipe(tiny_model_dir, tmp_path, vllm_gpu_memory_utilization=0.45)
    sampler = VLLMSampler(recipe, tmp_path / "run")
    assert standin.engines == []  # nothing starts before the first rollout
    prompts = [{"prompt_ids": [3, 4, 5]}, {"prompt_ids": [6, 7]}]
    for seed in (11, 12):
        sampler.sample(model, tok, prompts, _settings(), seed, "bf16")
    assert standin.engines == [dict(model=str(tiny_model_dir), revision=None, trust_remote_code=False, dtype="bfloat16", seed=recipe.training.seed,
                                    gpu_memory_utilization=0.45, max_model_len=64, enable_lora=True, max_lora_rank=8, max_loras=1)]
    # the sampling: one request per prompt, n completions each, the transformers path's sampling (no top-k)
    call = standin.calls[0]
    assert call["prompts"] == [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6, 7]}] and call["use_tqdm"] is False
    p = call["params"][0]
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (3, 0.9, 0.95, 0, 5)
    assert p.stop_token_ids == [tok.eos_token_id]
    seeds = [q.seed for q in call["params"]]
    assert len(set(seeds)) == 2  # a seed per prompt, drawn from the rollout's
    assert seeds != [q.seed for q in standin.calls[1]["params"]]
    sampler.sample(model, tok, prompts, _settings(), 11, "bf16")
    assert [q.seed for q in standin.calls[2]["params"]] == seeds  # the same rollout seed, the same seeds


def test_engine_arguments_of_qlora_and_of_ranks_between_vllms(tiny_model_dir, tmp_path):
    raw = grpo_recipe(tiny_model_dir, tmp_path)
    raw.update(device="auto", method="qlora", quantization={"bits": 4})
    raw["grpo"]["use_vllm"] = True
    raw["lora"]["r"] = 12
    args = engine_args(Recipe.from_dict(raw), "fp16")
    assert args["quantization"] == "bitsandbytes" and args["max_lora_rank"] == 16 and args["dtype"] == "float16"
    assert "quantization" not in engine_args(_recipe(tiny_model_dir, tmp_path), "fp32")
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 300, 320, 321, 512)] == [1, 8, 8, 16, 320, 320, 512, 512]
    with pytest.raises(ValueError):
        vllm_lora_rank(513)


def test_each_rollout_hands_vllm_a_new_request_for_the_adapter_as_it_is_then(tiny_model_dir, tmp_path, policy, monkeypatch):
    from peft import get_peft_model_state_dict

    model, tok = policy
    standin = StandIn(lambda ids, p, lora: [([5, tok.eos_token_id], "stop", None)] * p.n).install(monkeypatch)
    run = tmp_path / "run"
    sampler = VLLMSampler(_recipe(tiny_model_dir, tmp_path), run)
    expected = []
    for k in range(3):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.add_(0.5 * (k + 1))  # a training step changed the adapter
        expected.append({n: t.clone() for n, t in get_peft_model_state_dict(model).items()})
        sampler.sample(model, tok, [{"prompt_ids": [3, 4]}], _settings(), k, "fp32")
    requests = [c["lora"] for c in standin.calls]
    assert [(r.lora_name, r.lora_int_id) for r in requests] == [("policy-1", 1), ("policy-2", 2), ("policy-3", 3)]
    assert {r.lora_path for r in requests} == {str(run / ADAPTER_DIR)}
    for call, weights in zip(standin.calls, expected):
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(call["files"])
        assert set(call["adapter"]) == set(weights)
        for name, t in weights.items():  # the folder held the adapter of that rollout, bit for bit
            assert torch.equal(call["adapter"][name], t), name
    b = next(n for n in expected[0] if "lora_B" in n)
    assert not torch.equal(standin.calls[0]["adapter"][b], standin.calls[1]["adapter"][b])
    assert sorted(p.name for p in run.iterdir()) == [ADAPTER_DIR]  # replaced in place: no half-written or old copy left


# --------------------------------------------------------------------------- the conversion
def test_outputs_become_the_rows_sample_completions_gives(policy):
    """The same completions through transformers' generate (rollout.generate_group, a model whose generate
    returns them, padded as generate pads) and through vLLM's outputs give the same rows."""
    _, tok = policy
    eos, pad = tok.eos_token_id, tok.pad_token_id
    max_new = 5
    # per prompt, two completions: EOS inside (tokens after it dropped), cut at max_new_tokens, EOS last, EOS first
    sampled = [[[7, 8, eos, 9, 10], [11, 12, 13, 14, 15]], [[16, eos], [eos]]]

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.generation_config = types.SimpleNamespace(eos_token_id=eos)

        def generate(self, input_ids, attention_mask, **kw):
            rows = [c for group in sampled for c in group]
            rows = [r + [pad] * (max_new - len(r)) for r in rows]
            return torch.cat([input_ids, torch.tensor(rows)], dim=1)

    from finetuner.objectives.rollout import generate_group

    prompts = [[3, 4, 5], [6, 7]]
    via_generate = generate_group(Fake(), tok, prompts, num_generations=2, max_new_tokens=max_new, seed=0).rows()
    outputs = [RequestOutput(str(i), None, p, outputs=[CompletionOutput(j, "x", ids, finish_reason="stop" if eos in ids else "length")
                                                       for j, ids in reversed(list(enumerate(group)))])
               for i, (p, group) in enumerate(zip(prompts, sampled))]
    via_vllm = completion_rows(outputs, tok, [eos], 2, max_new)
    assert via_vllm == via_generate
    assert [r["completion_ids"] for r in via_vllm] == [[7, 8, eos], [11, 12, 13, 14, 15], [16, eos], [eos]]
    assert [r["finished"] for r in via_vllm] == [True, False, True, True]
    assert via_vllm[3]["text"] == "" and via_vllm[1]["text"] == tok.decode([11, 12, 13, 14, 15], skip_special_tokens=True)


def test_a_stop_token_vllm_left_out_of_the_ids_is_put_back(policy):
    _, tok = policy
    eos = tok.eos_token_id
    outs = [RequestOutput("0", None, [3], outputs=[
        CompletionOutput(0, "", [7, 8], finish_reason="stop", stop_reason=eos),  # stopped on it, not kept: put back
        CompletionOutput(1, "", [7, 8, 9], finish_reason="length"),  # cut at max_tokens: unfinished
        CompletionOutput(2, "", [7, 8, 9, 10], finish_reason="length")])]  # longer than asked: cut
    rows = completion_rows(outs, tok, [eos], 3, 3)
    assert [(r["completion_ids"], r["finished"]) for r in rows] == [([7, 8, eos], True), ([7, 8, 9], False), ([7, 8, 9], False)]
    with pytest.raises(RuntimeError, match="2 completions of a prompt, not 3"):
        completion_rows([RequestOutput("0", None, [3], outputs=outs[0].outputs[:2])], tok, [eos], 3, 3)


# --------------------------------------------------------------------------- a run
def test_a_grpo_run_generates_every_rollout_on_vllm_with_the_adapter_of_its_step(tiny_model_dir, tmp_path, monkeypatch):
    """A short GRPO run of the tiny model on the CPU with the stand-in engine generating (the CUDA check
    passed by the test): every rollout and evaluation is a vLLM call with a new request, never transformers'
    generate; the first rollout's adapter is the fresh one (B = 0), each training rollout's differs from the
    one before (the steps between changed it), the final evaluation's is the run's final adapter; the step
    events carry the rollouts' fields."""
    standin = StandIn(sampling_respond(tiny_model_dir)).install(monkeypatch)

    def no_generate(*a, **kw):
        raise AssertionError("the transformers path generated")

    monkeypatch.setattr("finetuner.objectives.rollout.generate_group", no_generate)
    raw = grpo_recipe(tiny_model_dir, tmp_path, name="vllm", max_steps=4)
    raw["device"] = "auto"
    raw["grpo"].update(use_vllm=True, vllm_mode="colocate")
    raw["training"]["eval_every"] = 2
    result = finetuner.train(Recipe.from_dict(raw))
    events = read_events(result.run_dir / "events.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    evals = [e for e in events if e["event"] == "eval"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and evals
    assert len(standin.engines) == 1 and standin.engines[0]["dtype"] == "float32"  # the CPU run's precision
    assert len(standin.calls) == len(steps) + len(evals)
    assert [c["lora"].lora_int_id for c in standin.calls] == list(range(1, len(standin.calls) + 1))
    first = standin.calls[0]["adapter"]
    assert all(not t.any() for n, t in first.items() if "lora_B" in n)  # the fresh adapter: B = 0
    train_calls = [c for c in standin.calls if c["params"][0].max_tokens == 8 and len(c["prompts"]) == 4]
    for before, after in zip(train_calls, train_calls[1:]):
        assert any(not torch.equal(before["adapter"][n], after["adapter"][n]) for n in before["adapter"])
    for s in steps:
        assert {"reward", "reward_std", "completion_length", "completions_clipped"} <= set(s)
        assert 1 <= s["completion_length"] <= 8
    # the last call is the final evaluation, after the last step: it was handed the run's final adapter
    from safetensors.torch import load_file

    final = load_file(str(result.run_dir / "adapter" / "adapter_model.safetensors"))
    assert set(final) == set(first) and all(torch.equal(final[n], standin.calls[-1]["adapter"][n]) for n in final)
    assert (result.run_dir / ADAPTER_DIR / "adapter_model.safetensors").is_file()


# --------------------------------------------------------------------------- refusals
def test_vllm_not_installed_or_no_cuda_is_refused_before_the_run(tiny_model_dir, tmp_path, monkeypatch):
    from finetuner.objectives import build_objective

    recipe = _recipe(tiny_model_dir, tmp_path)
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed: import vllm raises ImportError
    with pytest.raises(UserError, match="vLLM is not installed") as e:
        build_objective(recipe)
    assert "pip install 'finetuner[vllm]'" in str(e.value) and "grpo.use_vllm: false" in str(e.value)
    with pytest.raises(UserError, match="vLLM is not installed"):
        finetuner.train(recipe)
    StandIn(lambda *a: []).install(monkeypatch, cuda=False)
    with pytest.raises(UserError, match="no CUDA GPU is visible") as e:
        build_objective(recipe)
    assert "pip install 'finetuner[vllm]'" in str(e.value)
    StandIn(lambda *a: []).install(monkeypatch, cuda=True)
    assert build_objective(recipe).vllm is not None
    raw = grpo_recipe(tiny_model_dir, tmp_path)
    assert build_objective(Recipe.from_dict(raw)).vllm is None  # the default: transformers' generate


@pytest.mark.parametrize("change, message", [
    ({"device": "cpu"}, "vLLM runs on a CUDA GPU, and device is cpu"),
    ({"method": "full"}, "method 'full' vLLM would need the whole model's weights copied into it"),
    ({"grpo": {"vllm_mode": "server"}}, "vllm_mode: server is not supported: finetuner runs vLLM in its own process"),
    ({"grpo": {"vllm_mode": "remote"}}, "vllm_mode: 'remote' is not a mode"),
    ({"grpo": {"vllm_gpu_memory_utilization": 1.0}}, "vllm_gpu_memory_utilization"),
    ({"grpo": {"vllm_gpu_memory_utilization": 0}}, "vllm_gpu_memory_utilization"),
    ({"method": "qlora", "quantization": {"bits": 8}}, "4-bit NF4 with double quantization only"),
    ({"method": "qlora", "quantization": {"bits": 4, "quant_type": "fp4"}}, "4-bit NF4 with double quantization only"),
    ({"lora": {"r": 600}}, "above vLLM's largest LoRA rank 512"),
    ({"lora": {"bias": "all"}}, "without biases"),
    ({"distributed": {"num_processes": 2}}, "single training process"),
])
def test_what_vllm_cannot_run_is_refused_naming_the_key(tiny_model_dir, tmp_path, change, message):
    raw = grpo_recipe(tiny_model_dir, tmp_path)
    raw["device"] = "auto"
    raw["grpo"]["use_vllm"] = True
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    with pytest.raises(UserError, match=message):
        Recipe.from_dict(raw)


def test_vllm_mode_colocate_is_accepted_and_not_kept(tiny_model_dir, tmp_path):
    r = _recipe(tiny_model_dir, tmp_path, vllm_mode="colocate")
    assert r.grpo.use_vllm and r.grpo.vllm_gpu_memory_utilization == 0.3  # TRL's default
    assert "vllm_mode" not in r.to_dict()["grpo"] and Recipe.from_dict(r.to_dict()).grpo == r.grpo


# --------------------------------------------------------------------------- the memory model
def _memory_case():
    from finetuner.memory.grpo import GrpoSettings
    from finetuner.memory.model import Settings
    from finetuner.model.shapes import resolve_shape

    return (resolve_shape("llama-3-8b"), Settings(method="lora", micro_batch=4, gradient_checkpointing=True, lora_r=16),
            GrpoSettings(num_generations=8, max_new_tokens=512, prompt_len=256, prompts_per_step=2))


def test_vllms_share_replaces_the_generation_in_torchs_memory_and_is_held_on_top():
    from finetuner.memory.grpo import VLLM_SHARE, VLLM_BLOCK_TOKENS, grpo_estimate, kv_cache_bytes, vllm_terms
    from finetuner.memory.model import ALLOCATOR_FIXED_BYTES, ALLOCATOR_FRACTION, CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
    from finetuner.memory.storage import quantized_weight_parts

    sh, s, g = _memory_case()
    plain = grpo_estimate(sh, s, g)
    card = 80 * GiB
    m = grpo_estimate(sh, s, g.with_(use_vllm=True, vllm_gpu_memory_utilization=0.3, card_bytes=card))
    share = int(0.3 * card)
    assert m.components[VLLM_SHARE] == share
    assert all(v == 0 for k, v in m.components.items() if k.startswith("generation:"))
    assert plain.components["generation: KV cache"] > 0 and VLLM_SHARE not in plain.components
    # the generation phase holds the resident weights and states and the GRPO buffers; vLLM's tensors (torch's
    # allocator, the same process) are there in every phase
    resident, buffers = m.details["resident_bytes"], m.components["loss: GRPO buffers"]
    assert m.phases["generation"] - share == resident + buffers < plain.phases["generation"]
    assert {k: v - share for k, v in m.phases.items() if k != "generation"} == {k: v for k, v in plain.phases.items() if k != "generation"}
    allocated = max(m.phases.values()) + CUBLAS_WORKSPACE_BYTES - m.loss.spillable_bytes
    training = allocated - share  # the allocator's slack on the training's tensors only
    reserved = training + int(training * ALLOCATOR_FRACTION) + ALLOCATOR_FIXED_BYTES + share
    assert (m.allocated_bytes, m.reserved_bytes) == (allocated, reserved)
    assert m.total_bytes == reserved + m.loss.spillable_bytes + CUDA_CONTEXT_BYTES
    # here the loss phase is the peak with and without vLLM: the card holds the share more
    assert m.peak_phase == plain.peak_phase == "loss forward/backward" and m.total_bytes == plain.total_bytes + share
    # what the share must hold: the bf16 weights (8.03e9 parameters), rank-16 LoRA slots on every linear, the KV cache
    t = vllm_terms(sh, s, g.with_(use_vllm=True, card_bytes=card))
    assert t.weights == 2 * sh.param_counts()["total"] and t.fits and m.vllm_fits and not m.notes
    seq = -(-768 // VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
    assert (t.kv_one_sequence, t.kv_rollout) == (kv_cache_bytes(sh, 1, seq, 2), kv_cache_bytes(sh, 16, seq, 2))
    linears = sum(lin.in_features + lin.out_features for lin in sh.layer_linears()) * sh.num_layers
    assert t.lora_slots == 2 * 16 * linears
    # QLoRA: vLLM's copy is quantized in flight (NF4 + double quant): half a byte per linear weight and the
    # block-wise state, the embeddings, LM head and norms in bf16
    q = vllm_terms(sh, s.with_(method="qlora", quant_type="fp4", double_quant=False), g.with_(use_vllm=True, card_bytes=card))
    packed, state = quantized_weight_parts(sh, s.with_(method="qlora"))
    linear = sh.linear_weight_numel
    assert packed == -(-linear // 2)
    assert q.weights == packed + state + 2 * (sh.param_counts()["total"] - linear) < t.weights / 2


def test_weights_that_do_not_fit_vllms_share_make_the_estimate_not_fit_and_say_why():
    from finetuner.memory.grpo import grpo_estimate, grpo_memory_estimate
    from finetuner.config.hardware import GpuProfile

    sh, s, g = _memory_case()
    small = grpo_estimate(sh, s, g.with_(use_vllm=True, vllm_gpu_memory_utilization=0.1, card_bytes=80 * GiB))
    assert not small.vllm_fits and not small.fits(10**15)  # 8 GiB cannot hold 16 GB of bf16 weights, whatever the budget
    assert "cannot hold its copy of the weights" in small.notes[0] and "vllm_gpu_memory_utilization" in small.notes[0]
    waves = grpo_estimate(sh, s, g.with_(use_vllm=True, vllm_gpu_memory_utilization=0.205, card_bytes=80 * GiB,
                                         num_generations=64))
    assert waves.vllm_fits and "generates them in waves" in waves.notes[0]
    unknown = grpo_estimate(sh, s, g.with_(use_vllm=True))
    assert unknown.details["vllm_share_bytes"] == 0 and "not known" in unknown.notes[0]
    # the planner's form: the card's memory comes from the GPU, the share is a component, the notes carry over
    gpu = GpuProfile(name="test-80", description="test", memory_bytes=80 * GiB)
    est = grpo_memory_estimate(sh, s, g.with_(use_vllm=True, vllm_gpu_memory_utilization=0.1), gpu)
    assert est.components["vLLM share (gpu_memory_utilization × card)"] == int(0.1 * gpu.memory_bytes)
    assert sum(est.components.values()) == est.total_bytes and any("cannot hold" in n for n in est.notes)


def test_the_trainers_prediction_passes_the_card(tiny_model_dir, tmp_path, monkeypatch):
    from finetuner.config.hardware import GpuProfile
    from finetuner.model.shapes import resolve_shape
    from finetuner.planning.predict import predict

    StandIn(lambda *a: []).install(monkeypatch)
    gpu = GpuProfile(name="test-24", description="test", memory_bytes=24 * GiB)
    pred = predict(_recipe(tiny_model_dir, tmp_path, vllm_gpu_memory_utilization=0.25), gpu, shape=resolve_shape("llama-3-8b"))
    assert pred.memory.to_dict()["components"]["vLLM share (gpu_memory_utilization × card)"] == int(0.25 * gpu.memory_bytes)

"""GRPO's rollout on vLLM (``grpo.use_vllm: true``): a vLLM engine colocated in the training process.

Written against vLLM 0.30's Python API (``vllm/entrypoints/llm.py`` ``LLM`` and ``LLM.generate``,
``vllm/lora/request.py`` ``LoRARequest``, ``vllm/sampling_params.py`` ``SamplingParams``,
``vllm/inputs`` ``TokensPrompt``, ``vllm/outputs.py`` ``RequestOutput``/``CompletionOutput``), with the
option names of TRL 1.16's GRPO (``use_vllm``, ``vllm_mode="colocate"``, ``vllm_gpu_memory_utilization``
0.3). It has not run on a real vLLM here (vLLM is CUDA-only and no GPU was lent): the tests run it
against a stand-in module with those classes' names (``tests/training/test_rollout_vllm.py``).

* **The engine** is built once, at the first rollout: ``vllm.LLM`` on the base model the recipe names
  (its local folder or hub id, revision, ``trust_remote_code``), ``enable_lora`` with ``max_lora_rank``
  the recipe's ``lora.r`` (rounded up to a rank vLLM takes), ``max_loras=1``, the run's autocast
  precision as its dtype, the run's seed, ``max_model_len = data.max_seq_len`` and
  ``gpu_memory_utilization = grpo.vllm_gpu_memory_utilization``: the share of the card vLLM reserves
  for its weights and its KV cache, for the whole run (:mod:`finetuner.memory.grpo` counts it).
  Sleep mode is off (TRL's default): the share stays held during the training phases.
* **QLoRA**: vLLM loads the base quantized in flight (``quantization="bitsandbytes"``), which its
  loader does as 4-bit NF4 with double quantization, the scheme finetuner's QLoRA trains on by default
  (the recipe check refuses the others, :func:`finetuner.config.recipe.vllm_refusal`): vLLM's copy of the
  weights costs what the trainer's does (about half a byte per linear weight, the embeddings and LM head
  in the compute dtype), not the 2 bytes per parameter of a 16-bit copy. Full fine-tuning is refused:
  it would need the whole model's weights copied into vLLM at every rollout.
* **The policy's weights**: at each rollout the adapter as it is now is saved (peft ``save_pretrained``,
  safetensors) into ``RUN/vllm_adapter`` (written beside it, then renamed into place, replacing the
  previous one), and handed to vLLM as a new ``LoRARequest`` (a new name and integer id each time, so
  vLLM loads it instead of reusing the adapter or the prefix cache of an older one).
* **Sampling**: one ``generate`` call for the step's prompts (``TokensPrompt``: the token ids the
  data pipeline made, used as they are), ``SamplingParams(n=num_generations, temperature, top_p,
  top_k=0, max_tokens=max_new_tokens, seed, stop_token_ids=the EOS tokens)``: plain temperature
  sampling with nucleus truncation, no top-k, as the transformers path samples
  (:mod:`finetuner.objectives.rollout`). Each prompt gets its own seed, drawn from the rollout's seed.
* **The completions** come back in exactly the form :func:`finetuner.objectives.grpo.sample_completions`
  gives (:func:`completion_rows`): the ids up to and including the first EOS (the tokenizer's and the
  generation config's), ``finished`` whether there is one, the text decoded by the run's tokenizer
  without special tokens; scoring, advantages and the loss are the same code for both paths.
"""

from __future__ import annotations

import importlib
import random
import shutil
from pathlib import Path
from typing import Any

import finetuner.device as dev
from finetuner.config.recipe import VLLM_LORA_RANKS, Recipe
from finetuner.config.runtime import TORCH_DTYPES
from finetuner.errors import UserError
from finetuner.text import clean_text

#: where the adapter handed to vLLM is saved, in the run folder
ADAPTER_DIR = "vllm_adapter"
#: the vLLM version whose API this module is written against (the ``vllm`` extra asks for it or newer)
VLLM_API_VERSION = "0.30.0"

_OFF = "Set grpo.use_vllm: false to generate with transformers instead."


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (vLLM's wheels are CUDA-only)."""
    return dev.available()


def check_vllm() -> None:
    """A :class:`~finetuner.errors.UserError` when vLLM cannot run here: not installed, or no CUDA device."""
    try:
        importlib.import_module("vllm")
    except ImportError:
        raise UserError("grpo.use_vllm: true, but vLLM is not installed.",
                        hint=f"On a machine with a CUDA GPU: pip install 'finetuner[vllm]'. {_OFF}") from None
    if not cuda_available():
        raise UserError("grpo.use_vllm: true, but no CUDA GPU is visible here, and vLLM runs on CUDA GPUs only.",
                        hint=f"Run on a CUDA machine with pip install 'finetuner[vllm]'. {_OFF}")


def vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM's engine takes that holds a LoRA of rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if r <= rank:
            return rank
    raise ValueError(f"lora.r {r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def engine_args(recipe: Recipe, precision: str) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for ``recipe`` run in ``precision`` (the runtime's autocast
    dtype: bf16, fp16 or fp32)."""
    m, g = recipe.model, recipe.grpo
    args: dict[str, Any] = dict(
        model=m.name, revision=m.revision, trust_remote_code=m.trust_remote_code,
        dtype=TORCH_DTYPES[precision], seed=recipe.training.seed,
        gpu_memory_utilization=g.vllm_gpu_memory_utilization, max_model_len=recipe.data.max_seq_len,
        enable_lora=True, max_lora_rank=vllm_lora_rank(recipe.lora.r), max_loras=1,
    )
    if recipe.method == "qlora":
        args["quantization"] = "bitsandbytes"
    return args


def completion_rows(outputs, tokenizer, eos_ids, num_generations: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """vLLM's ``RequestOutput`` list (one per prompt, ``num_generations`` ``CompletionOutput`` each) as
    :func:`~finetuner.objectives.grpo.sample_completions`' rows, the completions of a prompt consecutive:
    ``completion_ids`` up to and including the first token of ``eos_ids``, ``finished`` whether there is
    one, ``text`` the ids before it decoded without special tokens. A completion vLLM stopped on a stop
    token that it did not keep in ``token_ids`` (``finish_reason`` ``stop``, ``stop_reason`` the token) gets
    it back, so it ends as the transformers path's does."""
    eos = set(eos_ids)
    rows = []
    for request in outputs:
        got = sorted(request.outputs, key=lambda o: o.index)
        if len(got) != num_generations:
            raise RuntimeError(f"vLLM returned {len(got)} completions of a prompt, not {num_generations}")
        for out in got:
            ids = [int(t) for t in out.token_ids][:max_new_tokens]
            stopped_on = out.stop_reason if isinstance(out.stop_reason, int) else None
            if out.finish_reason == "stop" and stopped_on in eos and not eos.intersection(ids) and len(ids) < max_new_tokens:
                ids.append(stopped_on)
            end = next((i for i, t in enumerate(ids) if t in eos), None)
            finished = end is not None
            if finished:
                ids = ids[: end + 1]
            text = clean_text(tokenizer.decode(ids[: len(ids) - int(finished)], skip_special_tokens=True))
            rows.append({"completion_ids": ids, "text": text, "finished": finished})
    return rows


def publish_adapter(model, run_dir: Path) -> Path:
    """The adapter as it is now, saved (peft ``save_pretrained``, safetensors) into ``run_dir/vllm_adapter``:
    written into a folder beside it, then renamed into place, the previous one removed."""
    from finetuner.fileio import publish_dir

    final, tmp, old = run_dir / ADAPTER_DIR, run_dir / f".tmp-{ADAPTER_DIR}", run_dir / f".old-{ADAPTER_DIR}"
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        final.rename(old)
    publish_dir(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


class VLLMSampler:
    """The colocated vLLM engine of a GRPO run and its rollouts (see the module's docstring). Building
    it checks that vLLM can run here (:func:`check_vllm`); the engine itself starts at the first rollout."""

    def __init__(self, recipe: Recipe, run_dir: Path | None):
        check_vllm()
        self.recipe = recipe
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.llm = None
        self.adapters = 0  #: adapters handed to vLLM so far (the last one's integer id)

    def engine(self, precision: str):
        """The ``vllm.LLM``, built at the first call."""
        if self.llm is None:
            from vllm import LLM

            self.llm = LLM(**engine_args(self.recipe, precision))
        return self.llm

    def adapter_request(self, model):
        """The adapter as it is now, saved and named in a new ``LoRARequest``."""
        from vllm.lora.request import LoRARequest

        if self.run_dir is None:
            from finetuner.fileio import private_temp_dir

            self.run_dir = private_temp_dir("finetuner-vllm-", owner=self)
        path = publish_adapter(model, self.run_dir)
        self.adapters += 1
        return LoRARequest(f"policy-{self.adapters}", self.adapters, str(path))

    def sample(self, model, tokenizer, prompts: list[dict[str, Any]], settings, seed: int, precision: str) -> list[dict[str, Any]]:
        """``settings.num_generations`` completions of each prompt (its ``prompt_ids``), sampled by vLLM
        with the adapter as it is now: the rows of :func:`completion_rows`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from finetuner.objectives.rollout import eos_token_ids

        eos = eos_token_ids(model, tokenizer)
        llm = self.engine(precision)
        request = self.adapter_request(model)
        draw = random.Random(seed)
        params = [SamplingParams(n=settings.num_generations, temperature=settings.temperature, top_p=settings.top_p, top_k=0,
                                 max_tokens=settings.max_new_tokens, seed=draw.getrandbits(32), stop_token_ids=list(eos))
                  for _ in prompts]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p["prompt_ids"])) for p in prompts], params,
                               use_tqdm=False, lora_request=request)
        return completion_rows(outputs, tokenizer, eos, settings.num_generations, settings.max_new_tokens)

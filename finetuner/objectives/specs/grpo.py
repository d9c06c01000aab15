"""GRPO (:mod:`finetuner.objectives.grpo`): reinforcement learning from reward functions on prompts, a group of
completions sampled for each. Its planned learning rates are TRL's GRPOConfig default for full fine-tuning and
Unsloth's GRPO LoRA notebooks' for LoRA / QLoRA; 8 prompts a step when the user gives none."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from finetuner.objectives.specs.base import ObjectiveSpec
from finetuner.schema import Section

#: its section's ``loss_type`` values: how the clipped surrogate is averaged (:mod:`finetuner.losses.grpo`)
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


class RewardSection(Section):
    """One reward function of ``objective: grpo``: a function of a Python file with TRL's signature
    ``fn(prompts, completions, **columns) -> list[float]``, or a built-in
    (:mod:`finetuner.rewards`) with its keyword arguments."""

    function: str = Field(description="The function's name in file, or the name of a built-in reward when file is not set.")
    file: str | None = Field(None, description="A Python file defining function (relative to the recipe).")
    weight: float = Field(1.0, description="The reward's weight in the sum the advantages are computed from.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of a built-in reward (e.g. column, pattern, max_words).")

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, raw: Any) -> Any:
        """``- exact_match`` (a name alone) is a built-in with no arguments."""
        return {"function": raw} if isinstance(raw, str) else raw

    @model_validator(mode="after")
    def _args_for_builtins(self) -> RewardSection:
        if self.file is not None and self.args:
            raise ValueError(f"args: set for '{self.function}' from {self.file}; args are the keyword arguments of a "
                             "built-in reward: remove them (a function of your file takes the data's columns)")
        return self


class GRPOSection(Section):
    """Settings of ``objective: grpo``: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath)
    with Dr. GRPO's and DAPO's variants (:mod:`finetuner.losses.grpo` writes out the formulas).

    Each step takes the prompts of ``training.micro_batch_size × gradient_accumulation`` examples of
    the data (the prompt side of any supported format, or a file of prompts), generates
    ``num_generations`` completions of each with the adapter in the loop, scores them with the reward
    functions, and trains on the completions with their group-relative advantages. TRL's
    ``GRPOConfig`` names are accepted where they mean the same (:attr:`TRL_NAMES`).
    """

    #: TRL ``GRPOConfig`` names → this section's key (the same meaning)
    TRL_NAMES: ClassVar[dict[str, str]] = {"max_completion_length": "max_new_tokens", "reward_funcs": "rewards",
                                           "num_completions_to_print": "logged_completions"}

    num_generations: int = Field(4, ge=2, description="Completions generated per prompt (the group whose rewards are compared).")
    max_new_tokens: int = Field(64, ge=1, description="The longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the completions.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p.")
    rewards: list[RewardSection] = Field(default_factory=list, description="The reward functions, summed with their weights.")
    beta: float = Field(0.0, ge=0, description="Weight of the KL divergence to the reference (the base with the adapter off); 0: no reference pass.")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Clipping of the importance ratio to [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = Field(None, gt=0, description="DAPO's upper clip bound (default: epsilon).")
    loss_type: Literal[LOSS_TYPES] = Field(  # type: ignore[valid-type]
        "dapo", description="grpo: mean per sequence (DeepSeekMath); dr_grpo: sum over tokens / (sequences x max_new_tokens) "
        "(Dr. GRPO); dapo: mean over all tokens (DAPO).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide the advantages by the group's reward std (group), the batch's (batch), or not (none, Dr. GRPO).")
    num_iterations: int = Field(1, ge=1, description="Optimizer steps on each rollout (mu): the prompts of one step are generated once and trained on this many times.")
    use_bias_correction_kl: bool = Field(False, description="Weight each token's KL term by its importance ratio (DeepSeek-V3.2's unbiased reverse-KL gradient; TRL's default is true); false: DeepSeekMath's beta x KL. Matters only with beta > 0.")
    logged_completions: int = Field(2, ge=0, description="Completions (with their rewards) written to the events at each logging step.")
    reward_timeout_s: float = Field(600.0, gt=0, description="The longest one call of a reward function may take, in seconds; "
                                    "past it the run stops with a message naming the function, after a checkpoint of its last step.")
    use_vllm: bool = Field(False, description="Generate the completions with vLLM (pip install 'finetuner[vllm]', a CUDA GPU), "
                           "colocated in the training process, the adapter as it is at each rollout; false: transformers' generate.")
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, lt=1, description="With use_vllm: the share of the GPU's memory vLLM reserves for its copy of the weights "
        "and its KV cache, for the whole run, on top of the training's (TRL's name and default).")

    #: TRL's ``vllm_mode`` values: only ``colocate`` is finetuner's (the key is accepted, and not kept)
    VLLM_MODES: ClassVar[tuple[str, ...]] = ("colocate",)

    @model_validator(mode="before")
    @classmethod
    def _trl_names(cls, raw: Any) -> Any:
        """TRL's names for the same settings; ``scale_rewards`` true/false as TRL takes it; TRL's
        ``vllm_mode: colocate`` (the only mode finetuner runs vLLM in), ``server`` refused."""
        if not isinstance(raw, dict):
            return raw
        out = dict(raw)
        if "vllm_mode" in out:
            mode = out.pop("vllm_mode")
            if mode == "server":
                raise ValueError("vllm_mode: server is not supported: finetuner runs vLLM in its own process, colocated with "
                                 "the training (vllm_mode: colocate): remove vllm_mode, or set it to colocate")
            if mode not in cls.VLLM_MODES:
                raise ValueError(f"vllm_mode: '{mode}' is not a mode; finetuner runs vLLM colocated (vllm_mode: colocate)")
        for theirs, ours in cls.TRL_NAMES.items():
            if theirs in out:
                if ours in out:
                    raise ValueError(f"{theirs} and {ours} are the same setting (TRL's name and finetuner's): give one")
                out[ours] = out.pop(theirs)
        if isinstance(out.get("scale_rewards"), bool):
            out["scale_rewards"] = "group" if out["scale_rewards"] else "none"
        return out

    @model_validator(mode="after")
    def _bounds(self) -> GRPOSection:
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(f"epsilon_high: {self.epsilon_high} is below epsilon {self.epsilon}; DAPO's upper bound is the "
                             "larger one: raise it, or remove it")
        return self


GRPO = ObjectiveSpec(
    name="grpo", order=70, data_kind="prompts", section="grpo", section_schema=GRPOSection,
    section_help="Settings of objective grpo (its reward functions, group size, generation).", label="GRPO", generates=True, whole_sequences=True,
    units="prompts", learning_rates={"lora": 5e-6, "qlora": 5e-6, "full": 1e-6},
    lr_source={"lora": "Unsloth's GRPO LoRA notebooks", "qlora": "Unsloth's GRPO LoRA notebooks",
                                                               "full": "TRL's GRPOConfig default"}, max_epochs=3, default_effective_batch=8,
    scorer="rewards", description="reinforcement learning from reward functions on prompts",
)

SPECS = (GRPO,)

"""Mean reward of the base model and the fine-tune on held-out prompts (a GRPO run).

``finetuner eval RUN`` on a run whose objective is ``grpo`` (or ``--data PROMPTS`` for such a run)
comes here (:func:`finetuner.infer.evaluate.evaluate_run` hands it over). Each prompt gets the
run's ``grpo.num_generations`` completions from each model, sampled with the run's generation
settings under the same seed the trainer's evaluation uses
(:func:`finetuner.objectives.grpo.sample_completions`), and the run's reward functions score them
(:func:`finetuner.objectives.grpo.score_completions`): the numbers are those of the run's ``eval``
events for the fine-tune. Both models come from one loaded model (the base is the adapter switched off).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import finetuner.phases as phases
from finetuner.errors import UserError
from finetuner.infer.preference_eval import describe_examples, examples_are


@dataclass
class RewardScore:
    reward: float  #: the mean total (weighted) reward of the completions
    rewards: dict[str, float]  #: each function's mean, by name
    completion_length: float  #: mean completion tokens
    tokens: int  #: completion tokens in all


@dataclass
class RewardEvalResult:
    """Mean reward of ``base`` and ``fine_tuned`` on ``examples`` held-out prompts."""

    source: str
    data: str
    examples: int
    completions_per_prompt: int
    base: RewardScore
    fine_tuned: RewardScore
    kind: str = "reward"
    samples: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    examples_are: str = "held-out"

    def describe(self) -> str:
        return describe_examples(self.examples, "prompts", self.data, self.examples_are, "the rewards show")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [("", "base", "fine-tuned"), ("mean reward", f"{self.base.reward:.4f}", f"{self.fine_tuned.reward:.4f}")]
        rows += [(f"  {name}", f"{self.base.rewards[name]:.4f}", f"{self.fine_tuned.rewards[name]:.4f}") for name in self.base.rewards]
        rows.append(("completion tokens", f"{self.base.completion_length:.1f}", f"{self.fine_tuned.completion_length:.1f}"))
        w = max(len(r[0]) for r in rows)
        return "\n".join(f"{a:<{w}}  {b:>10}  {c:>10}" for a, b, c in rows)


def held_out_prompts(src, tokenizer, data: str | Path | None) -> tuple[list[dict[str, Any]], str]:
    """The prompts to score: ``data``'s (all of them), or the run's validation prompts as the trainer split them."""
    from finetuner.data.prompts import prepare_prompts

    recipe = src.recipe
    cfg = recipe.data
    if data is not None:
        cfg = cfg.model_copy(update={"path": str(data), "val_size": 0.0, "val_path": None, "max_examples": None})
        return prepare_prompts(cfg, tokenizer, recipe.training.seed, recipe.grpo.max_new_tokens).train, str(data)
    if not cfg.val_path and not cfg.val_size:
        raise UserError(f"The run {src.path} kept no held-out prompts (data.val_size is 0 and there is no data.val_path).",
                        hint="Pass a file of prompts with --data.")
    prepared = prepare_prompts(cfg, tokenizer, recipe.training.seed, recipe.grpo.max_new_tokens)
    what = f"{cfg.val_path}" if cfg.val_path else f"the run's held-out prompts ({len(prepared.val)} of {cfg.path})"
    return list(prepared.val), what


def _score(model, tokenizer, prompts, settings, rewards, seed: int, batch_size: int, adapter: bool):
    import torch

    from finetuner.objectives.grpo import sample_completions, score_completions

    ctx = contextlib.nullcontext() if adapter else model.disable_adapter()
    who = "the fine-tune" if adapter else "the base model"
    with ctx, torch.no_grad(), phases.phase("eval", total=len(prompts), unit="prompts", label=f"completions of {who}"):
        completions = sample_completions(model, tokenizer, prompts, settings, seed, batch_size)  # counted at its end
    scored = score_completions(rewards, settings.num_generations, prompts, completions)
    lengths = [len(c["completion_ids"]) for c in completions]
    score = RewardScore(round(sum(scored.total) / len(scored.total), 6), {k: round(v, 6) for k, v in scored.means().items()},
                        round(sum(lengths) / len(lengths), 3), sum(lengths))
    return score, [c["text"] for c in completions[:: settings.num_generations]]


def evaluate_rewards(src, tokenizer, data, batch_size: int, device: str, load_model) -> RewardEvalResult:
    """Sample and score completions of the held-out prompts with the fine-tune and the base."""
    from finetuner.objectives.grpo import EVAL_SEED_OFFSET, reward_functions

    t0 = time.perf_counter()
    recipe = src.recipe
    settings = recipe.grpo
    rewards = reward_functions(settings.rewards, allow_code=src.allow_code)  # the run's reward file runs only with --trust-remote-code
    prompts, what = held_out_prompts(src, tokenizer, data)
    if not prompts:
        raise UserError(f"No prompts to evaluate in {what}.")
    seed = recipe.training.seed + EVAL_SEED_OFFSET
    model, dev = load_model(src, adapter=True, device=device)
    model.eval()
    tuned, tuned_text = _score(model, tokenizer, prompts, settings, rewards, seed, batch_size, adapter=True)
    base, base_text = _score(model, tokenizer, prompts, settings, rewards, seed, batch_size, adapter=False)
    samples = [{"prompt": p["prompt"] if isinstance(p["prompt"], str) else p["prompt"][-1]["content"], "base": b, "fine_tuned": f}
               for p, b, f in zip(prompts[:5], base_text, tuned_text)]
    return RewardEvalResult(source=str(src.path), data=what, examples=len(prompts), completions_per_prompt=settings.num_generations,
                            base=base, fine_tuned=tuned, samples=samples, seconds=round(time.perf_counter() - t0, 2),
                            examples_are=examples_are(recipe, data))

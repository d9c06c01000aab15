"""GRPO: reinforcement learning from reward functions on prompts (``objective: grpo``).

Each optimizer step is a rollout phase and a training phase:

1. **Rollout** (:meth:`GRPOObjective.before_step`): the step's prompts (``training.micro_batch_size
   × gradient_accumulation`` of them, the schedule's batch) each get ``grpo.num_generations``
   completions, sampled with the adapter in the loop (:mod:`finetuner.objectives.rollout`, transformers'
   ``generate`` with a KV cache), under a seed of the run's seed and the batch's number, so a resumed
   run samples what the uninterrupted one did. The reward functions (:mod:`finetuner.rewards`) score
   them; the weighted sum's group-relative advantages (:func:`finetuner.losses.grpo.group_advantages`)
   are fixed for the batch. With ``beta > 0`` the reference's per-token log-probabilities (the base with
   the adapter switched off, as for DPO) are computed once here, under ``no_grad``; with
   ``num_iterations > 1`` the sampling policy's too (the ``π_old`` of the clipped ratio).
2. **Training**: the completions are the step's rows, ``micro_batch_size`` of them a forward pass
   (prompt + completion, the loss on the completion tokens only). Each micro-batch's loss
   (:func:`finetuner.losses.grpo.grpo_loss`) is normalised by the whole step's completions and tokens,
   so the micro-batches' losses add up to the step's whatever the split (and over several processes).

A batch of prompts is trained on for ``num_iterations`` steps (μ in the papers) with the same rollout;
a checkpoint inside such a block keeps the rollout (:meth:`GRPOObjective.state`) so that a resumed
run goes on with it.

The step event carries the mean total reward and its mean within-group standard deviation, each
function's mean and standard deviation, the KL to the reference (``beta > 0``), the clip fractions,
the completion length and the share of completions cut at ``max_new_tokens``, and a few sampled
completions with their rewards. The evaluation samples ``num_generations`` completions of each
held-out prompt with a fixed seed and reports their mean reward (the same prompts and seed at every
evaluation: the curve shows the policy, not the sampling).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import finetuner.phases as phases
from finetuner.config.recipe import Recipe
from finetuner.data.pipeline import IGNORE_INDEX
from finetuner.data.prompts import prepare_prompts
from finetuner.losses.grpo import group_advantages, grpo_loss
from finetuner.model.scoring import scored_token_logps
from finetuner.objectives.base import Objective, loss_module, register

#: added to the run's seed for the evaluation's sampling (never a training batch's seed)
EVAL_SEED_OFFSET = 7_919


# --------------------------------------------------------------------------- micro-batches
class CompletionCollator:
    """Completion rows (prompt + completion tokens) padded on the right into a micro-batch: labels
    only on the completion tokens, and the rollout's per-row values (advantage, reference and old
    log-probabilities) as tensors aligned with the completion tokens."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        n = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
        width = max(max(len(r["completion_ids"]) for r in rows), 1)
        ids, labels, attention = [], [], []
        for r in rows:
            seq = r["prompt_ids"] + r["completion_ids"]
            pad = n - len(seq)
            ids.append(seq + [self.pad_token_id] * pad)
            labels.append([IGNORE_INDEX] * len(r["prompt_ids"]) + r["completion_ids"] + [IGNORE_INDEX] * pad)
            attention.append([1] * len(seq) + [0] * pad)
        lengths = torch.tensor([len(r["completion_ids"]) for r in rows])
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)

        def aligned(key: str):
            if rows[0].get(key) is None:
                return None
            out = torch.zeros(len(rows), width)
            for i, r in enumerate(rows):
                out[i, : len(r[key])] = torch.tensor(r[key], dtype=torch.float32)
            return out

        return {
            "input_ids": torch.tensor(ids),
            "labels": torch.tensor(labels),
            "attention_mask": torch.tensor(attention),
            "completion_mask": mask,
            "advantages": torch.tensor([r["advantage"] for r in rows], dtype=torch.float32),
            "ref_logps": aligned("ref_logps"),
            "old_logps": aligned("old_logps"),
            "num_tokens": int(sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)),
        }


def completion_logps(model, batch: dict[str, Any], chunk_size: int):
    """``[rows, longest completion]``: the per-token log-probabilities of each row's completion tokens
    (0 past its end), through the chunked LM head (:func:`finetuner.model.scoring.scored_token_logps`)."""
    token, _ = scored_token_logps(model, batch, chunk_size)
    mask = batch["completion_mask"]
    return token.new_zeros(mask.shape).masked_scatter(mask, token)


# --------------------------------------------------------------------------- the memory prediction
# --------------------------------------------------------------------------- the step's sums
class StepSums:
    """The loss-side sums of a step over its micro-batches (token-weighted), all-reduced with the loss."""

    FIELDS = ("tokens", "kl", "clip_low", "clip_high", "clip_region")

    def __init__(self) -> None:
        self.tokens = self.kl = self.clip_low = self.clip_high = self.clip_region = 0.0

    def add(self, metrics: dict[str, float]) -> None:
        n = metrics["tokens"]
        self.tokens += n
        self.kl += metrics.get("kl", 0.0) * n
        self.clip_low += metrics["clip_ratio/low"] * n
        self.clip_high += metrics["clip_ratio/high"] * n
        self.clip_region += metrics["clip_ratio/region"] * n

    def totals(self) -> list[float]:
        return [float(getattr(self, f)) for f in self.FIELDS]

    @classmethod
    def from_totals(cls, values) -> StepSums:
        out = cls()
        for f, v in zip(cls.FIELDS, values, strict=True):
            setattr(out, f, float(v))
        return out

    def to_dict(self, beta: float) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        out = {"clip_ratio": round(self.clip_region / n, 6), "clip_ratio_low": round(self.clip_low / n, 6),
               "clip_ratio_high": round(self.clip_high / n, 6)}
        if beta:
            out["kl"] = round(self.kl / n, 8)
        return out


# --------------------------------------------------------------------------- the reward functions
def reward_functions(specs, allow_code: bool = True) -> list:
    """The recipe's ``grpo.rewards`` as :class:`finetuner.rewards.combine.RewardFunction` objects: a
    function of a user's file (:func:`finetuner.rewards.loading.load_reward_function`), or a built-in
    (:data:`finetuner.rewards.builtin.BUILTINS`) made with its ``args``. Two rewards of the same name
    are told apart by their place in the list. ``allow_code``: run a file of functions (False: refuse it,
    for a recipe read back from a run folder the user has not vouched for with ``--trust-remote-code``)."""
    from finetuner.rewards.builtin import make_builtin
    from finetuner.rewards.combine import RewardFunction
    from finetuner.rewards.loading import load_reward_function

    out = []
    for i, spec in enumerate(specs):
        where = f"grpo.rewards[{i}]"
        if spec.file is not None:
            fn, name = load_reward_function(spec.file, spec.function, where=where, allow_code=allow_code), spec.function
        else:
            fn = make_builtin(spec.function, spec.args, name_at=f"{where}.function", args_at=f"{where}.args")
            name = getattr(fn, "__name__", spec.function)
        taken = {r.name for r in out}
        out.append(RewardFunction(name if name not in taken else f"{name}#{i + 1}", fn, spec.weight))
    return out


# --------------------------------------------------------------------------- sampling and scoring
def sample_completions(model, tokenizer, prompts: list[dict[str, Any]], settings, seed: int, batch_size: int) -> list[dict[str, Any]]:
    """``settings.num_generations`` completions of each prompt (consecutive in the result), sampled
    with ``settings``' temperature and top-p under ``seed`` (:mod:`finetuner.objectives.rollout`), the
    completions of ``batch_size`` prompts a ``generate`` call: ``{"completion_ids", "text", "finished"}``
    each, the ids up to and with the end token."""
    from finetuner.objectives.rollout import generate_group

    rollout = generate_group(model, tokenizer, [p["prompt_ids"] for p in prompts], num_generations=settings.num_generations,
                             max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
                             seed=seed, batch_size=batch_size * settings.num_generations)
    return rollout.rows()


def decode_steps(completions: list[dict[str, Any]], rows_per_call: int) -> int:
    """The decode steps ``generate`` ran for ``completions``, summed over its calls of ``rows_per_call``
    rows: a call generates until every row has ended, so as many tokens as its longest completion."""
    return sum(max(len(c["completion_ids"]) for c in completions[i : i + rows_per_call])
               for i in range(0, len(completions), rows_per_call))


def as_completion(prompt: dict[str, Any], completion: dict[str, Any]):
    """A completion as TRL hands it to reward functions: a text for a text prompt, a list with one
    assistant message for a conversational one."""
    text = completion["text"]
    return text if isinstance(prompt["prompt"], str) else [{"role": "assistant", "content": text}]


def score_completions(rewards: list, num_generations: int, prompts: list[dict[str, Any]], completions: list[dict[str, Any]],
                      timeout_s: float | None = None, stop=None):
    """The rewards of the completions (:func:`finetuner.rewards.combine.score`): each function gets
    the prompts, the completions and the data's other columns, one value per completion, and
    ``completion_ids``; a :class:`~finetuner.errors.RewardError` names the function and the row. Each call
    runs under ``timeout_s`` and the stop request ``stop()`` (:mod:`finetuner.rewards.limits`)."""
    from finetuner.rewards.combine import score

    group = [p for p in prompts for _ in range(num_generations)]
    keys = sorted({k for p in prompts for k in p["columns"]})
    columns = {k: [p["columns"].get(k) for p in group] for k in keys}
    columns["completion_ids"] = [c["completion_ids"] for c in completions]
    return score(rewards, [p["prompt"] for p in group], [as_completion(p, c) for p, c in zip(group, completions, strict=True)],
                 columns, [p["where"] for p in group], timeout_s, stop)


# --------------------------------------------------------------------------- the objective
@register("grpo")
class GRPOObjective(Objective):
    """GRPO on prompts with reward functions (see the module's docstring)."""

    data_kind = "prompts"

    def __init__(self, recipe: Recipe, run_dir=None):
        super().__init__(recipe, run_dir)
        self.settings = recipe.grpo
        self.steps_per_batch = self.settings.num_iterations
        self.rewards = reward_functions(self.settings.rewards)  # a bad file or name stops here, before the run
        self.vllm = None  # grpo.use_vllm: the colocated vLLM sampler (finetuner.objectives.rollout_vllm); vLLM missing stops here
        if self.settings.use_vllm:
            from finetuner.objectives.rollout_vllm import VLLMSampler

            self.vllm = VLLMSampler(recipe, run_dir)
        self.rollout: dict[str, Any] | None = None  # the current batch's: {"batch": k, "rows": [...], "metrics": {...}}
        self.sums = StepSums()
        self.counts = (1, 1)  # the step's completions and completion tokens (the loss's normalisers)
        self.tokenizer = None
        self.rollout_s = 0.0  # the wall time of the rollout this step made (0 when it reused the batch's)

    # ---------------------------------------------------------------- set-up
    def prepare_data(self, tokenizer, processor=None):
        r = self.recipe
        self.tokenizer = tokenizer
        return prepare_prompts(r.data, tokenizer, r.training.seed, self.settings.max_new_tokens)

    def collator(self, pad_token_id: int) -> CompletionCollator:
        return CompletionCollator(pad_token_id)

    def step_loss_module(self, model, chunk_size: int, fused_ce=None):
        """The module a micro-batch's forward goes through: its share of the step's GRPO loss."""
        return loss_module(model, lambda m, batch: self.loss(m, batch, chunk_size))

    # ---------------------------------------------------------------- the rollout
    def before_step(self, trainer, step: int, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The step's completion rows: a new rollout at the first step of a batch (its wall time is the
        step's ``rollout_s``), the batch's rollout again at the next ``num_iterations − 1`` steps
        (``rollout_s`` 0: they spend nothing on it)."""
        batch = step // self.steps_per_batch
        self.rollout_s = 0.0
        if self.rollout is None or self.rollout["batch"] != batch:
            start = time.perf_counter()
            self.rollout = self.roll_out(trainer, examples, trainer.recipe.training.seed * 1_000_003 + batch)
            self.rollout_s = time.perf_counter() - start
            self.rollout["batch"] = batch
        return self.rollout["rows"]

    def generate(self, trainer, prompts: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
        """:func:`sample_completions` with the trainer's model (the adapter in the loop), or with
        ``grpo.use_vllm`` the colocated vLLM engine given the adapter as it is now (the same rows)."""
        if self.vllm is not None:
            return self.vllm.sample(trainer.model, self.tokenizer, prompts, self.settings, seed, trainer.rt.precision)
        return sample_completions(trainer.model, self.tokenizer, prompts, self.settings, seed,
                                  max(trainer.recipe.training.micro_batch_size, 1))

    def score(self, prompts: list[dict[str, Any]], completions: list[dict[str, Any]], trainer=None):
        # the stop request of one process (a threading.Event; the ranks of a multi-process run agree on theirs
        # collectively, once per step, which a timer inside a reward call must not do)
        event = getattr(trainer, "stop_event", None)
        stop = event.is_set if isinstance(event, threading.Event) else None
        return score_completions(self.rewards, self.settings.num_generations, prompts, completions,
                                 self.settings.reward_timeout_s, stop)

    def roll_out(self, trainer, prompts: list[dict[str, Any]], seed: int) -> dict[str, Any]:
        """Generate, score and prepare the step's completion rows (see the module's docstring)."""
        import torch

        g = self.settings
        model = trainer.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), trainer.evaluation():
                completions = self.generate(trainer, prompts, seed)
        finally:
            model.train(was_training)
        rewards = self.score(prompts, completions, trainer)
        total = torch.tensor(rewards.total, dtype=torch.float32)
        adv = group_advantages(total, g.num_generations, scale_rewards=g.scale_rewards)
        G = g.num_generations
        rows = [{"prompt_ids": prompts[j // G]["prompt_ids"], "completion_ids": c["completion_ids"],
                 "advantage": float(adv.advantages[j])} for j, c in enumerate(completions)]
        with torch.no_grad(), trainer.evaluation():
            model.eval()
            try:
                if g.beta:
                    with model.disable_adapter():
                        self._attach_logps(trainer, rows, "ref_logps")
                if self.steps_per_batch > 1:
                    self._attach_logps(trainer, rows, "old_logps")
            finally:
                model.train(was_training)
        metrics = self._rollout_metrics(prompts, completions, rewards, adv)
        metrics["decode_steps"] = decode_steps(completions, max(trainer.recipe.training.micro_batch_size, 1) * G)
        return {"rows": rows, "metrics": metrics}

    def _attach_logps(self, trainer, rows: list[dict[str, Any]], key: str) -> None:
        """Each row's per-token completion log-probabilities under the model as it is now, as ``row[key]``."""
        mbs = max(trainer.recipe.training.micro_batch_size, 1)
        collate = CompletionCollator(self.tokenizer.pad_token_id)
        for i in range(0, len(rows), mbs):
            part = rows[i : i + mbs]
            batch = trainer.to_device(collate(part))
            with trainer.autocast():
                logps = completion_logps(trainer.model, batch, trainer.recipe.training.loss_chunk_size).float().cpu()
            for r, values in zip(part, logps, strict=True):
                r[key] = values[: len(r["completion_ids"])].tolist()

    def _rollout_metrics(self, prompts, completions, rewards, adv) -> dict[str, Any]:
        """The rollout's fields of the step event (means over the step's completions)."""
        G = self.settings.num_generations
        total = rewards.total
        per_function = {}
        for name, values in rewards.per_function.items():
            scored = [v for v in values if not math.isnan(v)]
            mean = sum(scored) / len(scored) if scored else math.nan
            std = math.sqrt(sum((v - mean) ** 2 for v in scored) / (len(scored) - 1)) if len(scored) > 1 else 0.0
            per_function[name] = {"mean": round(mean, 6), "std": round(std, 6)}
        lengths = [len(c["completion_ids"]) for c in completions]
        shown = []
        for j in range(0, min(self.settings.logged_completions, len(prompts)) * G, G):  # the first completion of the first prompts
            p = prompts[j // G]["prompt"]
            shown.append({"prompt": p if isinstance(p, str) else p[-1]["content"], "completion": completions[j]["text"],
                          "reward": round(total[j], 6),
                          "rewards": {name: round(v[j], 6) if not math.isnan(v[j]) else None for name, v in rewards.per_function.items()}})
        return {
            "reward": round(sum(total) / len(total), 6),
            "reward_std": round(float(adv.std.mean()), 6),
            "rewards": per_function,
            "completion_length": round(sum(lengths) / len(lengths), 3),
            "completions_clipped": round(sum(not c["finished"] for c in completions) / len(completions), 6),
            "zero_std_groups": round(float(adv.zero_std.float().mean()), 6),
            "completions": shown,
        }

    # ---------------------------------------------------------------- a step
    def start_step(self, examples: list[dict[str, Any]]) -> int:
        """The step's completions and completion tokens normalise each micro-batch's loss
        (:func:`~finetuner.losses.grpo.grpo_loss`), so the trainer divides the summed loss by 1."""
        self.sums = StepSums()
        self.counts = (len(examples), sum(len(r["completion_ids"]) for r in examples))
        return 1

    def loss(self, model, batch: dict[str, Any], chunk_size: int):
        """The micro-batch's share of the step's GRPO loss; its KL and clip fractions go to the step's sums."""
        g = self.settings
        logps = completion_logps(model, batch, chunk_size)
        mask = batch["completion_mask"]
        out = grpo_loss(logps, batch["advantages"], mask, old_logps=batch["old_logps"], ref_logps=batch["ref_logps"],
                        beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high, loss_type=g.loss_type,
                        use_bias_correction_kl=g.use_bias_correction_kl,
                        max_completion_length=g.max_new_tokens, num_sequences=self.counts[0], num_tokens=self.counts[1])
        self.sums.add(out.metrics)
        return out.loss

    def uncounted(self):
        import contextlib

        @contextlib.contextmanager
        def nowhere():
            kept, self.sums = self.sums, StepSums()
            try:
                yield
            finally:
                self.sums = kept

        return nowhere()

    def step_totals(self) -> list[float]:
        return self.sums.totals()

    def set_step_totals(self, values) -> None:
        self.sums = StepSums.from_totals(values)

    def step_metrics(self) -> dict[str, Any]:
        """The rollout's rewards and the loss's KL and clip fractions of the step just taken."""
        return {**(self.rollout["metrics"] if self.rollout else {}), "rollout_s": round(self.rollout_s, 4),
                **self.sums.to_dict(self.settings.beta)}

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, trainer) -> tuple[float | None, dict[str, Any]]:
        """No validation loss; the mean reward of ``num_generations`` completions of each held-out
        prompt, sampled with a fixed seed (``eval_reward``, and per function ``eval_rewards``)."""
        val = trainer.data.val
        if not val:
            return None, {}
        import torch

        model = trainer.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), trainer.evaluation():
                completions = self.generate(trainer, list(val), trainer.recipe.training.seed + EVAL_SEED_OFFSET)
            phases.advance(len(val))  # the trainer's "eval" phase: its prompts sampled (one generate call)
        finally:
            model.train(was_training)
        rewards = self.score(list(val), completions, trainer)
        return None, {"eval_reward": round(sum(rewards.total) / len(rewards.total), 6),
                      "eval_rewards": {k: round(v, 6) for k, v in rewards.means().items()},
                      "eval_completion_length": round(sum(len(c["completion_ids"]) for c in completions) / len(completions), 3)}

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        """The rollout in use when a checkpoint falls inside a batch's ``num_iterations`` steps (a
        resumed run trains on it, as the uninterrupted one does); nothing otherwise."""
        if self.steps_per_batch == 1 or self.rollout is None:
            return {}
        return {"rollout": self.rollout}

    def load_state(self, state: dict[str, Any]) -> None:
        self.rollout = state.get("rollout")

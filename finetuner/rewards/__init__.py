"""Reward functions for GRPO, with TRL's signature ``fn(prompts, completions, **columns) -> list[float]``.

* :mod:`finetuner.rewards.loading`: a user's function from a Python file named in a recipe;
* :mod:`finetuner.rewards.builtin`: exact match of a final answer, a regex format check, length bounds, a tool call's match, the reasoning format;
* :mod:`finetuner.rewards.combine`: several weighted functions scored on a batch, their outputs checked
  (:class:`finetuner.errors.RewardError` naming the function and the row).
"""

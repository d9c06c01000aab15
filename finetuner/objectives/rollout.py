"""GRPO's rollout: a group of ``num_generations`` completions per prompt, sampled from the policy.

Generation goes through transformers' ``generate`` with its KV cache, the prompts left-padded so every
row's completion starts in the same column. The model is the one being trained, adapter on (the policy);
it generates in evaluation mode (no dropout) and goes back to training mode after. Sampling is plain
temperature sampling with nucleus (``top_p``) truncation, no top-k (``top_k=0``), so the distribution
sampled from is the one :func:`finetuner.losses.grpo.token_logps` scores at the same temperature
(``top_p = 1``) — as TRL's GRPO samples.

A prompt is a string, a list of chat messages, or a list of token ids (already rendered and tokenized, as
:mod:`finetuner.data` prepares them; used as they are). Messages are rendered with the chat template and the
generation prompt (as the SFT pipeline renders a conversation, :mod:`finetuner.data.pipeline`); a string
is wrapped as one user message when a chat template is given, else tokenized as it is, with the
tokenizer's special tokens (as the pipeline's prompt/completion format).

A completion ends at its first end-of-sequence token (the tokenizer's EOS and the model's generation
config's): the mask covers the tokens up to and including it, nothing after; a completion that reaches
``max_new_tokens`` without one is flagged unfinished. The same seed gives the same completions: the
sampling draws from the global RNG inside ``torch.random.fork_rng``, seeded with ``seed``, and the RNG
state outside is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import finetuner.device as dev
from finetuner.token_progress import counted
from finetuner.text import clean_text
from finetuner.labels import IGNORE_INDEX

if TYPE_CHECKING:
    import torch


@dataclass
class Rollout:
    """A batch of groups: row ``j`` is generation ``j % G`` of prompt ``j // G`` (``G = num_generations``)."""

    prompts: list[Any]  #: ``[N]`` the prompts as given, each repeated ``G`` times
    prompt_texts: list[str]  #: ``[N]`` the prompts as rendered (chat template applied; token ids: decoded)
    prompt_ids: torch.Tensor  #: ``[N, P]`` left-padded
    prompt_mask: torch.Tensor  #: ``[N, P]`` 1 on prompt tokens, 0 on padding
    completion_ids: torch.Tensor  #: ``[N, C]`` padded after the completion's end
    completion_mask: torch.Tensor  #: ``[N, C]`` 1 up to and including the first EOS, 0 after it
    finished: torch.Tensor  #: ``[N]`` bool: the completion ended with an EOS token
    completions: list[str]  #: ``[N]`` the completions' text, up to the EOS, special tokens skipped
    num_generations: int

    @property
    def input_ids(self) -> torch.Tensor:
        """``[N, P + C]``: prompt then completion, the input of the loss's forward pass."""
        import torch

        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        import torch

        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def labels(self) -> torch.Tensor:
        """``[N, P + C]``: the completion's tokens where its mask is 1, :data:`IGNORE_INDEX` elsewhere (the
        prompt, the padding and anything after the EOS): the labels of :func:`finetuner.losses.grpo.token_logps`."""
        import torch

        ids = self.input_ids.masked_fill(self.attention_mask == 0, IGNORE_INDEX)
        ids[:, : self.prompt_ids.size(1)] = IGNORE_INDEX
        return ids

    @property
    def completion_lengths(self) -> torch.Tensor:
        """``[N]`` the number of completion tokens, the EOS included."""
        return self.completion_mask.sum(dim=1)

    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's token ids up to and including its EOS (TRL's ``completion_ids`` for rewards)."""
        return [row[: int(n)].tolist() for row, n in zip(self.completion_ids, self.completion_lengths)]

    def rows(self) -> list[dict[str, Any]]:
        """One dict per completion: ``completion_ids`` (up to and including the EOS), ``text``, ``finished``."""
        return [{"completion_ids": ids, "text": text, "finished": bool(done)}
                for ids, text, done in zip(self.completion_id_lists(), self.completions, self.finished.tolist())]


def render_prompts(tokenizer: Any, prompts: Sequence[Any], chat_template: str | None) -> tuple[list[str], bool]:
    """The prompts as text, and whether they carry their special tokens already (a chat template renders
    them; a plain string without one gets the tokenizer's at tokenization)."""
    texts, templated = [], chat_template is not None
    for p in prompts:
        if isinstance(p, str) and chat_template is None:
            texts.append(p)
            continue
        if chat_template is None:
            raise ValueError("chat messages as prompts need a chat template")
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        texts.append(tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                                   add_generation_prompt=True))
    return texts, templated


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and those of the model's generation config."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for t in ([config_eos] if isinstance(config_eos, int) else list(config_eos or [])):
        if t not in ids:
            ids.append(t)
    if not ids:
        raise ValueError("the tokenizer has no EOS token and the model's generation config names none")
    return ids


def end_mask(completion_ids: torch.Tensor, eos_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, finished)`` for completions: 1 up to and including each row's first EOS (all ones when it
    has none), and whether it has one."""
    import torch

    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_ids), device=completion_ids.device))
    finished = is_eos.any(dim=1)
    first = torch.where(finished, is_eos.int().argmax(dim=1), completion_ids.new_full(finished.shape, completion_ids.size(1)))
    cols = torch.arange(completion_ids.size(1), device=completion_ids.device)
    return (cols.unsqueeze(0) <= first.unsqueeze(1)).long(), finished


def _is_ids(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt) \
        and len(prompt) > 0


def left_pad(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts as a left-padded ``[N, P]`` tensor and its mask."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, r in enumerate(rows):
        if r:
            ids[j, width - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[j, width - len(r):] = 1
    return ids, mask


def generate_group(model: Any, tokenizer: Any, prompts: Sequence[Any], *, num_generations: int, max_new_tokens: int,
                   temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, chat_template: str | None = None,
                   batch_size: int | None = None) -> Rollout:
    """Sample ``num_generations`` completions of at most ``max_new_tokens`` tokens for each prompt.

    ``temperature`` 0 decodes greedily (all of a group alike: no signal for GRPO, but useful to check).
    ``batch_size``: at most this many rows per ``generate`` call (None: all at once); the result has the
    same shape, and is the same for the same seed and batch size.
    """
    import torch

    if num_generations < 1 or max_new_tokens < 1:
        raise ValueError("num_generations and max_new_tokens must be at least 1")
    rows = [list(p) if _is_ids(p) else p for p in prompts for _ in range(num_generations)]
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    if all(_is_ids(p) for p in rows):
        texts = [tokenizer.decode(p) for p in rows]
        prompt_ids, prompt_mask = left_pad(rows, pad)
    else:
        texts, templated = render_prompts(tokenizer, rows, chat_template)
        side = tokenizer.padding_side
        tokenizer.padding_side = "left"
        try:
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not templated)
        finally:
            tokenizer.padding_side = side
        prompt_ids, prompt_mask = enc["input_ids"], enc["attention_mask"]
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)

    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos, use_cache=True)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    step = batch_size or len(rows)
    outs = []
    was_training = model.training
    model.eval()
    try:
        with dev.fork_rng(device), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(rows), step):
                sl = slice(start, start + step)
                # its tokens counted into the open phase (an evaluation's), nothing outside one (a training step's)
                out = model.generate(input_ids=prompt_ids[sl], attention_mask=prompt_mask[sl],
                                     stopping_criteria=counted(eos), **kwargs)
                outs.append(out[:, prompt_ids.size(1):])
    finally:
        if was_training:
            model.train()
    width = max(o.size(1) for o in outs)
    completion_ids = torch.cat([torch.nn.functional.pad(o, (0, width - o.size(1)), value=pad) for o in outs])
    completion_mask, finished = end_mask(completion_ids, eos)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    lengths = completion_mask.sum(dim=1)
    decoded = [clean_text(tokenizer.decode(ids[: int(n) - int(f)], skip_special_tokens=True))
               for ids, n, f in zip(completion_ids.tolist(), lengths, finished)]
    return Rollout(prompts=rows, prompt_texts=texts, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   completion_ids=completion_ids, completion_mask=completion_mask, finished=finished,
                   completions=decoded, num_generations=num_generations)

"""Builds the embedded demo model in data/demo_model/: a small Llama pre-trained on data/pretrain.

The demo (``recipes/demo_cpu.yaml``) fine-tunes this model with LoRA on the CPU. It is small
enough to ship in the repository (a few MB of safetensors) and pre-trained just enough to answer
simple questions in a plain style, so that the fine-tune's change to "Tern"'s voice is visible.

Deterministic: fixed seeds, one thread pair, the same corpus (``scripts/dev/make_sample_data.py``).
Usage: python -m scripts.dev.build_demo_model  (about 3-4 minutes on 2 CPU cores)
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SEQ_LEN, BATCH, STEPS, LR, WARMUP = 256, 16, 500, 3e-3, 30


def main() -> None:
    import torch

    from finetuner.model.tiny_llama import tiny_llama, train_bpe_tokenizer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    out = REPO / "data" / "demo_model"
    lines = (REPO / "data" / "pretrain" / "corpus.txt").read_text(encoding="utf-8").split("\n")
    sample_text = [(REPO / "data" / name).read_text(encoding="utf-8") for name in ("alpaca_sample.json", "chat_sample.jsonl")]
    tok = train_bpe_tokenizer(lines + sample_text, vocab_size=2048)
    model = tiny_llama(tok, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384,
                       max_position_embeddings=1024, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}, parameters {n_params:,}", flush=True)

    # one token stream of the corpus; chats keep their ChatML markers, other lines end with a newline
    ids: list[int] = []
    for line in lines:
        if line:
            ids += tok(line + "\n", add_special_tokens=False)["input_ids"]
    data = torch.tensor(ids)
    n_windows = (len(data) - 1) // SEQ_LEN
    print(f"corpus: {len(ids):,} tokens, {n_windows} windows of {SEQ_LEN}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * min(s, STEPS) / STEPS)) * 0.95 + 0.05
    )
    rng = random.Random(0)
    model.train()
    t0 = time.perf_counter()
    for step in range(1, STEPS + 1):
        starts = [rng.randrange(0, len(data) - SEQ_LEN - 1) for _ in range(BATCH)]
        x = torch.stack([data[s : s + SEQ_LEN] for s in starts])
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == 1:
            print(f"step {step}/{STEPS}  loss {loss.item():.3f}  {time.perf_counter() - t0:.0f}s", flush=True)
    model.eval()
    model.config.use_cache = True
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    for prompt in ("What should I pack for a day hike?", "Tell me about the puffin."):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
        gen = model.generate(**enc, max_new_tokens=40, do_sample=False)
        print(f"{prompt!r} -> {tok.decode(gen[0, enc['input_ids'].shape[1]:], skip_special_tokens=True)!r}")
    size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
    print(f"saved {out} ({size:.1f} MB) in {time.perf_counter() - t0:.0f}s; final loss {loss.item():.3f}")


if __name__ == "__main__":
    main()

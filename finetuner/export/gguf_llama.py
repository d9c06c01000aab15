"""llama.cpp itself (llama-cpp-python) as the reader that checks a GGUF export whose architecture transformers' GGUF
loader does not read (Qwen3.5's ``qwen35``): its tokenizer's ids for the check's texts and its logits on the probe,
which the export compares with the merged model's as it compares transformers' elsewhere.

Without llama-cpp-python nothing independent could read such a file back, so the export refuses (one line, before
anything is written) unless the checks are skipped with ``--no-verify``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from finetuner.errors import UserError

#: llama.cpp architectures finetuner writes that transformers' GGUF loader does not read (nor a twin of them)
CHECKED_BY_LLAMA_CPP = ("qwen35",)


def require(gguf_arch: str) -> None:
    """Refuse, in one line, a checked export of ``gguf_arch`` that nothing installed can read back."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError(f"transformers' GGUF loader does not read llama.cpp's {gguf_arch}, and llama-cpp-python, which "
                        "would check the file, is not installed; nothing was written.",
                        hint="Install llama-cpp-python (pip install llama-cpp-python; it compiles llama.cpp), or pass "
                             "--no-verify to write the file checked only by reading its tensors back.")


def read(path: Path, ids: list[int], texts: list[str]):
    """llama.cpp's logits at every position of ``ids`` (a float32 tensor, 1 x T x vocab) and its token ids of each
    of ``texts`` (special tokens parsed, no BOS added)."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=max(64, len(ids) + 8), n_threads=2, logits_all=True, verbose=False)
    try:
        tokens = {text: llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) for text in texts}
        llm.reset()
        llm.eval(list(ids))
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    return torch.from_numpy(logits.copy())[None], tokens

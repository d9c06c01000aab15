"""llama.cpp itself (llama-cpp-python) as the reader that checks a GGUF export whose architecture transformers' GGUF
loader does not read (Qwen3.5's ``qwen35``, Mamba-2's ``mamba2``; Falcon-Mamba's ``mamba``, which it reads as plain
Mamba, without the norms on dt, B and C): its tokenizer's ids for the check's texts and its logits on the probe,
which the export compares with the merged model's as it compares transformers' elsewhere.

Without llama-cpp-python nothing independent could read such a file back, so the export refuses (one line, before
anything is written) unless the checks are skipped with ``--no-verify``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from finetuner.errors import UserError

#: llama.cpp architectures finetuner writes that transformers' GGUF loader does not read (nor a twin of them)
CHECKED_BY_LLAMA_CPP = ("qwen35", "qwen35moe", "mamba2", "lfm2moe", "granitehybrid", "falcon-h1", "nemotron_h",
                        "nemotron_h_moe", "jamba", "qwen3next")
#: families written as an architecture transformers' loader reads, but reads as another model (Falcon-Mamba: as Mamba)
FAMILIES_CHECKED_BY_LLAMA_CPP = ("falcon_mamba",)


def checks(model_type: str, gguf_arch: str) -> bool:
    """Whether llama.cpp itself, not transformers' GGUF loader, reads the export of ``model_type`` back."""
    return gguf_arch in CHECKED_BY_LLAMA_CPP or model_type in FAMILIES_CHECKED_BY_LLAMA_CPP


def unread(model_type: str, gguf_arch: str) -> str:
    """What transformers' GGUF loader does not read, in words (the reason the export asks llama.cpp)."""
    if model_type in FAMILIES_CHECKED_BY_LLAMA_CPP:
        return f"transformers' GGUF loader does not read {model_type} from llama.cpp's {gguf_arch} (it reads another model)"
    return f"transformers' GGUF loader does not read llama.cpp's {gguf_arch}"


def require(model_type: str, gguf_arch: str) -> None:
    """Refuse, in one line, a checked export of ``model_type`` that nothing installed can read back."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise UserError(f"{unread(model_type, gguf_arch)}, and llama-cpp-python, which "
                        "would check the file, is not installed; nothing was written.",
                        hint="Install llama-cpp-python (pip install llama-cpp-python; it compiles llama.cpp), or pass "
                             "--no-verify to write the file checked only by reading its tensors back.")


#: run in a child process: a GGML_ASSERT in llama.cpp aborts its whole process, which must not be the export's
CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
args = json.loads(sys.stdin.read())
ids = args["ids"]
llm = Llama(model_path=args["path"], n_ctx=max(64, len(ids) + 8), n_threads=2, logits_all=True, verbose=False)
tokens = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in args["texts"]]
llm.reset()
llm.eval(ids)
np.save(args["out"], np.asarray(llm.scores[: len(ids)], dtype=np.float32))
print(json.dumps(tokens))
"""


def read(path: Path, ids: list[int], texts: list[str]):
    """llama.cpp's logits at every position of ``ids`` (a float32 tensor, 1 x T x vocab) and its token ids of each
    of ``texts`` (special tokens parsed, no BOS added). A RuntimeError with llama.cpp's last words if it fails."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    import numpy as np
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.npy")
        p = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps({"path": str(path), "ids": list(ids),
                                                                             "texts": texts, "out": out}),
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        if p.returncode != 0:
            last = next((line for line in p.stderr.splitlines() if "GGML_ASSERT" in line or "error" in line.lower()),
                        p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}")
            raise RuntimeError(f"llama.cpp could not run the GGUF file: {last}")
        logits = np.load(out)
        tokens = json.loads(p.stdout.strip().splitlines()[-1])
    return torch.from_numpy(logits)[None], dict(zip(texts, tokens))

"""A transformers tokenizer as GGUF vocabulary metadata (llama.cpp's ``tokenizer.ggml.*`` keys).

Two kinds of tokenizer can be written, the two llama.cpp and transformers' GGUF reader both know:

- **byte-level BPE** (GPT-2 style: Llama 3, Qwen2, the demo model): ``tokenizer.ggml.model = gpt2``
  with the vocabulary in the byte alphabet, the merges, and the pre-tokenizer's name
  (``gpt-2``, ``llama-bpe`` or ``qwen2``: the regex that splits text before merging);
- **sentencepiece-style BPE** with byte fallback (Llama 2, Mistral, Gemma): ``tokenizer.ggml.model = llama``
  with scores (the merge order), byte tokens ``<0xNN>`` typed as bytes, and the merges.

Anything else (WordPiece, Unigram, a normalizer or a split regex llama.cpp does not know) cannot be
represented and is refused with a :class:`UserError` before anything is written. The export also
checks the result: transformers rebuilds the tokenizer from the written file and must give the
same ids as the original (``finetuner.export.gguf``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from finetuner.data.template_choice import adds_token
from finetuner.errors import UserError

#: Token types (gguf.TokenType values), spelled here so this module imports nothing heavy.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

#: Split regexes of the byte-level pre-tokenizers llama.cpp knows by name (its ``tokenizer.ggml.pre``).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Qwen3.5's (letters with their combining marks, ``\p{M}``), which transformers saves for Qwen3.5-MoE's tokenizer
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
KNOWN_SPLITS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2", QWEN35_SPLIT: "qwen35"}


@dataclass
class GGUFVocab:
    """What goes into the ``tokenizer.ggml.*`` keys."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece-style BPE)
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool | None = None

    def write(self, writer, chat_template: str | None) -> None:
        """Add the keys to a ``gguf.GGUFWriter``."""
        writer.add_tokenizer_model(self.model)
        if self.pre:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges:
            writer.add_token_merges(self.merges)
        for tid, add in ((self.bos_id, writer.add_bos_token_id), (self.eos_id, writer.add_eos_token_id),
                         (self.pad_id, writer.add_pad_token_id), (self.unk_id, writer.add_unk_token_id)):
            if tid is not None:
                add(tid)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if chat_template:
            writer.add_chat_template(chat_template)


def _refuse(what: str, why: str) -> UserError:
    return UserError(
        f"The tokenizer of {what} cannot be represented in a GGUF file: {why}. Nothing was written.",
        hint="GGUF export handles byte-level BPE tokenizers (Llama 3, Qwen2, GPT-2 style) and sentencepiece-style "
             "BPE with byte fallback (Llama 2, Mistral). Export a transformers folder with `finetuner merge` instead.",
    )


def _kind(spec: dict[str, Any], what: str) -> tuple[str, str | None, bool | None]:
    """``(model, pre, add_space_prefix)`` from the tokenizer.json's normalizer and pre-tokenizer."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise _refuse(what, f"its model is {model.get('type')!r}, not BPE")
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    pres = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else ([pre] if pre else [])
    types = [p.get("type") for p in pres]
    if model.get("byte_fallback"):
        norms = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else ([norm] if norm else [])
        prepend = [n for n in norms if n.get("type") == "Prepend"]
        replace = [n for n in norms if n.get("type") == "Replace"]
        # Gemma's: a split on ' ' after the normalizer has replaced every space with '▁' never splits (a no-op)
        noop = [p for p in pres if p.get("type") == "Split" and (p.get("pattern") or {}).get("String") == " "
                and any((n.get("pattern") or {}).get("String") == " " and n.get("content") == "\u2581" for n in replace)]
        if norms and len(norms) == len(prepend) + len(replace) and replace and len(noop) == len(pres):
            return "llama", None, bool(prepend)
        if not norms and types == ["Metaspace"]:
            return "llama", None, pres[0].get("prepend_scheme", "always") != "never"
        raise _refuse(what, f"a byte-fallback BPE with normalizer {norm and norm.get('type')!r} and pre-tokenizer {types}")
    if norm is not None and norm.get("type") != "NFC":  # Qwen2's NFC: llama.cpp skips it (same ids on NFC text)
        raise _refuse(what, f"it has a {norm.get('type')!r} normalizer, which llama.cpp does not apply")
    if types == ["ByteLevel"] and pres[0].get("use_regex", True) and not pres[0].get("add_prefix_space", False):
        return "gpt2", "gpt-2", None
    if types == ["Split", "ByteLevel"] and not pres[1].get("use_regex", True) and not pres[1].get("add_prefix_space", False):
        regex = (pres[0].get("pattern") or {}).get("Regex")
        if regex in KNOWN_SPLITS:
            return "gpt2", KNOWN_SPLITS[regex], None
        raise _refuse(what, f"its pre-tokenizer splits text with a regex llama.cpp does not know ({regex!r})")
    raise _refuse(what, f"its pre-tokenizer {types or None} is not byte-level")


def _merge_strings(merges: list[Any], what: str) -> list[str]:
    out = []
    for m in merges:
        pair = m.split(" ") if isinstance(m, str) else list(m)
        if len(pair) != 2 or any(" " in p or not p for p in pair):
            raise _refuse(what, f"the merge {m!r} holds a space, which GGUF's 'a b' merge format cannot spell")
        out.append(" ".join(pair))
    return out


def vocab_from_tokenizer(tokenizer, vocab_size: int, what: str) -> GGUFVocab:
    """The GGUF vocabulary of a fast tokenizer whose model has ``vocab_size`` embedding rows."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise _refuse(what, "it is not a fast (tokenizers) tokenizer")
    spec = json.loads(backend.to_str())
    model_kind, pre, space_prefix = _kind(spec, what)
    model = spec["model"]
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types: dict[int, int] = {}
    for added in spec.get("added_tokens") or []:
        i = int(added["id"])
        if i in by_id and by_id[i] != added["content"]:
            raise _refuse(what, f"token id {i} is both {by_id[i]!r} and the added token {added['content']!r}")
        by_id[i] = added["content"]
        types[i] = CONTROL if added.get("special") else USER_DEFINED
    n = max(by_id) + 1
    if n > vocab_size:
        raise _refuse(what, f"it has token ids up to {n - 1} but the model's embedding has only {vocab_size} rows")
    unk = model.get("unk_token")
    tokens, token_types = [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            token_types.append(UNUSED)
            continue
        tokens.append(tok)
        if model_kind == "llama" and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            token_types.append(BYTE)  # byte fallback pieces, also where the tokenizer lists them as added tokens
        elif unk is not None and tok == unk:
            token_types.append(UNKNOWN)
        elif i in types:
            token_types.append(types[i])
        else:
            token_types.append(NORMAL)
    if len(set(tokens)) != len(tokens):
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise _refuse(what, f"the token {dup!r} appears twice")
    merges = _merge_strings(model.get("merges") or [], what)
    scores = None
    if model_kind == "llama":  # llama.cpp's sentencepiece tokenizer merges by score: the earlier merge, the higher
        rank = {m.replace(" ", ""): r for r, m in reversed(list(enumerate(merges)))}
        scores = [-float(rank[t] + 1) if t in rank and token_types[i] == NORMAL else 0.0 for i, t in enumerate(tokens)]

    def tid(name: str) -> int | None:
        value = getattr(tokenizer, f"{name}_token_id", None)
        return int(value) if isinstance(value, int) else None

    bos, eos = tid("bos"), tid("eos")
    return GGUFVocab(
        model=model_kind, pre=pre, tokens=tokens, token_types=token_types, scores=scores, merges=merges,
        bos_id=bos, eos_id=eos, pad_id=tid("pad"), unk_id=tid("unk"),
        add_bos=adds_token(tokenizer, bos), add_eos=adds_token(tokenizer, eos, end=True), add_space_prefix=space_prefix,
    )

"""The model census: every causal-LM type of the installed transformers, tried as finetuner's users would.

For each model type transformers maps to a causal LM (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``):

1. **Builds tiny and trains in transformers itself**: a tiny config (:func:`finetuner.model.tiny.tiny_config`),
   random weights, one forward and backward with labels on the CPU. A type that fails here (transformers
   cannot build its own defaults, a missing package, an encoder that needs ``is_decoder``) is outside the
   census's denominator, with the reason.
2. **finetuner**: the memory model's layout (:func:`finetuner.model.shapes.shape_from_config`, read from the
   model itself), ``plan`` on an RTX 4090, 2 LoRA steps with the
   trainer, merge, and one chat answer. The first step that fails is the type's reason.

Writes ``docs/models.md`` (the table), ``docs/validation/model_census.json`` (every row) and docs/planning.md's model list
(between its ``model census`` markers)::

    .venv/bin/python -m scripts.dev.model_census            # all types (a few minutes on 2 cores)
    .venv/bin/python -m scripts.dev.model_census llama gemma3_text   # some, printed, nothing written
    .venv/bin/python -m scripts.dev.model_census --update zamba2     # some again, their recorded rows replaced
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "models.md"
JSON = REPO / "docs" / "validation" / "model_census.json"
#: the most parameters the census builds for real (fp32 on the CPU, with gradients and Adam: ~16 bytes each)
MAX_PARAMS = 60_000_000
#: how a row whose tiny config stays too large to build says so: the shrinker's failure (finetuner/model/tiny.py does
#: not know the family's width settings), so the row is refused at step ``tiny`` and counts, never outside
TOO_LARGE = "its tiny config still has"
#: the prompt of the chat step
PROMPT = "What should I bring on a hike?"



def gpu_rows() -> dict[str, int]:
    """Recorded GPU training runs (``docs/validation/validate_*.json``, the memory model's replay) by model type."""
    from finetuner.model.shapes import load_config
    from scripts.validate.memory import replay

    out: dict[str, int] = {}
    for r in replay(again=False):
        if "error" not in r:
            mt = load_config(r["preset"])[0]["model_type"]
            out[mt] = out.get(mt, 0) + 1
    return out

def _rows(n: int = 8) -> list[dict[str, str]]:
    return [{"instruction": f"What should I bring on hike {i}?", "input": "",
             "output": "Bring water, a map and warm boots."} for i in range(n)]


def _transformers_trains(model_type: str, cfg: dict, tok) -> tuple[object | None, str | None]:
    """The tiny model with random weights when transformers builds it and one forward/backward runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
        if getattr(config, "is_encoder_decoder", False):
            return None, "an encoder-decoder model, not decoder-only"
        if "type_vocab_size" in cfg:  # token-type embeddings: BERT and its kin
            return None, "an encoder (BERT family) with a causal-LM head, not a decoder-only LM"
        with torch.device("meta"):  # its size first: some families keep huge tables at any width (BLT's hash embeddings)
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if n > MAX_PARAMS:
            return None, f"{TOO_LARGE} {n / 1e6:,.0f}M parameters (more than the census builds on a CPU)"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        ids = torch.tensor([tok("bring water and a map on the trail")["input_ids"][:8]])
        out = model(input_ids=ids, labels=ids)
        if out.loss is None or not math.isfinite(float(out.loss)):
            return None, "transformers' own forward gives no finite loss"
        out.loss.backward()
        return model, None
    except Exception as e:  # noqa: BLE001 - the census records every way a type fails
        return None, _own_failure(e)


def _own_failure(e: Exception) -> str:
    """transformers' own failure, in a row's words: the first line with words (a missing package's ImportError
    opens with an empty one)."""
    from finetuner.errors import first_line

    return f"transformers cannot build or train it tiny: {type(e).__name__}: {first_line(str(e), 160)}"


def _fails_on_meta(model_type: str, cfg: dict, tok) -> str | None:
    """How transformers' forward of ``cfg`` fails on the meta device (no weights: any size), in the words of
    :func:`_transformers_trains`; None when it runs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"}))
            ids = torch.tensor([tok("bring water and a map on the trail")["input_ids"][:8]])
            model(input_ids=ids, labels=ids)
    except Exception as e:  # noqa: BLE001 - the failure is the answer
        return _own_failure(e)
    return None


def census_row(model_type: str, tok, work: Path) -> dict:
    """One type's row: ``status`` is ``supported``, ``refused`` (finetuner says why, or its tiny config stays too
    large: step ``tiny``) or ``outside`` (not in the denominator: not decoder-only, or transformers itself cannot
    build or train it, its error quoted)."""
    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.errors import UserError
    from finetuner.model.shapes import shape_from_config
    from finetuner.model.tiny import tiny_config

    began = time.monotonic()
    row: dict = {"model_type": model_type}
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    model = why = tiny_why = None
    for widths in (True, False):  # tiny widths; else the family's own widths at 2 layers (they may depend on each other)
        try:
            cfg = tiny_config(model_type, len(tok), widths=widths, **ids)
        except Exception as e:  # noqa: BLE001
            return {**row, "status": "outside", "reason": f"transformers cannot build its default config: {type(e).__name__}"}
        model, why = _transformers_trains(model_type, cfg, tok)
        if model is not None or why.startswith(("an ", TOO_LARGE)):
            break
        tiny_why = why
    if model is None and not widths and why.startswith(TOO_LARGE) and _fails_on_meta(model_type, cfg, tok) == tiny_why:
        # the family's own widths too large to build, but their forward on the meta device fails as the tiny one
        # did: transformers' own failure at any size (Gemma 4's assistant, a drafter that needs its main model's
        # shared keys and values), quoted
        why = tiny_why
    if model is None and why.startswith(TOO_LARGE):  # the shrinker's failure, not transformers': counted, refused
        return {**row, "status": "refused", "step": "tiny", "reason": why}
    if model is None:
        return {**row, "status": "outside", "reason": why}
    row["tiny"] = "widths" if widths else "depth"
    step = "layout"
    try:
        shape = shape_from_config(cfg, name=model_type)
        row["gpu_rows"] = gpu_rows().get(shape.model_type, 0)
        folder = work / model_type
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        step = "plan"
        finetuner.plan(str(folder), "rtx4090", seq_len=512)
        step = "train"
        data = work / "rows.json"
        data.write_text(json.dumps(_rows()), encoding="utf-8")
        recipe = {"name": model_type, "model": {"name": str(folder)}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                  "data": {"path": str(data), "max_seq_len": 32, "val_size": 0},
                  "training": {"max_steps": 2, "lr": 1e-3, "micro_batch_size": 2, "gradient_accumulation": 1,
                               "warmup_steps": 0},
                  "logging": {"tensorboard": False}, "output_dir": str(work / f"run-{model_type}")}
        result = finetuner.train(Recipe.from_dict(recipe))
        if len(result.losses) != 2 or not all(math.isfinite(x) for x in result.losses):
            raise RuntimeError(f"losses {result.losses}")
        step = "merge"
        finetuner.merge_adapter(result.run_dir, work / f"merged-{model_type}")
        step = "chat"
        chat = finetuner.load_chat_model(result.run_dir, device="cpu")
        chat.reply([{"role": "user", "content": PROMPT}], max_new_tokens=4)
        row.update(status="supported", params=shape.num_params)
        row["traced"] = _traced(cfg, shape)
    except UserError as e:
        row.update(status="refused", step=step, reason=e.message)
    except Exception as e:  # noqa: BLE001 - a crash is recorded as one, with its place
        tb = traceback.extract_tb(e.__traceback__)[-1]
        row.update(status="refused", step=step,
                   reason=f"crash: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''} "
                          f"({Path(tb.filename).name}:{tb.lineno})")
    row["seconds"] = round(time.monotonic() - began, 1)
    return row


def _traced(cfg: dict, shape) -> str:
    """The memory model's activation terms against the layer's own trace (:mod:`finetuner.memory.trace`), in
    words: the formula's error in percent, or why the layer was not traced."""
    from finetuner.memory.trace_check import compare

    if shape.experts is not None:
        return "not traced (routing by value)"
    try:
        c = compare(cfg, shape)
    except Exception as e:  # noqa: BLE001 - a check: a layer it cannot run is said, never a refusal
        return f"not traced: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return f"{c['error_pct']:+.1f} %"


def _tokenizer():
    from finetuner.model.tiny_llama import train_bpe_tokenizer

    words = "the a hike bird sea rain sun pack water map boots trail bring what should i for day".split()
    texts = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    return train_bpe_tokenizer(texts, vocab_size=400)


#: where docs/models.md's section of image-text types begins (scripts/dev/vlm_census.py writes it)
PICTURES_HEADING = "## Image-text-to-text types (pictures)"


def pictures_section(doc: str) -> str:
    """The image-text section of a docs/models.md text ('' when it has none)."""
    return doc[doc.index(PICTURES_HEADING):] if PICTURES_HEADING in doc else ""


def write_table(rows: list[dict], pictures_section: str = "") -> str:
    """docs/models.md: the causal-LM census's table, then ``pictures_section`` (the picture census's, kept as it is)."""
    import transformers

    inside = [r for r in rows if r["status"] != "outside"]
    supported = [r for r in inside if r["status"] == "supported"]
    share = 100 * len(supported) / max(1, len(inside))
    lines = [
        "# Models finetuner fine-tunes",
        "",
        f"Generated by `scripts/dev/model_census.py` with transformers {transformers.__version__}: every model type it "
        f"maps to a causal LM ({len(rows)}), built tiny from its own default config with random weights.",
        "",
        f"**{len(supported)} of the {len(inside)} decoder-only types ({share:.0f} %) plan, train 2 LoRA steps, merge "
        f"and chat.** The denominator is every decoder-only type of the mapping except those transformers itself "
        f"cannot build or train on a CPU (its own error quoted); a type whose tiny config "
        "(`finetuner/model/tiny.py`: the family's defaults with its own width settings made small) stays too large "
        "is ours to fix and counts, refused at step `tiny`. The other "
        f"{len(rows) - len(inside)} types are outside, with the reason: not decoder-only, or transformers' own error. "
        "gemma3n builds only with the timm package (its vision tower), and timm imports torchvision, whose "
        "only wheel for torch 2.13.0 the package index holds is the CUDA build: its compiled operators link "
        "libtorch_cuda.so, which the CPU torch of this install does not have, so torchvision fails to import and "
        "CI cannot install it (its text model, gemma3n_text, is inside). Every layout is read from the model transformers builds (finetuner/model/inventory.py, "
        "finetuner/model/layout.py); \"GPU runs\": the family's training runs whose peak memory was measured on a GPU "
        "and is replayed by the tests (docs/validation, docs/memory.md); the other families' memory terms are those "
        "of the measured ones. \"activations vs trace\": the memory model's named activation terms of one decoder "
        "layer (LoRA, fp32, 256 tokens) against what the layer itself saves for backward, traced on the meta device "
        "(finetuner/model/trace.py; negative: the terms name less, and the memory model adds the difference from the "
        "trace, finetuner/memory/model.py's traced_excess); a mixture of experts routes by value, which the meta "
        "device cannot run, and some layers need inputs the trace does not give (ALiBi biases).",
        "",
        "| model type | status | GPU runs | activations vs trace | reason |",
        "|---|---|---|---|---|",
    ]
    order = {"supported": 0, "refused": 1, "outside": 2}
    for r in sorted(rows, key=lambda r: (order[r["status"]], r["model_type"])):
        reason = (f"{r.get('step', '')}: " if r["status"] == "refused" else "") + r.get("reason", "")
        lines.append(f"| {r['model_type']} | {r['status']} | {r.get('gpu_rows') or ''} | {r.get('traced', '')} | {reason.replace('|', '/')} |")
    if pictures_section:  # the picture census's (scripts/dev/vlm_census.py)
        lines += ["", pictures_section.rstrip("\n")]
    return "\n".join(lines) + "\n"


#: where docs/planning.md lists the supported types (between these two lines, written by :func:`list_block`)
LIST_PAGE = REPO / "docs" / "planning.md"
LIST_START, LIST_END = "<!-- model census: start -->", "<!-- model census: end -->"


def list_block(rows: list[dict]) -> str:
    """docs/planning.md's model list: the census's supported types and its headline numbers."""
    inside = [r for r in rows if r["status"] != "outside"]
    supported = sorted(r["model_type"] for r in inside if r["status"] == "supported")
    return (f"{LIST_START}\n{len(supported)} of the {len(inside)} decoder-only model types transformers "
            f"{_version()} builds tiny and trains plan, train, merge and chat (the census, "
            f"[docs/models.md](models.md), says why each other one is refused): "
            + ", ".join(f"`{t}`" for t in supported) + f".\n{LIST_END}")


def _version() -> str:
    import transformers

    return transformers.__version__


def with_list_block(text: str, rows: list[dict]) -> str:
    a, b = text.index(LIST_START), text.index(LIST_END) + len(LIST_END)
    return text[:a] + list_block(rows) + text[b:]


def main(argv: list[str]) -> int:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    update = bool(argv) and argv[0] == "--update"  # these types again, their rows replaced in the recorded census
    if update:
        argv = argv[1:]
        recorded = json.loads(JSON.read_text(encoding="utf-8"))
        if recorded["transformers"] != transformers.__version__:
            raise SystemExit(f"{JSON.name} was made with transformers {recorded['transformers']}, this is "
                             f"{transformers.__version__}: run the whole census (no arguments)")
    types = argv or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    tok = _tokenizer()
    rows = []
    with tempfile.TemporaryDirectory(prefix="finetuner-census-") as tmp:
        for mt in types:
            row = census_row(mt, tok, Path(tmp))
            rows.append(row)
            print(f"{row['status']:9} {mt:28} {row.get('gpu_rows', ''):3} {row.get('traced', ''):12} {row.get('step', '')} {row.get('reason', '')[:150]}",
                  flush=True)
    if update:
        again = {r["model_type"]: r for r in rows}
        rows = [again.pop(r["model_type"], r) for r in recorded["rows"]] + list(again.values())
    if update or not argv:
        kept = pictures_section(DOC.read_text(encoding="utf-8")) if DOC.is_file() else ""
        DOC.write_text(write_table(rows, kept), encoding="utf-8")
        LIST_PAGE.write_text(with_list_block(LIST_PAGE.read_text(encoding="utf-8"), rows), encoding="utf-8")
        JSON.write_text(json.dumps({"transformers": transformers.__version__, "rows": rows}, indent=1) + "\n",
                        encoding="utf-8")
        print(f"wrote {DOC.relative_to(REPO)} and {JSON.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The picture census: every image-text-to-text model type of the installed transformers, tried as finetuner's users
would train one on chat rows with pictures.

For each model type transformers loads with ``AutoModelForImageTextToText``
(``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``):

* a type with a tiny builder (:data:`finetuner.model.tiny_vlm.TINY_VLMS`: random weights and a working processor,
  built from the demo tokenizer with the family's image tokens) is built, trains 2 LoRA steps at micro-batch 2 with
  ``finetuner.train`` on 4 pictured rows (plain-colour pictures of different shapes), and answers one chat turn with
  a picture (``load_chat_model(run).reply(..., images=[...])``): "trains", with the 2 losses and the seconds, or
  "refused" with finetuner's one-line reason (a crash is recorded as one, with its place);
  A type that trains is then exported to GGUF (``finetuner.export_model(run, ..., quant="f16")``, checked): the
  language model and llama.cpp's projector file, or the export's one-line refusal;
* the other types: "not checked (no tiny processor built)".

Writes ``docs/validation/vlm_census.json`` (the rows) and the image-text section of ``docs/models.md``
(:func:`write_table`, through ``scripts.dev.model_census.write_table``, which writes the whole page)::

    .venv/bin/python -m scripts.dev.vlm_census              # all types (about a minute on 2 cores)
    .venv/bin/python -m scripts.dev.vlm_census gemma3 llava  # some, printed, nothing written
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

from scripts.dev import model_census

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "models.md"
JSON = REPO / "docs" / "validation" / "vlm_census.json"
#: the pictures of the census's rows: (width, height, colour name, RGB); landscape, square and portrait, so that a
#: micro-batch joins pictures of different tiles and sizes
PICTURES = [(40, 30, "red", (220, 30, 30)), (32, 32, "green", (30, 200, 60)), (24, 44, "blue", (30, 60, 220)),
            (50, 28, "yellow", (230, 220, 40))]
#: the question of each row and of the chat step
QUESTION = "What colour is this?"
NOT_CHECKED = "not checked (no tiny processor built)"


def write_pictures_data(folder: Path) -> Path:
    """The census's data: ``folder/pics.jsonl``, one pictured row a picture (``img/NNN.png`` next to it)."""
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (w, h, name, rgb) in enumerate(PICTURES):
        Image.new("RGB", (w, h), rgb).save(folder / "img" / f"{i:03d}.png")
        rows.append({"messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                                  {"role": "assistant", "content": f"It is {name}."}],
                     "images": [f"img/{i:03d}.png"]})
    path = folder / "pics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def demo_tokenizer():
    """The demo model's tokenizer (``data/demo_model``), which every tiny family starts from."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(REPO / "data" / "demo_model")


def build(model_type: str, work: Path) -> tuple[Path, int]:
    """The tiny ``model_type`` model and processor saved to ``work/model_type``, and its number of parameters."""
    from finetuner.model.tiny_vlm import TINY_VLMS

    folder = work / model_type
    model = TINY_VLMS[model_type](demo_tokenizer(), folder)
    return folder, sum(p.numel() for p in model.parameters())


def train_and_chat(model_type: str, folder: Path, work: Path) -> tuple[dict, Path | None]:
    """2 LoRA steps on the census's pictured rows and one chat turn with a picture: the row's results (``losses``,
    ``answer``, or ``status: refused`` with the reason and the step) and the run's folder (None when refused)."""
    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.errors import UserError
    from finetuner.infer.chat import load_chat_model

    data = write_pictures_data(work / f"data-{model_type}")
    step = "plan"
    try:
        # what `finetuner plan --model FOLDER --gpu rtx4090 --data FILE` says: the pictures' tokens, the peak
        planned = finetuner.plan(str(folder), "rtx4090", data=str(data))
        plan = {"picture_tokens": planned.data["picture_tokens"], "pictures": planned.data["pictures"],
                "plan_gib": round(planned.estimate.total_bytes / 2**30, 3) if planned.estimate else None}
        step = "train"
        recipe = {"name": model_type, "model": {"name": str(folder)}, "method": "lora",
                  "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                  "data": {"path": str(data), "max_seq_len": 512, "val_size": 0},
                  "training": {"max_steps": 2, "micro_batch_size": 2, "gradient_accumulation": 1, "lr": 1e-3,
                               "warmup_steps": 0},
                  "logging": {"tensorboard": False}, "device": "cpu"}
        result = finetuner.train(Recipe.from_dict(recipe), output_dir=str(work / f"run-{model_type}"))
        losses = [round(float(x), 4) for x in result.losses]
        if len(losses) != 2 or not all(math.isfinite(x) for x in losses):
            raise RuntimeError(f"losses {losses}")
        step = "chat"
        chat = load_chat_model(result.run_dir, device="cpu")
        answer = chat.reply([{"role": "user", "content": QUESTION}], images=[str(data.parent / "img" / "000.png")],
                            temperature=0, max_new_tokens=8)
        if not isinstance(answer, str):
            raise RuntimeError(f"the answer is a {type(answer).__name__}")
        return {"status": "trains", **plan, "losses": losses, "answer": answer,
                "gguf": export_row(Path(result.run_dir), work, folder, model_type)}, Path(result.run_dir)
    except UserError as e:  # the model's folder named as the type, not the census's temporary path
        return {"status": "refused", "step": step, "reason": e.message.replace(str(folder), model_type)}, None
    except Exception as e:  # noqa: BLE001 - a crash is recorded as one, with its place
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return {"status": "refused", "step": step,
                "reason": f"crash: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''} "
                          f"({Path(tb.filename).name}:{tb.lineno})"}, None


def export_row(run: Path, work: Path, folder: Path, model_type: str) -> str:
    """What ``finetuner export RUN --format gguf --quant f16`` does with a trained type: the files it writes, or
    its one-line refusal."""
    import finetuner
    from finetuner.errors import UserError

    try:
        r = finetuner.export_model(run, work / f"{model_type}.gguf", quant="f16")
    except UserError as e:
        return "refused: " + e.message.replace(str(folder), model_type).replace(str(run), model_type)
    if r.mmproj_file is None:
        return f"language model only ({r.architecture})"
    return f"language model ({r.architecture}) + projector file ({r.mmproj_tensors} tensors)"


def census_row(model_type: str, work: Path) -> tuple[dict, Path | None]:
    """One type's row (and its run's folder when it trains): built tiny, trained 2 steps, asked about a picture."""
    from finetuner.model.tiny_vlm import TINY_VLMS

    if model_type not in TINY_VLMS:
        return {"model_type": model_type, "status": NOT_CHECKED}, None
    began = time.monotonic()
    row: dict = {"model_type": model_type}
    try:
        folder, params = build(model_type, work)
    except Exception as e:  # noqa: BLE001
        return {**row, "status": "refused", "step": "build",
                "reason": f"crash: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}, None
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    row["architecture"] = config["architectures"][0]
    row["params"] = params
    result, run_dir = train_and_chat(model_type, folder, work)
    row.update(result)
    row["seconds"] = round(time.monotonic() - began, 1)
    return row, run_dir


def write_table(rows: list[dict]) -> str:
    """The image-text section of ``docs/models.md``: the census's rows as a markdown table, the families that train
    first."""
    import transformers

    trains = [r for r in rows if r["status"] == "trains"]
    refused = [r for r in rows if r["status"] == "refused"]
    lines = [
        model_census.PICTURES_HEADING,
        "",
        f"Generated by `scripts/dev/vlm_census.py` (`python -m scripts.dev.vlm_census`) with transformers "
        f"{transformers.__version__}: every model type it loads with `AutoModelForImageTextToText` ({len(rows)}). A "
        "type with a tiny builder (`finetuner/model/tiny_vlm.py`: random weights, fp32, a 1-layer vision tower and a "
        "2-layer language model, and a working processor made from the demo tokenizer with the family's image tokens "
        "and a chat template that reads content parts) trains 2 LoRA steps at micro-batch 2 with `finetuner.train` "
        "on 4 chat rows with plain-colour pictures of different shapes, on the CPU, and answers one chat turn with a "
        "picture (`load_chat_model(run).reply(..., images=[...])`), after `finetuner.plan(FOLDER, 'rtx4090', "
        "data=FILE)` counted the image tokens of its 4 pictures through the processor (tokens a picture, at the "
        "tiny processor's sizes) and predicted the peak; then `finetuner.export_model(run, FILE, quant='f16')` "
        "writes its GGUF (the language model, checked, and llama.cpp's projector file) or says in one line why not; "
        "seconds: building, planning, training, chatting and exporting. The others are not checked: they need a "
        "tiny processor built for them first.",
        "",
        f"**{len(trains)} of the {len(trains) + len(refused)} types checked train and chat; {len(refused)} refused "
        f"(finetuner says why in one line before training); {len(rows) - len(trains) - len(refused)} not checked.**",
        "",
        "| model type | status | architecture | parameters | image tokens a picture | losses (2 steps) | GGUF export | seconds | reason |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {"trains": 0, "refused": 1}
    for r in sorted(rows, key=lambda r: (order.get(r["status"], 2), r["model_type"])):
        losses = ", ".join(f"{x:.4f}" for x in r.get("losses", []))
        reason = (f"{r['step']}: " if r.get("step") else "") + r.get("reason", "")
        params = f"{r['params']:,}" if r.get("params") else ""
        per_picture = f"{r['picture_tokens'] / r['pictures']:g}" if r.get("pictures") else ""
        lines.append(f"| {r['model_type']} | {r['status']} | {r.get('architecture', '')} | {params} | {per_picture} | {losses} | "
                     f"{r.get('gguf', '').replace('|', '/')} | {r.get('seconds', '')} | {reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    types = argv or sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    began = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="finetuner-vlm-census-") as tmp:
        for mt in types:
            row, _ = census_row(mt, Path(tmp))
            rows.append(row)
            print(f"{row['status']:40} {mt:28} {row.get('losses', '')} {row.get('seconds', '')} "
                  f"{row.get('step', '')} {row.get('reason', '')[:150]}", flush=True)
    print(f"census: {time.monotonic() - began:.0f} s")
    if not argv:
        JSON.write_text(json.dumps({"transformers": transformers.__version__, "rows": rows}, indent=1) + "\n",
                        encoding="utf-8")
        text_rows = json.loads(model_census.JSON.read_text(encoding="utf-8"))["rows"]
        DOC.write_text(model_census.write_table(text_rows, write_table(rows)), encoding="utf-8")
        print(f"wrote {DOC.relative_to(REPO)} and {JSON.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""llama.cpp reads pictures with finetuner's export of an image-text model (the language GGUF and the mmproj file).

For each family (``--family llava``: the picture demo, ``runs/demo_vlm_cpu`` if it was trained, else
``data/demo_vlm``; ``--family gemma3``: a tiny Gemma 3 from ``finetuner.model.tiny_vlm`` whose vision tower and
projector get random weights, so a tensor written wrong shows), the model is exported with
``finetuner.export_model`` (f16), and then, for each held-out picture of ``data/pictures`` (resized to the
model's picture size first, so both sides see the same pixels), in a process that imports llama_cpp from
``--target`` (installed as ``scripts/validate/llama_cpp_check.py`` does):

- the picture's embeddings after the projector, from llama.cpp's ``mtmd_encode_chunk``, against transformers'
  ``get_image_features`` (largest difference, least cosine over the image tokens; Qwen3-VL's DeepStack features
  beside each token's embedding, as llama.cpp gives them);
- for LLaVA also against transformers' tower run the way this llama.cpp's CLIP graph runs it (the class token
  after the patches: ggml-org/llama.cpp#25814), which tells a wrong file from llama.cpp's known bug;
- the question "What is in the picture?" with the picture, chat template applied, answered greedily by llama.cpp
  (``mtmd_helper_eval_chunks``, then argmax) and by transformers; equal or not.

Results: ``docs/validation/llama_cpp_vlm_check.json`` and ``.md``.

    python -m scripts.validate.llama_cpp_vlm_check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.validate.llama_cpp_check import install, installed_version

REPO = Path(__file__).resolve().parents[2]
QUESTION = "What is in the picture?"
#: the text each family's chat template writes where a picture is, and what llama.cpp is given there instead
#: (@@PICTURE@@: its marker) so that both sides read the same tokens: llama.cpp writes Gemma 3's <start_of_image>
#: ... <end_of_image> around the picture itself, and transformers' Gemma3Processor also puts two blank lines on
#: each side (its full_image_sequence), which llama.cpp does not
PLACEHOLDER = {"llava": ("<image>", "@@PICTURE@@"), "gemma3": ("<start_of_image>", "\n\n@@PICTURE@@\n\n"),
               "qwen2_5_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "@@PICTURE@@"),
               "qwen2_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "@@PICTURE@@"),
               "qwen3_vl": ("<|vision_start|><|image_pad|><|vision_end|>", "@@PICTURE@@"),
               "smolvlm": ("<image>", "@@PICTURE@@"), "mistral3": ("[IMG]", "@@PICTURE@@")}
#: the size both sides see a family's pictures at (width, height); the others: their tower's square picture size.
#: Qwen2.5-VL: 16 x 12 patches, more than one of llama.cpp's 112-pixel (8-patch) windows each way, 48 image tokens
#: (Qwen2-VL's the same; Qwen3-VL's 16 x 12 patches of 16 pixels); SmolVLM: 2 x 2 tiles of 32 pixels and the whole
#: picture, 4 image tokens each; Mistral 3: 8 x 6 patches of 8 pixels merged 2 x 2, 12 image tokens in 3 rows
PICTURE_SIZE = {"qwen2_5_vl": (224, 168), "qwen2_vl": (224, 168), "qwen3_vl": (256, 192), "smolvlm": (64, 64),
                "mistral3": (64, 48)}
#: the pixels llama.cpp's Qwen-VL graph keeps of a picture (8 to 4,096 image tokens of 28 x 28 pixels, 32 x 32 for
#: Qwen3-VL: its set_limit_image_tokens), given to the tiny model's processor so that both sides resize alike
QWEN_PIXELS = (8 * 28 * 28, 4096 * 28 * 28)
QWEN3_PIXELS = (8 * 32 * 32, 4096 * 32 * 32)

CHILD = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp
import llama_cpp.mtmd_cpp as M
lm, mm, text, pictures, max_new, eos = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]), json.loads(sys.argv[6])
forced = json.loads(sys.argv[7])  # transformers' greedy answer to each picture: llama.cpp's next token after each of its tokens
llm = llama_cpp.Llama(model_path=lm, n_ctx=1024, n_threads=2, verbose=False)
params = M.mtmd_context_params_default()
params.use_gpu = False
params.n_threads = 2
params.print_timings = False
ctx = M.mtmd_init_from_file(mm.encode(), llm.model, params)
assert ctx, "mtmd could not load the projector file"
width = llama_cpp.llama_model_n_embd_inp(llm.model)  # an image token's embedding (Qwen3-VL's: its DeepStack features too)
marker = M.mtmd_default_marker().decode()
out = []
def run(chunks, ids):
    llm.reset()
    llm._ctx.kv_cache_clear()
    n_past = llama_cpp.llama_pos(0)
    assert M.mtmd_helper_eval_chunks(ctx, llm._ctx.ctx, chunks, 0, 0, llm.n_batch, True, ctypes.byref(n_past)) == 0
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()
    first, out = logits, []
    for step in range(max_new if ids is None else len(ids)):
        tok = int(logits.argmax())
        if ids is None and tok in eos:
            break
        out.append(tok)
        feed = tok if ids is None else ids[step]
        batch = llama_cpp.llama_batch_get_one((llama_cpp.llama_token * 1)(feed), 1)
        assert llama_cpp.llama_decode(llm._ctx.ctx, batch) == 0
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()
    return first, out
for picture, ids in zip(pictures, forced):
    bitmap = M.mtmd_helper_bitmap_init_from_file(ctx, picture.encode(), False)
    data = text.replace("@@PICTURE@@", marker).encode()
    inp = M.mtmd_input_text()
    inp.text, inp.text_len, inp.add_special, inp.parse_special = data, len(data), False, True
    chunks = M.mtmd_input_chunks_init()
    assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    embeddings = None
    for i in range(M.mtmd_input_chunks_size(chunks)):
        chunk = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            n = M.mtmd_input_chunk_get_n_tokens(chunk)
            assert M.mtmd_encode_chunk(ctx, chunk) == 0
            rows = np.ctypeslib.as_array(M.mtmd_get_output_embd(ctx), shape=(n * width,)).reshape(n, width).tolist()
            embeddings = (embeddings or []) + rows  # every image chunk in order (SmolVLM's tiles, then the whole)
    first, answer = run(chunks, None)
    _, next_tokens = run(chunks, ids)
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bitmap)
    out.append({"answer_ids": answer, "answer": llm.detokenize(answer).decode("utf-8", "replace"), "embeddings": embeddings,
                "first_logits": first.tolist(), "forced_next": next_tokens})
print(json.dumps(out))
"""


def randomized(model, folder: Path, vision: tuple[str, ...], text_scale: float = 0.2) -> str:
    """``model`` with random weights added (seeded): 0.05 deviations to the parameters whose names hold one of
    ``vision`` (the tower and projector), ``text_scale`` to the others (0: the language model as built), so that a
    tensor written wrong shows and answers depend on the picture; saved in ``folder``."""
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.05 if any(v in name for v in vision) else text_scale
            if scale:
                param.add_(torch.randn(param.shape, generator=g) * scale)
    model.save_pretrained(folder)
    return str(folder)


def tiny_gemma3(folder: Path) -> str:
    """A tiny Gemma 3 with the demo tokenizer, its vision tower and projector given random weights (its
    projector is built zero), saved in ``folder``."""
    from transformers import AutoTokenizer

    from finetuner.model.tiny_vlm import tiny_gemma3 as build

    model = build(AutoTokenizer.from_pretrained(str(REPO / "data" / "demo_model")), folder)
    return randomized(model, folder, ("vision_tower", "multi_modal_projector"), text_scale=0)


def tiny_qwen(family: str, folder: Path) -> str:
    """A tiny Qwen2.5-VL (2 vision layers: the first attending in llama.cpp's 112-pixel windows, the second to the
    whole picture), Qwen2-VL (2 vision layers) or Qwen3-VL (2 vision layers, the first's features passed to the
    language model by a DeepStack merger) with the demo tokenizer, random weights everywhere (the language
    model's too, so that its answers are not one token repeated and depend on the picture), its processor keeping
    the pixels llama.cpp keeps (:data:`QWEN_PIXELS`); saved in ``folder``."""
    from transformers import AutoTokenizer

    from finetuner.model.tiny_vlm import tiny_qwen2_5_vl, tiny_qwen2_vl, tiny_qwen3_vl

    tok = AutoTokenizer.from_pretrained(str(REPO / "data" / "demo_model"))
    if family == "qwen2_5_vl":
        model = tiny_qwen2_5_vl(tok, folder, depth=2, full_attention=(1,), window=112, pixels=QWEN_PIXELS)
    elif family == "qwen3_vl":
        model = tiny_qwen3_vl(tok, folder, depth=2, pixels=QWEN3_PIXELS)
    else:
        model = tiny_qwen2_vl(tok, folder, depth=2, pixels=QWEN_PIXELS)
    return randomized(model, folder, ("visual",))


def tiny_mistral3(folder: Path) -> str:
    """A tiny Mistral 3 (needs torchvision: run this check with an interpreter that has it) keeping pictures of up to
    64 pixels a side, random weights everywhere (as :func:`tiny_qwen`'s); saved in ``folder``."""
    from transformers import AutoTokenizer

    from finetuner.model.tiny_vlm import tiny_mistral3 as build

    model = build(AutoTokenizer.from_pretrained(str(REPO / "data" / "demo_model")), folder, longest_edge=64)
    return randomized(model, folder, ("vision", "projector"))


def without_breaks(rows, width: int, height: int):
    """llama.cpp's Pixtral embeddings without the [IMG_BREAK] rows it puts after each row of ``width`` image tokens
    but the last (transformers' image features have none: its processor writes the token in the text)."""
    keep = [i for i in range(len(rows)) if (i + 1) % (width + 1) or i // (width + 1) == height - 1]
    return rows[keep]


def tiny_smolvlm(folder: Path) -> str:
    """A tiny SmolVLM with the demo tokenizer whose processor cuts a 64-pixel picture into 2 x 2 tiles of 32 pixels
    (and the whole picture), random weights everywhere (as :func:`tiny_qwen`'s); saved in ``folder``. The tokenizer
    gets a blank line as one token (a BPE merge of two new lines, as SmolVLM's own tokenizer has it): llama.cpp
    looks that token up to write before the whole picture."""
    import shutil

    from transformers import AutoTokenizer

    from finetuner.model.tiny_vlm import tiny_smolvlm as build

    words = folder.with_name(folder.name + "-tokenizer")
    shutil.copytree(REPO / "data" / "demo_model", words, ignore=shutil.ignore_patterns("*.safetensors"))
    spec = json.loads((words / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["vocab"]["\u010a\u010a"] = max(spec["model"]["vocab"].values()) + 1  # "ĊĊ": byte-level "\n\n"
    spec["model"]["merges"].append(["\u010a", "\u010a"])
    (words / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    model = build(AutoTokenizer.from_pretrained(str(words)), folder, longest_edge=64)
    return randomized(model, folder, ("vision", "connector"))


def clip_as_llama_cpp_runs_it(model, pixel_values):
    """LLaVA's picture embeddings computed as this llama.cpp's CLIP graph computes them (ggml-org/llama.cpp#25814):
    the class token after the patches, positions 0..n in that order, rows 1..n taken (the last n)."""
    import torch

    tower = model.model.vision_tower
    vm = getattr(tower, "vision_model", tower)
    e = vm.embeddings
    patches = e.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
    x = torch.cat([patches, e.class_embedding.reshape(1, 1, -1)], 1) + e.position_embedding.weight[None]
    h = vm.pre_layrnorm(x)
    n = model.config.vision_feature_layer
    n = n if n >= 0 else len(vm.encoder.layers) + 1 + n
    for layer in vm.encoder.layers[:n]:
        h = layer(h, None)
        h = h[0] if isinstance(h, tuple) else h
    return model.model.multi_modal_projector(h[:, 1:])[0]


def check_family(family: str, source: str, target: Path, pictures: list[Path], max_new: int, tmp: Path) -> dict:
    import numpy as np
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    import finetuner
    from finetuner.export.merge import merge_adapter
    from finetuner.infer.loading import resolve_source
    from finetuner.model.vision import load_processor

    src = resolve_source(source)
    weights = source
    if src.has_adapter:
        weights = str(tmp / f"{family}-merged")
        merge_adapter(source, weights, dtype="fp32")
    processor = load_processor(weights)
    model = AutoModelForImageTextToText.from_pretrained(weights, dtype=torch.float32).eval()
    r = finetuner.export_model(source, tmp / f"{family}.gguf", quant="f16")
    size = PICTURE_SIZE.get(family) or (int(model.config.vision_config.image_size),) * 2
    sized = []
    for p in pictures:  # the model's own size: llama.cpp pads, transformers crops; the same pixels on both sides
        q = tmp / f"{family}-{p.name}"
        Image.open(p).convert("RGB").resize(size, Image.BICUBIC).save(q)
        sized.append(q)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.tokenizer.apply_chat_template(messages, chat_template=processor.chat_template,  # as finetuner renders
                                                   add_generation_prompt=True, tokenize=False)
    tok = processor.tokenizer
    eos = sorted({tok.eos_token_id} | ({tok.convert_tokens_to_ids("<|im_end|>")} if "<|im_end|>" in tok.get_vocab() else set()))
    reference = []
    for q in sized:
        inputs = processor(text=text, images=[Image.open(q).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            out = model.get_image_features(**{k: inputs[k] for k in ("pixel_values", "image_grid_thw", "image_sizes")
                                              if k in inputs})
            feats = getattr(out, "pooler_output", out)
            feats = (feats[0] if isinstance(feats, (list, tuple)) else feats).reshape(-1, model.config.text_config.hidden_size)
            deep = getattr(out, "deepstack_features", None) or []  # Qwen3-VL: beside each image token's embedding
            feats = torch.cat([feats] + [(d[0] if isinstance(d, (list, tuple)) else d).reshape(feats.shape) for d in deep], -1)
            first = model(**inputs).logits[0, -1]
            ids = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                                 pad_token_id=tok.pad_token_id)[0, inputs["input_ids"].shape[1]:].tolist()
            while ids and ids[-1] in eos:
                ids.pop()
            simulated = clip_as_llama_cpp_runs_it(model, inputs["pixel_values"]) if family == "llava" else None
        reference.append((feats.numpy(), first.numpy(), ids, simulated))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", CHILD, str(r.gguf_file), str(r.mmproj_file), text.replace(*PLACEHOLDER[family], 1),
                        json.dumps([str(q) for q in sized]), str(max_new), json.dumps(eos), json.dumps([x[2] for x in reference])],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return {"source": Path(source).name, "error": p.stderr[-3000:]}
    got = json.loads(p.stdout.strip().splitlines()[-1])
    rows = []
    for q, g, (hf, first, ids, simulated) in zip(sized, got, reference):
        ll = np.asarray(g["embeddings"], dtype=np.float32)
        if family == "mistral3":  # 8 x 6 patches merged 2 x 2: 4 tokens a row, 3 rows
            ll = without_breaks(ll, size[0] // 16, size[1] // 16)
        cos = (ll * hf).sum(-1) / (np.linalg.norm(ll, axis=-1) * np.linalg.norm(hf, axis=-1) + 1e-12)
        ll_first = np.asarray(g["first_logits"], dtype=np.float32)
        row = {"picture": q.name.split("-", 1)[1], "image_tokens": int(ll.shape[0]),
               "max_abs_embedding_diff": float(np.abs(ll - hf).max()), "max_abs_embedding": float(np.abs(hf).max()),
               "min_cosine": float(cos.min()), "first_token_max_abs_logit_diff": float(np.abs(ll_first - first).max()),
               "first_token_max_abs_logit": float(np.abs(first).max()),
               "forced_top1": [sum(a == b for a, b in zip(g["forced_next"], ids)), len(ids)],
               "transformers_answer": tok.decode(ids), "llama_cpp_answer": g["answer"], "answer_equal": g["answer_ids"] == ids}
        if simulated is not None:
            row["max_abs_diff_to_llama_cpp_graph"] = float(np.abs(ll - simulated.numpy()).max())
        rows.append(row)
    shown = source if not source.startswith(tempfile.gettempdir()) else Path(source).name  # a tiny model built here
    return {"source": shown, "gguf_bytes": r.file_bytes, "mmproj_bytes": r.mmproj_bytes, "mmproj_tensors": r.mmproj_tensors,
            "picture_size": list(size), "prompt": text, "pictures": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / ".cache" / "llama_cpp_python"), help="Where llama-cpp-python is installed.")
    ap.add_argument("--family", choices=sorted(PLACEHOLDER), action="append",
                    help="Default: all of them (mistral3 only where torchvision is installed: its processor needs it).")
    ap.add_argument("--pictures", type=int, default=12, help="How many held-out pictures of data/pictures.")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(REPO / "docs" / "validation" / "llama_cpp_vlm_check.json"))
    args = ap.parse_args()
    target = Path(args.target)
    seconds_install = install(target)
    rows = [json.loads(line) for line in (REPO / "data" / "pictures" / "shapes_heldout.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    pictures = []
    for row in rows[:args.pictures]:
        pictures += [REPO / "data" / "pictures" / part["image"] for m in row["messages"] if isinstance(m["content"], list)
                     for part in m["content"] if part.get("type") == "image"]
    demo = REPO / "runs" / "demo_vlm_cpu"
    result = {"question": QUESTION, "install_seconds": round(seconds_install, 1), "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        from transformers.utils import is_torchvision_available

        for family in args.family or [f for f in sorted(PLACEHOLDER) if f != "mistral3" or is_torchvision_available()]:
            if family == "llava":
                source = str(demo) if (demo / "adapter").is_dir() else str(REPO / "data" / "demo_vlm")
            elif family == "gemma3":
                source = tiny_gemma3(Path(tmp) / "tiny-gemma3")
            elif family == "smolvlm":
                source = tiny_smolvlm(Path(tmp) / "tiny-smolvlm")
            elif family == "mistral3":
                source = tiny_mistral3(Path(tmp) / "tiny-mistral3")
            else:
                source = tiny_qwen(family, Path(tmp) / f"tiny-{family}")
            result["families"][family] = check_family(family, source, target, pictures, args.max_new_tokens, Path(tmp))
    version = installed_version(target)
    result["llama_cpp_python"] = version
    import torch
    import transformers

    result["torch"], result["transformers"] = torch.__version__, transformers.__version__
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    lines = ["# llama.cpp reads pictures with finetuner's export (language GGUF + mmproj)", "",
             f"`python -m scripts.validate.llama_cpp_vlm_check`, llama-cpp-python {version}, torch {result['torch']}, "
             f"transformers {result['transformers']}, f16 export, {len(pictures)} "
             f"held-out pictures of `data/pictures` at the model's picture size, {QUESTION!r} answered greedily (up to "
             f"{args.max_new_tokens} tokens). Raw result: `{out.name}`.", "",
             "| family | source | picture embeddings: max abs diff (largest abs) / least cosine, llama.cpp vs transformers "
             "| vs transformers run as llama.cpp's CLIP graph runs it (#25814) | first answer token: max abs logit diff (largest abs) "
             "| llama.cpp's next token = transformers' along transformers' answers | greedy answers equal "
             "| an answer (llama.cpp / transformers) |",
             "|---|---|---|---|---|---|---|---|"]
    for family, f in result["families"].items():
        if "error" in f:
            lines.append(f"| {family} | {Path(f['source']).name} | error: {f['error'].strip().splitlines()[-1]} | | | | | |")
            continue
        ps = f["pictures"]
        sim = [p["max_abs_diff_to_llama_cpp_graph"] for p in ps if "max_abs_diff_to_llama_cpp_graph" in p]
        lines.append(f"| {family} | {Path(f['source']).name} | {max(p['max_abs_embedding_diff'] for p in ps):.2g} "
                     f"({max(p['max_abs_embedding'] for p in ps):.2g}) / {min(p['min_cosine'] for p in ps):.4f} "
                     f"| {f'{max(sim):.2g}' if sim else 'n/a'} | {max(p['first_token_max_abs_logit_diff'] for p in ps):.2g} "
                     f"({max(p['first_token_max_abs_logit'] for p in ps):.2g}) "
                     f"| {sum(p['forced_top1'][0] for p in ps)} of {sum(p['forced_top1'][1] for p in ps)} "
                     f"| {sum(p['answer_equal'] for p in ps)} of {len(ps)} "
                     f"| {ps[0]['llama_cpp_answer']!r} / {ps[0]['transformers_answer']!r} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 39, parts 2 and 4: a user's chat file with pictures trains an image-text-to-text model from the CLI (LoRA on
the language model, the vision tower frozen), the run's adapter loads with peft on AutoModelForImageTextToText, the
pictures reach the model (other pictures, other loss), `chat --image` answers about a picture, and `plan` counts the
pictures' image tokens."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, cli_in_process, write_picture_chats, write_recipe


@pytest.fixture(scope="module")
def picture_run(tiny_vlm_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pictures")
    data = write_picture_chats(folder, 8)
    recipe = write_recipe(folder / "recipe.yaml", {
        "name": "colours", "model": {"name": str(tiny_vlm_dir)}, "method": "lora",
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 2},
        "training": {"max_steps": 3, "micro_batch_size": 2, "lr": 1e-3, "eval_every": 3},
        "logging": {"tensorboard": False}, "device": "cpu"})
    out = cli_in_process("run", str(recipe), "-o", str(folder / "run"), "--quiet", cwd=REPO)
    assert out.returncode == 0, out.stderr
    return folder / "run", data


def test_a_picture_file_trains_lora_on_the_language_model_only(picture_run, tiny_vlm_dir):
    import math

    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    run, _ = picture_run
    metrics = json.loads((run / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["steps"] == 3 and math.isfinite(metrics["eval_loss"])
    assert metrics["data"]["pictures"] == 6  # the training rows' (2 of the 8 held out)
    assert (run / "adapter" / "processor_config.json").is_file()  # the processor goes with the adapter
    with safe_open(str(run / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(".language_model." in k for k in keys), keys[:5]  # the vision tower and projector frozen
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir), run / "adapter")
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0


def test_the_pictures_reach_the_model(picture_run, tiny_vlm_dir):
    """The loss of the same chat with a red and with a blue picture differs: the pixel values go through the
    vision tower into the language model (finetuner.model.scoring.token_loss_sum)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from finetuner.data.images import PictureCollator, encode_pictured
    from finetuner.data.pipeline import Collator
    from finetuner.model.scoring import token_loss_sum

    _, data = picture_run
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    collate = PictureCollator(Collator(processor.tokenizer.pad_token_id), processor)
    losses = []
    for picture in ("img/000.png", "img/002.png"):  # red, blue
        ex = {"messages": [{"role": "user", "content": "<image>What colour is this?"},
                           {"role": "assistant", "content": "It is red."}], "images": [str(data.parent / picture)]}
        batch = collate([encode_pictured(ex, processor, processor.chat_template, 64, False)])
        with torch.no_grad():
            losses.append(float(token_loss_sum(model, batch)[0]))
    assert losses[0] != losses[1]


def test_chat_answers_about_a_picture(picture_run):
    run, data = picture_run
    out = cli_in_process("chat", str(run), "-p", "What colour is this?", "--image", str(data.parent / "img" / "001.png"),
                         "--temperature", "0", "--max-new-tokens", "4", "--compare", cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("base:") and "fine-tuned:" in out.stdout
    missing = cli_in_process("chat", str(run), "-p", "What colour?", "--image", "nope.png", cwd=REPO)
    assert missing.returncode != 0 and "error: --image nope.png: no such file." in missing.stderr


def test_a_text_model_refuses_pictures_in_one_line(tmp_path):
    data = write_picture_chats(tmp_path, 2)
    recipe = write_recipe(tmp_path / "recipe.yaml", {
        "name": "text", "model": {"name": str(REPO / "data" / "demo_model")}, "data": {"path": str(data)},
        "training": {"max_steps": 1}, "device": "cpu"})
    out = cli_in_process("run", str(recipe), "-o", str(tmp_path / "run"), cwd=REPO)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"{data}, line 1: the row has 1 picture(s), but the model reads only text" in out.stderr


def test_plan_counts_the_pictures_tokens(picture_run, tiny_vlm_dir):
    _, data = picture_run
    out = cli_in_process("plan", "--model", str(tiny_vlm_dir), "--gpu", "rtx4090", "--data", str(data), "--json", cwd=REPO)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["data"]["pictures"] == 8 and plan["data"]["picture_tokens"] == 8 * 16
    # each example's length is the trainer's: its text and its picture's 16 tokens
    from transformers import AutoProcessor

    from finetuner.data.formats import FileExamples
    from finetuner.data.images import encode_pictured

    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    longest = max(len(encode_pictured(ex, processor, processor.chat_template, 1024, False)["input_ids"])
                  for ex in FileExamples(str(data)))
    assert plan["data"]["max_tokens"] == longest


def test_eval_scores_the_held_out_pictures(picture_run):
    run, data = picture_run
    out = cli_in_process("eval", str(run), "--json", "--no-write", cwd=REPO)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["examples"] == 2 and r["base"]["loss"] != r["fine_tuned"]["loss"]
    other = cli_in_process("eval", str(run), "--data", str(data), "--json", "--no-write", cwd=REPO)
    assert other.returncode == 0 and json.loads(other.stdout)["examples"] == 8


def test_merge_keeps_the_processor_and_the_merged_model_reads_pictures(picture_run, tmp_path):
    run, data = picture_run
    out = cli_in_process("merge", str(run), "-o", str(tmp_path / "merged"), cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "merged" / "processor_config.json").is_file()
    from finetuner.infer.chat import load_chat_model

    chat = load_chat_model(tmp_path / "merged", device="cpu")
    assert chat.processor is not None  # a model folder with its processor: it reads pictures
    answer = chat.reply([{"role": "user", "content": "What colour is this?"}], images=[str(data.parent / "img" / "000.png")],
                        temperature=0, max_new_tokens=4)
    fine_tuned = load_chat_model(run, device="cpu").reply([{"role": "user", "content": "What colour is this?"}],
                                                          images=[str(data.parent / "img" / "000.png")], temperature=0,
                                                          max_new_tokens=4)
    assert answer == fine_tuned  # greedy: the merged weights answer as the adapter on its base


def test_export_writes_the_language_model_and_the_projector_file(picture_run, tiny_vlm_dir, tmp_path):
    """A picture run exports to llama.cpp's two files: the language model and the projector file (mmproj) with the
    CLIP tower up to the model's feature layer and LLaVA's projector as llama.cpp's 'mlp' reads them; Ollama's
    folder gets both, each a FROM line of the Modelfile."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    run, _ = picture_run
    out = cli_in_process("export", str(run), "--format", "gguf", "--quant", "f16", "-o", str(tmp_path / "m.gguf"), cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m.gguf").is_file() and f"--mmproj {tmp_path / 'mmproj-m.gguf'}" in out.stdout
    reader = gguf.GGUFReader(str(tmp_path / "mmproj-m.gguf"))
    field = {k: reader.fields[k].contents() for k in ("general.architecture", "general.type", "clip.projector_type",
                                                     "clip.vision.block_count", "clip.vision.feature_layer",
                                                     "clip.vision.image_size", "clip.vision.patch_size",
                                                     "clip.vision.projection_dim")}
    assert field == {"general.architecture": "clip", "general.type": "mmproj", "clip.projector_type": "mlp",
                     "clip.vision.block_count": 2, "clip.vision.feature_layer": [2],  # vision_feature_layer -1 of 2
                     "clip.vision.image_size": 32, "clip.vision.patch_size": 8, "clip.vision.projection_dim": 64}
    assert "clip.use_gelu" not in reader.fields  # CLIP's quick GELU, llama.cpp's default
    names = {t.name for t in reader.tensors}
    assert {"v.class_embd", "v.patch_embd.weight", "v.position_embd.weight", "v.pre_ln.weight", "v.blk.1.attn_q.weight",
            "v.blk.1.ffn_down.bias", "mm.0.weight", "mm.0.bias", "mm.2.weight", "mm.2.bias"} <= names
    assert not any(n.startswith(("v.post_ln", "token_embd", "blk.")) for n in names)  # LLaVA reads before it; no text
    stored = {t.name: t for t in reader.tensors}
    base = load_file(str(tiny_vlm_dir / "model.safetensors"))
    want = base[next(k for k in base if k.endswith("multi_modal_projector.linear_1.weight"))].numpy()
    got = np.asarray(stored["mm.0.weight"].data, dtype=np.float32).reshape(want.shape)  # the run trained the text only
    assert np.abs(got - want).max() <= 2.0**-11 * np.abs(want).max()

    ollama = cli_in_process("export", str(run), "--format", "ollama", "--quant", "f16", "-o", str(tmp_path / "ol"), cwd=REPO)
    assert ollama.returncode == 0, ollama.stderr
    froms = [line for line in (tmp_path / "ol" / "Modelfile").read_text().splitlines() if line.startswith("FROM")]
    assert froms == ["FROM ./model.gguf", "FROM ./mmproj.gguf"] and (tmp_path / "ol" / "mmproj.gguf").is_file()

    from ui.handlers import Handlers  # the Export tab says where the projector file went

    shown = list(Handlers(run.parent, tmp_path / "uploads").on_gguf(run.name, "gguf", "f16", str(tmp_path / "ui.gguf"), False))
    assert shown[-1].startswith("✓ f16 GGUF saved") and f"`{tmp_path / 'mmproj-ui.gguf'}`" in shown[-1], shown[-1]


def test_export_of_a_family_without_a_projector_writer_is_refused_in_one_line(tmp_path):
    from transformers import AutoTokenizer

    from finetuner.model.tiny_vlm import tiny_llava_next

    tiny_llava_next(AutoTokenizer.from_pretrained(REPO / "data" / "demo_model"), tmp_path / "next")
    out = cli_in_process("export", str(tmp_path / "next"), "--format", "gguf", "-o", str(tmp_path / "m.gguf"), cwd=REPO)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "the projector file (mmproj) llama.cpp reads pictures with is not written for llava_next" in out.stderr
    assert "gemma3, idefics3, llava, mistral3, qwen2_5_vl, qwen2_vl, qwen3_vl, smolvlm" in out.stderr and not list(tmp_path.glob("*.gguf"))


def test_the_ui_chat_takes_a_picture(picture_run, tmp_path):
    """The Chat tab's picture goes with the message to the run's chat worker (its own process): the fine-tune's
    greedy answer is the one load_chat_model gives with the picture; the status line says which picture."""
    from finetuner.infer.chat import load_chat_model
    from ui.handlers import Handlers

    run, data = picture_run
    picture = str(data.parent / "img" / "001.png")
    h = Handlers(run.parent, tmp_path / "uploads")
    assert h.on_chat_run(run.name) == {"__type__": "update", "visible": True}  # the tab offers the picture upload
    try:
        out = list(h.on_chat("What colour is this?", [], [], run.name, False, 4, 0.0, 1.0, None, False, picture))
    finally:
        h.chat_pool.close()
    _msg, tuned, _base, status = out[-1]
    assert status.startswith("Answered in") and "with the picture 001.png" in status, status
    want = load_chat_model(run, device="cpu").reply([{"role": "user", "content": "What colour is this?"}], images=[picture],
                                                    temperature=0, max_new_tokens=4)
    assert tuned[-1]["content"] == (want or "(no answer)")


@pytest.mark.parametrize("strategy, tower", [("ddp", False), ("fsdp", False), ("fsdp", True)])
def test_two_processes_with_pictures_match_one_process(picture_run, tiny_vlm_dir, tmp_path, strategy, tower):
    """Two processes (DDP or FSDP over gloo, `--gpus 2`) train the picture file as one process does: the same losses
    and adapter, each rank collating its own examples' pictures; under FSDP also with the projector trained in full
    and LoRA on the vision tower (``tower``), whose weights the adapter then holds."""
    import torch
    from safetensors.torch import load_file

    from finetuner.runs.events import read_events
    from tests.conftest import run_cli

    _, data = picture_run
    base = {"name": "colours", "model": {"name": str(tiny_vlm_dir)}, "method": "lora",
            "lora": {"dropout": 0.0,  # no random masks: each rank draws its own
                     **({"train_projector": True, "train_vision_tower": True} if tower else {})},
            "data": {"path": str(data), "max_seq_len": 64, "val_size": 0},
            "training": {"max_steps": 3, "micro_batch_size": 2, "gradient_accumulation": 2, "lr": 1e-3,
                         "seed": 7},
            "logging": {"tensorboard": False}, "device": "cpu"}
    runs = {}
    for name, gpus in (("one", None), ("two", "2")):
        recipe = write_recipe(tmp_path / f"{name}.yaml", dict(base, output_dir=str(tmp_path / name),
                                                              **({"distributed": {"strategy": strategy}} if gpus else {})))
        out = run_cli("run", str(recipe), "--quiet", *(["--gpus", gpus] if gpus else []))
        assert out.returncode == 0, out.stderr + out.stdout
        runs[name] = tmp_path / name
    dist = next(e for e in read_events(runs["two"] / "events.jsonl") if e["event"] == "distributed")
    assert dist["strategy"] == strategy and dist["world_size"] == 2
    assert {"ddp": "DistributedDataParallel", "fsdp": "FSDP2"}[strategy] in dist["engine"]
    losses = {n: [e["loss"] for e in read_events(d / "events.jsonl") if e["event"] == "step"] for n, d in runs.items()}
    assert len(losses["one"]) == 3 and losses["two"] == pytest.approx(losses["one"], abs=1e-5)
    one, two = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in runs.values())
    assert set(one) == set(two) and max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
    assert torch.is_tensor(next(iter(one.values())))
    if tower:  # the projector's own weights and the tower's LoRA weights are in both adapters, trained alike
        assert any("multi_modal_projector" in k and "lora_" not in k for k in one)
        assert any("vision_tower" in k and "lora_A" in k for k in one)


def test_the_ui_data_tab_shows_the_pictures(tmp_path):
    """The Data tab's preview of a file with pictures: the first examples' pictures as thumbnails (PNG data URIs of
    at most 96 px a side), under each example's place; the summary counts the pictures' image tokens."""
    import base64
    import io
    import re

    from PIL import Image

    from ui.handlers import Handlers

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    data = REPO / "data" / "pictures" / "shapes.jsonl"
    summary, _preview, _hist, pictures = h.on_data(str(REPO / "data" / "demo_vlm"), str(data), 0)
    assert pictures["visible"] is True
    shown = re.findall(r"<img src='data:image/png;base64,([^']+)' alt='(train-\d+\.png)'>", pictures["value"])
    assert [name for _, name in shown] == ["train-000.png", "train-001.png", "train-002.png"]
    for b64, name in shown:
        thumb = Image.open(io.BytesIO(base64.b64decode(b64)))
        with Image.open(REPO / "data" / "pictures" / "img" / name) as original:
            assert max(thumb.size) <= 96 and thumb.size == original.size  # 48 px pictures are shown whole
    assert "**48** pictures · 16 image tokens a picture (768 in all, in the lengths above)" in summary


def test_the_ui_plans_and_trains_a_picture_file(tmp_path):
    """The Plan tab plans the picture demo's file on the demo's image-text model (the pictures counted), and Start
    runs it as a picture run in its own process: its adapter keeps the processor."""
    from tests.conftest import wait_until_done
    from ui.handlers import Handlers
    from ui.recipe_text import fields_of

    from finetuner.config.recipe import Recipe

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    model, data = str(REPO / "data" / "demo_vlm"), str(REPO / "data" / "pictures" / "shapes.jsonl")
    out = h.on_plan(model, "cpu", data, 0, 0, "auto", "auto", "", 4, 64)
    head, text = out[0], out[4]
    assert "ft-error" not in head, head
    recipe = Recipe.from_yaml_text(text, source="recipe")
    fields = list(fields_of(recipe))
    fields[1], fields[2], fields[7] = 2, 1, 2  # micro-batch, accumulation, max steps
    *_, edited, _dl, error = h.on_edit(text, "cpu", *fields)
    assert error == "", error
    _run, _table, started, _mine = h.on_start(edited, "cpu", data, False)
    assert started.startswith(f"✓ Training started: **{recipe.name}**"), started
    wait_until_done(h.runs, recipe.name)
    run = h.runs / recipe.name
    assert (run / "adapter" / "processor_config.json").is_file()
    assert json.loads((run / "metrics.json").read_text(encoding="utf-8"))["data"]["pictures"] > 0


def test_the_projector_and_the_vision_tower_train_by_setting(tiny_vlm_dir, tmp_path):
    """lora.train_projector trains the projector in full (saved with the adapter), lora.train_vision_tower puts
    LoRA on the vision tower's linears; the merged folder holds both and answers as the adapter does; a text run
    with either setting is refused in one line."""
    import torch
    from safetensors.torch import load_file

    data = write_picture_chats(tmp_path, 8)
    recipe = write_recipe(tmp_path / "recipe.yaml", {
        "name": "eyes", "model": {"name": str(tiny_vlm_dir)}, "method": "lora",
        "lora": {"train_projector": True, "train_vision_tower": True},
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 0},
        "training": {"max_steps": 3, "micro_batch_size": 2, "lr": 1e-2}, "logging": {"tensorboard": False}, "device": "cpu"})
    out = cli_in_process("run", str(recipe), "-o", str(tmp_path / "run"), "--quiet", cwd=REPO)
    assert out.returncode == 0, out.stderr
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    tower_lora = [k for k in adapter if "vision_tower" in k and "lora_B" in k]
    assert tower_lora and all(float(adapter[k].abs().max()) > 0 for k in tower_lora)  # trained from B = 0
    assert any("language_model" in k for k in adapter)
    base = load_file(str(tiny_vlm_dir / "model.safetensors"))
    key = next(k for k in base if k.endswith("multi_modal_projector.linear_1.weight"))
    trained = next(v for k, v in adapter.items() if k.endswith("multi_modal_projector.linear_1.weight"))
    assert not torch.allclose(trained, base[key])  # the whole projector, trained and kept

    merged = cli_in_process("merge", str(tmp_path / "run"), "-o", str(tmp_path / "merged"), cwd=REPO)
    assert merged.returncode == 0, merged.stderr
    weights = load_file(str(next((tmp_path / "merged").glob("*.safetensors"))))
    torch.testing.assert_close(next(v for k, v in weights.items() if k.endswith("multi_modal_projector.linear_1.weight")),
                               trained)
    import gguf
    import numpy as np

    exported = cli_in_process("export", str(tmp_path / "run"), "--quant", "f32", "-o", str(tmp_path / "eyes.gguf"), cwd=REPO)
    assert exported.returncode == 0, exported.stderr
    stored = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "mmproj-eyes.gguf")).tensors}
    np.testing.assert_array_equal(np.asarray(stored["mm.0.weight"].data).reshape(trained.shape), trained.numpy())
    tower_q = next(k for k in weights if k.endswith("vision_tower.encoder.layers.0.self_attn.q_proj.weight"))
    np.testing.assert_array_equal(np.asarray(stored["v.blk.0.attn_q.weight"].data).reshape(weights[tower_q].shape),
                                  weights[tower_q].numpy())  # the tower with its LoRA merged in
    from finetuner.infer.chat import load_chat_model

    question = [{"role": "user", "content": "What colour is this?"}]
    picture = [str(data.parent / "img" / "003.png")]
    assert (load_chat_model(tmp_path / "merged", device="cpu").reply(question, images=picture, temperature=0, max_new_tokens=4)
            == load_chat_model(tmp_path / "run", device="cpu").reply(question, images=picture, temperature=0, max_new_tokens=4))

    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Hi {i}"},
                                                     {"role": "assistant", "content": "Hello."}]}) + "\n" for i in range(8)))
    refused = write_recipe(tmp_path / "text.yaml", {
        "name": "text", "model": {"name": str(tiny_vlm_dir)}, "method": "lora", "lora": {"train_projector": True},
        "data": {"path": str(text), "max_seq_len": 64, "val_size": 0}, "training": {"max_steps": 1},
        "logging": {"tensorboard": False}, "device": "cpu"})
    out = cli_in_process("run", str(refused), "-o", str(tmp_path / "text-run"), "--quiet", cwd=REPO)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "lora.train_projector: this run reads no pictures" in out.stderr
    plain = write_recipe(tmp_path / "plain.yaml", {
        "name": "plain", "model": {"name": str(tiny_vlm_dir)}, "method": "lora",
        "data": {"path": str(text), "max_seq_len": 64, "val_size": 0}, "training": {"max_steps": 1},
        "logging": {"tensorboard": False}, "device": "cpu"})
    out = cli_in_process("run", str(plain), "-o", str(tmp_path / "plain-run"), "--quiet", cwd=REPO)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "is an image-text model (llava) with no text-only class in transformers, and the data has no pictures" in out.stderr


def test_qlora_keeps_a_trained_projector_whole(tiny_vlm_dir, tmp_path):
    """QLoRA with lora.train_projector: the projector is left out of the 4-bit load (its copy trains; 4-bit weights
    cannot), the output layer stays out as transformers keeps it, and the vision tower's 4-bit linears get LoRA."""
    from safetensors.torch import load_file

    import finetuner
    from finetuner.config.recipe import Recipe
    from finetuner.model.vision_parts import not_quantized

    config = json.loads((tiny_vlm_dir / "config.json").read_text())
    assert {"lm_head", "model.multi_modal_projector"} <= set(not_quantized(config))  # with transformers' own defaults
    data = write_picture_chats(tmp_path, 8)
    recipe = Recipe.from_dict({
        "name": "q", "model": {"name": str(tiny_vlm_dir)}, "method": "qlora",
        "lora": {"train_projector": True, "train_vision_tower": True},
        "data": {"path": str(data), "max_seq_len": 64, "val_size": 0}, "training": {"max_steps": 2, "micro_batch_size": 2},
        "logging": {"tensorboard": False}, "device": "cpu"})
    result = finetuner.train(recipe, output_dir=str(tmp_path / "run"))
    assert len(result.losses) == 2
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert adapter["base_model.model.model.multi_modal_projector.linear_1.weight"].shape == (64, 32)
    assert any("vision_tower" in k and "lora_A" in k for k in adapter)

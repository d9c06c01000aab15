"""The recipe schema: defaults, overrides, path resolution, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetuner.errors import UserError
from finetuner.config.recipe import Recipe, accepted_values, recipe_keys
from tests.conftest import REPO

BASE = {"model": {"name": "org/model"}, "data": {"path": "org/dataset"}}


def err(raw, overrides=None) -> str:
    with pytest.raises(UserError) as e:
        Recipe.from_dict(raw, overrides=overrides)
    return str(e.value)


def test_defaults():
    r = Recipe.from_dict(BASE)
    assert r.method == "lora" and r.quantization is None
    assert r.model.trust_remote_code is False
    assert r.lora.target_modules == "all-linear"
    assert r.training.optimizer == "adamw_torch"
    assert r.output_path() == (Path.cwd() / "runs" / "run").resolve()


def test_qlora_defaults_to_4bit_nf4_double_quant():
    r = Recipe.from_dict({**BASE, "method": "qlora"})
    assert (r.quantization.bits, r.quantization.quant_type, r.quantization.double_quant) == (4, "nf4", True)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ({**BASE, "modle": {}}, "modle: unknown key. Did you mean 'model'?"),
        ({**BASE, "training": {"optimzer": "sgd"}}, "training.optimzer: unknown key. Did you mean 'optimizer'?"),
        ({**BASE, "training": {"optimizer": "adamw8bit"}}, "training.optimizer: invalid value 'adamw8bit'. Did you mean 'adamw_8bit'?"),
        ({**BASE, "training": {"lr": "fast"}}, "training.lr: must be a number > 0; got 'fast'."),
        ({**BASE, "training": {"micro_batch_size": 0}}, "training.micro_batch_size"),
        ({**BASE, "lora": {"r": -1}}, "lora.r"),
        ({**BASE, "method": "qlora", "quantization": None}, "quantization: method 'qlora' needs a quantized base"),
        ({**BASE, "method": "lora", "quantization": {"bits": 4}}, "use method 'qlora'"),
        ({**BASE, "method": "full", "quantization": {"bits": 8}}, "method 'full' cannot train quantized weights"),
        ({**BASE, "method": "qlora", "quantization": {"quant_type": "nf5"}}, "quantization.quant_type: invalid value 'nf5'. Did you mean 'nf4'?"),
        ({**BASE, "training": {"warmup_steps": 5, "warmup_ratio": 0.1}}, "training.warmup_steps: set warmup_steps or warmup_ratio, not both"),
        ({**BASE, "name": "../escape"}, "name: use letters"),
        ({"data": {"path": "x"}}, "model: required key is missing"),
        ({**BASE, "method": "dora"}, "method: invalid value 'dora'"),
        ({**BASE, "method": "qlroa"}, "method: invalid value 'qlroa'. Did you mean 'qlora'? Valid choices: lora, qlora, full, auto."),
        ({**BASE, "training": {"micro_batch_size": [4]}}, "training.micro_batch_size: must be a whole number ≥ 1 (or auto); got [4]."),
        ({**BASE, "training": {"micro_batch_size": 2.5}}, "training.micro_batch_size: must be a whole number ≥ 1 (or auto); got 2.5."),
        ({**BASE, "training": {"gradient_accumulation": "atuo"}}, "must be a whole number ≥ 1 (or auto); got 'atuo'. Did you mean 'auto'?"),
        ({**BASE, "training": {"gradient_checkpointing": "yes2"}}, "training.gradient_checkpointing: must be true or false (or auto); got 'yes2'."),
        ({**BASE, "training": {"optimizer": "adam"}}, "Valid choices: adamw_torch, adamw_8bit, paged_adamw_8bit, paged_adamw_32bit, adafactor, sgd, auto."),
        ({**BASE, "training": {"max_steps": 0}}, "training.max_steps: must be a whole number ≥ 1; got 0."),
        ({**BASE, "training": {"warmup_ratio": 1}}, "training.warmup_ratio: must be a number ≥ 0 and < 1; got 1."),
        ({**BASE, "lora": {"r": 4096}}, "lora.r: must be a whole number from 1 to 1024; got 4096."),
        ({**BASE, "data": {"path": "x", "max_seq_len": 8}}, "data.max_seq_len: must be a whole number ≥ 16 (or auto); got 8."),
        ({**BASE, "lora": {"target_modules": 5}}, "lora.target_modules: must be text or a list of texts; got 5."),
        ({**BASE, "training": "fast"}, "training: must be a section of keys (epochs, max_steps, lr, ...); got 'fast'."),
    ],
)
def test_errors_name_the_key(raw, expected):
    assert expected in err(raw)


@pytest.mark.parametrize("key", ["training.max_steps", "training.micro_batch_size", "training.gradient_accumulation",
                                 "training.eval_every", "data.max_examples"])
def test_a_whole_number_is_taken_as_written_and_no_larger_than_2_53(key):
    """YAML reads 1.0e+12 as a float: a whole one is the whole number; one above 2**53 (where a float stops holding
    every whole number, so 1e20 is not the number anyone wrote) is refused on one line naming the key."""
    section, leaf = key.split(".")
    assert getattr(getattr(Recipe.from_dict(BASE, [f"{key}=1.0e+12"]), section), leaf) == 10**12
    assert getattr(getattr(Recipe.from_dict(BASE, [f"{key}={2**53}"]), section), leaf) == 2**53
    for given, shown in ((2**53 + 1, str(2**53 + 1)), ("1.0e+20", "1e+20"), (".inf", "inf")):
        msg = err(BASE, [f"{key}={given}"])
        assert f"  - {key}: must be a whole number of at most 9,007,199,254,740,992 (2**53" in msg and f"got {shown}." in msg
    assert "must be a whole number" in err(BASE, [f"{key}=2.5"])  # a fraction, as before


@pytest.mark.parametrize("written, value", [("1e12", 10**12), ("1E3", 1000), ("+2e2", 200)])
def test_a_number_written_with_an_exponent_and_no_dot_is_the_number(written, value):
    """``--set training.micro_batch_size=1e12``: YAML 1.1 (PyYAML) reads ``1e12`` as text; where a number belongs
    it is the number (as YAML 1.2 and JSON read it), so its own check speaks (issue 54, case 7), not "not a whole
    number"; a float key takes ``2e-4`` as 0.0002; where text belongs it stays text."""
    assert Recipe.from_dict(BASE, [f"training.max_steps={written}"]).training.max_steps == value
    assert Recipe.from_dict(BASE, ["training.lr=2e-4"]).training.lr == 2e-4
    assert "training.max_steps: must be a whole number of at most 9,007,199,254,740,992" in err(BASE, ["training.max_steps=1e20"])
    assert Recipe.from_dict(BASE, ["name=1e3"]).name == "1e3"


def test_epochs_are_bounded_as_whole_numbers_are():
    """1e308 epochs overflowed the count of steps (a traceback); 2**53 is already a run of ~300 million years."""
    assert "  - training.epochs: must be a number > 0 and ≤ 9007199254740992; got 1e+308." in err(BASE, ["training.epochs=1.0e+308"])


JARGON = ("constrained-", "literal[", "Input should", "function-", "[type=", "union[", "Value error")


@pytest.mark.parametrize("key", recipe_keys())
def test_every_key_says_in_plain_words_what_it_takes(key):
    """A value of the wrong kind for any key: one line for the key, saying what it must be, no pydantic jargon."""
    overrides = [f"{key}=[[1]]"] if key not in ("model", "data") else []
    raw = {**BASE} if overrides else {**BASE, key: [[1]]}
    msg = err(raw, overrides)
    lines = [line for line in msg.splitlines() if line.startswith((f"  - {key}:", f"  - {key}."))]  # or its item
    assert len(lines) == 1, msg
    assert "must be " in lines[0] or "invalid value" in lines[0] or "not a module name" in lines[0], msg
    assert not [j for j in JARGON if j in msg], msg


def _choices(key: str) -> list:
    return [c for c in accepted_values(key)[1] if isinstance(c, str)]


CHOICE_KEYS = [k for k in recipe_keys() if _choices(k)]


def test_keys_with_named_choices_are_found():
    assert {"method", "training.micro_batch_size", "training.optimizer", "data.packing", "model.dtype"} <= set(CHOICE_KEYS)
    assert _choices("method") == ["lora", "qlora", "full", "auto"]


@pytest.mark.parametrize("key", CHOICE_KEYS)
def test_a_misspelt_choice_lists_every_choice_of_the_key(key):
    """For keys with named choices (``lora|qlora|full`` or ``auto``...), the one line about the key lists all of them."""
    msg = err(BASE, [f"{key}=zzzzzz"])
    lines = [line for line in msg.splitlines() if line.startswith(f"  - {key}:")]
    assert len(lines) == 1, msg
    for c in _choices(key):
        assert c in lines[0], lines[0]


@pytest.mark.parametrize("override, expected", [
    ("training.learning_rate=1e-4", "training.learning_rate: unknown key. Did you mean 'lr'?"),
    ("lora.rank=8", "lora.rank: unknown key. Did you mean 'r'?"),
    ("lora.lora_alpha=16", "lora.lora_alpha: unknown key. Did you mean 'alpha'?"),
    ("lora.lora_dropout=0.1", "lora.lora_dropout: unknown key. Did you mean 'dropout'?"),
    ("training.batch_size=4", "training.batch_size: unknown key. Did you mean 'micro_batch_size'?"),
    ("training.per_device_train_batch_size=4", "Did you mean 'micro_batch_size'?"),
    ("training.gradient_accumulation_steps=4", "Did you mean 'gradient_accumulation'?"),
    ("training.num_train_epochs=3", "Did you mean 'epochs'?"),
    ("data.cutoff_len=512", "data.cutoff_len: unknown key. Did you mean 'max_seq_len'?"),
    ("data.sequence_len=512", "Did you mean 'max_seq_len'?"),
    ("training.max_length=512", "training.max_length: unknown key. Did you mean 'data.max_seq_len'? (finetuner's name for max_length; it goes in the data section)"),
    ("training.max_seq_len=512", "Did you mean 'data.max_seq_len'?"),
    ("learning_rate=1e-4", "learning_rate: unknown key. Did you mean 'training.lr'?"),
    ("lora.lora_r=8", "Did you mean 'r'?"),
    ("training.lrr=1", "training.lrr: unknown key. Did you mean 'lr'?"),
])
def test_unknown_keys_suggest_finetuners_name(override, expected):
    assert expected in err(BASE, [override])


def test_every_synonym_points_at_a_real_key():
    from finetuner.config.recipe_errors import SYNONYMS

    keys = set(recipe_keys())
    assert not {t for t in SYNONYMS.values() if t not in keys}
    assert not [s for s in SYNONYMS if s in {k.rsplit(".", 1)[-1] for k in keys}]  # a synonym is never a real name


@pytest.mark.parametrize("given, expected", [
    ("q_proj,v_proj", ["q_proj", "v_proj"]),
    ("q_proj, v_proj", ["q_proj", "v_proj"]),
    ("q_proj v_proj", ["q_proj", "v_proj"]),
    ("q_proj", ["q_proj"]),
    ("self_attn.q_proj", ["self_attn.q_proj"]),
    ("[q_proj, v_proj]", ["q_proj", "v_proj"]),
    ("all-linear", "all-linear"),
    (r".*\.(q_proj|v_proj)", r".*\.(q_proj|v_proj)"),
])
def test_target_modules_take_a_comma_separated_string(given, expected):
    assert Recipe.from_dict(BASE, overrides=[f"lora.target_modules={given}"]).lora.target_modules == expected


def test_target_modules_that_cannot_work_say_why():
    assert "nor a valid regular expression" in err(BASE, ["lora.target_modules=(q_proj"])
    assert "'q proj' is not a module name" in err(BASE, ["lora.target_modules=[q proj]"])
    assert "needs at least one module name" in err(BASE, ["lora.target_modules=[]"])


def test_overrides_parse_yaml_values_and_create_sections():
    r = Recipe.from_dict(BASE, overrides=["training.lr=1e-4", "lora.target_modules=[q_proj, v_proj]", "method=qlora", "samples.prompts=[hi]"])
    assert r.training.lr == 1e-4 and r.lora.target_modules == ["q_proj", "v_proj"]
    assert r.method == "qlora" and r.samples.prompts == ["hi"]


def test_override_errors():
    assert "expected key.path=value" in err(BASE, ["training.lr"])
    assert "training.lrr: unknown key. Did you mean 'lr'?" in err(BASE, ["training.lrr=1"])
    assert "'model.name' is not a section" in err(BASE, ["model.name.x=1"])


def test_yaml_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  name: x\n data: [\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"bad.yaml: line \d+"):
        Recipe.from_yaml(p)
    p.write_text("", encoding="utf-8")
    with pytest.raises(UserError, match="empty"):
        Recipe.from_yaml(p)
    p.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(UserError, match="not a UTF-8"):
        Recipe.from_yaml(p)
    with pytest.raises(UserError, match="not found"):
        Recipe.from_yaml(tmp_path / "missing.yaml")


def test_relative_paths_resolve_against_the_recipe_folder(tmp_path, monkeypatch):
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "d.jsonl").write_text("{}\n")
    sub = tmp_path / "recipes"
    sub.mkdir()
    p = sub / "r.yaml"
    p.write_text(yaml.safe_dump({"model": {"name": "../models/m"}, "data": {"path": "../d.jsonl"}}))
    monkeypatch.chdir("/")
    r = Recipe.from_yaml(p)
    assert r.model.name == str((tmp_path / "models" / "m").resolve())
    assert r.data.path == str((tmp_path / "d.jsonl").resolve())


def test_missing_local_paths_are_errors(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"model": {"name": "./nope"}, "data": {"path": "x.jsonl"}}))
    with pytest.raises(UserError, match="model.name: './nope' does not exist"):
        Recipe.from_yaml(p)
    p.write_text(yaml.safe_dump({"model": {"name": "org/m"}, "data": {"path": "missing.jsonl"}}))
    with pytest.raises(UserError, match="data.path: 'missing.jsonl' does not exist"):
        Recipe.from_yaml(p)


def test_resolved_recipe_round_trips(tmp_path):
    r = Recipe.from_dict({**BASE, "method": "qlora", "training": {"max_steps": 3}})
    r.save(tmp_path / "recipe.yaml")
    again = Recipe.from_yaml(tmp_path / "recipe.yaml")
    assert again == r


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_are_valid(path):
    r = Recipe.from_yaml(path)
    assert r.model.trust_remote_code is False


def test_base_weight_offload_to_cpu_is_refused_with_alternatives(recipe_dict):
    from finetuner.errors import UserError
    from finetuner.config.recipe import Recipe

    recipe_dict["model"]["max_memory"] = {"0": "20GiB", "cpu": "64GiB"}
    with pytest.raises(UserError) as e:
        Recipe.from_dict(recipe_dict)
    msg = e.value.message
    assert "model.max_memory" in msg and "qlora" in msg and "zero3" in msg
    recipe_dict["model"]["max_memory"] = {"0": "20GiB", "1": "24GiB"}
    assert Recipe.from_dict(recipe_dict).model.max_memory == {"0": "20GiB", "1": "24GiB"}


def test_gpu_split_on_a_machine_without_those_gpus_is_a_clear_error(recipe_dict, tmp_path):
    from tests.conftest import cli_in_process, write_recipe

    recipe_dict["model"]["max_memory"] = {"0": "20GiB", "1": "24GiB"}
    res = cli_in_process("run", str(write_recipe(tmp_path / "r.yaml", recipe_dict)), "-q")
    assert res.returncode == 2 and "model.max_memory" in res.stderr and "Traceback" not in res.stderr

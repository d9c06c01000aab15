"""The web UI's handlers without a browser, and what the UI leaves to the library: it merges in
another process through the Python API and shows the merge's ``UserError`` as raised; it reads
and writes recipes with ``finetuner.config.recipe``; it finds the GPU with
``finetuner.config.hardware``; it runs no command to scrape its output."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from finetuner.config.recipe import Recipe, readable_yaml
from finetuner.errors import UserError
from finetuner.export.merge import merge_adapter
from tests.conftest import demo_run_folder
from ui import handlers as ui_handlers
from ui.errors import error_md
from ui.handlers import Handlers

REPO = Path(__file__).resolve().parents[2]
DEMO = {"model": {"name": str(REPO / "data" / "demo_model")}, "data": {"path": str(REPO / "data" / "alpaca_sample.json")}}


def test_the_export_handler_shows_the_merges_own_refusal(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    run = demo_run_folder(h.runs)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine", encoding="utf-8")
    shown = list(h.on_merge(run.name, str(full), "auto", False))
    with pytest.raises(UserError) as e:
        merge_adapter(run, full)
    assert shown[0].startswith(f"Merging {run.name} into its base model")
    assert shown[-1] == error_md(e.value)  # the merge's message and hint, nothing of the UI's own
    assert "is not empty" in shown[-1] and "allow overwrite" in shown[-1]
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    missing = list(h.on_merge("no-such-run", "", "auto", False))
    assert len(missing) == 1 and "No run named no-such-run" in missing[0]  # refused before anything starts


def test_the_export_tab_writes_a_checked_gguf_and_an_ollama_folder(tmp_path):
    """GGUF and Ollama from the Export tab: the library's export in another process, its checks
    reported on the page, and its refusals shown as raised."""
    import gguf

    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    run = demo_run_folder(h.runs, adapter=True)
    shown = list(h.on_gguf(run.name, "gguf", "q8_0", "", False))
    file = run / f"{run.name}-q8_0.gguf"
    assert shown[0].startswith(f"Exporting {run.name} to GGUF (q8_0)")
    assert shown[-1].startswith(f"✓ q8_0 GGUF saved to `{file}`"), shown[-1]
    assert "top-1 agreement 100%" in shown[-1] and "same ids" in shown[-1]
    assert gguf.GGUFReader(file).fields["general.architecture"].contents() == "llama"
    again = list(h.on_gguf(run.name, "gguf", "q8_0", "", False))[-1]
    assert "exists" in again and "overwrite" in again and not again.startswith("✓")  # the export's own refusal
    folder = tmp_path / "ollama"
    done = list(h.on_gguf(run.name, "ollama", "f16", str(folder), False))[-1]
    assert "ollama create" in done and (folder / "Modelfile").is_file() and (folder / "model.gguf").is_file()


def test_the_editor_reads_and_writes_recipes_with_the_library(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    recipe = Recipe.from_dict(dict(DEMO, name="edited", distributed={"num_processes": 2}))
    text = readable_yaml(recipe)
    *_, checked = h.on_check_yaml(text, "cpu")
    assert checked.startswith("✓ The recipe is valid: run **edited**")
    file = tmp_path / "mine.yaml"
    file.write_text("# my recipe\n" + text, encoding="utf-8")
    shown, *_ = h.on_load_recipe(str(file), "cpu")
    assert shown == "# my recipe\n" + text  # the library's writer: the same keys in the same order
    assert "distributed:\n  num_processes: 2" in shown  # kept (the UI's own copy of the writer lost it)
    *_, bad = h.on_check_yaml("model: [", "cpu")
    with pytest.raises(UserError) as e:
        Recipe.from_yaml_text("model: [", source="recipe")
    assert bad == error_md(e.value)  # the recipe's own message, not a second formatter's


def test_the_default_card_is_what_hardware_detect_finds(monkeypatch):
    from finetuner.config import hardware

    ui_handlers.default_card.cache_clear()
    try:
        monkeypatch.setattr(hardware, "detect", lambda: None)
        assert ui_handlers.default_card() == "cpu"
        ui_handlers.default_card.cache_clear()
        monkeypatch.setattr(hardware, "detect", lambda: hardware.PROFILES["rtx4090"])
        assert ui_handlers.default_card() == "auto"
    finally:
        ui_handlers.default_card.cache_clear()


def test_ui_runs_no_command_to_scrape_and_keeps_no_copy_of_library_logic():
    for path in sorted((REPO / "ui").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"subprocess", "yaml"}, f"ui/{path.name} imports {imported & {'subprocess', 'yaml'}}"
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not [s for s in strings if s.startswith("error:")], f"ui/{path.name} looks for error: lines"
        assert "nvidia-smi" not in text, f"ui/{path.name} runs nvidia-smi (use finetuner.config.hardware.detect)"
        assert "exclude_defaults" not in text, f"ui/{path.name} dumps a recipe itself (use finetuner.config.recipe.readable_yaml)"

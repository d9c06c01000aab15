"""The Data tab's column menus: a file whose columns finetuner cannot place (``frage,antwort,kategorie``)
is mapped in the page, the menus' choices become the recipe's ``data.columns``, and the message
that asks for them names the menus, not a command line. A new file clears the old file's preview."""

from __future__ import annotations

from pathlib import Path

from finetuner.config.recipe import Recipe
from finetuner.data.formats import file_columns
from ui.handlers import COLUMN_ROLES, Handlers
from ui.recipe_text import recipe_from_text

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "data" / "demo_model")


def german_csv(tmp_path: Path) -> Path:
    path = tmp_path / "fragen.csv"
    rows = ["frage,antwort,kategorie"] + [f"Wie heißt die Zahl {i}?,Die Zahl heißt {i}.,zahlen" for i in range(24)]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def picks(**roles: str) -> list[str]:
    """The column menus' values, in the page's order (blank: as detected)."""
    return [roles.get(role, "") for role in COLUMN_ROLES]


def test_file_columns_are_the_first_rows_names(tmp_path):
    assert file_columns(str(german_csv(tmp_path))) == ["frage", "antwort", "kategorie"]
    assert file_columns(str(REPO / "data" / "alpaca_sample.json"))[:3] == ["instruction", "input", "output"]


def test_a_new_file_fills_the_menus_with_its_columns_and_clears_the_old_preview(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    box, *menus, preview, pairs = h.on_columns(str(german_csv(tmp_path)))
    assert box["visible"] is True and len(menus) == len(COLUMN_ROLES)
    for menu in menus:
        assert [value for _label, value in menu["choices"]] == ["", "frage", "antwort", "kategorie"]
        assert menu["value"] == ""  # as detected until the user picks one
    assert preview["value"] == [] and pairs == {"value": "", "visible": False, "__type__": "update"}
    box, *_ = h.on_columns(str(REPO / "data" / "preference_sample.jsonl"))
    assert box["visible"] is False  # preference data is read by its column names: no menus


def test_columns_not_detected_are_asked_for_in_the_menus_and_then_read(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    csv = str(german_csv(tmp_path))
    summary, *_ = h.on_data(MODEL, csv, 64, *picks())
    assert "cannot tell the data format" in summary
    assert "column menus" in summary and "--set" not in summary and "command line" not in summary
    summary, preview, _hist, _pairs = h.on_data(MODEL, csv, 64, *picks(prompt="frage", response="antwort"))
    assert "ft-error" not in summary, summary
    shown = "".join(text for text, _ in preview["value"])
    assert "Wie heißt die Zahl 0?" in shown and "Die Zahl heißt 0." in shown
    assert any(label == "trained" and "Zahl" in text for text, label in preview["value"])  # the answer is trained on


def test_the_plan_writes_the_chosen_columns_into_the_recipe(tmp_path):
    h = Handlers(tmp_path / "runs", tmp_path / "uploads")
    csv = str(german_csv(tmp_path))
    refused = h.on_plan(MODEL, "cpu", csv, 64, 0, "auto", "auto", "", None, None, *picks())
    assert "column menus" in refused[0] and "--set" not in refused[0]
    out = h.on_plan(MODEL, "cpu", csv, 64, 0, "auto", "auto", "", None, None, *picks(prompt="frage", response="antwort"))
    recipe: Recipe = recipe_from_text(out[4])
    assert recipe.data.columns == {"prompt": "frage", "response": "antwort"}
    assert "columns:" in out[4]

"""Pictures in a web UI that serves other machines, through the app served over HTTP (``gradio_client``), as whoever
reaches the page meets them: a row's picture outside the UI's folders is never read (no thumbnail, no plan, no
start, no resume, no training) and is refused with one text whatever is there; a picture bomb inside them is one
line in the error box, never "Unexpected error"."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import yaml

from finetuner.data import scope
from finetuner.data.picture_files import FLOOR_PIXELS
from tests.conftest import HANG_GUARD_S, outside_picture_refs, ui_client, write_bomb_png, write_picture_places
from ui import views

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "data" / "demo_model")
#: what the UI says of every picture outside its folders, but for the row's own reference
REFUSAL = "is not in a folder this UI reads pictures from"


def chat_rows(pictures: list[str]) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": "<image>What colour is it?"},
                                            {"role": "assistant", "content": "Green."}], "images": [p]}) + "\n"
                   for p in pictures)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``finetuner ui --data-dir MINE`` served over HTTP (the folders of ``--host 0.0.0.0`` and ``mine``): a green
    picture and the 30000 x 30000 bomb in ``mine``; outside every folder of the UI a red picture, a folder named
    like one, and a link in ``mine`` to the red one."""
    base = tmp_path_factory.mktemp("ui_pictures")
    mine, outside = write_picture_places(base)
    write_bomb_png(mine / "bomb.png", 30000, 30000)
    with ui_client(base, data_dirs=[mine]) as c:
        c.mine, c.outside = mine, outside
        yield c


def upload(client, folder: Path, name: str, text: str) -> str:
    """``text`` uploaded as the file ``name`` through the Data tab's upload; the path the UI stored it at."""
    from gradio_client import handle_file

    src = folder / name
    src.write_text(text, encoding="utf-8")
    update, _ = client.predict(handle_file(str(src)), api_name="/upload_data")
    return update["value"]


def test_a_served_ui_never_reads_a_picture_outside_its_folders(served, tmp_path):
    """An uploaded file whose second row names a picture outside the UI's folders, in each way a row can (absolute,
    file://, ../, a link) and in each state the file can be in (there, missing, a folder, under a file): the Data tab
    shows the same page for every one of them but for the row's own words (one refusal: nothing tells a missing file
    from one that is there), and the thumbnail of the first row's picture only; the plan says the same; Start is
    refused before anything runs."""
    secret = served.outside / "secret.png"
    refs = outside_picture_refs(served.mine, served.outside)
    pages = {}
    for i, (way, ref) in enumerate(refs.items()):
        stored = upload(served, tmp_path, f"rows{i}.jsonl", chat_rows([str(served.mine / "ok.png")] * 3 + [ref]))
        summary, _tokens, _hist, pictures = served.predict(MODEL, stored, 64, api_name="/analyse_data")
        assert REFUSAL in summary, (way, summary)
        shown = html.escape(repr(ref.removeprefix("file://")))  # file:// is read as a path
        pages[way] = (summary.replace(stored, "FILE").replace(shown, "REF"), pictures["value"].replace(stored, "FILE"))
    assert len(set(pages.values())) == 1, pages  # one page, whatever is outside
    summary, thumbs = pages["there"]
    assert "**1 row(s) cannot be used**, the first: FILE, line 4: picture REF is not in a folder" in summary
    assert "Unexpected error" not in summary and "not found" not in summary and "cannot be read" not in summary
    green = f"<img src='{views.thumbnail_src(str(served.mine / 'ok.png'))}'"
    assert thumbs.count("<img ") == 3 == thumbs.count(green)  # the first three rows' own picture, and nothing else

    stored = upload(served, tmp_path, "out.jsonl", chat_rows([str(served.mine / "ok.png"), str(secret)]))
    plan = served.predict(MODEL, "cpu", stored, 64, 0, "auto", "auto", api_name="/plan")
    assert REFUSAL in plan[0] and yaml.safe_load(plan[4])["data"]["path"] == stored
    runs = served.base / "runs"
    _pick, _table, msg = served.predict(plan[4], "cpu", stored, True, api_name="/start_training")
    assert msg.startswith('<div class="ft-error"') and f"Not started: {stored}, line 2: picture {str(secret)!r} {REFUSAL}" in msg
    assert not any(p for p in runs.iterdir() if not p.name.startswith("."))  # nothing started


def test_a_data_file_outside_a_served_uis_folders_is_one_refusal_whatever_is_there(served):
    """The Data file box, the same way: a file outside that is there, one that is not (where the command line would
    list the near matches in its folder), a folder, a path under a file: one text but for the name typed."""
    (served.outside / "notes.jsonl").write_text(chat_rows([str(served.outside / "secret.png")]), encoding="utf-8")
    typed = [str(served.outside / n) for n in ("notes.jsonl", "note.jsonl", "folder.png", "notes.jsonl/x.jsonl")]
    typed.append("../" * 12 + typed[0].lstrip("/"))
    shown = {served.predict(MODEL, name, 64, api_name="/analyse_data")[0].replace(name, "NAME") for name in typed}
    assert shown == {'<div class="ft-error" role="alert">✕ Data file NAME: this UI reads data files only from data, '
                     f'{served.base / "uploads"}, {served.base / "runs"}, {served.mine}.\nUpload the file, or start the UI '
                     'with --data-dir FOLDER for a folder of yours (finetuner ui --help).</div>'}


def test_a_picture_bomb_in_a_served_ui_is_one_line_in_its_error_box(served, tmp_path, tiny_vlm_dir):
    """The 110 KB PNG of 30000 x 30000 in a folder the UI reads: the Data tab (with the tiny LLaVA, whose processor
    counts the picture's tokens, and with a text model, where only the thumbnail opens it) and the plan show one
    line naming it and its size in the error box, not "Unexpected error"."""
    import shutil

    bomb = served.mine / "bomb.png"
    stored = upload(served, tmp_path, "bomb.jsonl", chat_rows([str(bomb)]))
    vlm = served.mine / "tiny_vlm"  # a served UI reads models only in its folders too (tests/ui/test_ui_scope.py)
    if not vlm.is_dir():
        shutil.copytree(tiny_vlm_dir, vlm)
    for model, limit in ((str(vlm), FLOOR_PIXELS), (MODEL, 8192 * 8192)):
        summary, *_ = served.predict(model, stored, 64, api_name="/analyse_data")
        assert re.fullmatch(rf'<div class="ft-error" role="alert">✕ picture {re.escape(str(bomb))} is 30,000 x 30,000 '
                            rf"pixels; the most finetuner decodes is {limit:,} pixels.\nMake it smaller[^\n]*</div>",
                            summary), summary
    plan = served.predict(str(vlm), "cpu", stored, 64, 0, "auto", "auto", api_name="/plan")
    assert "is 30,000 x 30,000 pixels" in plan[0] and "Unexpected error" not in plan[0]


def test_resume_and_the_jobs_the_ui_starts_read_no_picture_outside_its_folders(served, tmp_path, monkeypatch):
    """Resume checks a run's data as Start does; and a job started within the UI's folders inherits them
    (finetuner.data.scope.ENV): a real training process refuses the outside picture itself, one line in its error."""
    from finetuner.config.recipe import Recipe
    from finetuner.runs import jobs
    from finetuner.runs.jobs import RunStatus
    from ui import handlers as ui_handlers
    from ui.handlers import Handlers

    secret = served.outside / "secret.png"
    data = served.mine / "resume.jsonl"
    data.write_text(chat_rows([str(served.mine / "ok.png"), str(secret)]), encoding="utf-8")
    h = Handlers(tmp_path / "runs", tmp_path / "uploads", data_dirs=[served.mine])
    recipe = Recipe.from_dict({"name": "stopped", "model": {"name": MODEL}, "data": {"path": str(data), "max_seq_len": 64},
                               "training": {"max_steps": 2}})
    run = h.runs / "stopped"
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)  # a run stopped after its first step
    recipe.save(run / "recipe.yaml")
    monkeypatch.setattr(ui_handlers.jobs, "run_status", lambda *a, **k: RunStatus(str(run), "stopped", "stopped", step=1, max_steps=2))
    started = []
    monkeypatch.setattr(ui_handlers.jobs, "start_job", lambda *a, **k: started.append(k))
    refused = " ".join(map(str, h.on_resume("stopped", False)))
    assert f"Not started: {data}, line 2: picture {str(secret)!r} {REFUSAL}" in refused and started == []
    monkeypatch.undo()
    # what the check before starting does not see (a file changed since), the job itself refuses
    with scope.within(h.scope):
        job = jobs.start_job(recipe.model_copy(update={"name": "inherits"}), runs_dir=h.runs)
    assert jobs.wait_job(job, HANG_GUARD_S)
    st = jobs.run_status(job.run_dir, h.runs)
    assert st.state == "error" and f"line 2: picture {str(secret)!r} {REFUSAL}" in st.error, st.error

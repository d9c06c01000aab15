"""In a served web UI's folders (finetuner.data.scope): a picture a row names outside them is one refusal whatever is
there, decided before anything outside is looked at; the command line reads pictures where you say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetuner.data import scope
from finetuner.data.formats import FileExamples, PictureRefused
from tests.conftest import outside_picture_refs, write_picture_places


def write_rows(path: Path, pictures: list[str]) -> Path:
    rows = [{"messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "Green."}],
             "images": [p]} for p in pictures]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def places(tmp_path) -> dict[str, Path]:
    mine, outside = write_picture_places(tmp_path)
    return {"mine": mine, "outside": outside}


def test_outside_the_uis_folders_a_picture_is_one_refusal_whatever_is_there(places):
    """Within a scope every way out (absolute, file://, ../, a link) and every state of what is there (present,
    missing, a folder, under a file) gives the same text but for the row's own reference: nothing tells them apart.
    A path that only passes outside on its text (``outside/none/../../mine/ok.png``) is folded before anything on
    disk is asked, and read. Without a scope (the command line) the same rows read the outside picture."""
    refs = outside_picture_refs(places["mine"], places["outside"])
    data = write_rows(places["mine"] / "rows.jsonl", ["ok.png", *refs.values(),
                                                       str(places["outside"] / "none" / ".." / ".." / "mine" / "ok.png")])
    within = scope.ReadScope.of([places["mine"]], ["mine"])
    with scope.within(within):
        src = FileExamples(str(data))
        read = list(src)
    assert [ex["images"] for ex in read] == [[str(places["mine"] / "ok.png")]] * 2
    assert all(isinstance(b, PictureRefused) for b in src.bad) and len(src.bad) == len(refs)
    texts = {str(b).split(": ", 1)[1].replace(repr(ref.removeprefix("file://")), "REF")  # file:// read as a path
             for b, ref in zip(src.bad, refs.values())}
    assert texts == {"picture REF is not in a folder this UI reads pictures from (mine; finetuner ui --data-dir FOLDER "
                     "adds one)."}
    for way in ("../", "a link out"):  # nothing found on the way is said: only the row's own words
        assert str(places["outside"]) not in str(src.bad[list(refs).index(way)])
    via = places["mine"].parent / "via"  # the UI's folder given through a link: its paths are read as written
    via.symlink_to(places["mine"])
    with scope.within(scope.ReadScope.of([via])):
        assert [ex["images"] for ex in FileExamples(str(write_rows(via / "via.jsonl", [str(via / "ok.png")])))] == [
            [str(places["mine"] / "ok.png")]]
    # the command line reads pictures where you say
    cli = FileExamples(str(data))
    read = [Path(ex["images"][0]).resolve() for ex in cli]
    assert read == [places["mine"] / "ok.png", *[places["outside"] / "secret.png"] * 5]
    assert len(cli.bad) == 4 and all(" not found (looked for " in str(b) for b in cli.bad)  # missing there, as the OS says

"""finetuner's caches are this user's own (finetuner.cachedir): issue 66's breaks replayed with the real mechanisms.

The audit found every cache trusted whoever owned it: tokenized data planted under a run's key were trained on
(60 rows where the profile said 300), a planted speed file changed the estimate, and the default folders were
0755 with 0644 files. Here a cache folder of another user (uid 65534, a real second account: needs root, as CI
runs) or one others can write is refused in one line before anything in it is read; an entry that is not what
its key says is rebuilt and the run says so; new folders are 0700 and files 0600. (The chat history's link:
tests/infer/test_chat_eval.py.)"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from finetuner.cachedir import CacheRefused, cache_folder, write_json_entry
from tests.conftest import REPO, alpaca_rows, cli_in_process, run_cli, write_recipe

NOBODY = 65534


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user (uid 65534) needs root (CI runs as root)")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A fresh cache folder (``$FINETUNER_CACHE_DIR``), not made yet."""
    d = tmp_path / "cache"
    monkeypatch.setenv("FINETUNER_CACHE_DIR", str(d))
    return d


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(os.lstat(root).st_mode)}
    for p in sorted(root.rglob("*")):
        out[p.relative_to(root).as_posix()] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def _run(recipe_dict: dict, tmp_path: Path, data: Path, name: str, cli=cli_in_process):
    recipe = dict(recipe_dict, output_dir=str(tmp_path / name))
    recipe["data"] = {**recipe["data"], "path": str(data), "val_size": 10}
    recipe["training"] = {**recipe["training"], "max_steps": 1}
    path = write_recipe(tmp_path / f"{name}.yaml", recipe)
    p = cli("run", str(path), "--quiet")
    return p, tmp_path / name


def _data(tmp_path: Path, n: int) -> Path:
    f = tmp_path / f"rows-{n}.json"
    f.write_text(json.dumps(alpaca_rows(n)), encoding="utf-8")
    return f


def test_new_cache_folders_are_0700_and_their_files_0600(recipe_dict, tmp_path, cache):
    """A run fills the tokenized-data cache and the memo of weight hashes; the calibration is written as `finetuner
    gpus --calibrate` writes it: every folder 0700, every file 0600 (the audit: 0755 and 0644, readable by all)."""
    from finetuner.planning import calibrate

    old_umask = os.umask(0o022)  # the usual umask, which made them 0755 and 0644
    try:
        p, _ = _run(recipe_dict, tmp_path, _data(tmp_path, 40), "run")
        assert p.returncode == 0, p.stderr
        speed = calibrate.load(REPO / "tests" / "planning" / "speed_cpu.json")
        calibrate.save(speed, calibrate.cache_file("cpu-test"))
    finally:
        os.umask(old_umask)
    modes = _modes(cache)
    assert any(k.startswith("tokenized/") and k.endswith(".arrow") for k in modes), sorted(modes)
    assert "speed" in modes
    folders = {k: m for k, m in modes.items() if (cache / k).is_dir()}
    files = {k: m for k, m in modes.items() if not (cache / k).is_dir()}
    assert set(folders.values()) == {0o700}, folders
    assert set(files.values()) == {0o600}, files


def test_an_older_folder_readable_by_others_is_made_private(cache):
    """A cache folder an older finetuner made 0755 (this user's, nobody else can write it) is made 0700 on use."""
    (cache / "speed").mkdir(parents=True, mode=0o755)
    cache.chmod(0o755)
    (cache / "speed").chmod(0o755)
    assert cache_folder("speed") == cache / "speed"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and stat.S_IMODE((cache / "speed").stat().st_mode) == 0o700


def _plant_tokenized(cache: Path) -> Path:
    """A tokenized-data entry someone else planted under some run's key (60 rows of theirs)."""
    entry = cache / "tokenized" / ("0" * 32)
    entry.mkdir(parents=True)
    (entry / "meta.json").write_text(json.dumps({"has_val": False, "stats": {"rows": 60}}), encoding="utf-8")
    return entry


def _expose(how: str, cache: Path) -> tuple[Path, str]:
    """Make the cache (or its tokenized folder) one that someone else could have written into: the folder the
    refusal names, and its words for why."""
    _plant_tokenized(cache)
    if how == "root 0777":
        cache.chmod(0o777)
        return cache, r"it is writable by group or others \(mode 0777\)"
    if how == "tokenized 0775":
        (cache / "tokenized").chmod(0o775)
        return cache / "tokenized", r"it is writable by group or others \(mode 0775\)"
    _needs_root()
    if how == "root owned by uid 65534":
        os.chown(cache, NOBODY, NOBODY)
        return cache, r"it is owned by uid 65534, not by you \(uid 0\)"
    if how == "tokenized owned by uid 65534":
        os.chown(cache / "tokenized", NOBODY, NOBODY)
        return cache / "tokenized", r"it is owned by uid 65534, not by you \(uid 0\)"
    if how == "root a link of uid 65534's":
        real = cache.with_name("theirs")
        cache.rename(real)
        cache.symlink_to(real, target_is_directory=True)
        os.lchown(cache, NOBODY, NOBODY)
        return cache, r"it is a link that is owned by uid 65534, not by you \(uid 0\)"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["root 0777", "tokenized 0775", "root owned by uid 65534", "tokenized owned by uid 65534",
                                 "root a link of uid 65534's"])
def test_a_cache_folder_someone_else_could_write_is_refused_by_the_cli_in_one_line(recipe_dict, tmp_path, cache, how):
    """`finetuner run` with a cache folder another user owns or others can write stops in one line naming the folder
    and the fix, exit 2, before anything in it is read (the planted entry is left as it was, not read and rebuilt)."""
    import re

    folder, words = _expose(how, cache)
    planted = {p: p.read_bytes() for p in (cache / "tokenized").rglob("*") if p.is_file()}
    p, run = _run(recipe_dict, tmp_path, _data(tmp_path, 40), "run")
    assert p.returncode == 2, p.stdout + p.stderr
    first = p.stderr.strip().splitlines()[0]
    assert re.match(rf"error: {re.escape(str(folder))}: {words}, so what finetuner cached there .* could have been "
                    r"planted by someone else; nothing was read from it\.$", first), p.stderr
    assert f"rm -r {folder}" in p.stderr and "FINETUNER_CACHE_DIR" in p.stderr and "Traceback" not in p.stderr
    assert {q: q.read_bytes() for q in (cache / "tokenized").rglob("*") if q.is_file()} == planted
    assert not (run / "adapter").exists()
    with pytest.raises(CacheRefused):
        cache_folder("tokenized")


def test_a_planted_tokenized_entry_under_the_runs_key_is_never_trained_on(recipe_dict, tmp_path, cache):
    """The audit's break: another run's 60 tokenized rows put under the key of a run of 300 rows were trained on
    (60 rows where the profile said 300). Planted as a copy (its meta.json names its own key) and re-keyed with a
    valid header (a planter who knows the format), the entry is rebuilt: the run trains on its own 300 rows and says
    the entry was rebuilt and why."""
    small, big = _data(tmp_path, 60), _data(tmp_path, 300)
    p, _ = _run(recipe_dict, tmp_path, small, "small")
    assert p.returncode == 0, p.stderr
    (small_entry,) = (cache / "tokenized").iterdir()
    p, first = _run(recipe_dict, tmp_path, big, "big")
    assert p.returncode == 0, p.stderr
    assert json.loads((first / "metrics.json").read_text())["data"]["train_examples"] == 290
    (big_entry,) = set((cache / "tokenized").iterdir()) - {small_entry}

    # 1. the 60-row entry copied under the 300-row run's key, as the audit did
    shutil.rmtree(big_entry)
    shutil.copytree(small_entry, big_entry)
    p, run = _run(recipe_dict, tmp_path, big, "copied", cli=run_cli)
    assert p.returncode == 0, p.stderr
    data = json.loads((run / "metrics.json").read_text())["data"]
    assert (data["rows"], data["train_examples"], data["val_examples"]) == (300, 290, 10)
    assert data["cache"] == "rebuilt" and data["cache_note"] == "it was written for another key"
    assert f"WARNING: The tokenized-data cache entry {big_entry} is not used (it was written for another key)" in p.stderr

    # 2. re-keyed with a header that holds: the files match, but the rows are not the data file's
    shutil.rmtree(big_entry)
    shutil.copytree(small_entry, big_entry)
    meta = json.loads((big_entry / "meta.json").read_text().split("\n", 1)[1])
    write_json_entry(big_entry / "meta.json", big_entry.name, meta)
    p, run = _run(recipe_dict, tmp_path, big, "rekeyed")
    assert p.returncode == 0, p.stderr
    data = json.loads((run / "metrics.json").read_text())["data"]
    assert (data["rows"], data["train_examples"], data["cache"]) == (300, 290, "rebuilt")
    assert data["cache_note"] == "it was made from 60 rows where the data file has 300"

    # 3. the rebuilt entry is the run's own: the next run is a hit of 290 training rows
    p, run = _run(recipe_dict, tmp_path, big, "again")
    data = json.loads((run / "metrics.json").read_text())["data"]
    assert (data["cache"], data["cache_note"], data["train_examples"]) == ("hit", None, 290)


def test_an_entry_whose_files_changed_is_rebuilt(recipe_dict, tmp_path, cache):
    """A file of an entry changed after finetuner wrote it (a data set's arrow file replaced): its SHA-256 no
    longer matches meta.json's list, and the entry is rebuilt."""
    data = _data(tmp_path, 40)
    assert _run(recipe_dict, tmp_path, data, "first")[0].returncode == 0
    (entry,) = (cache / "tokenized").iterdir()
    arrow = next((entry / "train").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-8] + b"\0" * 8)
    p, run = _run(recipe_dict, tmp_path, data, "second")
    assert p.returncode == 0, p.stderr
    got = json.loads((run / "metrics.json").read_text())["data"]
    assert got["cache"] == "rebuilt" and "its files are not the ones its meta.json lists" in got["cache_note"]


def test_a_planted_speed_file_never_changes_the_estimate(tmp_path, cache, monkeypatch):
    """The audit's break: a speed file planted under this machine's calibration name made the estimate 4x faster
    (15 s -> 3.6 s a step). Planted as the audit did (the calibration's JSON with its matmul rates x4), it fails its
    check: the speed the plan uses is the one it uses with no calibration at all, and it is said; a calibration
    finetuner wrote is used as written."""
    from finetuner.config.hardware import cpu_profile
    from finetuner.planning import calibrate

    monkeypatch.delenv(calibrate.SPEED_FILE_ENV, raising=False)
    cpu = cpu_profile()
    unmeasured = calibrate.speed_for(cpu, calibrate=False)
    ours = calibrate.load(REPO / "tests" / "planning" / "speed_cpu.json")
    path = calibrate.cache_file(calibrate.device_key()[1])

    planted = ours.to_dict()
    planted["matmul_flops"] = {dt: [[w, r * 4] for w, r in rows] for dt, rows in planted["matmul_flops"].items()}
    path.write_text(json.dumps(planted), encoding="utf-8")
    assert calibrate.speed_for(cpu, calibrate=False) == unmeasured
    assert calibrate.place()["cached"] is False

    calibrate.save(ours, path)  # the file as finetuner writes it: used
    assert calibrate.speed_for(cpu, calibrate=False) == ours
    head, body = path.read_text(encoding="utf-8").split("\n", 1)
    path.write_text(head + "\n" + body.replace(str(ours.to_dict()["bandwidth_bytes_per_s"]),
                                               str(ours.to_dict()["bandwidth_bytes_per_s"] * 4)), encoding="utf-8")
    assert calibrate.speed_for(cpu, calibrate=False) == unmeasured  # edited after: its SHA-256 fails

    link = tmp_path / "elsewhere.json"  # a link to a calibration elsewhere is not followed
    calibrate.save(ours, link)
    path.unlink()
    path.symlink_to(link)
    assert calibrate.speed_for(cpu, calibrate=False) == unmeasured


def test_estimate_refuses_a_speed_folder_others_can_write_in_one_line(tmp_path, cache, recipe_dict, monkeypatch):
    """`finetuner estimate` on the CPU with no $FINETUNER_SPEED_FILE reads the calibration cache: with its folder
    writable by others (a planted file in it) it stops in one line, exit 2, instead of using or measuring it."""
    from finetuner.planning import calibrate

    monkeypatch.delenv(calibrate.SPEED_FILE_ENV, raising=False)
    speed = cache_folder("speed")
    (speed / "planted.json").write_text("{}", encoding="utf-8")
    speed.chmod(0o777)
    recipe = write_recipe(tmp_path / "r.yaml", recipe_dict)
    p = cli_in_process("estimate", str(recipe))
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines()[0].startswith(f"error: {speed}: it is writable by group or others (mode 0777)")
    assert "Traceback" not in p.stderr


#: the uses of cache_root() that open nothing: a path said in a message or shown (each read and write of these
#: caches goes through cache_folder first)
NAMING_ONLY = {
    "finetuner/cachedir.py": "cache_folder itself",
    "finetuner/model/fingerprint.py": "the warning when the memo cannot be written",
    "finetuner/planning/calibrate.py": "place(): the folder `finetuner gpus` shows",
    "finetuner/data/replay.py": "cache_path(): the file's name (read_cache and write_cache open the folder)",
    "finetuner/data/cache.py": "store(): the entry's name for its warning when the folder cannot be made",
}


def test_every_cache_opens_its_folder_through_cachedir():
    """No module reaches a cache folder but through finetuner.cachedir.cache_folder (private or refused): every other
    call of cache_root() in finetuner, ui and scripts only names a path (NAMING_ONLY says where and why)."""
    import ast

    found = {}
    for pkg in ("finetuner", "ui", "scripts"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            calls = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "cache_root"]
            if calls and rel != "finetuner/fileio.py":
                found[rel] = len(calls)
    assert set(found) == set(NAMING_ONLY), found
    assert all(n == 1 for n in found.values()), found

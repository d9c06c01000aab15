"""What the web UI keeps to itself (issue 23): its own private temp folder, whose files only it
serves and where a planted link is never followed; no public share link whatever the environment
says; chat in two sessions with two runs at once; Stop never signals a process that merely has a
stale job's pid; uploads bounded, with a refusal that says what to do."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import gradio as gr
import pytest

from tests.conftest import demo_run_folder, free_port, HANG_GUARD_S
from finetuner.config.recipe import Recipe, readable_yaml
from finetuner.runs import jobs
from ui.app import build_app, launch
from ui.handlers import Handlers

REPO = Path(__file__).resolve().parents[2]
DEMO = {"name": "mine", "model": {"name": str(REPO / "data" / "demo_model")},
        "data": {"path": str(REPO / "data" / "alpaca_sample.json")}}


@pytest.fixture
def own_tmp(tmp_path, monkeypatch) -> Path:
    """The system's temp folder is a fresh one for this test (where the old fixed folder was)."""
    t = tmp_path / "systmp"
    t.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(t))
    return t


def _http_status(url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def _download(h: Handlers) -> tuple[str, str]:
    """The recipe download the Plan tab's check makes of the DEMO recipe, and its verdict."""
    out = h.on_check_yaml(readable_yaml(Recipe.from_dict(DEMO)), "cpu")
    return out[2], out[-1]


# --------------------------------------------------------------------------- item 3: the temp folder
def test_each_ui_instance_has_a_private_temp_folder_of_its_own(own_tmp):
    a = build_app(own_tmp / "runs-a", own_tmp / "up-a")
    b = build_app(own_tmp / "runs-b", own_tmp / "up-b")
    assert a.temp_dir != b.temp_dir
    for app in (a, b):
        st = os.lstat(app.temp_dir)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert app.temp_dir.parent == own_tmp and app.temp_dir.name.startswith("finetuner-ui-")
    dl, checked = _download(a.handlers)
    assert checked.startswith("✓") and Path(dl).parent == a.temp_dir  # the recipe download is in a's own folder
    assert not (own_tmp / "finetuner-ui").exists()  # the shared fixed folder is gone


def test_the_temp_folder_goes_when_the_ui_process_exits(tmp_path):
    code = ("import sys; from ui.app import build_app; a = build_app(sys.argv[1], sys.argv[2]); "
            "print(a.temp_dir); (a.temp_dir / 'x.yaml').write_text('x')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "runs"), str(tmp_path / "up")],
                       capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    folder = Path(r.stdout.strip().splitlines()[-1])
    assert folder.name.startswith("finetuner-ui-") and not folder.exists()


def test_a_planted_link_is_never_followed(own_tmp, tmp_path):
    victim = tmp_path / "victim_file.txt"
    victim.write_text("precious\n", encoding="utf-8")
    future = time.time() + 3600  # newer than any adapter: a link taken for an up-to-date zip would be served
    os.utime(victim, (future, future))
    old = own_tmp / "finetuner-ui"  # the old fixed folder, made first by someone else, links planted in it
    (old / "adapters").mkdir(parents=True)
    (old / "mine.yaml").symlink_to(victim)
    runs = tmp_path / "runs"
    run = demo_run_folder(runs, "zipme")  # a run with an adapter folder
    h = Handlers(runs, tmp_path / "uploads")
    # links planted in the instance's own folder too, where its recipe and zip go
    (h.temp_dir / "mine.yaml").symlink_to(victim)
    import hashlib

    zip_dir = h.temp_dir / "adapters" / hashlib.sha1(str(run.resolve()).encode()).hexdigest()[:12]
    zip_dir.mkdir(parents=True)
    (zip_dir / "zipme-adapter.zip").symlink_to(victim)
    (old / "adapters" / "zipme-adapter.zip").symlink_to(victim)

    text = readable_yaml(Recipe.from_dict(DEMO))
    dl, checked = _download(h)
    assert checked.startswith("✓")
    archive = h.adapter_zip("zipme")

    assert victim.read_text(encoding="utf-8") == "precious\n"  # never written through a link
    for written in (Path(dl), archive):
        assert not written.is_symlink() and written.parent.is_relative_to(h.temp_dir)
    assert Path(dl).read_text(encoding="utf-8") == text
    with zipfile.ZipFile(archive) as z:  # a real zip of the adapter, not the victim
        assert z.namelist() == ["adapter_config.json"]


@pytest.fixture
def two_servers(own_tmp, tmp_path, monkeypatch):
    """Two UIs served as ``finetuner ui`` serves one (ui.app.launch), in this process; the first
    takes uploads up to 1 MiB."""
    monkeypatch.delenv("GRADIO_TEMP_DIR", raising=False)  # each launch sets its own; put back afterwards
    apps = []
    try:
        for name, limit in (("a", 2**20), ("b", None)):
            port = free_port()
            app = launch(runs_dir=tmp_path / f"runs-{name}", upload_dir=tmp_path / f"up-{name}", port=port,
                         block=False, quiet=True, max_upload_bytes=limit)
            app.url = f"http://127.0.0.1:{port}"
            app.cache = Path(app.GRADIO_CACHE)  # where gradio keeps this app's uploads and handed-out files
            apps.append(app)
        yield apps
    finally:
        for app in apps:
            app.close()


def test_an_instance_serves_its_own_files_only(two_servers):
    a, b = two_servers
    dl, checked = _download(a.handlers)
    assert checked.startswith("✓") and Path(dl).parent == a.temp_dir
    status, body = _http_status(f"{a.url}/gradio_api/file={dl}")
    assert status == 200 and "name: mine" in body  # a serves its own folder
    status, _ = _http_status(f"{b.url}/gradio_api/file={dl}")
    assert status in (403, 404)  # b does not serve a's
    other = b.temp_dir / "b-only.yaml"
    other.write_text("name: b\n", encoding="utf-8")
    assert _http_status(f"{a.url}/gradio_api/file={other}")[0] in (403, 404)
    assert _http_status(f"{b.url}/gradio_api/file={other}")[0] == 200
    assert b.allowed_paths == [str(b.temp_dir)]


def test_an_upload_is_kept_in_its_instances_own_cache_and_served_by_it_only(two_servers):
    a, b = two_servers
    boundary = "finetunerboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"mine.jsonl\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + b'{"text": "private"}\n' + f"\r\n--{boundary}--\r\n".encode()
    status, text = _http_status(f"{a.url}/gradio_api/upload", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert status == 200
    stored = Path(json.loads(text)[0])
    assert _http_status(f"{a.url}/gradio_api/file={stored}")[0] == 200
    assert _http_status(f"{b.url}/gradio_api/file={stored}")[0] in (403, 404)
    assert stored.is_relative_to(a.cache) and a.cache != b.cache  # not the gradio folder every app shares
    assert a.cache.parent == Path(tempfile.gettempdir()) and stat.S_IMODE(os.lstat(a.cache).st_mode) == 0o700


# --------------------------------------------------------------------------- item 5: share
def test_gradio_share_in_the_environment_is_ignored(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kw: seen.update(kw))
    monkeypatch.setenv("GRADIO_SHARE", "True")
    monkeypatch.setenv("GRADIO_ALLOWED_PATHS", "/")
    app = launch(runs_dir=tmp_path / "runs", upload_dir=tmp_path / "up", block=False)
    assert seen["share"] is False and seen["server_name"] == "127.0.0.1"
    assert seen["allowed_paths"] == [str(app.temp_dir)]  # given, so GRADIO_ALLOWED_PATHS is not read
    assert seen["max_file_size"] == 512 * 2**20
    assert "warning: GRADIO_SHARE is set; ignored: finetuner ui never makes a public share link" in capsys.readouterr().err
    monkeypatch.delenv("GRADIO_SHARE")
    launch(runs_dir=tmp_path / "runs", upload_dir=tmp_path / "up", host="0.0.0.0", block=False)
    assert seen["share"] is False and seen["server_name"] == "0.0.0.0"
    assert "GRADIO_SHARE" not in capsys.readouterr().err


# --------------------------------------------------------------------------- item 7: chat
def test_two_sessions_chat_with_two_runs_at_once(tmp_path, monkeypatch):
    """Session one has loaded run-a's model and is about to send its message when session two asks
    run-b something (the moment is pinned with events, not timing): both are answered."""
    import threading

    from finetuner.infer.chat_worker import ChatWorker

    runs = tmp_path / "runs"
    for name in ("run-a", "run-b"):
        demo_run_folder(runs, name, adapter=True)
    h = Handlers(runs, tmp_path / "uploads")
    one_loaded, two_done = threading.Event(), threading.Event()
    real_loading = ChatWorker.loading

    def loading(worker, every=1.0):  # the real loading; then, the first time run-a's model is loaded, session two goes
        yield from real_loading(worker, every)
        if worker.source.endswith("run-a") and not one_loaded.is_set():
            one_loaded.set()
            assert two_done.wait(HANG_GUARD_S)

    monkeypatch.setattr(ChatWorker, "loading", loading)
    settings = (True, 8, 0.0, 1.0, None)  # both lanes (the fine-tune, then the base model), 8 tokens, greedy
    one: list = []
    try:
        session_one = threading.Thread(target=lambda: one.extend(h.on_chat("Hello", [], [], "run-a", *settings)))
        session_one.start()
        assert one_loaded.wait(HANG_GUARD_S)
        two = list(h.on_chat("Hi there", [], [], "run-b", *settings))
        two_done.set()
        session_one.join(300)
        assert not session_one.is_alive()
        for outputs in (one[-1], two[-1]):
            _msg, tuned, base, status = outputs
            assert status.startswith("Answered in"), status
            for lane in (tuned, base):
                assert lane[-1]["role"] == "assistant" and lane[-1]["content"].strip()
        assert h.chat_pool.loaded == [str((runs / "run-a").resolve())]  # one model kept loaded once both are done
        again = list(h.on_chat("Hello", [], [], "run-a", *settings))  # and it answers again without loading
        assert again[0][3] == "Answering…" and again[-1][3].startswith("Answered in")
    finally:
        two_done.set()
        h.chat_pool.close()


# --------------------------------------------------------------------------- item 9: stale job records
def _record(runs: Path, run: Path, pid: int, **extra) -> None:
    rec = {"pid": pid, "run_dir": str(run.resolve()), "name": run.name, "device": "cpu", "started": time.time(),
           "log": str(run / "train.log"), "command": [], **extra}
    (runs / ".jobs.json").write_text(json.dumps([rec]), encoding="utf-8")


def test_stop_never_signals_a_process_that_has_a_stale_jobs_pid(tmp_path):
    runs = tmp_path / "runs"
    run = demo_run_folder(runs, "old-run")
    h = Handlers(runs, tmp_path / "uploads")
    # an unrelated process that got the ended job's pid (killed below), with Ctrl-C as in a terminal even where
    # this test runs in the background of a script (which ignores SIGINT, and its children with it)
    sleeper = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                                "print('ready', flush=True); time.sleep(3600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline() == "ready\n"
        started = jobs.process_start_time(sleeper.pid)
        assert started is not None
        _record(runs, run, sleeper.pid, proc_start=started - 7.0, command=["python", "-m", "finetuner", "run"])
        shown = h.on_stop("old-run")
        assert "old-run is not running" in shown
        _record(runs, run, sleeper.pid, command=["python", "-m", "finetuner", "run"])  # an older record: no start time
        assert "old-run is not running" in h.on_stop("old-run")
        assert jobs.stop_job(jobs.Job(sleeper.pid, str(run), run.name, "cpu", 0.0, "", [], proc_start=started - 7.0)) is False
        time.sleep(0.2)
        assert sleeper.poll() is None  # never signalled
        assert jobs.running_jobs(runs) == []  # the stale record is dropped

        _record(runs, run, sleeper.pid, proc_start=started)  # the job's own process: Stop signals it
        assert "Stopping **old-run**" in h.on_stop("old-run")
        assert sleeper.wait(timeout=HANG_GUARD_S) == -signal.SIGINT
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_a_job_started_records_its_process_start_time(long_recipe_dict, tmp_path, monkeypatch):
    gate = tmp_path / "hold"
    gate.touch()
    monkeypatch.setenv("FINETUNER_FAULT", "HOLD@1")
    monkeypatch.setenv("FINETUNER_HOLD_FILE", str(gate))
    runs = tmp_path / "runs"
    job = jobs.start_job(Recipe.from_dict(long_recipe_dict), runs_dir=runs)
    try:
        assert job.proc_start == jobs.process_start_time(job.pid)
        saved = json.loads((runs / ".jobs.json").read_text(encoding="utf-8"))
        assert saved[0]["proc_start"] == job.proc_start
        assert [j.pid for j in jobs.running_jobs(runs)] == [job.pid]
    finally:
        assert jobs.stop_job(job, runs, wait=120)


def test_a_job_asked_to_stop_while_it_starts_stops_also_from_a_ui_that_ignores_ctrl_c(long_recipe_dict, tmp_path, monkeypatch):
    """``finetuner ui &`` in a script: the UI ignores SIGINT and would pass that on to its jobs, so a stop sent
    before the job installs its own handler (while it imports) was lost and the job trained on. (CI's runner
    starts the suite like that: this test then took its whole wait and left a job behind.)"""
    gate = tmp_path / "hold"
    gate.touch()
    monkeypatch.setenv("FINETUNER_FAULT", "HOLD@1")  # a job that missed the stop holds here until the gate goes
    monkeypatch.setenv("FINETUNER_HOLD_FILE", str(gate))
    runs = tmp_path / "runs"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        job = jobs.start_job(Recipe.from_dict(long_recipe_dict), runs_dir=runs)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        assert jobs.stop_job(job, runs)  # at once: the job is still starting
        assert jobs.wait_job(job, timeout=HANG_GUARD_S)  # a lost stop: the job holds at step 1 (until the gate goes)
    finally:
        gate.unlink(missing_ok=True)
        jobs.stop_job(job, runs, wait=HANG_GUARD_S)


@pytest.fixture
def long_recipe_dict(recipe_dict):
    r = dict(recipe_dict)
    r.pop("output_dir")
    return r


# --------------------------------------------------------------------------- item 6: uploads
def test_an_upload_over_the_limit_is_refused_saying_the_limit_and_what_to_do(tmp_path):
    big = tmp_path / "big.jsonl"
    row = json.dumps({"instruction": "x" * 989, "output": "y"}) + "\n"
    assert len(row) == 1024
    big.write_text(row * 1536, encoding="utf-8")  # 1.5 MiB
    uploads = tmp_path / "uploads"
    h = Handlers(tmp_path / "runs", uploads, max_upload_bytes=2**20)
    _choices, shown = h.on_upload(str(big))
    assert "'big.jsonl' is 1.5 MiB: the UI takes uploads up to 1 MiB." in shown
    assert "type its path in the Data file box" in shown and "finetuner ui --max-upload-mb N" in shown
    assert not uploads.exists() or not any(uploads.iterdir())  # nothing stored
    assert Handlers(tmp_path / "runs", uploads).max_upload_bytes == 512 * 2**20  # the default


def test_the_server_refuses_an_upload_over_its_limit(two_servers):
    a, b = two_servers
    boundary = "finetunerboundary"

    def body(n: int) -> bytes:
        return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"d.jsonl\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + b"x" * n + f"\r\n--{boundary}--\r\n".encode()

    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    status, text = _http_status(f"{a.url}/gradio_api/upload", body(2**20 + 4096), headers)
    assert status == 413 and str(2**20) in text  # a takes 1 MiB at most: the transfer is cut off
    assert _http_status(f"{a.url}/gradio_api/upload", body(4096), headers)[0] == 200
    assert _http_status(f"{b.url}/gradio_api/upload", body(2**20 + 4096), headers)[0] == 200  # b: 512 MiB


def test_the_cli_takes_an_upload_limit_and_refuses_a_bad_one():
    from tests.conftest import run_cli

    r = run_cli("ui", "--max-upload-mb", "0")
    assert r.returncode == 2 and "--max-upload-mb 0: give a size in MiB above 0" in r.stderr
    assert "--max-upload-mb" in run_cli("ui", "--help").stdout


def test_finetuner_ui_with_gradio_share_set_serves_locally_and_caps_uploads(tmp_path):
    """``finetuner ui`` as a user starts it, with GRADIO_SHARE=True in the environment and a 1 MiB
    upload limit: one warning line, no share link, and a larger upload is cut off."""
    port = free_port()
    env = dict(os.environ, GRADIO_SHARE="True", GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    log = tmp_path / "ui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "finetuner", "ui", "--port", str(port), "--runs-dir", str(tmp_path / "runs"),
             "--upload-dir", str(tmp_path / "up"), "--max-upload-mb", "1"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + HANG_GUARD_S
        while not (_port_open(port) and _http_status(url + "/")[0] == 200):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        boundary = "finetunerboundary"
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"d.jsonl\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + b"x" * (2**20 + 1) + f"\r\n--{boundary}--\r\n".encode()
        status, _ = _http_status(url + "/gradio_api/upload", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
        assert status == 413
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_GUARD_S)
    text = log.read_text()
    assert "warning: GRADIO_SHARE is set; ignored: finetuner ui never makes a public share link" in text
    assert "gradio.live" not in text and "public URL" not in text


def test_finetuner_ui_says_its_address_once_it_serves(tmp_path):
    """The address line is printed once the port accepts connections: a user (or a script) who opens it the
    moment it appears gets the page, at the first try, with no wait and no retry."""
    port = free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetuner", "ui", "--port", str(port), "--runs-dir", str(tmp_path / "runs"),
         "--upload-dir", str(tmp_path / "up")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, text=True)
    try:
        seen = []
        for line in proc.stdout:  # the line as it appears; a server that exits ends the loop
            seen.append(line)
            if "finetuner UI on" in line:
                break
        assert seen and (f"finetuner UI on http://127.0.0.1:{port} (only your account: other users of this machine "
                         "are refused; Ctrl-C to quit)") in seen[-1], "".join(seen)
        assert _port_open(port)  # at once, one try: the port accepted connections before the line was printed
        assert _http_status(f"http://127.0.0.1:{port}/")[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=HANG_GUARD_S)


def _port_open(port: int) -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False

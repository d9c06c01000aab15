"""Who the web UI answers (issue 66, "the UI is a server"), over real HTTP as a browser or a script reaches it.

Without a password ``finetuner ui`` answers only the account that started it: a request from another account of
the machine (a child process of this test running as uid 65534, ``nobody``) is refused with 403 for the page, the
Data preview's API and uploads, while the owner's own works; where a connection's account cannot be told, only a
client with the launch's token gets in. With a password (``--auth-file``, ``FINETUNER_UI_AUTH``; never in argv),
wrong passwords lock a client out, and a client that has not logged in sees no server path or upload name.
"""

from __future__ import annotations

import argparse
import http.client
import http.cookiejar
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import HANG_GUARD_S, free_port, run_cli
from finetuner.cli.ui import AUTH_ENV, auth_from
from finetuner.errors import UserError
from ui.access import Access, LoginLimiter
from ui.app import launch

REPO = Path(__file__).resolve().parents[2]
OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="acting as another account of the machine (uid 65534) needs root (CI runs as root)")


# --------------------------------------------------------------------------- HTTP as a client makes it
def request(url: str, data: bytes | None = None, headers: dict | None = None, method: str | None = None,
            opener=None, follow: bool = True) -> tuple[int, dict, str]:
    """One HTTP request: status, headers (lower-case names), body as text."""
    req = urllib.request.Request(url, data=data, headers=headers or {}, method=method)
    op = opener or (urllib.request.build_opener() if follow else urllib.request.build_opener(_NoRedirect))
    try:
        with op.open(req, timeout=HANG_GUARD_S) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read().decode("utf-8", "replace")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def upload_body(name: str, content: bytes) -> tuple[bytes, dict]:
    boundary = "finetunerboundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"{name}\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def websocket_handshake(url: str, path: str) -> int:
    """The status of a websocket handshake on ``path`` (urllib cannot send one: it says ``Connection: close``)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
    try:
        conn.request("GET", path, headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                                           "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        return conn.getresponse().status
    finally:
        conn.close()


def preview_request(url: str, data_file: str) -> tuple[int, str]:
    """The Data tab's preview of ``data_file`` through gradio's HTTP API (``/gradio_api/call/analyse_data``):
    the status of the call, and what it returned (the server-sent events) when it was taken; the six column
    menus left as detected."""
    status, _, text = request(url + "/gradio_api/call/analyse_data",
                              json.dumps({"data": ["data/demo_model", data_file, 256] + [None] * 6}).encode(),
                              {"Content-Type": "application/json"})
    if status != 200:
        return status, text
    return status, request(url + f"/gradio_api/call/analyse_data/{json.loads(text)['event_id']}")[2]


def as_other_account(fn, *args) -> object:
    """``fn(*args)`` in a child process running as uid 65534 (another account of this machine); its
    JSON-able result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the other account, then act
        os.close(read)
        code = 0
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            assert os.getuid() == OTHER_UID
            out = json.dumps({"result": fn(*args)})
        except BaseException as e:  # noqa: BLE001  (reported to the parent, which fails)
            out, code = json.dumps({"error": repr(e)}), 1
        with os.fdopen(write, "w") as w:
            w.write(out)
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as r:
        got = json.loads(r.read() or '{"error": "no answer"}')
    os.waitpid(pid, 0)
    assert "error" not in got, got
    return got["result"]


def serve_cli(tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str, Path]:
    """``finetuner ui`` as a user starts it, in its own process, on a free port; its process, url and the
    line it printed with its address (read once it serves)."""
    port = free_port()
    log = tmp_path / "ui.log"
    full_env = dict(os.environ if env is None else env, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "finetuner", "ui", "--port", str(port), "--runs-dir", str(tmp_path / "runs"),
         "--upload-dir", str(tmp_path / "uploads"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, cwd=tmp_path, text=True)
    seen = []
    for line in proc.stdout:  # the address line is printed once the port serves; a server that exits ends it
        seen.append(line)
        if "finetuner UI on" in line:
            break
    assert seen and "finetuner UI on" in seen[-1], "".join(seen)
    return proc, f"http://127.0.0.1:{port}", seen[-1].strip()


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=HANG_GUARD_S)


# --------------------------------------------------------------------------- without a password
@needs_root
def test_another_account_of_the_machine_is_refused_the_page_the_data_preview_and_uploads(tmp_path):
    """The audit's attack: another account (uid 65534) reads the owner's 0600 file through the Data preview and
    uploads a file. Here every one of its requests is refused with 403 before gradio sees it, also one naming the
    owner's own live connection in ``X-Forwarded-For``; the owner's same requests work."""
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"instruction": "owner-only-words", "output": "private answer"}) + "\n")
    secret.chmod(0o600)
    (tmp_path / "uploads").mkdir()
    proc, url, line = serve_cli(tmp_path)
    try:
        assert "(only your account: other users of this machine are refused; Ctrl-C to quit)" in line
        # the owner: the page, the preview of the 0600 file, an upload
        assert request(url + "/")[0] == 200
        status, shown = preview_request(url, str(secret))
        assert status == 200 and "owner-only-words" in shown
        body, headers = upload_body("mine.jsonl", secret.read_bytes())
        assert request(url + "/gradio_api/upload", body, headers)[0] == 200
        owner = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=HANG_GUARD_S)
        owner.request("GET", "/config")  # a live connection of the owner's, which the other account names below
        response = owner.getresponse()
        response.read()
        assert response.status == 200
        owners_port = owner.sock.getsockname()[1]

        def attack(url: str, secret: str, owners_port: int) -> dict:
            body, headers = upload_body("evil.jsonl", b'{"text": "import os"}\n')
            return {
                "page": request(url + "/")[0],
                "config": request(url + "/config")[0],
                "api info": request(url + "/gradio_api/info")[0],
                "preview": preview_request(url, secret)[0],
                "upload": request(url + "/gradio_api/upload", body, headers)[0],
                "file route": request(url + f"/gradio_api/file={secret}")[0],
                "queue stream": request(url + "/gradio_api/queue/data?session_hash=x")[0],
                "heartbeat": request(url + "/gradio_api/heartbeat/x")[0],
                "websocket": websocket_handshake(url, "/gradio_api/queue/join"),
                "forwarded as the owner": request(url + "/config",
                                                  headers={"X-Forwarded-For": f"127.0.0.1:{owners_port}"})[0],
            }

        refused = as_other_account(attack, url, str(secret), owners_port)
        owner.close()
        assert refused == {name: 403 for name in refused}, refused
        assert not any(p.name.startswith("evil") for p in (tmp_path / "uploads").iterdir())
        assert request(url + "/")[0] == 200  # and the owner still gets in
    finally:
        stop(proc)


def test_where_a_connections_account_cannot_be_told_only_the_token_opens_the_ui(tmp_path):
    """Off Linux, or for a client whose socket is not in this machine's tables (another machine, another network
    namespace), the uid check is impossible: here the tables are a folder without them. The printed address then
    holds a token; a request without it (or with a wrong one) is refused, the address sets an HttpOnly cookie and
    drops the token from the address, and the cookie opens the page and its API."""
    tables = tmp_path / "no-tcp-tables"
    tables.mkdir()
    port = free_port()
    app = launch(runs_dir=tmp_path / "runs", upload_dir=tmp_path / "up", port=port, block=False, quiet=True,
                 access=Access(proc_net=tables))
    try:
        url = f"http://127.0.0.1:{port}"
        line = app.access.address("127.0.0.1", port)
        token = app.access.token
        assert line == (f"finetuner UI on {url}/?token={token} (only with this address's token: this system "
                        "cannot tell whose a connection is; Ctrl-C to quit)")
        assert len(token) >= 40 and token not in " ".join(os.environ.values())
        assert token not in Path("/proc/self/cmdline").read_text(errors="replace")
        body, headers = upload_body("d.jsonl", b'{"text": "x"}\n')
        for path in ("/", "/config", "/gradio_api/info", "/?token=wrong"):
            assert request(url + path)[0] == 401, path
        assert request(url + "/gradio_api/upload", body, headers)[0] == 401
        status, got, _ = request(f"{url}/?token={token}&page=", follow=False)
        assert status == 303 and got["location"] == "/?page="
        assert got["set-cookie"] == f"finetuner-ui-{port}={token}; HttpOnly; SameSite=Strict; Path=/"
        cookie = {"Cookie": f"finetuner-ui-{port}={token}"}
        assert request(url + "/", headers=cookie)[0] == 200
        assert request(url + "/config", headers=cookie)[0] == 200
        assert request(url + "/gradio_api/upload", body, {**headers, **cookie})[0] == 200
        assert request(url + "/config", headers={"Cookie": f"finetuner-ui-{port}=x{token[1:]}"})[0] == 401
    finally:
        app.close()


# --------------------------------------------------------------------------- the password
def test_a_password_on_the_command_line_is_refused_naming_the_alternatives():
    r = run_cli("ui", "--auth", "alice:s3cret")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --auth takes no password on the command line, where every account of this machine can read it: put "
        f"USER:PASS in a file only you can read and give --auth-file FILE, or set {AUTH_ENV}."]
    assert "s3cret" not in r.stderr and "--auth-file" in run_cli("ui", "--help").stdout


def test_an_auth_file_is_refused_as_ssh_refuses_a_key_others_can_read(tmp_path):
    """One line ``USER:PASS`` in a file of one's own that only one can read; each refusal is one line that
    never shows the file's text."""
    f = tmp_path / "ui-password"
    f.write_text("alice:s3cret\n")
    f.chmod(0o644)
    r = run_cli("ui", "--auth-file", str(f))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert f"others can read or change it (mode 0644): chmod 600 {f}, then start again." in r.stderr
    f.chmod(0o600)
    f.write_text("alice:s3cret\nbob:other\n")
    r = run_cli("ui", "--auth-file", str(f))
    assert r.returncode == 2 and "give one line USER:PASS (it has 2)" in r.stderr and "s3cret" not in r.stderr
    f.write_text("alice-without-a-password\n")
    r = run_cli("ui", "--auth-file", str(f))
    assert r.returncode == 2 and "give one line USER:PASS, e.g. alice:s3cret" in r.stderr
    assert "alice-without" not in r.stderr
    r = run_cli("ui", "--auth-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot read it (No such file or directory)" in r.stderr


@needs_root
def test_an_auth_file_of_another_account_is_refused(tmp_path):
    """A password file owned by someone else (who could have written it) is refused, mode 0600 or not."""
    f = tmp_path / "ui-password"
    f.write_text("alice:s3cret\n")
    f.chmod(0o600)
    os.chown(f, OTHER_UID, OTHER_UID)
    r = run_cli("ui", "--auth-file", str(f))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "s3cret" not in r.stderr
    assert f"--auth-file {f}: owned by another user (uid {OTHER_UID}): give a file of your own." in r.stderr


def test_the_lockout_doubles_up_to_an_hour():
    """A client that goes on guessing after each lockout: 10 s after the 5th wrong password, then 20, 40... and
    never more than an hour, however many it tries."""
    now = [0.0]
    limiter = LoginLimiter(clock=lambda: now[0])
    waits = []
    for _ in range(20):
        assert limiter.wait_s("c") == 0
        limiter.failed("c")
        waits.append(limiter.wait_s("c"))
        now[0] += waits[-1]
    assert waits[:4] == [0, 0, 0, 0] and waits[4:9] == [10, 20, 40, 80, 160] and waits[-1] == 3600
    assert limiter.wait_s("another client") == 0
    limiter.succeeded("c")
    assert limiter.wait_s("c") == 0


def test_the_password_from_the_environment_is_taken_out_of_it_before_any_process_starts(monkeypatch):
    """``FINETUNER_UI_AUTH`` is read and removed from the UI's environment, so the processes it starts
    (training, chat, export) never inherit it; ``--auth-file`` is taken before it."""
    monkeypatch.setenv(AUTH_ENV, "alice:pa:ss")
    assert auth_from(argparse.Namespace(auth=None, auth_file=None)) == ("alice", "pa:ss")
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ.get({AUTH_ENV!r}))"],
                           capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert child.stdout.strip() == "None"
    monkeypatch.setenv(AUTH_ENV, "nopassword")
    with pytest.raises(UserError, match=f"^{AUTH_ENV}: give one line USER:PASS"):
        auth_from(argparse.Namespace(auth=None, auth_file=None))


def _login(url: str, user: str, password: str, opener=None) -> int:
    data = urllib.parse.urlencode({"username": user, "password": password}).encode()
    return request(url + "/login", data, {"Content-Type": "application/x-www-form-urlencoded"}, opener=opener)[0]


def test_finetuner_ui_with_an_auth_file_shows_nothing_of_the_server_before_the_login(tmp_path):
    """``finetuner ui --auth-file``: the password is nowhere in the process's arguments; before logging in, no
    GET a client can make (``/``, ``/config``, ``/gradio_api/info``, the OpenAPI schema, a file route...) shows
    the checkout's path, the runs or uploads folder, or the name of a file uploaded to it; after logging in
    the page does (so the test sees them when they are there)."""
    f = tmp_path / "ui-password"
    f.write_text("alice:correct horse\n")
    f.chmod(0o600)
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    (uploads / "confidential_hikes.jsonl").write_text('{"text": "a walk"}\n')  # uploaded before this start
    proc, url, line = serve_cli(tmp_path, "--auth-file", str(f))
    try:
        assert "(password required; 5 wrong passwords lock a client out, longer each time; Ctrl-C to quit)" in line
        assert "correct horse" not in Path(f"/proc/{proc.pid}/cmdline").read_text(errors="replace")
        logged_in = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        assert _login(url, "alice", "correct horse", logged_in) == 200
        body, headers = upload_body("new_secret_notes.jsonl", b'{"text": "notes"}\n')
        status, _, sent = request(url + "/gradio_api/upload", body, headers, opener=logged_in)
        assert status == 200
        cached = json.loads(sent)[0]  # where gradio keeps the upload: a path of the server, with the file's name
        page = request(url + "/", opener=logged_in)[2] + request(url + "/config", opener=logged_in)[2]
        assert "confidential_hikes" in page and str(tmp_path) in page  # there for whoever logged in
        private = [str(REPO), str(tmp_path), "confidential_hikes", "new_secret_notes", cached]
        paths = ["/", "/?page=&deep_link=x", "/config", "/config/", "/gradio_api/info", "/gradio_api/info?all_endpoints=true",
                 "/gradio_api/openapi.json", f"/gradio_api/file={cached}", f"/gradio_api/file={uploads}/confidential_hikes.jsonl",
                 "/gradio_api/upload_progress?upload_id=x", "/gradio_api/queue/data?session_hash=x", "/gradio_api/token",
                 "/gradio_api/app_id", "/gradio_api/user", "/gradio_api/runs", "/gradio_api/run-history/records",
                 "/gradio_api/startup-events", "/manifest.json", "/theme.css", "/gradio_api/heartbeat/x", "/monitoring",
                 "/gradio_api/login_check"]
        shown = {}
        for path in paths:
            status, got, text = request(url + path)
            shown[path] = (status, [p for p in private if p in text + json.dumps(got)])
        assert {p: leaked for p, (_, leaked) in shown.items() if leaked} == {}, shown
        assert shown["/"][0] == 200 and shown["/config"][0] == 401 and shown["/gradio_api/info"][0] == 401
        assert shown[f"/gradio_api/file={cached}"][0] == 401
        assert request(url + "/gradio_api/upload", body, headers)[0] == 401  # no upload before the login
    finally:
        stop(proc)


@pytest.fixture
def password_ui(tmp_path):
    """``ui.app.launch`` with a password, as ``finetuner ui --auth-file`` serves it, whose wrong-password counts
    go by a clock the test moves (``server.now[0]``, seconds): a lockout ends when the test says, not after a wait."""
    now = [1000.0]
    port = free_port()
    app = launch(runs_dir=tmp_path / "runs", upload_dir=tmp_path / "up", port=port, block=False, quiet=True,
                 auth=("alice", "right one"), access=Access(password=True, limiter=LoginLimiter(clock=lambda: now[0])))
    app.url, app.now = f"http://127.0.0.1:{port}", now
    try:
        yield app
    finally:
        app.close()


def test_thirty_wrong_passwords_are_mostly_refused_unchecked_and_the_right_one_works_after_the_lockout(password_ui):
    """The audit sent 30 wrong passwords in 0.2 s, each one checked. Now the first 5 are checked (400) and the 25
    after them refused without being checked (429, with Retry-After), also when sent 10 at a time; the right
    password is refused too while the lockout lasts, and works once it ends. Each further wrong password doubles
    the lockout."""
    url, now, limiter = password_ui.url, password_ui.now, password_ui.access.limiter
    statuses = [_login(url, "alice", f"guess {i}") for i in range(10)]
    with ThreadPoolExecutor(10) as pool:
        statuses += list(pool.map(lambda i: _login(url, "alice", f"guess {i}"), range(10, 30)))
    assert statuses[:5] == [400] * 5 and statuses[5:] == [429] * 25
    assert limiter.refused == 25
    status, got, text = request(url + "/login", urllib.parse.urlencode({"username": "alice", "password": "right one"}).encode(),
                                {"Content-Type": "application/x-www-form-urlencoded"})
    assert status == 429 and got["retry-after"] == "10" and text.strip() == "Too many wrong passwords: try again in 10 s."
    now[0] += 10.5  # the lockout ends
    assert _login(url, "alice", "guess again") == 400  # checked: the 6th wrong password
    now[0] += 19  # locked for 20 s now
    assert _login(url, "alice", "right one") == 429
    now[0] += 1.5
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    assert _login(url, "alice", "right one", opener) == 200
    assert request(url + "/config", opener=opener)[0] == 200
    assert [_login(url, "alice", "wrong") for _ in range(5)] == [400] * 5  # a right password clears the count


@needs_root
def test_another_accounts_wrong_passwords_do_not_lock_the_owner_out(password_ui):
    """Wrong passwords are counted per account where the connection's account is known: another account of the
    machine that tries 30 is locked out, and the owner still logs in at once."""
    url = password_ui.url
    theirs = as_other_account(lambda: [_login(url, "alice", f"guess {i}") for i in range(30)])
    assert theirs[:5] == [400] * 5 and theirs[5:] == [429] * 25
    assert _login(url, "alice", "right one") == 200
    assert as_other_account(lambda: _login(url, "alice", "right one")) == 429

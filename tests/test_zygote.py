"""The tests' zygote (tests/zygote.py) gives a command what a new interpreter gives it: the same output, exit
status, working folder, arguments and environment, checked against a real subprocess of the same command; and so
does a rank of a multi-process run that it forks for tests/zygote_child.py, where signals reach the rank and the
rank ends with its stand-in."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import conftest
from tests.conftest import _ZYGOTE, run_module
from tests.zygote import differences

PROBE = '''
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "path0", sys.path[0] == os.getcwd(), "cwd", os.path.basename(os.getcwd()))
print("probe", os.environ.get("PROBE_VALUE"), "stdin", repr(sys.stdin.read()))
print("path", [p for p in sys.path[1:] if "site-packages" not in p and "python3" not in p])
print("to stderr", file=sys.stderr)
def later():
    time.sleep(0.2)
    print("thread done")
threading.Thread(target=later).start()  # waited for at exit, as an interpreter waits
atexit.register(lambda: print("atexit ran"))
what = sys.argv[1]
if what == "exit":
    sys.exit(int(sys.argv[2]))
if what == "message":
    sys.exit("a message for the user")
if what == "raise":
    raise ValueError("uncaught")
if what == "sleep":
    time.sleep(60)
'''


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "zprobe.py").write_text(PROBE, encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize("args", [("ok",), ("exit", "3"), ("message",), ("raise",)])
def test_a_command_from_the_zygote_is_what_a_new_interpreter_gives(probe, args, monkeypatch):
    monkeypatch.setenv("PROBE_VALUE", "from-the-test")  # read when the command runs: the zygote may give it
    env = {k: v for k, v in conftest._cli_env(conftest.os.environ).items() if k != "PYTHONPATH"}
    if args == ("ok",):  # the module path as PYTHONPATH gives it, not as the zygote's was
        env["PYTHONPATH"] = str(probe / "elsewhere")
    env["HF_HUB_DISABLE_TELEMETRY"] = "True"  # what gradio sets in a process that served the UI
    before = _ZYGOTE.count
    forked = run_module("zprobe", *args, cwd=probe, env=env)
    assert _ZYGOTE.count == before + 1  # it did come from the zygote
    fresh = run_module("zprobe", *args, cwd=probe, env=env, fresh=True)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout)
    # the traceback's first frames differ (runpy called from the zygote's loop); its last lines do not
    assert forked.stderr.splitlines()[-2:] == fresh.stderr.splitlines()[-2:]
    assert "probe from-the-test stdin ''" in forked.stdout and "thread done" in forked.stdout
    assert "atexit ran" in forked.stdout and "to stderr" in forked.stderr


def test_a_hung_command_is_cut_off_as_subprocess_cuts_it_off(probe):
    with pytest.raises(subprocess.TimeoutExpired):
        run_module("zprobe", "sleep", cwd=probe, env=conftest._cli_env(conftest.os.environ), timeout=2)
    assert run_module("zprobe", "ok", cwd=probe, env=conftest._cli_env(conftest.os.environ)).returncode == 0


def test_what_a_library_reads_on_import_sends_the_command_to_a_new_interpreter():
    started = {"PATH": "/bin", "HOME": "/root"}
    loaded = {**started, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}  # torch sets it when it is imported
    assert not differences(started, loaded, {**started, "FINETUNER_CACHE_DIR": "/c", "COLUMNS": "200", "MINE": "1"})
    assert not differences(started, loaded, {**loaded, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})  # read when used
    assert differences(started, loaded, {**started, "HF_HOME": "/elsewhere"}) == ["HF_HOME"]
    assert differences(started, loaded, {**started, "OMP_NUM_THREADS": "1"}) == ["OMP_NUM_THREADS"]
    assert differences(started, loaded, {**started, "TORCHINDUCTOR_CACHE_DIR": "/tmp/y"}) == ["TORCHINDUCTOR_CACHE_DIR"]
    assert differences(started, loaded, {"PATH": "/bin"}) == ["HOME"]  # HOME unset
    assert not differences(started, loaded, {**started, "PYTHONPATH": "/mine", "HF_HUB_DISABLE_TELEMETRY": "True"})


RANK_PROBE = '''
import os, sys, time
import torch
print("argv", sys.argv[1:], "cwd first", sys.path[0] == os.getcwd(), "rank", os.environ.get("RANK"))
print("stdin", repr(sys.stdin.read()), "threads", torch.get_num_threads(), "deepspeed", "deepspeed" in sys.modules)
print("to stderr", file=sys.stderr)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "sleep":
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
'''


def _rank(probe: Path, *args: str, zygote: bool = True, wait: bool = True):
    """``python -I tests/zygote_child.py -u -P -m zrank ARGS`` as torchrun starts a rank of a test's run: its own
    environment (the rank's variables, one thread, a ``sitecustomize`` on the path), stdin and output files."""
    env = {**os.environ, **_ZYGOTE.children_environment(), "RANK": "1", "OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "t",
           "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join([str(conftest.REPO), str(probe)])}
    if not zygote:
        del env["FINETUNER_TESTS_ZYGOTE_SOCKET"]
    (probe / "in.txt").write_text("from torchrun", encoding="utf-8")
    cmd = [sys.executable, *shlex.split(env["FINETUNER_PYTHON"])[1:], "-u", "-P", "-m", "zrank", *args]
    with open(probe / "in.txt", "rb") as stdin:
        proc = subprocess.Popen(cmd, cwd=probe, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        out, err = proc.communicate(timeout=conftest.HANG_GUARD_S)
        return proc.returncode, out, err
    return proc


@pytest.fixture
def rank_probe(tmp_path):
    (tmp_path / "zrank.py").write_text(RANK_PROBE, encoding="utf-8")
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None\n", encoding="utf-8")
    assert run_module("platform").returncode == 0  # the zygote is ready
    return tmp_path


@pytest.mark.parametrize("args", [("ok",), ("exit", "3")])
def test_a_rank_from_the_zygote_is_what_a_new_interpreter_gives(rank_probe, args):
    before = (_ZYGOTE.cpu(), _ZYGOTE.children_forked)[1]
    forked = _rank(rank_probe, *args)
    assert (_ZYGOTE.cpu(), _ZYGOTE.children_forked)[1] == before + 1  # it did come from the zygote
    fresh = _rank(rank_probe, *args, zygote=False)
    assert forked == fresh
    assert "cwd first False rank 1" in forked[1] and "stdin 'from torchrun' threads 1 deepspeed True" in forked[1]


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _started_rank(probe: Path) -> tuple[subprocess.Popen, int]:
    proc = _rank(probe, "sleep", str(probe / "pid"), wait=False)
    deadline = time.monotonic() + 120
    while not (probe / "pid").exists() or not (probe / "pid").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    pid = int((probe / "pid").read_text())
    assert pid != proc.pid  # forked from the zygote, not this stand-in
    return proc, pid


def test_a_signal_to_the_stand_in_reaches_the_rank_and_its_status_comes_back(rank_probe):
    proc, pid = _started_rank(rank_probe)
    proc.send_signal(signal.SIGTERM)  # what torchrun sends its workers when it stops them
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert _gone(pid)


def test_a_killed_stand_in_takes_its_rank_with_it(rank_probe):
    proc, pid = _started_rank(rank_probe)
    proc.kill()  # torchrun's last resort, or torchrun itself gone (the stand-in dies with it)
    proc.wait(timeout=60)
    assert _gone(pid)


def test_a_python_c_child_from_the_zygote_is_what_a_new_interpreter_gives(rank_probe):
    """``python -c CODE ARGS`` (the validation scripts' measurements): argv, module path, main module, status."""
    code = ("import os, sys; import zrank_helper; print(sys.argv, repr(sys.path[0]), __name__, zrank_helper.X, "
            "os.path.basename(os.getcwd())); sys.exit(4)")
    (rank_probe / "zrank_helper.py").write_text("X = 'found in the working folder'\n", encoding="utf-8")
    env = {**os.environ, **_ZYGOTE.children_environment()}
    runs = []
    for socket_path in (env["FINETUNER_TESTS_ZYGOTE_SOCKET"], ""):
        before = (_ZYGOTE.cpu(), _ZYGOTE.children_forked)[1]
        cmd = [*shlex.split(env["FINETUNER_PYTHON"]), "-c", code, "a", "b c"]
        p = subprocess.run(cmd, cwd=rank_probe, env={**env, "FINETUNER_TESTS_ZYGOTE_SOCKET": socket_path},
                           capture_output=True, text=True, timeout=conftest.HANG_GUARD_S)
        runs.append((p.returncode, p.stdout))
        assert (_ZYGOTE.cpu(), _ZYGOTE.children_forked)[1] == before + bool(socket_path)
    assert runs[0] == runs[1] == (4, f"['-c', 'a', 'b c'] '' __main__ found in the working folder {rank_probe.name}\n")

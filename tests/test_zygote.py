"""The tests' zygote (tests/zygote.py) gives a command what a new interpreter gives it: the same output, exit
status, working folder, arguments and environment, checked against a real subprocess of the same command."""
from __future__ import annotations

import subprocess

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

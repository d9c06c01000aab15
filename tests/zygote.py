"""A process that has imported torch, transformers and peft once, and forks a child for each ``python -m
MODULE ARGS`` a test runs: the child is a new process with that command's arguments, working folder,
environment, standard streams and exit status, without a new interpreter's ~13 s of CPU for those imports
(on the 2-core machines the suite runs on, most of its time was spent importing them again in each
``finetuner`` command a test started).

What differs from ``subprocess.run([sys.executable, "-m", MODULE, *ARGS])``, and why it does not matter for
the tests that use it (:func:`tests.conftest.run_cli` and the scripts' helpers):

- the libraries above are imported before the command's environment is set. A command whose environment
  differs from this process's in a variable they may read on import (:data:`READ_ON_IMPORT`) therefore runs
  as a real subprocess (:func:`matches`);
- ``/proc/PID/cmdline`` names this process's command, not ``python -m MODULE``: tests that look at a
  command's process from outside start it themselves (``subprocess.Popen``) and do not come here;
- the child ends as an interpreter does (threads waited for, ``atexit`` handlers, buffered output flushed, an
  uncaught exception's traceback and exit status 1, an uncaught Ctrl-C killed by SIGINT) but does not tear
  down the modules one by one (``os._exit``): no test reads what that does.

What only a fresh interpreter shows (the ``finetuner`` entry point, import-time cost, which modules a command
imports) is tested with real subprocesses (``run_cli(..., fresh=True)``, tests/cli/test_cli_startup.py,
tests/runs/test_child_path.py, the README walk-through); ``FINETUNER_TESTS_FRESH_PROCESS=1`` makes every
command a real subprocess, for comparison.

The protocol: one JSON line per command on this process's standard input (``module``, ``args``, ``cwd``,
``env``, ``stdout``, ``stderr`` (files the child writes), ``timeout``), one JSON line back on its standard
output (``rc``: the exit status as ``subprocess`` gives it, or ``null`` when the timeout killed it; ``cpu_s``:
the CPU seconds it used, which tests/conftest.py counts as a subprocess's).
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

#: imported once here: most of a ``finetuner`` command's start-up (all of them ~13 s of CPU on the suite's 2-core
#: machines; ``python -X importtime``: transformers.modeling_utils 8.6 s, peft with bitsandbytes 3.4 s, torch 2.6 s)
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "peft", "datasets", "accelerate")

#: the environment variables the preloaded libraries (or the interpreter, or the native libraries they load,
#: such as OpenMP) may read when they are imported: a command whose value differs from this process's runs as
#: a real subprocess. Every other variable (``FINETUNER_*``, ``COLUMNS``, pytest's, a test's own) is read by
#: the command when it runs, which it does after its environment is set (:func:`_become`)
READ_ON_IMPORT = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "PEFT", "DATASETS", "ACCELERATE", "TORCH", "PYTORCH",
                  "CUDA", "NVIDIA", "OMP_", "MKL_", "KMP_", "GOMP", "BNB_", "BITSANDBYTES", "TRITON", "XDG_", "PYTHON",
                  "LD_", "TOKENIZERS", "HOME", "PATH", "TMPDIR", "LANG", "LC_", "TZ")
#: of those, the ones read when used, not on import: torch.cuda reads this one in ``is_available()``
#: (torch/cuda/__init__.py, ``_nvml_based_avail``), and accelerate sets it in the tests' process while it asks;
#: and two the interpreter reads when it starts, which the child applies as it would: ``PYTHONUNBUFFERED`` (its
#: standard streams) and ``PYTHONPATH`` (its module path; the preloaded libraries come from site-packages)
READ_WHEN_USED = frozenset({"PYTORCH_NVML_BASED_CUDA_CHECK", "PYTHONUNBUFFERED", "PYTHONPATH"})


#: what finetuner sets in its own process (``os.environ.setdefault``: finetuner/cli/main.py, quiet.py,
#: training/trainer.py) and applies through the libraries' own settings as well: a test's process that ran
#: finetuner in-process has them, and a command gets the same from its own start-up either way
#: (and gradio's ``Blocks.launch`` sets ``HF_HUB_DISABLE_TELEMETRY=True`` in the tests that serve the UI in
#: their process: telemetry is off either way, and nothing goes online in the tests)
SET_BY_FINETUNER = {"TRANSFORMERS_VERBOSITY": {"error"}, "TRANSFORMERS_NO_ADVISORY_WARNINGS": {"1"},
                    "PYTORCH_CUDA_ALLOC_CONF": {"expandable_segments:True"}, "HF_HUB_DISABLE_TELEMETRY": {"1", "True"},
                    "HF_HUB_DISABLE_PROGRESS_BARS": {"1"}, "HF_DATASETS_DISABLE_PROGRESS_BARS": {"1"},
                    "TOKENIZERS_PARALLELISM": {"false"}}


def differences(started_with: dict[str, str], loaded: dict[str, str], env: dict[str, str]) -> list[str]:
    """The variables that keep a command with environment ``env`` from running in a zygote started with
    ``started_with`` whose environment, once it had imported :data:`PRELOAD`, was ``loaded`` (torch sets a few
    variables when it is imported, e.g. ``TORCHINDUCTOR_CACHE_DIR``: a command that lacks them sets them alike
    on import). None: it may."""
    set_on_import = set(loaded) - set(started_with)

    def same(k: str) -> bool:
        if loaded.get(k) == env.get(k) or (k in set_on_import and k not in env):
            return True
        return k in SET_BY_FINETUNER and {loaded.get(k), env.get(k)} <= {None, *SET_BY_FINETUNER[k]}

    keys = {k for k in set(loaded) | set(env) if k.startswith(READ_ON_IMPORT) and k not in READ_WHEN_USED}
    return sorted(k for k in keys if not same(k))


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # ``sys.exit("message")``: printed, status 1
    return 1


def _child(request: dict) -> None:
    """In the forked child: become ``python -m MODULE ARGS``, run it, and end as an interpreter ends (its
    threads waited for, ``atexit`` handlers, output flushed; an uncaught exception's traceback, status 1; an
    uncaught Ctrl-C, killed by SIGINT), without tearing down the imported modules one by one (with torch and
    transformers loaded, ``finetuner --version`` took 2.4 s that way and 0.3 s this way; no test reads it)."""
    import atexit
    import threading

    try:
        try:
            _become(request)
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except KeyboardInterrupt:
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # what Py_FinalizeEx does first
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code if code >= 0 else 1)


def _python_path(env) -> list[str]:
    """The module path entries ``PYTHONPATH`` gives an interpreter (made absolute, as ``site`` makes them)."""
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _become(request: dict) -> None:
    started = _python_path(os.environ)
    if sys.path[1:1 + len(started)] == started:  # the zygote's PYTHONPATH entries become the command's
        sys.path[1:1 + len(started)] = _python_path(request["env"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    if os.environ.get("PYTHONUNBUFFERED"):  # what ``python -u`` does to the standard streams
        import io

        for fd, name in ((1, "stdout"), (2, "stderr")):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding=old.encoding,
                                                errors=old.errors, write_through=True))
    sys.argv = ["-m", *request["args"]]  # runpy puts the module's file in argv[0], as ``-m`` does
    sys.path[0] = os.getcwd()  # ``-m`` puts the working folder first on the path
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _wait(pid: int, timeout: float | None) -> tuple[int | None, float]:
    """The child's exit status (None: killed at the timeout) and its CPU seconds, its subprocesses' included."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            _, _, usage = os.wait4(pid, 0)
            return None, usage.ru_utime + usage.ru_stime
        time.sleep(0.02)


def serve() -> None:
    """The zygote's loop (``python -c "from tests.zygote import serve; serve()"``): until its input ends."""
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # a child's standard input is empty, as ``stdin=DEVNULL`` gives a subprocess
    os.dup2(devnull, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    assert not any(m == "finetuner" or m.startswith("finetuner.") for m in sys.modules), "finetuner must not be preloaded"
    gc.freeze()  # what is loaded now stays out of the children's collections (no copy of its pages on write)
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)  # its own start-up, which the tests' process counts too
    replies.write(json.dumps({"ready": os.getpid(), "env": dict(os.environ), "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _child(request)
        rc, cpu_s = _wait(pid, request.get("timeout"))
        replies.write(json.dumps({"rc": rc, "cpu_s": cpu_s}) + "\n")
        replies.flush()


REPO = Path(__file__).resolve().parents[1]


class Client:
    """The tests' side: this process's zygote, started at its first command, ended with the process."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.count = 0
        self.counted = 0.0
        self.cpu_s = 0.0  # the CPU seconds of the commands it ran (the zygote's children, not this process's)
        #: the commands sent to a new interpreter instead, by the variables that kept them out
        self.fresh: dict[str, int] = {}
        self.failed = False  # a zygote that did not start is not tried again: each try costs its imports
        import atexit

        atexit.register(self.stop)

    def start(self, env: dict[str, str]) -> bool:
        import tempfile

        self.folder = Path(tempfile.mkdtemp(prefix="finetuner-zygote-"))
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.zygote import serve; serve()"], cwd=REPO, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.folder / "zygote.log", "w"),
        )
        ready = self._reply()
        self.loaded = ready["env"] if ready else {}
        self.counted = ready["cpu_s"] if ready else 0.0  # CPU of this zygote and its commands counted so far
        self.cpu_s += self.counted
        return ready is not None

    def _reply(self) -> dict | None:
        line = self.proc.stdout.readline() if self.proc else ""
        return json.loads(line) if line else None

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.cpu_s -= self.counted  # now in this process's RUSAGE_CHILDREN, with the rest of the zygote's
            self.counted = 0.0
            self.proc = None

    def run(self, module: str, args: tuple[str, ...], cwd: Path, env: dict[str, str],
            timeout: float | None, start_env: dict[str, str]) -> subprocess.CompletedProcess | None:
        """``python -m module args`` forked from the zygote, or None where it cannot (see tests/zygote.py)."""
        if os.environ.get("FINETUNER_TESTS_FRESH_PROCESS") == "1" or self.failed:
            return None
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            if not self.start(start_env):
                self.stop()
                self.failed = True
                return None
        kept_out = ", ".join(differences(self.env, self.loaded, env))
        if kept_out:  # e.g. a test changed the environment (monkeypatch)
            self.fresh[kept_out] = self.fresh.get(kept_out, 0) + 1
            return None
        self.count += 1
        out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
        request = dict(module=module, args=list(args), cwd=str(cwd), env=env, stdout=str(out), stderr=str(err),
                       timeout=timeout)
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = self._reply()
        except BaseException:  # e.g. pytest-timeout cut the test off: a zygote out of step is not reused
            self.proc.kill()
            self.stop()
            raise
        if reply is None:
            raise RuntimeError(f"the tests' zygote ended while it ran {module} {args}: see {self.folder / 'zygote.log'}")
        text = []
        for path in (out, err):  # decoded as ``text=True`` decodes a subprocess's output
            with open(path, encoding=None, newline=None) as f:
                text.append(f.read())
            path.unlink()
        cmd = [sys.executable, "-m", module, *args]
        self.cpu_s += reply["cpu_s"]
        self.counted += reply["cpu_s"]
        if reply["rc"] is None:
            raise subprocess.TimeoutExpired(cmd, timeout, output=text[0], stderr=text[1])
        return subprocess.CompletedProcess(cmd, reply["rc"], text[0], text[1])


CLIENT = Client()

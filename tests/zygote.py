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
the CPU seconds it used, which tests/conftest.py counts as a subprocess's; ``children_cpu_s``, ``children_forked``,
``children_fresh``: the totals so far of the processes below). ``{"query": "cpu"}`` asks for those totals alone.

The Python processes finetuner itself starts in a test come from here too (the ranks of a multi-process run, web
UI jobs, chat and export workers, the validation scripts' measurements): their command's ``python`` is
tests/zygote_child.py (``$FINETUNER_PYTHON``, set by tests/conftest.py), which sends the command, its environment
and its standard streams (the file descriptors) over the Unix socket ``$FINETUNER_TESTS_ZYGOTE_SOCKET``; the
process is forked at once, while a command (e.g. the ``finetuner run`` that launched a rank) may be running, and
its exit status goes back to the stand-in. Measured on 2 cores, test_fsdp.py, test_distributed_preference.py,
test_resume_exact.py and test_grpo_run.py (-n 2): 1,054 s of CPU with a new interpreter per rank, 458 s forked.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import shlex
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
    if any(os.path.exists(os.path.join(d, "sitecustomize.py")) for d in _python_path(request["env"])):
        sys.modules.pop("sitecustomize", None)  # what ``site`` imports when an interpreter starts (it runs no
        importlib.import_module("sitecustomize")  # code that the preloaded libraries would have run before it)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if "OMP_NUM_THREADS" in os.environ:  # what OpenMP reads when torch loads it: torch's threads, set as it sets them
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "stdout" in request:  # a stand-in's child keeps the stand-in's streams (tests/zygote_child.py)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(f, fd)
            os.close(f)
    if os.environ.get("PYTHONUNBUFFERED") or request.get("unbuffered"):  # what ``python -u`` does to the streams
        import io

        for fd, name in ((1, "stdout"), (2, "stderr")):
            old = getattr(sys, name)
            setattr(sys, name, io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding=old.encoding,
                                                errors=old.errors, write_through=True))
    if request.get("safe_path") or os.environ.get("PYTHONSAFEPATH"):
        del sys.path[0]  # ``-P``: nothing put before the module path
    elif "code" in request:
        sys.path[0] = ""  # ``-c`` puts the working folder first on the path, as ''
    else:
        sys.path[0] = os.getcwd()  # ``-m`` puts it there by name
    if "code" in request:  # ``python -c CODE ARGS``
        sys.argv = ["-c", *request["args"]]
        main = sys.modules["__main__"] = type(sys)("__main__")
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        return
    sys.argv = ["-m", *request["args"]]  # runpy puts the module's file in argv[0], as ``-m`` does
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


#: what torchrun, finetuner's launcher and tests/zygote_child.py set in a rank's environment (or a job's) that
#: :data:`READ_ON_IMPORT` names, all read when used (torch.distributed.elastic, accelerate's ``PartialState``),
#: or applied by the child as the interpreter applies it (``-u``, ``-P``; ``OMP_NUM_THREADS`` in :func:`_become`)
CHILD_READ_WHEN_USED = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "ACCELERATE_USE_CPU", "OMP_NUM_THREADS",
                       "PYTHONSAFEPATH")


def child_differences(started_with: dict[str, str], loaded: dict[str, str], env: dict[str, str]) -> list[str]:
    """:func:`differences` for a process finetuner starts (tests/zygote_child.py), and :func:`customized`."""
    kept = [k for k in differences(started_with, loaded, env) if not k.startswith(CHILD_READ_WHEN_USED)]
    return kept + customized(env)


def customized(env: dict[str, str]) -> list[str]:
    """A ``usercustomize`` on the command's module path runs when an interpreter with a user site starts, which
    a forked child does not do: such a command runs as a real subprocess (a ``sitecustomize`` it runs, in
    :func:`_become`: e.g. tests/training/test_distributed.py's ``without_deepspeed``, which hides a library
    that the preloaded ones look for only when asked)."""
    return ["PYTHONPATH (usercustomize.py)" for d in _python_path(env) if os.path.exists(os.path.join(d, "usercustomize.py"))]


def serve(socket_path: str = "") -> None:
    """The zygote's loop (``python -c "from tests.zygote import serve; serve(SOCKET)"``), until its input ends:
    the tests' commands (one JSON line each on its standard input, their replies on its standard output) and,
    meanwhile, the processes tests/zygote_child.py asks for on the Unix socket ``socket_path``."""
    import selectors
    import socket

    commands = os.dup(0)
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # a child's standard input is empty, as ``stdin=DEVNULL`` gives a subprocess
    os.dup2(devnull, 1)
    listener = None
    if socket_path:  # bound before the imports: a stand-in asking meanwhile waits for them, not for a new interpreter's
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(socket_path)
        listener.listen(64)
    started_with = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    assert not any(m == "finetuner" or m.startswith("finetuner.") for m in sys.modules), "finetuner must not be preloaded"
    gc.freeze()  # what is loaded now stays out of the children's collections (no copy of its pages on write)
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)  # its own start-up, which the tests' process counts too
    loaded = dict(os.environ)
    replies.write(json.dumps({"ready": os.getpid(), "env": loaded, "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n")
    replies.flush()
    selector = selectors.DefaultSelector()
    selector.register(commands, selectors.EVENT_READ, "command")
    if listener is not None:
        selector.register(listener, selectors.EVENT_READ, "stand-in")
    command: tuple[int, float | None] | None = None  # the command running: its pid and deadline
    children: dict[int, socket.socket] = {}  # the stand-ins' children running, by pid: the stand-in's connection
    children_cpu_s = 0.0  # the CPU seconds of the stand-ins' children that ended
    children_forked, children_fresh = 0, {}  # how many it forked, and those it did not by what kept them out
    pending = b""

    def fork(request: dict, fds: list[int] = ()) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd, target in zip(fds, (0, 1, 2)):
                os.dup2(fd, target)
            selector.close()
            for fd in (*fds, commands, *(c.fileno() for c in children.values()), *([listener.fileno()] if listener else [])):
                os.close(fd)
            replies.close()
            _child(request)
        return pid

    def reply(answer: dict) -> None:
        replies.write(json.dumps(dict(answer, children_cpu_s=children_cpu_s, children_forked=children_forked,
                                      children_fresh=children_fresh)) + "\n")
        replies.flush()

    while True:
        for key, _ in selector.select(timeout=0.02):
            if key.data == "command":
                chunk = os.read(commands, 1 << 20)
                if not chunk:  # the tests' process is done: so is any process it left
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    if request.get("query") == "cpu":
                        reply({})
                    else:
                        timeout = request.get("timeout")
                        command = fork(request), None if timeout is None else time.monotonic() + timeout
            elif key.data == "stand-in":
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message)
                kept_out = child_differences(started_with, loaded, request["env"])
                if kept_out or len(fds) != 3:
                    reason = ", ".join(kept_out) or "its standard streams"
                    children_fresh[reason] = children_fresh.get(reason, 0) + 1
                    conn.send(json.dumps({"fresh": kept_out}).encode())
                    conn.close()
                else:
                    pid = fork(request, fds)
                    children_forked += 1
                    conn.send(json.dumps({"pid": pid}).encode())
                    children[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
                for fd in fds:
                    os.close(fd)
            elif not key.fileobj.recv(1):  # a stand-in has gone (killed): so goes its child
                with contextlib.suppress(ProcessLookupError):
                    os.kill(key.data, signal.SIGKILL)
                selector.unregister(key.fileobj)
        while True:  # the children that ended
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rc, cpu_s = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
            if command is not None and pid == command[0]:
                command = None
                reply({"rc": rc, "cpu_s": cpu_s})
            elif pid in children:
                children_cpu_s += cpu_s
                conn = children.pop(pid)
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"rc": rc}).encode())
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(conn)
                conn.close()
        if command is not None and command[1] is not None and time.monotonic() > command[1]:
            os.kill(command[0], signal.SIGKILL)
            _, status, usage = os.wait4(command[0], 0)
            command = None
            reply({"rc": None, "cpu_s": usage.ru_utime + usage.ru_stime})


REPO = Path(__file__).resolve().parents[1]


class Client:
    """The tests' side: this process's zygote, started at its first command (or by :meth:`start` ahead of it,
    tests/conftest.py), ended with the process."""

    def __init__(self):
        import tempfile
        import threading

        self.proc: subprocess.Popen | None = None
        self.ready: dict | None = None
        self.env: dict[str, str] = {}
        self.count = 0
        self.counted = 0.0
        self.cpu_s = 0.0  # the CPU seconds of what it ran (the zygote's children, not this process's)
        self.children_cpu_s = 0.0  # of which its stand-ins' children (tests/zygote_child.py; the zygote's total so far)
        self.children_forked, self.children_fresh = 0, {}  # those it forked, and those it did not by what kept them out
        #: the commands sent to a new interpreter instead, by the variables that kept them out
        self.fresh: dict[str, int] = {}
        self.failed = False  # a zygote that did not start is not tried again: each try costs its imports
        self.lock = threading.Lock()  # one request at a time (the UI's tests run commands from its server's threads)
        self.folder = Path(tempfile.mkdtemp(prefix="finetuner-zygote-"))
        #: where tests/zygote_child.py asks for its process (``$FINETUNER_TESTS_ZYGOTE_SOCKET``)
        self.socket_path = str(self.folder / "children.sock")
        import atexit

        atexit.register(self.stop)

    def start(self, env: dict[str, str]) -> None:
        """Start the zygote (its imports go on in the background; :meth:`run` waits for them)."""
        if self.proc is None and not self.failed and os.environ.get("FINETUNER_TESTS_FRESH_PROCESS") != "1":
            self.env = dict(env)
            self.ready = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from tests.zygote import serve; serve({self.socket_path!r})"], cwd=REPO,
                env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=open(self.folder / "zygote.log", "a"),
            )

    def _started(self, env: dict[str, str]) -> bool:
        """The zygote, started if need be, has done its imports (False: it failed)."""
        if self.failed:
            return False
        if self.proc is not None and self.proc.poll() is not None:
            self.stop()
        self.start(env)
        if self.ready is None:
            self.ready = self._reply()
            if self.ready is None:
                self.stop()
                self.failed = True
                return False
            self.loaded = self.ready["env"]
            self.counted = self.ready["cpu_s"]  # CPU of this zygote and its children counted so far
            self.cpu_s += self.counted
        return True

    def _reply(self) -> dict | None:
        line = self.proc.stdout.readline() if self.proc else ""
        reply = json.loads(line) if line else None
        if reply and "children_cpu_s" in reply:
            self.children_forked, self.children_fresh = reply["children_forked"], reply["children_fresh"]
            more = reply["children_cpu_s"] - self.children_cpu_s
            self.children_cpu_s = reply["children_cpu_s"]
            self.cpu_s += more
            self.counted += more
        return reply

    def cpu(self) -> float:
        """:attr:`cpu_s` with the stand-ins' children that ended since the last reply (a child counts in the test
        during which it ended)."""
        import select

        if self.proc is not None and self.proc.poll() is None:
            with self.lock:
                if self.ready is None and select.select([self.proc.stdout], [], [], 0)[0]:  # its imports are done
                    self._started(self.env)
                if self.ready is not None:  # (no child has run before)
                    self._send({"query": "cpu"})
                    self._reply()
        return self.cpu_s

    def _send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

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
            self.children_cpu_s = 0.0
            self.proc = None
            self.ready = None

    def run(self, module: str, args: tuple[str, ...], cwd: Path, env: dict[str, str],
            timeout: float | None, start_env: dict[str, str]) -> subprocess.CompletedProcess | None:
        """``python -m module args`` forked from the zygote, or None where it cannot (see tests/zygote.py)."""
        if os.environ.get("FINETUNER_TESTS_FRESH_PROCESS") == "1":
            return None
        with self.lock:
            if not self._started(start_env):
                return None
            kept_out = ", ".join(differences(self.env, self.loaded, env) + customized(env))
            if kept_out:  # e.g. a test changed the environment (monkeypatch)
                self.fresh[kept_out] = self.fresh.get(kept_out, 0) + 1
                return None
            self.count += 1
            out, err = self.folder / f"{self.count}.out", self.folder / f"{self.count}.err"
            request = dict(module=module, args=list(args), cwd=str(cwd), env=env, stdout=str(out), stderr=str(err),
                           timeout=timeout)
            try:
                self._send(request)
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

    def children_environment(self) -> dict[str, str]:
        """The variables that make finetuner start its Python processes (ranks, UI jobs, workers) in the tests
        through tests/zygote_child.py (finetuner.children.python_command)."""
        client = Path(__file__).with_name("zygote_child.py")
        return {"FINETUNER_PYTHON": f"{shlex.quote(sys.executable)} -I {shlex.quote(str(client))}",
                "FINETUNER_TESTS_ZYGOTE_SOCKET": self.socket_path}


CLIENT = Client()

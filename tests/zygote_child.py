"""A Python process that finetuner starts in a test (a rank of a multi-process run, a web UI job, a chat or
export worker, a validation script's measurement), forked from this test worker's zygote (tests/zygote.py)
instead of a new interpreter: ``$FINETUNER_PYTHON`` (finetuner.children.python_command), which tests/conftest.py
sets to ``python -I tests/zygote_child.py``.

Run as ``python -I zygote_child.py [-u] [-P] (-m MODULE | -c CODE) ARGS``, it imports nothing but the standard
library. It sends the zygote (``$FINETUNER_TESTS_ZYGOTE_SOCKET``) the command, its working folder and
environment, and its own standard input, output and error (the file descriptors themselves), and the zygote
forks the process with them. This process then stands for it towards its parent: a signal sent to it goes on
(SIGTERM from torchrun, SIGINT from the UI's Stop); it ends with the child's exit status (killed by the same
signal where the child was); and the zygote kills the child when this process is gone. For a rank, this
process dies with torchrun (``PR_SET_PDEATHSIG``, which the rank itself asks for). Where the zygote is not there
or cannot give the environment (tests/zygote.py, ``child_differences``), or the interpreter's options are others,
it becomes the real interpreter with the same arguments (``exec``).
"""
import ctypes
import json
import os
import signal
import socket
import sys

SOCKET_ENV = "FINETUNER_TESTS_ZYGOTE_SOCKET"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _parse(argv: list[str]) -> dict | None:
    """``[-u] [-P] -m MODULE ARGS`` (finetuner.children.module_args) or ``[-u] [-P] -c CODE ARGS``, else None."""
    flags = {"unbuffered": False, "safe_path": False}
    for i, arg in enumerate(argv):
        if arg == "-u":
            flags["unbuffered"] = True
        elif arg == "-P":
            flags["safe_path"] = True
        elif arg == "-m" and i + 1 < len(argv):
            return dict(flags, module=argv[i + 1], args=argv[i + 2:])
        elif arg == "-c" and i + 1 < len(argv):
            return dict(flags, code=argv[i + 1], args=argv[i + 2:])
        else:
            return None
    return None


def _interpreter() -> None:
    """Become ``python ARGS`` (the real rank)."""
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def _reply(conn: socket.socket) -> dict:
    data = conn.recv(65536)
    return json.loads(data) if data else {}


def main() -> None:
    request, path = _parse(sys.argv[1:]), os.environ.get(SOCKET_ENV)
    if request is None or not path:
        _interpreter()
    if request.get("module") == "finetuner.training.distributed":  # a rank: gone with torchrun, as it would be
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (finetuner/training/distributed.py)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        request.update(cwd=os.getcwd(), env=dict(os.environ))
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        started = _reply(conn)
    except OSError:
        started = {}
    if "pid" not in started:
        conn.close()
        _interpreter()
    pid = started["pid"]

    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it has ended: its status is on the way
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    rc = _reply(conn).get("rc", 1)
    if rc < 0:
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    os._exit(rc if rc >= 0 else 1)


if __name__ == "__main__":
    main()

"""A rank of a multi-process test run, forked from this test worker's zygote (tests/zygote.py) instead of a new
interpreter: the interpreter torchrun starts for each rank (``$FINETUNER_RANK_INTERPRETER``, which
tests/conftest.py sets to ``python -I tests/zygote_rank.py``; finetuner/training/launch.py puts it in the
rank's command in place of ``python``).

Run as ``python -I zygote_rank.py [-u] [-P] -m MODULE ARGS``, it imports nothing but the standard library. It
sends the zygote (``$FINETUNER_TESTS_ZYGOTE_SOCKET``) the command, its working folder and environment, and its
own standard input, output and error (the file descriptors themselves), and the zygote forks the rank with
them. This process then stands for the rank towards torchrun: a signal torchrun sends it goes on to the rank;
it ends with the rank's exit status (killed by the same signal where the rank was); torchrun dying kills it
(``PR_SET_PDEATHSIG``, as the rank itself asks for), and the zygote kills the rank when this process is gone.
Where the zygote is not there or cannot give the rank's environment (tests/zygote.py, ``rank_differences``),
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
    """``[-u] [-P] -m MODULE ARGS`` (what finetuner.children.module_args gives a rank), or None."""
    flags = {"unbuffered": False, "safe_path": False}
    for i, arg in enumerate(argv):
        if arg == "-u":
            flags["unbuffered"] = True
        elif arg == "-P":
            flags["safe_path"] = True
        elif arg == "-m" and i + 1 < len(argv):
            return dict(flags, module=argv[i + 1], args=argv[i + 2:])
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
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with torchrun, as the rank would be
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

"""``finetuner ui``: serve the web UI (Gradio) on this machine.

gradio (a dependency of finetuner) is imported only when the command runs, so
``finetuner --help`` stays fast. Analytics and version checks are off: the UI never calls out.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ui",
        help="Serve the web UI: pick a model and data, plan, train, chat, export.",
        description="Serve the finetuner web UI. Training runs in its own process; closing the page does not stop it.",
    )
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1: this machine only).")
    p.add_argument("--port", type=int, default=7860, help="Port (default 7860).")
    p.add_argument("--auth-file", metavar="FILE",
                   help="Require the user name and password in FILE: one line USER:PASS, readable by you only "
                        "(chmod 600). Or set FINETUNER_UI_AUTH=USER:PASS. Without either, the UI answers only your "
                        "own account on this machine.")
    p.add_argument("--auth", nargs="?", const="", help=argparse.SUPPRESS)  # refused: a password in argv is seen by every account
    p.add_argument("--runs-dir", help="Where runs are kept (default: runs/ of the checkout).")
    p.add_argument("--upload-dir", help="Where uploaded data files are stored (default: data/uploads/ of the checkout).")
    p.add_argument("--data-dir", action="append", metavar="FOLDER",
                   help="Read models, data files, pictures, recipes and reward code only from this folder (repeatable), "
                        "data/, the uploads and the runs (recipes also from the shipped recipes/, reward code never "
                        "from the uploads). Always so with a --host other than 127.0.0.1: the page then reads no "
                        "other file of this machine.")
    p.add_argument("--max-upload-mb", type=float, default=None, metavar="MB",
                   help="The largest data file the page takes as an upload, in MiB (default 512); a larger file is "
                        "given by its path instead.")
    p.set_defaults(func=_cmd_ui)


#: the environment variable that can hold ``USER:PASS`` instead of ``--auth-file`` (removed once read)
AUTH_ENV = "FINETUNER_UI_AUTH"


def parse_auth(text: str, where: str) -> tuple[str, str]:
    """``USER:PASS`` (the password may hold ``:``) from ``where``; a refusal never shows the text (a password)."""
    from finetuner.errors import UserError

    user, sep, password = text.partition(":")
    if not sep or not user.strip() or not password:
        raise UserError(f"{where}: give one line USER:PASS, e.g. alice:s3cret.")
    return user.strip(), password


def read_auth_file(path: str) -> tuple[str, str]:
    """The one line ``USER:PASS`` of ``path``, refused (as ssh refuses a private key) when it is not a regular
    file of yours that only you can read or write, or holds anything but that one line."""
    import stat

    from finetuner.errors import UserError

    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise UserError(f"--auth-file {path}: cannot read it ({e.strerror}).") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"--auth-file {path}: not a regular file.")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise UserError(f"--auth-file {path}: owned by another user (uid {st.st_uid}): give a file of your own.")
        if st.st_mode & 0o077:
            raise UserError(f"--auth-file {path}: others can read or change it (mode {stat.S_IMODE(st.st_mode):04o}): "
                            f"chmod 600 {path}, then start again.")
        data = f.read(4097)
    if len(data) > 4096:
        raise UserError(f"--auth-file {path}: give one line USER:PASS (the file is over 4 KiB).")
    try:
        lines = [line.rstrip("\r") for line in data.decode("utf-8").split("\n")]
    except UnicodeDecodeError:
        raise UserError(f"--auth-file {path}: not UTF-8 text: give one line USER:PASS.") from None
    if lines and lines[-1] == "":
        lines.pop()  # the file's last newline
    if len(lines) != 1:
        raise UserError(f"--auth-file {path}: give one line USER:PASS (it has {len(lines)}).")
    return parse_auth(lines[0], f"--auth-file {path}")


def auth_from(args: argparse.Namespace, environ=os.environ) -> tuple[str, str] | None:
    """The user name and password the UI asks for: ``--auth-file``, else ``FINETUNER_UI_AUTH`` (taken out of
    ``environ``, so the processes the UI starts never see it); ``--auth`` on the command line is refused,
    since every account of the machine can read a process's arguments."""
    from finetuner.errors import UserError

    from_env = environ.pop(AUTH_ENV, None)
    if args.auth is not None:
        raise UserError("--auth takes no password on the command line, where every account of this machine can read "
                        f"it: put USER:PASS in a file only you can read and give --auth-file FILE, or set {AUTH_ENV}.")
    if args.auth_file:
        return read_auth_file(args.auth_file)
    if from_env is not None:
        return parse_auth(from_env, AUTH_ENV)
    return None


def exposed_without_auth(host: str, auth: tuple[str, str] | None) -> bool:
    from ui.paths import LOOPBACK

    return auth is None and host not in LOOPBACK


def _cmd_ui(args: argparse.Namespace) -> int:
    from finetuner.errors import UserError

    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    auth = auth_from(args)
    max_upload = args.max_upload_mb
    if max_upload is not None and not (max_upload > 0 and max_upload < 2**40):  # also refuses nan and inf
        raise UserError(f"--max-upload-mb {max_upload:g}: give a size in MiB above 0, e.g. --max-upload-mb 1024.")
    if exposed_without_auth(args.host, auth):
        print(
            f"warning: listening on {args.host} without --auth-file: a browser on another machine needs the token "
            "in the address below, and whoever has that address can start training and read your runs. For a "
            f"password, give --auth-file FILE (one line USER:PASS) or set {AUTH_ENV}.",
            file=sys.stderr,
        )
    try:
        from ui.app import launch, serve_until_interrupted
    except ImportError as e:
        raise UserError(
            f"The web UI needs gradio ({e}).",
            hint="gradio comes with finetuner: install finetuner again (pip install -c constraints.txt -e .).",
        ) from None
    app = launch(runs_dir=args.runs_dir, upload_dir=args.upload_dir, host=args.host, port=args.port, auth=auth, block=False,
                 quiet=True, max_upload_bytes=int(max_upload * 2**20) if max_upload is not None else None,
                 data_dirs=args.data_dir)
    # said once the port accepts connections (launch returns then), so the address works when it is read
    print(app.access.address(args.host, args.port), flush=True)
    print(serve_until_interrupted(app), flush=True)  # Ctrl-C: stopped at once; training jobs go on, and it says so
    # what is ours is closed by now; the interpreter's own teardown of gradio, torch and transformers took 7-8 s more
    # (docs/benchmarks.md): exit at once
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)

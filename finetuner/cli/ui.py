"""``finetuner ui``: serve the web UI (Gradio) on this machine.

gradio (a dependency of finetuner) is imported only when the command runs, so
``finetuner --help`` stays fast. Analytics and version checks are off: the UI never calls out.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--auth", metavar="USER:PASS", help="Require this user name and password.")
    p.add_argument("--runs-dir", help="Where runs are kept (default: runs/ of the checkout).")
    p.add_argument("--upload-dir", help="Where uploaded data files are stored (default: data/uploads/ of the checkout).")
    p.add_argument("--data-dir", action="append", metavar="FOLDER",
                   help="Read data files only from this folder (repeatable), data/, the uploads and the runs. "
                        "Always so with a --host other than 127.0.0.1: the page then reads no other file of this machine.")
    p.add_argument("--max-upload-mb", type=float, default=None, metavar="MB",
                   help="The largest data file the page takes as an upload, in MiB (default 512); a larger file is "
                        "given by its path instead.")
    p.set_defaults(func=_cmd_ui)


def parse_auth(text: str | None) -> tuple[str, str] | None:
    from finetuner.errors import UserError

    if not text:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise UserError(f"--auth {text!r}: give USER:PASS, e.g. --auth alice:s3cret.")
    return user, password


def exposed_without_auth(host: str, auth: tuple[str, str] | None) -> bool:
    from ui.paths import LOOPBACK

    return auth is None and host not in LOOPBACK


def _cmd_ui(args: argparse.Namespace) -> int:
    from finetuner.errors import UserError

    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    auth = parse_auth(args.auth)
    max_upload = args.max_upload_mb
    if max_upload is not None and not (max_upload > 0 and max_upload < 2**40):  # also refuses nan and inf
        raise UserError(f"--max-upload-mb {max_upload:g}: give a size in MiB above 0, e.g. --max-upload-mb 1024.")
    if exposed_without_auth(args.host, auth):
        print(
            f"warning: listening on {args.host} without --auth: anyone who can reach this machine can start "
            "training and read your runs. Add --auth USER:PASS.",
            file=sys.stderr,
        )
    try:
        from ui.app import launch
    except ImportError as e:
        raise UserError(
            f"The web UI needs gradio ({e}).",
            hint="gradio comes with finetuner: install finetuner again (pip install -c constraints.txt -e .).",
        ) from None
    app = launch(runs_dir=args.runs_dir, upload_dir=args.upload_dir, host=args.host, port=args.port, auth=auth, block=False,
                 quiet=True, max_upload_bytes=int(max_upload * 2**20) if max_upload is not None else None,
                 data_dirs=args.data_dir)
    # said once the port accepts connections (launch returns then), so the address works when it is read
    print(f"finetuner UI on http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port} (Ctrl-C to quit)", flush=True)
    app.block_thread()
    return 0

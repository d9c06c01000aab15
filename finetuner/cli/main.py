"""The ``finetuner`` command line: a thin layer over the Python API.

Imports are lazy: ``finetuner --help`` and commands that need no model never import torch.
User errors (:class:`~finetuner.errors.UserError`) print one message and exit non-zero without
a traceback; ``--debug`` shows it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from finetuner.children import Interrupted  # a second stop signal of a run: abort now (130 or 143)


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="Fine-tune from a recipe YAML (resumes a run folder that has checkpoints).")
    p.add_argument("recipe", help="Recipe YAML, e.g. recipes/demo_cpu.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="Override a recipe value, e.g. --set training.max_steps=5 (repeatable).")
    p.add_argument("--output", "-o", help="Run folder (default: the recipe's output_dir, or runs/<name>).")
    p.add_argument("--no-resume", action="store_true",
                   help="Start over even if the run folder has checkpoints (the old run is moved aside, not deleted).")
    p.add_argument("--trust-checkpoints", action="store_true",
                   help="Resume from FSDP/ZeRO checkpoints that finetuner did not write for you on this machine (a run "
                        "folder from someone else): loading them unpickles, which can run code.")
    p.add_argument("--tracking-resume", action="store_true",
                   help="Report to the MLflow/W&B/Trackio runs that the run folder's tracking.json names even if finetuner "
                        "did not start them for you (a run folder from someone else); else such a run reports to new ones.")
    p.add_argument("--quiet", "-q", action="store_true", help="Only print the summary.")
    p.add_argument("--report-to", metavar="TRACKERS",
                   help="Where the run reports, comma-separated: tensorboard, mlflow, wandb, trackio, or none "
                        "(sets logging.report_to; each but TensorBoard is an extra: pip install 'finetuner[mlflow]').")
    p.add_argument("--gpus", type=int, metavar="N",
                   help="Train on N processes (one per GPU; on a CPU machine, N CPU processes on gloo): "
                        "sets distributed.num_processes. The effective batch stays the same.")
    p.add_argument("--profile-memory", action="store_true",
                   help="Record CUDA allocations for the first steps into memory_snapshot.pickle (open it at pytorch.org/memory_viz).")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from finetuner.cli.progress import ProgressPrinter, console as run_console
    from finetuner.data.follow import load_recipe
    from finetuner.errors import UserError

    console = run_console()
    flags = [f"distributed.num_processes={args.gpus}"] if args.gpus else []
    if args.report_to is not None:
        chosen = [t.strip() for t in args.report_to.split(",") if t.strip() and t.strip() != "none"]
        flags += [f"logging.report_to=[{','.join(chosen)}]", "logging.tensorboard=null"]
    from finetuner.training.launch import needs_launch

    try:
        recipe = load_recipe(args.recipe, args.overrides + flags)
    except UserError as e:  # e.g. a resumed run's data file moved away: the run's own recipe no longer loads
        _record_if_own_recipe(args, e)
        raise
    stop = threading.Event()
    received: list[int] = []  # the signals asked to stop, first first: the exit status is 128 + the first
    started = threading.Event()  # set by the run's "start" event: from then on a stop saves a checkpoint
    aborting: list[int] = []  # the signal of a stop before the first step, once one came
    lost: list[int] = []  # that stop's exception was dropped by Python (see _unraisable)
    owner, launched = os.getpid(), needs_launch(recipe)  # a launched run's ranks stop on their own (.stop)

    def _on_signal(signum, _frame):
        if os.getpid() != owner:  # a worker forked by this process (datasets' tokenization pool): its parent decides
            if signum != signal.SIGINT:
                os._exit(128 + signum)  # the pool ends its workers with SIGTERM
            return
        received.append(signum)
        if aborting:  # already stopping before the first step: let its clean-up (ending worker processes) finish
            if lost:  # ... unless the stop was lost (see _unraisable): raise it again
                lost.clear()
                raise Interrupted(aborting[0])
            return
        if stop.is_set():
            raise Interrupted(received[0])
        if not started.is_set() and not launched:  # loading, tokenizing: nothing to save, so stop now
            aborting.append(signum)
            console.print("[yellow]Stopped before the first training step: there is nothing to save.[/]")
            raise Interrupted(signum)
        stop.set()
        console.print("[yellow]Stopping after this step and saving a checkpoint (press Ctrl-C again to abort).[/]")

    def _on_event(ev):
        if ev["event"] != "start":
            return
        if aborting:  # the Ctrl-C's exception was lost (Python drops one raised inside a finalizer): stop here, still before step 1
            raise Interrupted(aborting[0])
        started.set()

    default_unraisable = sys.unraisablehook

    def _unraisable(unraisable):
        """Python drops an exception raised while a finalizer (``__del__``, a weakref callback) runs:
        a stop that lands there is raised again a moment later, outside it, instead of a traceback."""
        if isinstance(unraisable.exc_value, Interrupted) and os.getpid() == owner:
            lost.append(unraisable.exc_value.signum)
            threading.Timer(0.01, os.kill, (owner, signal.SIGINT)).start()
            return
        default_unraisable(unraisable)

    sys.unraisablehook = _unraisable
    if not launched:  # processes forked from this one (datasets' tokenization workers) get the kernel's handling:
        # Ctrl-C ignored (this process stops them), SIGTERM ends them at once even while they wait inside a lock,
        # where a Python handler would never run and the pool's terminate() would leave them behind
        _register_worker_signals()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    import warnings

    import finetuner.phases as phases
    from finetuner.runs.folder import RunAlreadyFinished
    from finetuner.training.run import train

    warnings.filterwarnings("ignore", category=RunAlreadyFinished)  # progress.summary says it, in the CLI's words
    with ProgressPrinter(console, quiet=args.quiet) as progress, phases.reporting(progress.phases):  # before the run's
        result = train(  # own events (measuring the data for its auto values), the phases are said here directly
            recipe,
            callbacks=[_on_event, progress],
            output_dir=args.output,
            resume=not args.no_resume,
            stop_event=stop,
            profile_memory=args.profile_memory,
            trust_checkpoints=args.trust_checkpoints,
            tracking_resume=args.tracking_resume,
        )
    progress.summary(result)
    return 128 + (received[0] if received else signal.SIGINT) if result.stopped else 0


def _record_if_own_recipe(args: argparse.Namespace, error: Exception) -> None:
    """A run folder's own ``recipe.yaml`` that no longer loads (``finetuner run RUN/recipe.yaml -o RUN``,
    how the web UI starts and resumes a job): the attempt to run it failed, so its events say so
    (:func:`~finetuner.runs.folder.record_early_failure` decides whether they may). Another recipe's
    failure is not that run's."""
    from pathlib import Path

    from finetuner.runs.folder import events_size, record_early_failure

    if not args.output:
        return
    out = Path(args.output).expanduser().resolve()
    if Path(args.recipe).expanduser().resolve() == out / "recipe.yaml":
        record_early_failure(out, error, events_size(out))


_worker_signals_registered: list[bool] = []
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_fork_masks = threading.local()  # per forking thread: its signal mask before the fork


def _register_worker_signals() -> None:
    """:func:`_signals_of_a_worker` for every process forked from this one, registered once per process
    (``main`` may run several times in one, as the tests call it; fork hooks cannot be removed)."""
    if not _worker_signals_registered:
        os.register_at_fork(before=_hold_stop_signals, after_in_parent=_release_stop_signals,
                            after_in_child=_signals_of_a_worker)
        _worker_signals_registered.append(True)


def _hold_stop_signals() -> None:
    """Before a fork, in the forking thread: Ctrl-C and SIGTERM wait (blocked) until :func:`_release_stop_signals`
    in this process and :func:`_signals_of_a_worker` in the new one. A SIGTERM that reached a new worker before its
    handlers were reset would run this process's handler there, at the C level only, and Python then drops it
    ("signal ignored due to race condition"): a pool that ends its workers just after its handler thread forked a
    replacement (as a Ctrl-C's clean-up does) would wait for that worker forever."""
    _fork_masks.saved = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)


def _release_stop_signals() -> None:
    """After a fork, in the forking thread: its signal mask as it was (a stop signal that came meanwhile is
    delivered now)."""
    saved = getattr(_fork_masks, "saved", None)
    if saved is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, saved)
        _fork_masks.saved = None


def _signals_of_a_worker() -> None:
    """In a process forked from ``finetuner run``: Ctrl-C is the parent's to act on, SIGTERM ends
    it, and so does the parent's end (Linux ``PR_SET_PDEATHSIG``): a pool's manager process that a
    Ctrl-C cut off from its clean-up would otherwise live on, holding the terminal's pipes. The stop signals are
    blocked from the fork (:func:`_hold_stop_signals`) until its handlers are set here: a SIGTERM sent meanwhile
    ends it once they are."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


#: Modules that add sub-commands: each has ``register(sub)`` and imports nothing heavy at the
#: top (no torch, no transformers), so ``finetuner --help`` stays fast.
COMMAND_MODULES: tuple[str, ...] = ("finetuner.cli.plan", "finetuner.cli.ui", "finetuner.cli.inference", "finetuner.cli.export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetuner",
        description="Fine-tune 7B-13B language models on one GPU: finetuner predicts memory and picks the recipe that fits.",
    )
    parser.add_argument("--debug", action="store_true", help="Show tracebacks for user errors too, and the libraries' own warnings and progress bars.")
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="Show the version and exit.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    import importlib

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


class _VersionAction(argparse.Action):
    """``--version``, looked up only when asked for (importlib.metadata costs ~80 ms at start-up)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"finetuner {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("finetuner")
    except PackageNotFoundError:
        return "dev"


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    from finetuner.quiet import DEBUG_ENV, quiet_libraries

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    quiet_libraries()
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from finetuner.errors import UserError
    from finetuner.worker_protocol import REPORT_ENV, report_failure

    try:
        return int(args.func(args) or 0)
    except UserError as e:
        report_failure(e, os.environ.get(REPORT_ENV))  # a job's runner (the web UI) reads it there
        if args.debug:
            raise
        print(f"error: {e.message}", file=sys.stderr)
        hint = e.hint_for(args.command)  # settings to change, written as this command takes them
        if hint:
            print(hint, file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        print("aborted.", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)  # SIGINT's number is 2 on every platform
    except Exception as e:  # a full disk wherever no caller said what was being written: still one line
        from finetuner.errors import interruption
        from finetuner.fileio import disk_full_path, is_disk_full

        stop = interruption(e)  # a Ctrl-C that a library's clean-up turned into an error of its own
        if stop is not None and not args.debug:
            print("aborted.", file=sys.stderr)
            return 128 + getattr(stop, "signum", 2)
        report_failure(e, os.environ.get(REPORT_ENV))
        if args.debug or not is_disk_full(e):
            raise
        where = disk_full_path(e)
        print(f"error: No space left on device{f' while writing {where}' if where else ''}.", file=sys.stderr)
        print("Free some space on that disk, then run the same command again (a training run resumes from its last checkpoint).",
              file=sys.stderr)
        return UserError.exit_code


if __name__ == "__main__":
    sys.exit(main())

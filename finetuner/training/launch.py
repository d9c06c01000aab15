"""Launching a multi-process run: torchrun over :mod:`finetuner.training.distributed`, configs saved.

``finetuner run RECIPE --gpus N`` (or a recipe with a ``distributed:`` section) comes here from
:func:`finetuner.training.run.train`. The launcher, in the user's process:

1. resolves the recipe and prepares the run folder exactly like a one-process run (the lock,
   resume checks, ``recipe.yaml``), and holds the lock while the ranks run;
2. writes the configs the run uses into ``<run>/distributed/``: ``accelerate_config.yaml`` (for
   ``accelerate launch --config_file``; for fsdp, accelerate's FSDP2 plugin settings, which
   finetuner itself does not use: its ranks call torch's ``fully_shard``), ``deepspeed.json`` for
   the ZeRO strategies, and ``launch.sh``, the exact ``torchrun`` command, so a user can see and
   reuse them;
3. starts ``python -m torch.distributed.run ... -m finetuner.training.distributed RUN_DIR`` (torchrun, not
   ``accelerate launch``: on CPU ``accelerate launch --cpu --num_processes 2`` starts only one
   process), follows rank 0's ``events.jsonl`` for the callbacks, and turns the end of the run
   into a :class:`~finetuner.training.result.TrainResult`.

Several machines (``distributed.nodes`` > 1): the same command runs on each with its
``node_rank``; the run folder is on a file system they share. Node 0's launcher does steps 1-2
and holds the lock; the launcher of any other node waits for node 0's configs in the run folder,
then starts its torchrun (the ranks meet at ``master_addr:master_port``), writes its ranks' output
to ``distributed/launch-node<K>.log`` and follows the same ``events.jsonl`` (rank 0 writes it).

Stopping: the first stop request (Ctrl-C in the CLI, or ``stop_event``) writes ``<run>/.stop``;
every rank sees it at its next step, they agree to stop at the same step, save a checkpoint and
exit. A second Ctrl-C, an error in the launcher, or the launcher dying (``PR_SET_PDEATHSIG``)
terminates torchrun, which terminates its workers; each worker also dies with torchrun. torchrun
stops all ranks when one fails. Output of all ranks goes through the launcher to
``<run>/distributed/launch.log`` (:mod:`finetuner.training.rank_output`: elsewhere when that disk is full).

A failed run ends with what a rank reported (its own one-line error: a full disk, an out-of-memory
stop), else rank 0's ``error`` event, else torchrun's exit status and the end of the ranks' output; the
checkpoint the ranks were writing when it failed is removed first (:func:`_failure`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from finetuner.children import module_args, module_command, safe_env, stop_signals_as_in_a_terminal
import finetuner.device as dev
from finetuner.errors import UserError
from finetuner.config.recipe import Recipe
from finetuner.config.recipe_yaml import load_yaml
from finetuner.config.runtime import Runtime, resolve_runtime
from finetuner.strategy_table import DDP_ENGINE, FSDP_ENGINE
from finetuner.training.rank_output import RankOutput
from finetuner.training.seal import TRUST_ENV
from finetuner.tracking.owned import RESUME_ENV
from finetuner.workdir import work_dir

log = logging.getLogger(__name__)

#: Set in the environment of every rank; a rank never launches again.
RANK_ENV = "FINETUNER_DISTRIBUTED_RANK"
STOP_FILE = ".stop"
CONFIG_DIR = "distributed"
#: How long the launcher of a node other than 0 waits for node 0 to prepare the run folder.
NODE_WAIT_S = 900.0


def needs_launch(recipe: Recipe) -> bool:
    """True when the recipe asks for more than one process or for a sharding engine."""
    if os.environ.get(RANK_ENV):
        return False
    d = recipe.distributed
    return d.world_size > 1 or d.row.engine != DDP_ENGINE


# --------------------------------------------------------------------------- configs
def deepspeed_config(recipe: Recipe, rt: Runtime) -> dict[str, Any]:
    """The DeepSpeed JSON config for a ZeRO strategy (``train_batch_size`` = the effective batch),
    in the precision the trainer autocasts to (``rt.precision``)."""
    cuda = rt.is_cuda
    d, t = recipe.distributed, recipe.training
    stage = d.row.zero_stage
    micro = int(t.micro_batch_size)
    n_micro = -(-t.effective_batch_size // micro)
    gas = max(1, -(-n_micro // d.world_size))
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if d.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if d.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * d.world_size,
        "gradient_clipping": t.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": cuda and rt.precision == "bf16"},
        "fp16": {"enabled": cuda and rt.precision == "fp16"},
        "zero_allow_untested_optimizer": True,
        # torch AdamW may step the offloaded states when cpu_adam is off
        "zero_force_ds_cpu_optimizer": bool(d.offload != "none" and d.cpu_adam),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def accelerate_config(recipe: Recipe, rt: Runtime, transformer_layer: str | None = None) -> dict[str, Any]:
    """An ``accelerate launch --config_file`` config equivalent to this launch."""
    cuda = rt.is_cuda
    d = recipe.distributed
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": d.nodes,
        "machine_rank": d.node_rank,
        "num_processes": d.world_size,
        "main_process_ip": d.master_addr,
        "main_process_port": d.master_port,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": not cuda,
        "mixed_precision": "no" if rt.precision == "fp32" else rt.precision,
        "main_training_function": "main",
        "downcast_bf16": "no",
    }
    if d.row.launcher is not None:
        cfg["distributed_type"] = d.row.launcher
    if d.deepspeed:
        cfg["deepspeed_config"] = {"deepspeed_config_file": "deepspeed.json", "zero3_init_flag": False}
    elif d.row.engine == FSDP_ENGINE:
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": transformer_layer or "LlamaDecoderLayer",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": d.fsdp_offload,
            "fsdp_activation_checkpointing": bool(recipe.training.gradient_checkpointing is True),
        }
    else:
        cfg["distributed_type"] = ("MULTI_GPU" if cuda else "MULTI_CPU") if d.world_size > 1 else "NO"
    return cfg


def torchrun_command(recipe: Recipe, run_dir: Path) -> list[str]:
    """``python -m torch.distributed.run`` for this node (``--standalone`` on one machine: a free port); it starts
    each rank as ``python -u -P -m finetuner.training.distributed RUN`` (``--no-python``: the interpreter's flags
    are finetuner's), so that neither it nor a rank imports from the working folder (finetuner.children); a rank's
    ``python`` is ``$FINETUNER_PYTHON`` where that is set (:func:`finetuner.children.python_command`), torchrun's
    this interpreter."""
    d = recipe.distributed
    cmd = [sys.executable, *module_args("torch.distributed.run", f"--nproc_per_node={d.num_processes}")]
    if d.nodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={d.nodes}", f"--node_rank={d.node_rank}", f"--master_addr={d.master_addr}", f"--master_port={d.master_port}"]
    return cmd + ["--no-python", *module_command("finetuner.training.distributed", str(run_dir), unbuffered=True)]


def _transformer_layer(model_dir: str) -> str | None:
    """The decoder-layer class name FSDP wraps (``LlamaForCausalLM`` → ``LlamaDecoderLayer``)."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.is_file():
        return None
    arch = (json.loads(cfg.read_text(encoding="utf-8")).get("architectures") or [""])[0]
    return arch.replace("ForCausalLM", "DecoderLayer") if arch.endswith("ForCausalLM") else None


def write_configs(recipe: Recipe, run_dir: Path, rt: Runtime) -> dict[str, Path]:
    """Write the configs of this launch into ``<run>/distributed/``; returns their paths."""
    cuda = rt.is_cuda
    import yaml

    from finetuner.fileio import atomic_write_json, atomic_write_text

    out = Path(run_dir) / CONFIG_DIR
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    if recipe.distributed.deepspeed:
        paths["deepspeed"] = out / "deepspeed.json"
        atomic_write_json(paths["deepspeed"], deepspeed_config(recipe, rt))
    paths["accelerate"] = out / "accelerate_config.yaml"
    acc = accelerate_config(recipe, rt, _transformer_layer(recipe.model.name))
    atomic_write_text(paths["accelerate"], yaml.safe_dump(acc, sort_keys=False))
    paths["launch"] = out / "launch.sh"
    env = "ACCELERATE_USE_CPU=true " if not cuda else ""
    atomic_write_text(
        paths["launch"],
        "#!/bin/sh\n# The command finetuner ran for this run (resumes from the run folder's checkpoints).\n"
        f"{env}{shlex.join(torchrun_command(recipe, run_dir))}\n",
    )
    return paths


# --------------------------------------------------------------------------- running
def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launcher dies, even by SIGKILL (Linux); Ctrl-C as in a
    terminal (:func:`~finetuner.children.stop_signals_as_in_a_terminal`)."""
    stop_signals_as_in_a_terminal()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _relay_events(path: Path, callbacks, offset: int, stop: threading.Event, relayed: list[dict[str, Any]]) -> None:
    """Hand each new event of ``events.jsonl`` (written by rank 0) to the callbacks, and keep it in
    ``relayed``, until ``stop``. A callback that raises is logged and not called again."""
    from finetuner.runs.events import follow

    callbacks = list(callbacks or [])
    for event in follow(path, poll=0.2, offset=offset, stop=stop):
        relayed.append(event)
        for cb in list(callbacks):
            try:
                cb(event)
            except Exception:
                log.exception("An event callback failed; it gets no more events.")
                callbacks.remove(cb)


def _terminate(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM torchrun (it stops its workers), then SIGKILL; workers die with it (PDEATHSIG)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _failure(run_dir: Path, status: int, end: dict[str, Any] | None, output: RankOutput, first_node: bool) -> UserError:
    """The error a failed run ends with, once torchrun and every rank have ended. On node 0, which holds the
    run's lock, the checkpoint they were writing is removed first. Then: what a rank reported
    (:class:`RankOutput`; a full disk said again with the space free now), else the ``error`` event rank 0
    wrote, else torchrun's exit status with the end of the ranks' output; written as the run's ``error``
    event where rank 0 wrote none."""
    from finetuner.runs.events import EventWriter
    from finetuner.worker_protocol import error_of, error_text, event_fields
    from finetuner.training.checkpoint import remove_staging

    if first_node:
        remove_staging(run_dir)
    reported = output.report()
    if reported is None and end is not None and end["event"] == "error":
        reported = end
    if reported is not None and reported.get("user_error"):
        error = error_of(reported)
        error.add_hint(output.note())  # the ranks' output is not all where the run folder says
        event = event_fields(error)
    else:
        what = error_text(reported) if reported is not None else f"a training process failed (torchrun exit status {status})"
        error = UserError(f"Multi-process training failed: {what}", hint=output.where())
        event = {"message": what, "type": "DistributedRunFailed", "user_error": False}
    if first_node and (end is None or end["event"] != "error"):  # the events' one writer is on node 0
        try:
            writer = EventWriter(run_dir / "events.jsonl")
            try:
                writer.emit("error", message=event["message"], type=event["type"], user_error=event["user_error"])
            finally:
                writer.close()
        except OSError as e:  # a full disk: the error raised says what happened
            log.warning("Could not record the error in %s (%s).", run_dir / "events.jsonl", e)
    return error


def _wait_for_first_node(recipe: Recipe, stop_event: threading.Event | None) -> Path:
    """On a node other than 0: wait until node 0's launcher has prepared the shared run folder (its
    ``distributed/launch.sh`` is written last); returns the folder. A finished run raises
    :class:`~finetuner.runs.folder.RunFinished` here as on node 0, which then launches nothing."""
    from finetuner.runs.folder import check_not_finished
    from finetuner.training.checkpoint import latest_checkpoint

    run_dir = recipe.output_path()
    ready = run_dir / CONFIG_DIR / "launch.sh"
    d = recipe.distributed
    log.warning("Node %d of %d: waiting for node 0 to prepare %s.", d.node_rank, d.nodes, run_dir)
    deadline = time.monotonic() + NODE_WAIT_S
    while not (ready.is_file() and (run_dir / "recipe.yaml").is_file()):
        if stop_event is not None and stop_event.is_set():
            raise UserError(f"Stopped while node {d.node_rank} waited for node 0 to prepare {run_dir}.")
        if time.monotonic() > deadline:
            raise UserError(
                f"distributed.node_rank: node {d.node_rank} waited {NODE_WAIT_S:.0f} s and node 0 has not "
                f"prepared the run folder {run_dir}.",
                hint="Start node 0 with the same recipe (node_rank 0) and the same output_dir, on a file system every node shares.",
            )
        time.sleep(0.5)
    last = latest_checkpoint(run_dir)
    if last is not None:
        saved = load_yaml((run_dir / "recipe.yaml").read_text(encoding="utf-8"), str(run_dir / "recipe.yaml")) or {}
        check_not_finished(run_dir, recipe, saved, last)
    return run_dir


def launch_training(
    recipe: Recipe,
    callbacks=None,
    resume: bool = True,
    stop_event: threading.Event | None = None,
    profile_memory: bool = False,
    trust_checkpoints: bool = False,
    tracking_resume: bool = False,
):
    """Run ``recipe`` on ``distributed.world_size`` processes; returns a :class:`TrainResult`.
    ``trust_checkpoints``: the ranks may resume from sharded checkpoints this user did not seal
    (:mod:`finetuner.training.seal`); ``tracking_resume``: rank 0 continues tracking runs it did not start
    (:mod:`finetuner.tracking.owned`)."""
    from finetuner.training.checkpoint import latest_checkpoint, load_trainer_state
    from finetuner.runs.schema import RunStateTracker
    from finetuner.fileio import atomic_write_json
    from finetuner.planning.bounds import check_before_run
    from finetuner.planning.resolve import resolve_for_run
    from finetuner.runs.folder import prepare_run_dir
    from finetuner.training.result import TrainResult
    from finetuner.training.inputs import check_inputs

    cuda = dev.available() and recipe.device != dev.CPU
    d = recipe.distributed
    if d.deepspeed and importlib.util.find_spec("deepspeed") is None:
        raise UserError(
            f"distributed.strategy: {d.strategy} runs on DeepSpeed, which is not installed.",
            hint="Install the distributed extra (pip install -c constraints.txt -e '.[distributed]'), or use strategy ddp.",
        )
    if cuda and dev.count() < d.num_processes:
        raise UserError(
            f"distributed.num_processes: {d.num_processes} processes need {d.num_processes} GPUs, "
            f"but {dev.count()} are visible.",
            hint="Lower --gpus, or set device: cpu to run the processes on the CPU (gloo).",
        )
    if profile_memory:
        log.warning("--profile-memory is not supported for multi-process runs; ignored.")
    first_node = d.node_rank == 0
    if first_node:
        from finetuner.planning.data_auto import resolve_data

        recipe, resolved = resolve_data(recipe)  # data ``auto`` values → the plan's rules, on the recipe's own data
        for key, choice in resolved.items():  # the ranks' start event is written by their own process: said here
            log.warning("%s: auto → %s (%s)", key, choice["value"], choice["reason"])
        recipe, plan = resolve_for_run(recipe, resume)
        check_before_run(recipe)  # as one process checks it (finetuner.planning.bounds), before the folder is made
        run_dir, recipe, notes, lock = prepare_run_dir(recipe, resume, check_inputs)
    else:  # node 0 prepares the shared run folder, resolves the recipe and holds the lock
        run_dir, lock = _wait_for_first_node(recipe, stop_event), None
    try:
        if first_node:
            for note in notes:
                log.warning(note)
            if plan is not None:
                atomic_write_json(run_dir / "plan.json", plan.to_dict())
            launch_sh = write_configs(recipe, run_dir, resolve_runtime(recipe))["launch"]
            log_path = launch_sh.with_name("launch.log")
            (run_dir / STOP_FILE).unlink(missing_ok=True)
        else:
            log_path = run_dir / CONFIG_DIR / f"launch-node{d.node_rank}.log"
        events_path = run_dir / "events.jsonl"
        offset = events_path.stat().st_size if events_path.exists() else 0
        relayed: list[dict[str, Any]] = []
        relay_stop = threading.Event()
        follower = threading.Thread(target=_relay_events, args=(events_path, callbacks, offset, relay_stop, relayed), daemon=True)
        env = safe_env({**os.environ, RANK_ENV: "1", "PYTHONUNBUFFERED": "1"})
        if trust_checkpoints:
            env[TRUST_ENV] = "1"
        if tracking_resume:
            env[RESUME_ENV] = "1"
        if not cuda:
            env["ACCELERATE_USE_CPU"] = "true"
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // d.num_processes)))
        cmd = torchrun_command(recipe, run_dir)
        log.info("Launching: %s", shlex.join(cmd))
        output = RankOutput(log_path)
        # torchrun and the ranks run in finetuner's working folder, not the one the command was typed in (finetuner.workdir)
        proc = subprocess.Popen(cmd, env=env, cwd=work_dir(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)
        output.start(proc.stdout)
        follower.start()
        stop_requested = False
        try:
            while proc.poll() is None:
                if stop_event is not None and stop_event.is_set() and not stop_requested:
                    (run_dir / STOP_FILE).write_text(str(os.getpid()), encoding="utf-8")
                    stop_requested = True
                time.sleep(0.2)
        except BaseException:  # a second Ctrl-C, or anything else: no rank may outlive the launcher
            _terminate(proc)
            raise
        finally:
            relay_stop.set()
            follower.join()
            output.join()
            (run_dir / STOP_FILE).unlink(missing_ok=True)
        tracker = RunStateTracker()
        for event in relayed:
            tracker.feed(event)
        end = tracker.end  # the terminal event the ranks wrote, if they did
        if proc.returncode != 0 or end is None or end["event"] == "error":
            raise _failure(run_dir, proc.returncode, end, output, first_node)
        ckpt = latest_checkpoint(run_dir)
        losses = load_trainer_state(ckpt)["losses"] if ckpt else []
        if end["event"] == "stopped":
            return TrainResult(run_dir, run_dir / "adapter", {"step": end.get("step")}, stopped=True, losses=losses)
        metrics = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
        return TrainResult(run_dir, Path(end["adapter_dir"]), metrics, losses=losses)
    finally:
        if lock is not None:
            lock.release()

"""Load and soak figures for docs/soak.md (CPU, the shipped demo model).

Two measurements, each with one command:

  python -m scripts.bench.soak disk --steps 3000 --save-every 10 --keep-last 3
      A long run of tiny steps with frequent checkpoints (``finetuner run`` as a subprocess),
      sampled every 0.2 s from outside: disk use of the run folder, number of checkpoint folders,
      size of events.jsonl; a reader follows events.jsonl while it grows (finetuner.follow) and
      checks every line parses and the steps arrive in order.

  python -m scripts.bench.soak ui --pages 0,4 --reps 2 --steps 800
      The web UI (``finetuner ui``) serving while a run trains (started through finetuner.runs.jobs,
      as the UI's Start button does), with 0 and with N browser sessions (headless Chromium,
      each its own browser context) open on the Train tab, which polls the run every second.
      The run's median tokens/s over the steps after every page has loaded and shows the run
      (page loading is not polling) is compared between the two, in alternating order, with
      the CPU time the UI server and the browsers used over the same stretch.

``--out FILE.json`` keeps the raw figures; the Markdown table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("FINETUNER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage"]


def demo_recipe(steps: int, save_every: int, keep_last: int, log_every: int = 1) -> dict:
    """The demo model with the smallest steps that still train: LoRA r=4, 64 tokens, micro-batch 1."""
    return {
        "name": "soak",
        "model": {"name": str(REPO / "data" / "demo_model")},
        "method": "lora",
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(REPO / "data" / "alpaca_sample.json"), "max_seq_len": 64, "val_size": 0},
        "training": {"max_steps": steps, "lr": 1e-3, "micro_batch_size": 1, "gradient_accumulation": 1,
                     "warmup_steps": 0},
        "checkpointing": {"save_every": save_every, "keep_last": keep_last},
        "logging": {"every": log_every, "tensorboard": False},
    }


# ------------------------------------------------------------------------------------- disk
def soak_disk(args) -> dict:
    import yaml

    from finetuner.runs.events import follow
    from finetuner.fileio import tree_bytes

    work = Path(args.work or tempfile.mkdtemp(prefix="ft-soak-"))
    run_dir = work / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    recipe = work / "soak.yaml"
    recipe.write_text(yaml.safe_dump({**demo_recipe(args.steps, args.save_every, args.keep_last), "output_dir": str(run_dir)}))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "finetuner.cli.main", "run", str(recipe), "--quiet"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    reader = {"events": 0, "steps": [], "max_lag_s": 0.0, "out_of_order": 0}

    def read():
        last = 0
        for ev in follow(run_dir, poll=0.2, timeout=600):
            reader["events"] += 1
            if ev.get("event") == "step":
                if ev["step"] <= last:
                    reader["out_of_order"] += 1
                last = ev["step"]
                reader["steps"].append(ev["step"])
                reader["max_lag_s"] = max(reader["max_lag_s"], time.time() - ev["time"])

    t = threading.Thread(target=read, daemon=True)
    t.start()
    samples = []
    while proc.poll() is None:
        ck = run_dir / "checkpoints"
        n_ck = len([p for p in ck.iterdir() if p.name.startswith("step-")]) if ck.is_dir() else 0
        ev = run_dir / "events.jsonl"
        samples.append((time.monotonic() - t0, tree_bytes(run_dir) if run_dir.exists() else 0, n_ck,
                        ev.stat().st_size if ev.exists() else 0))
        time.sleep(0.2)
    wall = time.monotonic() - t0
    t.join(timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    parsed = sum(1 for line in lines if json.loads(line))
    ckpts = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    one_ckpt = tree_bytes(ckpts[-1])
    quarter = [s[1] for s in samples if s[0] > wall / 4]
    result = {
        "steps": args.steps, "save_every": args.save_every, "keep_last": args.keep_last, "wall_s": round(wall, 1),
        "checkpoints_saved": args.steps // args.save_every, "checkpoint_folders_max": max(s[2] for s in samples),
        "checkpoint_folders_end": len(ckpts), "checkpoint_bytes": one_ckpt,
        "run_folder_bytes_max": max(s[1] for s in samples), "run_folder_bytes_end": tree_bytes(run_dir),
        "run_folder_bytes_after_first_quarter": [min(quarter), max(quarter)] if quarter else None,
        "events_lines": len(lines), "events_parsed": parsed, "events_bytes": (run_dir / "events.jsonl").stat().st_size,
        "follower_events": reader["events"], "follower_steps": len(reader["steps"]),
        "follower_out_of_order": reader["out_of_order"], "follower_max_lag_s": round(reader["max_lag_s"], 2),
        "samples": len(samples),
    }
    mib = 2**20
    print(f"""
| measure | value |
|---|---|
| steps, checkpoint every, keep last | {args.steps}, {args.save_every}, {args.keep_last} |
| wall time | {result['wall_s']} s ({args.steps / wall:.1f} steps/s, {result['checkpoints_saved']} checkpoints written) |
| checkpoint folders: most seen at once / at the end | {result['checkpoint_folders_max']} / {result['checkpoint_folders_end']} |
| one checkpoint | {one_ckpt / mib:.2f} MiB |
| run folder: largest seen / at the end | {result['run_folder_bytes_max'] / mib:.2f} MiB / {result['run_folder_bytes_end'] / mib:.2f} MiB |
| run folder after the first quarter of the run: smallest / largest | {result['run_folder_bytes_after_first_quarter'][0] / mib:.2f} / {result['run_folder_bytes_after_first_quarter'][1] / mib:.2f} MiB |
| events.jsonl | {result['events_lines']} lines, {result['events_bytes'] / mib:.2f} MiB, {parsed} parsed |
| follower (finetuner.follow while it grew) | {result['follower_events']} events, {result['follower_steps']} steps, {result['follower_out_of_order']} out of order, lag at most {result['follower_max_lag_s']} s |
""")
    return result


# --------------------------------------------------------------------------------------- ui
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(procs) -> float:
    """User + system CPU time of these processes (ones that ended count as 0)."""
    import psutil

    total = 0.0
    for pr in procs:
        try:
            t = pr.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _chromium_processes():
    import psutil

    return [pr for pr in psutil.process_iter(["name"]) if "chrom" in (pr.info["name"] or "")]


def soak_ui(args) -> dict:
    from playwright.sync_api import sync_playwright

    from finetuner.runs import jobs
    from finetuner.runs.events import read_events
    from finetuner.config.recipe import Recipe

    work = Path(args.work or tempfile.mkdtemp(prefix="ft-soak-ui-"))
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), GRADIO_ANALYTICS_ENABLED="False")
    server = subprocess.Popen([sys.executable, "-m", "finetuner", "ui", "--port", str(port), "--runs-dir", str(runs)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work)
    url = f"http://127.0.0.1:{port}/"
    import psutil

    ui_proc = psutil.Process(server.pid)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    pages_list = [int(p) for p in args.pages.split(",")]
    order = [p for r in range(args.reps) for p in (pages_list if r % 2 == 0 else pages_list[::-1])]
    rows = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            for n_pages in order:
                recipe = Recipe.from_dict(demo_recipe(args.steps, 10**6, 1, log_every=1))
                job = jobs.start_job(recipe, runs_dir=runs)
                contexts = []
                for _ in range(n_pages):
                    ctx = browser.new_context(viewport={"width": 1360, "height": 1000})
                    pg = ctx.new_page()
                    pg.goto(url)
                    pg.get_by_role("tab", name="4 · Train").click()
                    contexts.append((ctx, pg))
                for _ctx, pg in contexts:  # loaded and following the run: from here on only the polling costs
                    pg.locator("#train-status").filter(has_text=job.name).wait_for(timeout=120_000)
                time.sleep(2)
                ready, cpu0 = time.time(), (_cpu_seconds([ui_proc]), _cpu_seconds(_chromium_processes()))
                polled = 0
                while not jobs.wait_job(job, 1):
                    for _ctx, pg in contexts:  # each page shows the live run (its timer polls every second)
                        if job.name in pg.locator("#train-status").inner_text():
                            polled += 1
                ui_cpu, browser_cpu = _cpu_seconds([ui_proc]) - cpu0[0], _cpu_seconds(_chromium_processes()) - cpu0[1]
                for ctx, _pg in contexts:
                    ctx.close()
                steps = [e for e in read_events(Path(job.run_dir) / "events.jsonl") if e.get("event") == "step"]
                tps = [e["tokens_per_s"] for e in steps if e["step"] > 10 and e["time"] > ready and e.get("tokens_per_s")]
                rows.append({"pages": n_pages, "run": job.name, "steps": len(steps), "tokens_per_s_median": statistics.median(tps),
                             "pages_showing_the_run": polled, "ui_server_cpu_s": round(ui_cpu, 2),
                             "browser_cpu_s": round(browser_cpu, 2), "run_wall_s": steps[-1]["elapsed_s"]})
                print(f"  {n_pages} page(s): {statistics.median(tps):.0f} tokens/s (median over {len(tps)} steps); "
                      f"CPU during the run: UI server {ui_cpu:.1f} s, browsers {browser_cpu:.1f} s, "
                      f"training {steps[-1]['elapsed_s']:.1f} s wall", flush=True)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    by = {p: [r["tokens_per_s_median"] for r in rows if r["pages"] == p] for p in pages_list}
    base = statistics.median(by[pages_list[0]])
    print("\n| browser sessions on the Train tab | tokens/s (median of runs) | runs | vs none | UI server CPU per run | browsers' CPU per run |\n|---|---|---|---|---|---|")
    for p in pages_list:
        med = statistics.median(by[p])
        ui = statistics.median([r["ui_server_cpu_s"] for r in rows if r["pages"] == p])
        br = statistics.median([r["browser_cpu_s"] for r in rows if r["pages"] == p])
        print(f"| {p} | {med:.0f} ({', '.join(f'{v:.0f}' for v in by[p])}) | {len(by[p])} | {100 * (med / base - 1):+.1f}% | {ui:.1f} s | {br:.1f} s |")
    return {"rows": rows, "steps": args.steps, "pages": pages_list, "reps": args.reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("disk")
    d.add_argument("--steps", type=int, default=3000)
    d.add_argument("--save-every", type=int, default=10)
    d.add_argument("--keep-last", type=int, default=3)
    u = sub.add_parser("ui")
    u.add_argument("--pages", default="0,4")
    u.add_argument("--reps", type=int, default=2)
    u.add_argument("--steps", type=int, default=800)
    for p in (d, u):
        p.add_argument("--work", help="working folder (default: a new temporary one)")
        p.add_argument("--out", help="write the raw figures here (JSON)")
    args = ap.parse_args()
    os.environ.setdefault("FINETUNER_CACHE_DIR", str(REPO / ".cache" / "finetuner"))
    result = soak_disk(args) if args.what == "disk" else soak_ui(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""A long run in miniature: many small steps with a checkpoint every other step. Disk use stays
bounded by checkpointing.keep_last while it runs, and events.jsonl can be read the whole time.
(scripts/bench/soak.py runs the long version; its figures are in docs/soak.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.conftest import REPO, write_recipe, HANG_GUARD_S
from finetuner.runs.events import follow
from finetuner.fileio import tree_bytes


def test_many_checkpoints_keep_disk_bounded_and_events_readable_while_growing(recipe_dict, tmp_path):
    steps, keep = 40, 2
    recipe_dict["training"].update(max_steps=steps, micro_batch_size=1, gradient_accumulation=1)
    recipe_dict["checkpointing"] = {"save_every": 2, "keep_last": keep}
    recipe_dict["logging"] = {"tensorboard": False, "every": 1}
    run_dir = Path(recipe_dict["output_dir"])
    r = write_recipe(tmp_path / "r.yaml", recipe_dict)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "finetuner.cli.main", "run", str(r), "--quiet"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: list[dict] = []
    reader = threading.Thread(target=lambda: seen.extend(follow(run_dir, poll=0.05, timeout=HANG_GUARD_S)), daemon=True)
    reader.start()
    most, sizes = 0, []
    while proc.poll() is None:
        ck = run_dir / "checkpoints"
        if ck.is_dir():
            names = [p.name for p in ck.iterdir()]
            most = max(most, sum(n.startswith("step-") for n in names))
            sizes.append(tree_bytes(ck))
        time.sleep(0.05)
    assert proc.wait() == 0, proc.stderr.read()
    reader.join(timeout=HANG_GUARD_S)

    # at most one checkpoint beyond keep_last exists, between publishing a new one and removing the oldest
    assert 0 < most <= keep + 1
    final = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert final == [f"step-{s:08d}" for s in (steps - 2, steps)]
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    one = tree_bytes(run_dir / "checkpoints" / final[-1])
    assert max(sizes) <= (keep + 1) * one * 1.05  # never the 20 checkpoints written

    # the follower read every event, in order, while the file grew
    lines = (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == seen
    step_numbers = [e["step"] for e in seen if e["event"] == "step"]
    assert step_numbers == list(range(1, steps + 1))
    assert sum(e["event"] == "checkpoint" for e in seen) >= steps // 2
    assert seen[-1]["event"] in ("done", "samples") and any(e["event"] == "done" for e in seen)

"""scripts/quickstart.ipynb runs top to bottom (plan, train, load, generate, evaluate, merge)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "scripts" / "quickstart.ipynb"

#: library output a user of the Python API should not see on every call
NOISE = ("Loading weights", "Writing model shards", "FutureWarning", "Setting accelerator", "is deprecated")


def test_python3_kernel_is_this_interpreter():
    import sys

    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    assert "python3" in KernelSpecManager().find_kernel_specs()
    km = KernelManager(kernel_name="python3")
    cmd = km.format_kernel_cmd()
    assert cmd[0] == sys.executable, cmd  # the notebook runs in the project's venv


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("FINETUNER_QUICKSTART_DIR", str(tmp_path))
    monkeypatch.setenv("FINETUNER_QUICKSTART_STEPS", "20")
    monkeypatch.setenv("TQDM_DISABLE", "0")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=HANG_GUARD_S, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = {i: c.get("outputs", []) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    assert not [o for outs in outputs.values() for o in outs if o.get("output_type") == "error"]
    html = [o["data"]["text/html"] for outs in outputs.values() for o in outs if "text/html" in o.get("data", {})]
    assert any("<b>Run</b>" in h for h in html)  # the run's summary renders as HTML
    streams = "".join(o.get("text", "") for outs in outputs.values() for o in outs if o.get("output_type") == "stream")
    assert not [n for n in NOISE if n in streams], streams  # the API keeps library chatter out of the cells
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "merged" / "config.json").is_file()
    assert "evaluation" in (tmp_path / "run" / "metrics.json").read_text()


API_SCRIPT = """
import json, sys, warnings
import finetuner
from finetuner.config.recipe import Recipe

recipe = Recipe.from_dict(json.loads(sys.argv[1]))
run_dir = finetuner.train(recipe).run_dir
chat = finetuner.load_chat_model(run_dir)
chat.reply([{"role": "user", "content": "hi"}], max_new_tokens=4)
finetuner.merge_adapter(run_dir, run_dir.parent / "merged", dtype="fp32")
print("API DONE", file=sys.stderr, flush=True)

# the user's own settings are as they were: transformers still draws its bars and warns
import logging
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging
warnings.warn("the user's own FutureWarning", FutureWarning)
AutoModelForCausalLM.from_pretrained(sys.argv[2])
print(json.dumps({"bars": hf_logging.is_progress_bar_enabled(), "verbosity": hf_logging.get_verbosity(),
                  "deepspeed_filters": len(logging.getLogger("DeepSpeed").filters)}))
"""


def test_python_api_calls_are_quiet_and_leave_the_users_settings(tmp_path, recipe_dict, tiny_model_dir):
    """train, load_chat_model, reply and merge_adapter print no library progress bars or warnings
    (the CLI's environment variables are not set here), and afterwards transformers behaves as before."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "TQDM_DISABLE", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = str(REPO)
    recipe_dict["training"]["max_steps"] = 2
    p = subprocess.run([sys.executable, "-c", API_SCRIPT, json.dumps(recipe_dict), str(tiny_model_dir)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert p.returncode == 0, p.stderr
    api, _, after = p.stderr.partition("API DONE")
    assert not [n for n in NOISE if n in api + p.stdout], api
    assert "the user's own FutureWarning" in after and "Loading weights" in after, after
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"bars": True, "verbosity": 30, "deepspeed_filters": 0}

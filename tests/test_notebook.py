"""scripts/quickstart.ipynb runs top to bottom (plan, train, load, generate, evaluate, merge)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "scripts" / "quickstart.ipynb"


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
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = {i: c.get("outputs", []) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    assert not [o for outs in outputs.values() for o in outs if o.get("output_type") == "error"]
    html = [o["data"]["text/html"] for outs in outputs.values() for o in outs if "text/html" in o.get("data", {})]
    assert any("<b>Run</b>" in h for h in html)  # the run's summary renders as HTML
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "merged" / "config.json").is_file()
    assert "evaluation" in (tmp_path / "run" / "metrics.json").read_text()

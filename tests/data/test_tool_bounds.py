"""Issue 66, part 4: a row's tool schemas are bounded before they are parsed or rendered (finetuner.data.tools:
MAX_TOOLS, MAX_TOOLS_BYTES, MAX_TOOLS_DEPTH). The audit's inputs: a 58 MB tool description took 17.4 GB and did not
end in 600 s, 200,000 tools in one row 10.9 GB, 100,000 nested levels in a ``tools`` JSON string a RecursionError
traceback. Each is now one line naming the file, the row and the bound, in the run, the plan, the UI's data preview
and ``chat --tools``, measured on the process the user starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetuner.data import tools
from finetuner.data.rows import RowError
from tests.conftest import REPO, cli_in_process

DEMO_MODEL = REPO / "data" / "demo_model"
CALL = [{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                             "function": {"name": "f0", "arguments": {}}}]}]
FINE = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
#: the audit's three inputs: a row's ``tools`` value, and what the one line says of it
HOSTILE = {
    "description_58mb": ([{"type": "function", "function": {"name": "f0", "description": "weather " * 7_250_000}}],
                         "'tools' is over 1,048,576 bytes"),
    "tools_200000": ([{"type": "function", "function": {"name": f"f{i}"}} for i in range(200_000)],
                     "'tools' lists 200,000 tools"),
    "nested_100000": ("[" * 100_000 + "]" * 100_000, "'tools' nests arrays or objects 100,000 levels deep"),
}
BOUND = ("a row may offer at most 128 tools, in at most 1,048,576 bytes (1 MiB) nested at most 64 levels deep "
         "(docs/tools.md)")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, Path]:
    """One JSON Lines file for each input: its first row has the hostile ``tools``, three fine rows follow; and a
    recipe training on it."""
    d = tmp_path_factory.mktemp("tool_bounds")
    out = {}
    for name, (value, _said) in HOSTILE.items():
        data = d / f"{name}.jsonl"
        with data.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"messages": CALL, "tools": value}) + "\n")
            f.writelines(json.dumps(FINE) + "\n" for _ in range(3))
        (d / f"{name}.yaml").write_text(f"name: {name}\nmodel:\n  name: {DEMO_MODEL}\ndata:\n  path: {data}\n"
                                        "  max_seq_len: 64\ntraining:\n  max_steps: 1\n", encoding="utf-8")
        out[name] = data
    assert out["description_58mb"].stat().st_size > 55 * 2**20
    return out


#: ``python -m finetuner`` that, as it exits, writes its own peak resident memory (``VmHWM`` of /proc/self/status,
#: in KiB) to the file $PEAK_FILE names. Not ``wait4``'s ``ru_maxrss``: Linux keeps a process's maximum across
#: ``execve``, so a child forked from a test worker of 2.2 GiB reported 2,288 MiB whatever it did itself; ``VmHWM``
#: belongs to the memory of the program exec'd, measured from its start.
OWN_PEAK = """import atexit, os, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(os.environ["PEAK_FILE"], "w") as out:
        out.write(kib)
atexit.register(_peak)
sys.argv[0] = "finetuner"
runpy.run_module("finetuner", run_name="__main__", alter_sys=True)
"""


def measured(*args: str, tmp: Path) -> tuple[subprocess.CompletedProcess, float, float]:
    """``python -m finetuner ARGS`` as the user starts it: the result, its own peak resident memory in MiB
    (:data:`OWN_PEAK`) and its CPU seconds, user and system (``wait4``'s rusage of that one process: what it costs,
    whatever else the machine runs; its wall time varies with the load), killed after 300 s."""
    import threading

    peak_file = tmp / "peak_kib"
    peak_file.unlink(missing_ok=True)
    with (tmp / "stdout").open("w+") as out, (tmp / "stderr").open("w+") as err:
        p = subprocess.Popen([sys.executable, "-c", OWN_PEAK, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                             env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                                  "PEAK_FILE": str(peak_file)})
        guard = threading.Timer(300, p.kill)
        guard.start()
        _pid, status, usage = os.wait4(p.pid, 0)
        guard.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())
    assert peak_file.exists(), f"the command said no peak (exit {p.returncode}): {done.stderr[-2000:]}"
    return done, int(peak_file.read_text()) / 1024, usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_tool_schemas_are_one_line_in_run_and_plan_under_1_gib_and_a_minute(hostile, name, tmp_path):
    data, said = hostile[name], HOSTILE[name][1]
    run, peak, seconds = measured("run", str(data.with_suffix(".yaml")), "-o", str(tmp_path / "out"), tmp=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"error: {data}, line 1: {said}: {BOUND} (format 'chat')."], run.stderr[-3000:]
    assert peak < 1024 and seconds < 60, (peak, seconds)
    print(f"{name}: run {peak:.0f} MiB {seconds:.1f} s of CPU")
    plan, peak, seconds = measured("plan", "-m", str(DEMO_MODEL), "--gpu", "cpu", "--data", str(data), tmp=tmp_path)
    assert "Traceback" not in plan.stderr, plan.stderr[-3000:]
    note = " ".join(plan.stdout.split())  # the plan wraps its notes
    assert f"Note: 1 row of 4 cannot be used (first: {data}, line 1: {said}: {BOUND} (format 'chat'))" in note, note
    assert peak < 1024 and seconds < 60, (peak, seconds)
    print(f"{name}: plan {peak:.0f} MiB {seconds:.1f} s of CPU")


def test_the_ui_data_preview_names_the_row_and_the_bound(hostile):
    from transformers import AutoTokenizer

    from finetuner.data.preview import preview_data
    from finetuner.errors import UserError

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    for name, (_value, said) in HOSTILE.items():
        with pytest.raises(UserError) as e:
            preview_data(str(hostile[name]), tok, n=2, max_seq_len=64)
        assert str(e.value).splitlines()[0] == f"{hostile[name]}, line 1: {said}: {BOUND} (format 'chat')."


def test_a_tools_file_over_a_bound_is_one_line_in_chat(hostile, tmp_path):
    """``finetuner chat --tools FILE`` reads its file as a row's ``tools``: the same bounds."""
    many = tmp_path / "many_tools.json"
    text = json.dumps(HOSTILE["tools_200000"][0])
    many.write_text(text, encoding="utf-8")
    out = cli_in_process("chat", str(DEMO_MODEL), "--tools", str(many), "-p", "hi")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert (f"error: The tools file {many}: 'tools' is {len(text):,} characters of JSON: {BOUND}."
            in out.stderr.splitlines()), out.stderr


def test_real_tool_sets_fit_and_each_bound_is_exact():
    """The packaged tool data reads as before; 128 tools, 1 MiB and 64 levels are taken, one more is not, whether
    the value is a list or a JSON string (LLaMA-Factory's)."""
    schemas = tools.tools_file(REPO / "data" / "tool_calls_tools.json")
    assert tools.tool_names(schemas) == ["get_weather", "convert_units", "define_word"]
    for line in (REPO / "data" / "tool_calls.jsonl").read_text(encoding="utf-8").splitlines():
        tools.read_tools(json.loads(line).get("tools"))
    fn = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    for form in (lambda v: v, json.dumps):
        assert len(tools.read_tools(form(fn[:128]))) == 128
        with pytest.raises(RowError, match="'tools' lists 129 tools"):
            tools.read_tools(form(fn))

    def nested(levels: int) -> list:  # a tools list whose parameters nest to `levels` levels in all
        inner: dict = {"type": "string"}
        for _ in range(levels - 4):
            inner = {"x": inner}
        return [{"type": "function", "function": {"name": "f", "parameters": inner}}]

    for form in (lambda v: v, json.dumps):
        assert tools.read_tools(form(nested(64)))
        with pytest.raises(RowError, match="nests arrays or objects (more than 64|65) levels deep"):
            tools.read_tools(form(nested(65)))
    pad = 2**20 - len(json.dumps([{"name": "f", "description": ""}]).encode())
    assert tools.read_tools(json.dumps([{"name": "f", "description": "d" * pad}]))
    with pytest.raises(RowError, match="'tools' is 1,048,577 characters of JSON"):
        tools.read_tools(json.dumps([{"name": "f", "description": "d" * (pad + 1)}]))
    assert pad % 2 == 0 and tools.read_tools(json.dumps([{"name": "f", "description": "é" * (pad // 2)}],
                                                        ensure_ascii=False))
    with pytest.raises(RowError, match="'tools' is 1,048,578 bytes of JSON"):  # UTF-8 bytes, not characters
        tools.read_tools(json.dumps([{"name": "f", "description": "é" * (pad // 2 + 1)}], ensure_ascii=False))
    with pytest.raises(RowError, match="is over 1,048,576 bytes"):
        tools.read_tools([{"name": "f", "description": "d" * 2**20}])

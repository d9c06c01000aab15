"""Issue 66, part 4: a task folder (``eval --tasks --include-path``) is checked in a private copy, which is what the
harness reads (a swap after the check changes nothing); every refusal of the check is one line; the folder's
templates render with bounded memory and time (finetuner.infer.template_bounds). The audit's breaks, replayed:
``{{ 'A' * 3000000000 }}`` took 12.4 GB and wrote a 2.1 GB traceback, nested ``range(100000)`` loops never ended,
a folder swapped 12-18 s into the eval ran its code, ``include: [5]`` and a loading script gave tracebacks."""

from __future__ import annotations

import json
import stat
import time

import pytest

from tests.conftest import REPO, cli_in_process
from tests.data.test_tool_bounds import measured
from tests.infer.test_harness import ITEMS, TRUST, run, write_task  # noqa: F401 - run: the module's fixture

BOUNDS = "(finetuner's bounds on a template's memory and time: docs/safety.md); simplify the template."


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def test_a_template_of_3_billion_characters_is_one_line_in_the_memory_of_a_plain_eval(run, tmp_path):  # noqa: F811
    """``{{ 'A' * 3000000000 }}`` (12.4 GB and a 2.1 GB traceback before) is one line, exit 2, and the eval's process
    peaks under 1 GiB and within 128 MiB of the same eval of a plain task: what lm-evaluation-harness, torch and the
    model take (748-778 MiB seen here), not the template."""
    plain = tmp_path / "plain"
    plain.mkdir()
    write_task(plain, "plain_mc")
    base, base_peak, _ = measured("eval", str(run), "--tasks", "plain_mc", "--include-path", str(plain), "--no-write",
                                  tmp=tmp_path)
    assert base.returncode == 0, base.stderr[-3000:]
    d = tmp_path / "tasks"
    d.mkdir()
    write_task(d, "huge_mc", doc_to_text="{{ 'A' * 3000000000 }}")
    out, peak, seconds = measured("eval", str(run), "--tasks", "huge_mc", "--include-path", str(d), "--no-write",
                                  tmp=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors(out.stderr) == [f"error: {d}/huge_mc.yaml: doc_to_text: '*' would make over 10,000,000 "
                                  f"characters {BOUNDS}"], out.stderr[-3000:]
    # the CPU time is mostly the harness indexing its own ~14,000 task YAMLs, not the render
    assert len(out.stderr) < 4000 and peak < 1024 and peak < base_peak + 128 and seconds < 150, (peak, base_peak, seconds)
    print(f"'A' * 3000000000: {peak:.0f} MiB (a plain task's eval: {base_peak:.0f} MiB), {seconds:.1f} s of CPU")


def test_nested_range_loops_end_in_one_line(run, tmp_path):  # noqa: F811
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    write_task(tmp_path, "loops_mc", doc_to_text=loops)
    began = time.process_time()  # this process's CPU seconds: the eval runs in it (its wall time varies with the load)
    out = cli_in_process("eval", str(run), "--tasks", "loops_mc", "--include-path", str(tmp_path), "--no-write",
                         cwd=REPO)
    seconds = time.process_time() - began
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors(out.stderr) == [f"error: {tmp_path}/loops_mc.yaml: doc_to_text: the range() calls of one render give "
                                  f"over 1,000,000 items {BOUNDS}"]
    assert seconds < 60, seconds
    print(f"nested range(100000) loops: {seconds:.1f} s of CPU")


@pytest.mark.parametrize("template,said", [
    ("{{ 'a'|center(3000000000) }}", "the filter center is given the number 3,000,000,000, over 10,000,000"),
    ("{{ '%3000000000d' % 1 }}", "a % format asks for a width of 3,000,000,000, over 10,000,000"),
    ("{{ '%*d' % (3000000000, 1) }}", "a % format's width is given the number 3,000,000,000, over 10,000,000"),
    ("{{ '{:>3000000000}'.format(1) }}", "a format field {:>3000000000} asks for 3000000000, over 10,000,000"),
    ("{{ (['a' * 1000000] * 1000)|join }}", "'*' would make over 10,000,000 characters"),
    ("{{ 'ab'|replace('', 'x' * 9000000) }}", "a replace() would make over 10,000,000 characters"),
    ("{{ 'a'.ljust(3000000000) }}", "ljust() is given the number 3,000,000,000, over 10,000,000"),
    ("{{ 7 ** 99999999 }}", "'**' would make a number of over 100,000 bits"),
    ("{% for a in range(3000) %}{{ 'y' * 5000 }}{% endfor %}", "the rendered text is over 10,000,000 characters"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "the template recursed too deeply"),
    ("{% set s = 'x' * 9000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "a render took over 10 s"),
], ids=["center", "printf", "printf_star", "format", "list", "replace", "ljust", "power", "output", "recursion", "time"])
def test_each_bound_of_a_render(template, said):
    """What a template builds, calls, writes and takes, each bounded; the render that passes one raises in bounded
    memory (the last: 81 trillion empty turns, stopped by the timer)."""
    import resource

    from lm_eval.utils import apply_template

    from finetuner.infer.task_folder import sandboxed_templates
    from finetuner.infer.template_bounds import TemplateBound

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    with sandboxed_templates(), pytest.raises(TemplateBound) as e:
        apply_template(template, {"question": "Why?"})
    assert e.value.what == said and e.value.source == template
    assert time.perf_counter() - began < 15
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 300


def test_real_templates_render_as_the_harness_renders_them():
    from lm_eval.utils import apply_template

    from finetuner.infer.task_folder import sandboxed_templates

    doc = {"question": "Why?", "choices": {"label": ["A", "B"], "text": ["x", "y"]}, "answerKey": "B",
           "passage": "puffin " * 200_000}
    templates = ["Question: {{question}}\nAnswer:", "{{choices.label.index(answerKey)}}",
                 "{{question|regex_replace('y', 'o')}} {{ '%s-%d' % (question, 3) }} {{ '{} {}'.format(1, 2) }}",
                 "{% for i in range(choices.label|length) %}{{choices.label[i]}}. {{choices.text[i]}}\n{% endfor %}",
                 "{{passage}}\n{{question}}", "{{ passage.split(' ')|length }} {{ (passage * 2)|length }}",
                 "{{ '%d people, %s' % (38000000, question) }} {{ '{:,}'.format(38000000) }} "
                 "{{ 38000000|string|center(12) }}"]
    plain = [apply_template(t, doc) for t in templates]
    with sandboxed_templates():
        assert [apply_template(t, doc) for t in templates] == plain


def swap_in_code(d, marker):
    """The folder turned evil: its task now runs ``utils.py``, which would leave ``marker``."""
    write_task(d, "swap_mc", extra="process_docs: !function utils.process_docs\n")
    (d / "utils.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\n\n"
                                "def process_docs(dataset):\n    return dataset.select(range(4))\n", encoding="utf-8")


def test_a_folder_swapped_after_the_check_never_runs_the_swapped_in_code(run, tmp_path, monkeypatch):  # noqa: F811
    """The swap comes right after the check returns, before the harness reads the folder (the audit's came 12-18 s
    into the eval); the harness reads the checked private copy, so the clean task runs (6 documents) and the
    marker stays absent."""
    from finetuner.infer import task_folder

    d, marker = tmp_path / "tasks", tmp_path / "ran.marker"
    d.mkdir()
    write_task(d, "swap_mc")
    real, copies = task_folder.checked_copy, []

    def check_then_swap(folder):
        copy, templates = real(folder)
        copies.append(copy)
        swap_in_code(d, marker)
        return copy, templates

    monkeypatch.setattr(task_folder, "checked_copy", check_then_swap)
    out = cli_in_process("eval", str(run), "--tasks", "swap_mc", "--include-path", str(d), "--json", "--no-write",
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tasks"][0]["samples"] == len(ITEMS)  # the checked task: no process_docs
    assert not marker.exists() and "process_docs" in (d / "swap_mc.yaml").read_text(encoding="utf-8")
    (copy,) = copies
    assert copy.name == "tasks" and not copy.exists()  # removed after the eval
    monkeypatch.undo()
    again = cli_in_process("eval", str(run), "--tasks", "swap_mc", "--include-path", str(d), "--no-write", cwd=REPO)
    assert f"error: {d}/swap_mc.yaml: process_docs: !function utils.process_docs runs {d}/utils.py{TRUST}" in \
        again.stderr.splitlines() and not marker.exists()  # the swapped folder itself is refused


def test_the_private_copy_is_the_users_alone_and_holds_only_yaml_and_python(tmp_path):
    from finetuner.infer.task_folder import private_copy

    d = tmp_path / "tasks"
    (d / "sub").mkdir(parents=True)
    write_task(d, "a_mc")
    (d / "sub" / "b.yml").write_text("task: b\n", encoding="utf-8")
    (d / "sub" / "helper.py").write_text("", encoding="utf-8")
    (d / "linked.yaml").symlink_to(d / "a_mc.yaml")
    copy = private_copy(d)
    assert stat.S_IMODE(copy.parent.stat().st_mode) == 0o700 and stat.S_IMODE(copy.stat().st_mode) == 0o700
    files = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file())
    assert files == ["a_mc.yaml", "linked.yaml", "sub/b.yml", "sub/helper.py"]  # the data file stays where it is
    assert not (copy / "linked.yaml").is_symlink()  # its content, not a link back to the user's folder


@pytest.mark.parametrize("extra,files,said", [
    ("include: [5]\n", {}, "{d}/t.yaml: include: 5 is not a file name; give the path of a YAML file (or a list of them)."),
    ("include: gone.yaml\n", {}, "{d}/t.yaml: include: gone.yaml: no such file."),
    ("include: ../outside.yaml\n", {"../outside.yaml": "output_type: multiple_choice\n"},
     "{d}/t.yaml: include: ../outside.yaml lies outside the folder; copy it into {d} (finetuner checks and runs a "
     "private copy of the folder)."),
    ("dataset_path: {d}/loader.py\n", {"loader.py": "import os\n"},
     "{d}/t.yaml: dataset_path: {d}/loader.py is a dataset loading script ({d}/loader.py): Python, which finetuner "
     "does not run (datasets 4 and later refuse it too); give the data as files instead (dataset_path: json, "
     "dataset_kwargs: data_files: ...)."),
    ("dataset_path: {d}/walks\n", {"walks/walks.py": "import os\n"},
     "{d}/t.yaml: dataset_path: {d}/walks is a dataset loading script ({d}/walks/walks.py): Python, which finetuner "
     "does not run (datasets 4 and later refuse it too); give the data as files instead (dataset_path: json, "
     "dataset_kwargs: data_files: ...)."),
    ("", {"broken.yaml": "task: [unclosed\n"}, "{d}/broken.yaml: line 2: not valid YAML (did not find expected ',' or "
                                               "']'); fix or remove the file."),
], ids=["include_5", "include_missing", "include_outside", "loading_script", "loading_script_folder", "bad_yaml"])
def test_each_refusal_of_the_check_is_one_line(run, tmp_path, extra, files, said):  # noqa: F811
    d = tmp_path / "tasks"
    d.mkdir()
    write_task(d, "t_mc", extra=extra.format(d=d), file="t")
    if "dataset_path" in extra:  # the task's own dataset_path replaced by the script
        text = (d / "t.yaml").read_text(encoding="utf-8").replace("dataset_path: json\n", "", 1)
        (d / "t.yaml").write_text(text, encoding="utf-8")
    for name, text in files.items():
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_text(text, encoding="utf-8")
    out = cli_in_process("eval", str(run), "--tasks", "t_mc", "--include-path", str(d), "--no-write", cwd=REPO)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors(out.stderr) == [f"error: {said.format(d=d)}"], out.stderr[-3000:]


def test_an_unreadable_yaml_is_one_line(run, tmp_path):  # noqa: F811
    """A YAML that cannot be read (a link to a file that is gone: what root cannot read either)."""
    d = tmp_path / "tasks"
    d.mkdir()
    write_task(d, "t_mc", file="t")
    (d / "dangling.yaml").symlink_to(tmp_path / "gone.yaml")
    out = cli_in_process("eval", str(run), "--tasks", "t_mc", "--include-path", str(d), "--no-write", cwd=REPO)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors(out.stderr) == [f"error: {d}/dangling.yaml: cannot read it (No such file or directory)."]

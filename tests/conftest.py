"""Shared fixtures: a tiny 2-layer Llama with a locally trained tokenizer, small data files."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests import gc_clock, zygote

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
# the general probe at the end of every run (finetuner/infer/probe.py) answers 80 questions; the tests that check it
# set training.general_probe, the others' runs skip it (a tiny model knows no general answers anyway)
os.environ.setdefault("FINETUNER_GENERAL_PROBE", "0")
os.environ.setdefault("FINETUNER_STRICT_EVENTS", "1")  # an event that breaks finetuner/runs/schema.py raises (runs started by tests inherit it)

REPO = Path(__file__).resolve().parents[1]
# plans for this machine's CPU use a fixed calibration (finetuner.planning.calibrate): the same numbers on
# every run of the tests, and no seconds spent measuring (runs started by tests inherit it)
os.environ.setdefault("FINETUNER_SPEED_FILE", str(REPO / "tests" / "planning" / "speed_cpu.json"))
PEER_DATA = REPO.parent / "shared" / "peer-data" / "llamafactory"
# DeepSpeedCPUAdam's C++ extension is built once into the repo's git-ignored .cache (the first test that needs it
# builds it: the cpu_adam_built fixture)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


def cores_per_worker() -> int:
    """The cores one pytest-xdist worker may use: the machine's cores shared among the workers (at least 1);
    all of them without xdist."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    return max(1, (os.cpu_count() or 1) // max(1, workers))


# Under xdist each worker, and every process its tests start, runs torch with its share of the cores. torch's
# default is one OpenMP thread per core in every process; two workers on two cores then run four threads that
# spin while they wait for a core. Measured on 2 cores, -n 2, main at 3249d62 (the README walk-through, the
# SmolLM2 walk-through and tests/cli/test_cli.py): 15 min 11 s and 27 min of CPU with torch's default, 6 min
# 30 s and 9 min 26 s of CPU with one thread a worker. Set before anything imports torch; a variable the
# user set wins. (torchrun's ranks get their own share from finetuner.training.launch, as for a user.)
# xdist's controller imports this file too, before it starts the workers, which inherit its environment: a value
# set here is marked as set here, and each worker sets its own share (with the marker only, "2 threads a worker
# on 2 cores" had stayed unseen: the controller's 2 reached every worker, measured by the junit property
# ``threads``, and the DPO-from-SFT test took 351 s of CPU in the whole suite, 56 s alone with one thread).
if os.environ.get("FINETUNER_TESTS_OMP_SET") == os.environ.get("OMP_NUM_THREADS") or "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = os.environ["FINETUNER_TESTS_OMP_SET"] = str(cores_per_worker())


@pytest.fixture
def peer_data() -> Path:
    """LLaMA-Factory's demo files, read in place from ../shared/peer-data (never copied into the repo).
    A user's clone has no ../shared: there the test is skipped with the reason, and with CI=true the
    skip is a failure (below)."""
    if not PEER_DATA.is_dir():
        pytest.skip(f"the peer data sets are not at {PEER_DATA} (a failure with CI=true)")
    return PEER_DATA


def in_ci() -> bool:
    """True when the environment variable ``CI`` says so (``CI=true``, as CI services set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def _fail_skips_in_ci(report):
    """In CI a skip is a failure: a missing Chromium, DeepSpeed or ../shared must not turn a test
    off unseen. Outside CI the skip stays a skip (with its reason in the ``-ra`` summary)."""
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{reason}\n(CI is set: every test must run here, a skip is a failure)"
    return report


CPU_AT_SETUP = pytest.StashKey[float]()
OWN_CPU_AT_SETUP = pytest.StashKey[float]()
GC_AT_SETUP = pytest.StashKey[float]()


#: kept in tests/gc_clock.py: pytest imports this file twice (``conftest``, ``tests.conftest``), the clock once
_GC_CLOCK = gc_clock.CLOCK


def cpu_seconds(children: bool = True) -> float:
    """CPU seconds of this process (every thread) and of its finished subprocesses (and theirs)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    seconds = own.ru_utime + own.ru_stime
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds += kids.ru_utime + kids.ru_stime + _ZYGOTE.cpu()  # the zygote's commands and ranks are this process's too
    return seconds


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[CPU_AT_SETUP] = cpu_seconds()
    item.stash[OWN_CPU_AT_SETUP] = cpu_seconds(children=False)
    item.stash[GC_AT_SETUP] = _GC_CLOCK.seconds
    item.user_properties += [("worker", os.environ.get("PYTEST_XDIST_WORKER", "")), ("started", round(time.time(), 1))]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and CPU_AT_SETUP in item.stash:
        # the test's CPU seconds, set-up (its module's fixtures the first time) to tear-down, subprocesses
        # included: a --junitxml report's property ``cpu_s`` (scripts/dev/test_times.py sums them)
        # (``own_cpu_s``: this process's threads only; ``worker`` and ``started`` say where and when it ran)
        item.user_properties.append(("cpu_s", round(cpu_seconds() - item.stash[CPU_AT_SETUP], 2)))
        item.user_properties.append(("own_cpu_s", round(cpu_seconds(children=False) - item.stash[OWN_CPU_AT_SETUP], 2)))
        # ``gc_s``: of those, in the garbage collector; ``threads``: this process's threads and torch's at the end
        item.user_properties.append(("gc_s", round(_GC_CLOCK.seconds - item.stash[GC_AT_SETUP], 2)))
        torch = sys.modules.get("torch")
        item.user_properties.append(("threads", f"{threading.active_count()} python, "
                                                f"{torch.get_num_threads() if torch else '-'} torch"))
        # ``forked``: commands run from tests/zygote.py so far in this worker; ``fresh_for``: those that were not,
        # by the variables that kept them out
        item.user_properties.append(("forked", _ZYGOTE.count))
        item.user_properties.append(("fresh_for", json.dumps(_ZYGOTE.fresh)))
        # the same for the Python processes finetuner started (ranks, UI jobs, workers: tests/zygote_child.py)
        item.user_properties.append(("children_forked", _ZYGOTE.children_forked))
        item.user_properties.append(("children_fresh_for", json.dumps(_ZYGOTE.children_fresh)))
    return _fail_skips_in_ci((yield))


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped as a whole (``allow_module_level``) fails its collection in CI."""
    return _fail_skips_in_ci((yield))

#: The test files that take longest (seconds on 2 idle cores, main at 127ba57: the README walk-through 476, the
#: multi-process trainings 360 and 329, the real SmolLM2's walk-through 291, gpu_all's smoke run 221, the browser
#: 203): collected first, so that with several workers (./scripts/test.sh: -n auto --dist loadfile --no-loadscope-reorder) they start
#: at once and the short ones fill in around them, instead of one of them starting last.
LONGEST_FIRST = ("tests/test_readme_walkthrough.py", "tests/training/test_distributed.py", "tests/training/test_fsdp.py",
                 "tests/training/test_cpu_walkthrough.py", "tests/test_gpu_all_smoke.py", "tests/ui/test_ui_browser.py",
                 "tests/training/test_oom.py", "tests/model/test_smollm2_real.py", "tests/ui/test_ui_display.py",
                 "tests/training/test_distributed_preference.py", "tests/objectives/test_grpo_run.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_addoption(parser):
    group = parser.getgroup("finetuner")
    group.addoption("--plan", action="store_true",
                    help="print the run's plan once collected: how many tests, the predicted time on this machine "
                         "(tests/suite_plan.py; ./scripts/test.sh passes it)")
    group.addoption("--record-durations", action="store_true",
                    help="write the time of each test file the run runs whole into tests/durations.json (the plan's "
                         "times; the files not run keep theirs); whole files only: no -k, -m or ::")


def _controller(config) -> bool:
    """This process runs the session (the only one without xdist; xdist's controller, not a worker)."""
    return not hasattr(config, "workerinput")


class _SuitePlan:
    """The plan and the durations of a run, kept by its controller (tests/suite_plan.py does the arithmetic)."""

    def __init__(self, config):
        from tests import suite_plan

        self.config = config
        self.load, self.cores = suite_plan.load_now()  # before this run's workers add theirs
        import psutil

        self.started = psutil.Process().create_time()  # this process's start: its imports, then collection
        self.written = ""
        self.first_report: float | None = None
        self.selected: dict[str, int] | None = None
        self.seen: dict[str, dict] = {}
        self.nodeids: dict[str, set] = {}

    def workers(self) -> int:
        return max(1, len(getattr(self.config.option, "tx", None) or [])) if self.config.pluginmanager.has_plugin("dsession") else 1

    def collected(self, nodeids) -> None:
        from tests import suite_plan

        if self.selected is not None:
            return
        self.selected = suite_plan.counts(nodeids)
        if self.config.getoption("plan"):
            plan = suite_plan.predict(self.selected, self.workers(), self.load, self.cores,
                                      cpu_adam_built=suite_plan.cpu_adam_built())
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            for line in suite_plan.plan_text(plan):
                reporter.write_line(line) if reporter else print(line)

    def report(self, report) -> None:
        from tests import suite_plan

        if self.first_report is None:
            self.first_report = time.time() - report.duration  # when the first test began (its set-up is its file's)
        f = suite_plan.file_of(report.nodeid)
        m = self.seen.setdefault(f, {"measured_s": 0.0, "loads": [], "cpu_s": 0.0})
        m["measured_s"] += report.duration
        m["loads"].append(os.getloadavg()[0])
        m["cpu_s"] += sum(v for k, v in report.user_properties if k == "cpu_s")
        self.nodeids.setdefault(f, set()).add(report.nodeid)

    def write(self) -> None:
        """The files this run ran whole (every selected test reported) into tests/durations.json."""
        from tests import suite_plan

        whole = {f: {"tests": n, "measured_s": self.seen[f]["measured_s"], "workers": self.workers(),
                     "load": sum(self.seen[f]["loads"]) / len(self.seen[f]["loads"]), "cpu_s": self.seen[f]["cpu_s"]}
                 for f, n in (self.selected or {}).items() if len(self.nodeids.get(f, ())) == n}
        startup = None
        if self.first_report is not None:  # collection and the workers' start, at the load of the run's start
            startup = (self.first_report - self.started) / suite_plan.share(self.load + self.workers(), self.cores)
        suite_plan.record(suite_plan.DURATIONS, whole, self.cores, startup)
        self.written = (f"recorded the times of {len(whole)} test file{'s' if len(whole) != 1 else ''} into "
                        f"{suite_plan.shown(suite_plan.DURATIONS)}")


SUITE_PLAN = pytest.StashKey[_SuitePlan]()


def pytest_configure(config):
    if not _controller(config):
        return
    if config.getoption("record_durations") and (config.getoption("keyword") or config.getoption("markexpr")
                                                 or any("::" in a for a in config.args) or config.getoption("lf", None)
                                                 or config.getoption("deselect")):
        raise pytest.UsageError("--record-durations records whole test files: give files or folders, without -k, -m, "
                                "--lf, --deselect or test names (FILE::TEST)")
    config.stash[SUITE_PLAN] = _SuitePlan(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist's controller collects nothing itself: the first worker's collection is the run's."""
    node.config.stash[SUITE_PLAN].collected(ids)


def pytest_collection_finish(session):
    if _controller(session.config) and SUITE_PLAN in session.config.stash:
        session.config.stash[SUITE_PLAN].collected([item.nodeid for item in session.items])


def pytest_sessionstart(session):
    """With --record-durations the controller takes each test's reports (:class:`_DurationReports`)."""
    config = session.config
    if _controller(config) and config.getoption("record_durations"):
        config.pluginmanager.register(_DurationReports(config.stash[SUITE_PLAN]), "finetuner-durations")


class _DurationReports:
    """The reports of a run's tests to its :class:`_SuitePlan`, and the durations written when it ends."""

    def __init__(self, plan: _SuitePlan):
        self.plan = plan

    def pytest_runtest_logreport(self, report):
        self.plan.report(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        self.plan.write()

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line(self.plan.written)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4 (each worker's tests start processes of their own)."""
    return max(1, min(os.cpu_count() or 1, 4))


WORDS = (
    "the a hike bird sea rain sun pack water map boots trail tern gull wind cold warm answer "
    "question what should i bring for day night river stone path cliff nest egg feather north"
).split()


def corpus(n: int = 400) -> list[str]:
    import random

    rng = random.Random(0)
    return [" ".join(rng.choices(WORDS, k=rng.randint(6, 20))) for _ in range(n)]


def shared_gguf_cache(tmp_path_factory) -> Path:
    """One GGUF conversion cache (finetuner.model.gguf_base) for every xdist worker of the run: dequantizing the
    real SmolLM2 file takes 17-55 s of CPU on 2 cores, and the walk-throughs, plans and token previews of several
    test files load it. Conversions are published atomically (two workers converting at once both load, one
    keeps its copy). tests/model/test_smollm2_real.py converts into a cache of its own: it checks the conversion."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder above the workers'
    folder = root / "gguf-shared"
    folder.mkdir(exist_ok=True)
    return folder


def share_gguf_cache(cache: Path, shared: Path) -> None:
    """``cache``'s ``gguf`` folder (finetuner's conversion cache) made a link to ``shared``."""
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "gguf").symlink_to(shared, target_is_directory=True)


@pytest.fixture(scope="session", autouse=True)
def _tokenized_data_cache(tmp_path_factory):
    """The tokenized-data cache of this test session (not the user's ~/.cache/finetuner), its GGUF conversions
    shared by the run's workers (:func:`shared_gguf_cache`)."""
    cache = tmp_path_factory.mktemp("finetuner_cache")
    share_gguf_cache(cache, shared_gguf_cache(tmp_path_factory))
    os.environ["FINETUNER_CACHE_DIR"] = str(cache)
    # and its checkpoint-sealing key (finetuner.training.seal), not the user's ~/.config/finetuner
    os.environ["FINETUNER_CONFIG_DIR"] = str(tmp_path_factory.mktemp("finetuner_config"))


@pytest.fixture(scope="session")
def cpu_adam_built() -> Path:
    """DeepSpeedCPUAdam's C++ extension (the default optimizer of ZeRO-Offload, ``distributed.cpu_adam``), built
    into ``$TORCH_EXTENSIONS_DIR`` (``.cache/torch_extensions``) the first time a test asks for it: 3 minutes of CPU
    on 2 idle cores, 9 on busy ones, so only the tests that run it pay for it (``./scripts/test.sh --quick`` and most
    ``-k`` selections never do); later runs find it built. Built in a process of its own (torch's lock file keeps
    two builders apart); its log is ``cpu_adam-build.log`` beside it. The files that use it are listed in
    tests/suite_plan.py's NEEDS_CPU_ADAM (the plan says when it is still to build)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -c constraints.txt -e '.[test]')")
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    so = root / "cpu_adam" / "cpu_adam.so"
    if not so.is_file():
        root.mkdir(parents=True, exist_ok=True)
        log = root / "cpu_adam-build.log"
        with log.open("w", encoding="utf-8") as out:
            done = subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
                                  stdout=out, stderr=subprocess.STDOUT, timeout=HANG_GUARD_S, env=dict(os.environ))
        if done.returncode != 0 or not so.is_file():
            tail = "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-20:])
            pytest.fail(f"could not build DeepSpeedCPUAdam into {root} (log: {log}):\n{tail}")
    return so


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved 2-layer Llama (random weights, fp32) with a ChatML tokenizer."""
    from finetuner.model.tiny_llama import tiny_llama, train_bpe_tokenizer

    out = tmp_path_factory.mktemp("tiny_model")
    tok = train_bpe_tokenizer(corpus(), vocab_size=400)
    model = tiny_llama(tok, seed=0)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """``recipes/demo_cpu.yaml`` trained as shipped (the demo model, 150 LoRA steps, its held-out split), once
    for the whole session, in this process: for the tests that only read a finished run (today the DPO run
    that starts from it, tests/infer/test_preference_eval.py). Never change it in a test: copy it first."""
    import finetuner

    out = tmp_path_factory.mktemp("demo_run") / "demo_cpu"
    return finetuner.train(REPO / "recipes" / "demo_cpu.yaml", output_dir=out).run_dir


#: the plain colours of the pictures tests write (write_pictures)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 220), "yellow": (230, 220, 40)}


def write_pictures(folder: Path, n: int = 8) -> list[tuple[str, str]]:
    """``n`` plain-colour pictures of different sizes in ``folder/img``: (path relative to ``folder``, colour) each."""
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        colour = list(COLOURS)[i % len(COLOURS)]
        Image.new("RGB", (40 + 3 * i, 30 + 2 * i), COLOURS[colour]).save(folder / "img" / f"{i:03d}.png")
        out.append((f"img/{i:03d}.png", colour))
    return out


def write_bomb_png(path: Path, width: int, height: int) -> Path:
    """A real PNG of ``width`` x ``height`` black pixels, 1 bit each, its rows compressed as one zlib stream: a
    30000 x 30000 one is about 110 KB on disk and 900 million pixels decoded (2.7 GB as RGB), written in well under a
    second without ever holding its pixels (each row is the same bytes)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + bytes((width + 7) // 8)  # filter type 0, then the row's bits
    z = zlib.compressobj(9)
    data = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit greyscale, no interlace
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path


def write_picture_places(base: Path) -> tuple[Path, Path]:
    """``base/mine``, a folder a served UI reads, with a green ``ok.png``; ``base/outside`` with a red ``secret.png``
    and a folder named ``folder.png``; and in ``mine`` the link ``link.png`` to the red picture."""
    from PIL import Image

    mine, outside = base / "mine", base / "outside"
    mine.mkdir()
    outside.mkdir()
    Image.new("RGB", (8, 8), (0, 200, 0)).save(mine / "ok.png")
    Image.new("RGB", (8, 8), (200, 0, 0)).save(outside / "secret.png")
    (outside / "folder.png").mkdir()
    (mine / "link.png").symlink_to(outside / "secret.png")
    return mine, outside


def outside_picture_refs(mine: Path, outside: Path) -> dict[str, str]:
    """Each way a row of a data file in a sibling of ``outside`` (:func:`write_picture_places`) names a picture
    outside ``mine`` (absolute, ``file://``, ``../``, a link out), and each state such a path can be in (there,
    missing, a folder, under a file)."""
    secret = outside / "secret.png"
    return {"there": str(secret), "file://": f"file://{secret}", "../": "../outside/secret.png",
            "../../": "../" * 12 + str(secret).lstrip("/"), "a link out": str(mine / "link.png"),
            "missing": str(outside / "no-such.png"), "a folder": str(outside / "folder.png"),
            "under a file": str(secret / "x.png")}


def write_picture_chats(folder: Path, n: int = 8) -> Path:
    """``folder/colours.jsonl``: one chat a picture of :func:`write_pictures` ("What colour is this?" → "It is
    <colour>."), in LLaMA-Factory's form (an ``images`` column and ``<image>``) and OpenAI's (image parts) by turns."""
    rows = []
    for i, (path, colour) in enumerate(write_pictures(folder, n)):
        answer = {"role": "assistant", "content": f"It is {colour}."}
        if i % 2:
            rows.append({"messages": [{"role": "user", "content": [{"type": "image", "image": path},
                                                                   {"type": "text", "text": "What colour is this?"}]}, answer]})
        else:
            rows.append({"messages": [{"role": "user", "content": "<image>What colour is this?"}, answer], "images": [path]})
    out = folder / "colours.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return out


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    """A saved tiny LLaVA (a CLIP tower, a projector, a 2-layer Llama; random weights, fp32) with its processor:
    pictures resized to 32 px, 16 image tokens each."""
    from transformers import AutoTokenizer

    from finetuner.model.tiny_vlm import tiny_llava

    out = tmp_path_factory.mktemp("tiny_llava")
    tiny_llava(AutoTokenizer.from_pretrained(REPO / "data" / "demo_model"), out)
    return out


def wait_until_done(runs, name: str):
    """Poll the run ``name`` under ``runs`` (as the Train tab follows it) until it is done, failing if it is in any
    other state than starting or running on the way, or still not done after the hang guard; its last status."""
    import time

    from finetuner.runs import jobs

    deadline = time.monotonic() + HANG_GUARD_S
    while (st := jobs.run_status(runs / name, runs)).state != "done" and time.monotonic() < deadline:
        assert st.state in ("new", "starting", "running", "finishing"), (st.state, st.error)
        time.sleep(1)
    return st


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A real file system of 12 MiB (a tmpfs: tests/small_disk.py) mounted on ``tmp_path/disk`` for the test,
    and unmounted after it. Skipped where this process cannot mount one (a failure with CI=true)."""
    from tests import small_disk as disks

    reason = disks.mountable()
    if reason:
        pytest.skip(reason)
    with disks.small_disk(tmp_path / "disk", 12) as disk:
        yield disk


def alpaca_rows(n: int = 48) -> list[dict]:
    return [
        {
            "instruction": f"What should I bring on hike {i}?",
            "input": "" if i % 3 else "a cold day",
            "output": "Tern here! Bring water, a map and warm boots. Happy trails!",
        }
        for i in range(n)
    ]


def tiny_with_ids(model_type: str, tok) -> dict:
    """:func:`finetuner.model.tiny.tiny_config` of ``model_type`` for the tokenizer ``tok``: its size and special ids."""
    from finetuner.model.tiny import tiny_config

    return tiny_config(model_type, len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def two_lora_steps(folder: Path, tmp_path: Path):
    """Train the model saved in ``folder`` 2 LoRA steps (r 4) on 8 alpaca rows with finetuner; its TrainResult."""
    import finetuner
    from finetuner.config.recipe import Recipe

    data = tmp_path / "a.json"
    data.write_text(json.dumps(alpaca_rows(8)), encoding="utf-8")
    return finetuner.train(Recipe.from_dict({
        "name": "t", "model": {"name": str(folder)}, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"path": str(data), "max_seq_len": 32, "val_size": 0},
        "training": {"max_steps": 2, "lr": 1e-2, "micro_batch_size": 2, "gradient_accumulation": 1, "warmup_steps": 0},
        "logging": {"tensorboard": False}, "output_dir": str(tmp_path / "run")}))


@pytest.fixture
def alpaca_file(tmp_path) -> Path:
    p = tmp_path / "alpaca.json"
    p.write_text(json.dumps(alpaca_rows()), encoding="utf-8")
    return p


@pytest.fixture
def recipe_dict(tiny_model_dir, alpaca_file, tmp_path):
    """A small, fast recipe as a dict; tests tweak it."""
    return {
        "name": "test",
        "model": {"name": str(tiny_model_dir)},
        "method": "lora",
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"path": str(alpaca_file), "max_seq_len": 64},
        "training": {"max_steps": 8, "lr": 5e-3, "micro_batch_size": 2, "gradient_accumulation": 2, "warmup_steps": 0},
        "checkpointing": {"save_every": 4, "keep_last": 2},
        "logging": {"tensorboard": False},
        "output_dir": str(tmp_path / "run"),
    }


def demo_run_folder(runs: Path, name: str = "merge-me", adapter: bool = False) -> Path:
    """A run folder of the demo model as the merge reads it: its recipe and its adapter (a real
    LoRA adapter with ``adapter=True``, else only its config: enough for the checks made before
    anything is loaded)."""
    from finetuner.config.recipe import Recipe

    run = runs / name
    run.mkdir(parents=True)
    Recipe.from_dict({"name": name, "model": {"name": str(REPO / "data" / "demo_model")},
                      "data": {"path": str(REPO / "data" / "alpaca_sample.json")}}).save(run / "recipe.yaml")
    if adapter:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(REPO / "data" / "demo_model")
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        for n, p in model.named_parameters():
            if "lora_B" in n:  # B starts at zero: give the adapter an effect the merge must carry
                torch.nn.init.normal_(p, std=0.02)
        model.save_pretrained(run / "adapter")
    else:
        (run / "adapter").mkdir()
        (run / "adapter" / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(REPO / "data" / "demo_model")}), encoding="utf-8")
    return run


def write_recipe(path: Path, recipe: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


#: A hang guard for the tests' subprocesses and waits, not a time limit: far above what any of them takes on an
#: idle 2-core machine (the longest single command, gpu_all's --smoke, about 4 minutes idle here; 6.6 minutes
#: with two busy processes competing) and above it on cores other jobs keep busy. A test that trips it hung; a slow machine never
#: should. pyproject's pytest-timeout (per test) is the same figure; a test that runs several such commands in a
#: row raises its own limit with ``pytest.mark.timeout``.
HANG_GUARD_S = 1800


if os.environ.get("FINETUNER_TESTS_FRESH_PROCESS") != "1":  # the Python processes finetuner starts, forked as well
    os.environ.update(zygote.CLIENT.children_environment())

#: the environment the tests' commands get when no test changed it (what tests/zygote.py may start with)
_BASE_ENV = dict(os.environ)


#: this worker's zygote (kept in tests/zygote.py: pytest imports this file as ``conftest`` and the tests import
#: it again as ``tests.conftest``; one zygote and one count of its CPU for both)
_ZYGOTE = zygote.CLIENT


@pytest.fixture(scope="session", autouse=True)
def _zygote_started():
    """This worker's zygote starts its imports with the first test: the ranks of a test's run come from it
    (tests/zygote_child.py) and find it ready."""
    _ZYGOTE.start(_cli_env(_BASE_ENV))


def run_module(module: str, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
               timeout: float | None = HANG_GUARD_S, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m module args`` as ``subprocess.run(..., capture_output=True, text=True)`` runs it, in a new
    process forked from a zygote that has imported torch, transformers and peft already (tests/zygote.py says
    what that changes), or with ``fresh`` (or an environment the zygote cannot give) in a new interpreter."""
    cwd = Path(cwd or REPO)
    env = dict(os.environ if env is None else env)
    done = None if fresh else _ZYGOTE.run(module, args, cwd, env, timeout, start_env=_cli_env(_BASE_ENV))
    if done is not None:
        return done
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_cli(*args: str, cwd: Path | None = None, timeout: float | None = HANG_GUARD_S,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """Run the ``finetuner`` CLI as a user would, in its own process (:func:`run_module`)."""
    return run_module("finetuner.cli.main", *args, cwd=cwd, env=_cli_env(os.environ), timeout=timeout, fresh=fresh)


def _cli_env(env) -> dict[str, str]:
    """The environment :func:`run_cli` runs the CLI in: ``env`` with this checkout on the path."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])), "COLUMNS": "200"}


def cli_in_process(*args: str, cwd: Path | None = None, timeout: float | None = None,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The ``finetuner`` CLI's ``main`` called in this process, with what it prints captured: the same parser,
    command, messages and exit status as :func:`run_cli`, without a new interpreter's ~10 s of imports (torch,
    transformers, peft). For commands that load a model or a run and end (``run``, ``plan``, ``eval``, ``merge``,
    ``export``, ``chat -p``); what only a process shows (the entry point, signals, stdin, output a library writes
    to the file descriptors or its own log handlers, warnings, import-time cost) stays with :func:`run_cli`.
    ``timeout`` is accepted for the same calls as :func:`run_cli` and left to pytest-timeout's per-test guard (a
    call in this process cannot be cut off alone). ``env`` adds to the environment for the call; standard input is
    empty (Ctrl-D at once, as ``stdin=DEVNULL`` gives a subprocess)."""
    import io
    import logging
    import signal
    from contextlib import redirect_stderr, redirect_stdout

    from finetuner.cli.main import main

    # what main sets for its process (finetuner.quiet.quiet_libraries, its environment defaults) is put back,
    # so that later tests, and the subprocesses they start with this environment, see this process's settings
    # (warnings filters pytest puts back after each test itself)
    loggers = {name: logging.getLogger(name) for name in ("transformers", "DeepSpeed", "bitsandbytes.backends.cpu.ops")}
    kept = {name: (lg.level, list(lg.filters)) for name, lg in loggers.items()}
    kept_env, here = dict(os.environ), os.getcwd()
    # ``run`` installs its Ctrl-C/SIGTERM handlers and an unraisable-exception hook for its process: put back
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    unraisable = sys.unraisablehook
    out, err = io.StringIO(), io.StringIO()
    os.environ["COLUMNS"] = "200"  # as run_cli sets it: rich's width off a terminal
    os.environ.update(env or {})
    stdin = sys.stdin
    try:
        os.chdir(cwd or REPO)
        sys.stdin = io.StringIO("")
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdin = stdin
        os.chdir(here)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        sys.unraisablehook = unraisable
        os.environ.clear()
        os.environ.update(kept_env)
        for name, (level, filters) in kept.items():
            loggers[name].setLevel(level)
            loggers[name].filters[:] = filters
    return subprocess.CompletedProcess(["finetuner", *args], code, out.getvalue(), err.getvalue())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ui_client(base: Path, data_dirs: list[Path] | None = None):
    """The web UI app served in this process on a free port, and a ``gradio_client`` on it;
    runs and uploads under ``base``; ``data_dirs`` as ``finetuner ui --data-dir`` gives them (``[]``: as
    ``--host 0.0.0.0`` serves it). Training jobs it started are stopped afterwards."""
    import gradio_client  # a dependency of gradio, which is one of finetuner's

    from finetuner.runs import jobs
    from ui.app import build_app

    app = build_app(runs_dir=base / "runs", upload_dir=base / "uploads", data_dirs=data_dirs)
    port = free_port()
    app.queue().launch(server_port=port, prevent_thread_lock=True, quiet=True, ssr_mode=False)
    c = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)
    c.base = base
    try:
        yield c
    finally:
        for job in jobs.running_jobs(base / "runs"):
            jobs.stop_job(job, base / "runs", wait=60)
        # the client's heartbeat thread and thread pools, which would outlive the test (and the heartbeat
        # retry a closed server), then the server
        c.close()
        for pool in (c.executor, c.helper_executor, c.stream_executor):
            pool.shutdown(wait=False, cancel_futures=True)
        app.close()


class Planted:
    """A pickle that creates the file ``marker`` when it is loaded: what a crafted checkpoint file
    could do instead (tests/training/test_seal.py checks that loading it does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))

"""With ``CI=true`` a skipped test is a failed one (tests/conftest.py): a missing Chromium, DeepSpeed
or ../shared cannot switch tests off unseen. Checked on a small test file run by pytest with the
suite's conftest as a plugin, once with CI set and once without."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO, HANG_GUARD_S

SKIPPING = '''
import pytest

def test_runs():
    pass

def test_skips_in_its_body():
    pytest.skip("no Chromium at /usr/bin/chromium")

@pytest.mark.skipif(True, reason="shared peer data not present")
def test_skipped_by_a_mark():
    pass

def test_needs_a_missing_module():
    pytest.importorskip("a_module_that_is_not_installed")

@pytest.fixture
def engine():
    pytest.skip("DeepSpeed is not installed")

def test_skipped_by_its_fixture(engine):
    pass
'''

SKIPPED_MODULE = '''
import pytest

pytest.skip("playwright is not installed", allow_module_level=True)

def test_never_collected():
    pass
'''


def _pytest(tmp_path, ci: str | None, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_skipping.py").write_text(SKIPPING, encoding="utf-8")
    (tmp_path / "test_skipped_module.py").write_text(SKIPPED_MODULE, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-rA",
         "--rootdir", str(tmp_path), *args, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )


def _counts(out: str) -> dict[str, int]:
    last = out.strip().splitlines()[-1]
    return {word.rstrip("s") if word.startswith("error") else word: int(n)
            for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)}


def test_skips_fail_when_ci_is_set(tmp_path):
    # (a module skipped as a whole is a collection error, which stops pytest before the tests run
    # unless told to go on: here it is, to see both kinds in one run)
    r = _pytest(tmp_path, "true", "--continue-on-collection-errors")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    # a skip in the test's body fails it; one in its set-up (a skipif mark, a fixture) or of a whole
    # module is an error: both make the run fail
    assert _counts(out) == {"passed": 1, "failed": 2, "error": 3}, out
    for reason in ("no Chromium at /usr/bin/chromium", "shared peer data not present", "a_module_that_is_not_installed",
                   "DeepSpeed is not installed", "playwright is not installed"):
        assert reason in out, reason
    assert "CI is set: every test must run here, a skip is a failure" in out


def test_skips_stay_skips_without_ci(tmp_path):
    for ci in (None, "false"):
        r = _pytest(tmp_path, ci)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert _counts(out) == {"passed": 1, "skipped": 5}, out

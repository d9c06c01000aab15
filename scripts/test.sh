#!/usr/bin/env bash
# Quick start, step 2: install (once, with test extras) and run the test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k recipe
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" test
cd "$FINETUNER_ROOT"
# -n auto: one pytest worker per core, at most 4 (tests/conftest.py); --dist loadfile: a test file runs on one
# worker, its module fixtures once; --no-loadscope-reorder: files in collection order, the longest first
# (tests/conftest.py: LONGEST_FIRST; xdist would order them by their number of tests). Give -n 0 to run in one
# process (a debugger, a single test).
exec python -m pytest -n auto --dist loadfile --no-loadscope-reorder "$@"

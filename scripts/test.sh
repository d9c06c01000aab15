#!/usr/bin/env bash
# Quick start, step 2: install (once, with test extras) and run the test suite.
# It prints its plan first: how many tests and the time predicted on this machine (tests/suite_plan.py, from
# tests/durations.json and the load now). Extra arguments go to pytest, e.g. ./scripts/test.sh -k recipe
#   ./scripts/test.sh --quick               the quick subset (tests/quick.txt: a few minutes on 2 cores)
#   ./scripts/test.sh --record-durations    also write each file's time into tests/durations.json (the plan's times)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" test
cd "$FINETUNER_ROOT"
args=()
quick=0
for a in "$@"; do
  if [ "$a" = "--quick" ]; then quick=1; else args+=("$a"); fi
done
if [ "$quick" = 1 ]; then
  mapfile -t files < <(python -m tests.suite_plan --quick-files)
  args=("${files[@]}" "${args[@]}")
fi
# -n auto: one pytest worker per core, at most 4 (tests/conftest.py); --dist loadfile: a test file runs on one
# worker, its module fixtures once; --no-loadscope-reorder: files in collection order, the longest first
# (tests/conftest.py: LONGEST_FIRST; xdist would order them by their number of tests). Give -n 0 to run in one
# process (a debugger, a single test).
exec python -m pytest -n auto --dist loadfile --no-loadscope-reorder --plan "${args[@]}"

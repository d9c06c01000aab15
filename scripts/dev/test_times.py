"""Where the test suite's time goes, from a pytest ``--junitxml`` report.

    PYTEST_ADDOPTS=--junitxml=/tmp/tests.xml ./scripts/test.sh
    python -m scripts.dev.test_times /tmp/tests.xml [--top 40]

Prints the slowest tests (wall seconds as pytest timed them, and CPU seconds: the worker's own and its
finished subprocesses', the ``cpu_s`` property tests/conftest.py records), then the same summed per file.
Under pytest-xdist the wall seconds of a test include the waits its worker had for a core; the CPU
seconds do not, so they say which test costs the machine most."""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def cases(path: str) -> list[tuple[str, str, float, float | None, str]]:
    """``(file, test, wall_s, cpu_s or None, outcome)`` of every test case in the report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        cpu = float(props["cpu_s"]) if "cpu_s" in props else None
        out.append((case.get("classname", ""), case.get("name", ""), float(case.get("time") or 0), cpu, outcome))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a pytest --junitxml file")
    ap.add_argument("--top", type=int, default=30, help="how many tests and files to list (default 30)")
    args = ap.parse_args(argv)
    rows = cases(args.report)
    wall = sum(r[2] for r in rows)
    cpu = sum(r[3] or 0 for r in rows)
    counts = collections.Counter(r[4] for r in rows)
    print(f"{len(rows)} tests ({', '.join(f'{n} {k}' for k, n in counts.most_common())}): "
          f"{wall:,.0f} s of tests' wall time, {cpu:,.0f} s of CPU")
    print(f"\n{'wall s':>8} {'cpu s':>8}  slowest tests")
    for f, name, w, c, outcome in sorted(rows, key=lambda r: -r[2])[: args.top]:
        print(f"{w:8.1f} {'-' if c is None else f'{c:.1f}':>8}  {f}::{name}" + ("" if outcome == "passed" else f"  [{outcome}]"))
    per: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for f, _, w, c, _ in rows:
        per[f][0] += w
        per[f][1] += c or 0
        per[f][2] += 1
    print(f"\n{'wall s':>8} {'cpu s':>8} {'tests':>5}  per file")
    for f, (w, c, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{w:8.1f} {c:8.1f} {n:5d}  {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

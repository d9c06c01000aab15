"""What fingerprinting a base model's weights costs (finetuner.model.fingerprint, the replay cache's key): one
weight file of ``--mb`` MiB of random bytes, fingerprinted the first time with the file out of the page cache
(``posix_fadvise(DONTNEED)``: on a virtual machine the host may still hold it), the first time with the file in
the page cache, and memoised (the next run: a ``stat`` and the memo read). Each ``--runs`` times; the median.

Usage:
  python -m scripts.bench.weights_fingerprint            # 500 MiB, 3 runs: a JSON object of seconds
  python -m scripts.bench.weights_fingerprint --mb 2000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fingerprint(folder: Path, hashed: bool) -> float:
    """Seconds to fingerprint ``folder``; raises when the file was (not) hashed as ``hashed`` says it must be."""
    from finetuner.model import fingerprint

    t = time.perf_counter()
    got = fingerprint.weights_fingerprint(str(folder))
    took = time.perf_counter() - t
    if bool(got.hashed) != hashed:
        raise RuntimeError(f"expected the weights {'hashed' if hashed else 'from the memo'}, got hashed={got.hashed}")
    return took


def measure(mb: int, runs: int) -> dict[str, float]:
    """Median seconds of a first fingerprint (file not cached, cached) and a memoised one, and the hashing rate."""
    from finetuner.model import fingerprint

    kept = os.environ.get("FINETUNER_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="fingerprint-bench-") as tmp:
        os.environ["FINETUNER_CACHE_DIR"] = str(Path(tmp) / "cache")  # a memo of its own
        try:
            folder = Path(tmp) / "model"
            folder.mkdir()
            with open(folder / "model.safetensors", "wb") as f:
                for _ in range(mb):
                    f.write(os.urandom(2**20))
            times: dict[str, list[float]] = {"first_from_disk_s": [], "first_in_page_cache_s": [], "memoised_s": []}
            for _ in range(runs):
                fingerprint.memo_path().unlink(missing_ok=True)
                _evict(folder / "model.safetensors")
                times["first_from_disk_s"].append(_fingerprint(folder, hashed=True))
                fingerprint.memo_path().unlink()
                times["first_in_page_cache_s"].append(_fingerprint(folder, hashed=True))
                times["memoised_s"].append(_fingerprint(folder, hashed=False))
        finally:
            if kept is None:
                os.environ.pop("FINETUNER_CACHE_DIR", None)
            else:
                os.environ["FINETUNER_CACHE_DIR"] = kept
    out = {k: round(statistics.median(v), 5) for k, v in times.items()}
    return {"mib": mb, "runs": runs, **out, "in_page_cache_mib_per_s": round(mb / out["first_in_page_cache_s"])}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=500, help="size of the weight file, MiB")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    result = measure(args.mb, args.runs)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

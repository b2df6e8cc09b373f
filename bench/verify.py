"""What the load rule's hashing costs: sha256 of a file, and a verified copy of one.

    python bench/verify.py               # a 512 MiB file
    python bench/verify.py --mib 2048

Writes a file of random bytes, reads it once to put it in the page cache, then times
`store.manifest.sha256_file` (what hashes an artifact read in place, weights included, at
every load) and `store.verified.verified_copy` (what the torch runner does to each graph and
kernel library: read once, hash, copy into a sealed memfd). Reports GB/s for each, and what
that makes of a 15 GB artifact's weights read in place. Name the CPU with the figures
(docs/security.md, "The load rule").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neuronctl.store.manifest import sha256_file  # noqa: E402
from neuronctl.store.verified import verified_copy  # noqa: E402

WEIGHTS_GB = 15


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def best_of(runs: int, work: object) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "blob"
        with open(path, "wb") as out:
            for _ in range(args.mib):
                out.write(os.urandom(1 << 20))
        size = path.stat().st_size
        sha = sha256_file(path)  # also fills the page cache
        hashed = best_of(args.runs, lambda: sha256_file(path))
        copied = best_of(args.runs, lambda: verified_copy(path, sha).close())
    result = {
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "bytes": size,
        "sha256_gb_s": round(size / hashed / 1e9, 2),
        "verified_copy_gb_s": round(size / copied / 1e9, 2),
        f"in_place_{WEIGHTS_GB}gb_weights_s": round(WEIGHTS_GB * 1e9 / (size / hashed), 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""The cache issue's four comparisons in one run, each from its own script, summarised at the end.

1. client CPU per fetched 100 KB object: blobdata's engine next to s3fs ``cat`` (goal <= 0.4 ms);
2. a warm epoch (from the cache) next to the same pipeline on local disk (goal >= 0.97x);
3. hit rate per epoch over 3 epochs with a cache of half the dataset, per policy
   (goal for the default >= 0.95 x cache/dataset);
4. ``blobdata warm`` MB/s next to ``rclone copy --transfers 64`` (goal: at least as fast).

Each part starts its own local S3 server (SeaweedFS) and prints its full table; the closing lines
repeat the ratios side by side. Parts run one after the other on the same machine, never timed
against each other. A benchmark, not a test.

    python benchmarks/bench_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PARTS = [
    ("client CPU per object", ["bench_fetch_cpu.py"], ["bench_fetch_cpu.py", "--objects", "500"]),
    (
        "warm epoch vs local disk",
        ["bench_latency.py", "--systems", "local,blobdata", "--rtt", "0", "--no-raw"],
        ["bench_latency.py", "--systems", "local,blobdata", "--rtt", "0", "--no-raw", "--images", "600"],
    ),
    ("hit rate per policy", ["bench_epochs.py"], ["bench_epochs.py", "--objects", "400"]),
    (
        "warm vs rclone",
        ["bench_warm.py", "--repeat", "2"],
        ["bench_warm.py", "--repeat", "1", "--objects", "500"],
    ),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller data sets, one repetition")
    args = p.parse_args()
    summary: list[str] = []
    failed = 0
    for title, full, quick in PARTS:
        argv = [
            sys.executable,
            str(HERE / (quick if args.quick else full)[0]),
            *(quick if args.quick else full)[1:],
        ]
        print(f"\n===== {title}: {' '.join(argv[1:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("[")]
        print("\n".join(lines[-14:]))
        if proc.returncode != 0:
            failed += 1
            print(proc.stderr[-3000:], file=sys.stderr)
        summary.append(
            f"{title:28s} exit {proc.returncode}, {time.perf_counter() - t0:5.0f} s; last line: "
            f"{lines[-1] if lines else '(no output)'}"
        )
    print("\n===== summary")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""benchmarks/bench_partition.py runs end to end at small sizes, and its cache simulation agrees with
blobdata's real BlobCache (the figures in the README rest on that simulation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_partition_quick(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        "benchmarks/bench_partition.py",
        "--quick",
        "--parts",
        "quality,cache",
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    quality = {row[0]: row for row in doc["quality"]}
    # Batches as mixed as DistributedSampler's (within 10%); a contiguous partition is far worse.
    assert float(quality["partitioned"][1]) >= 0.9 * float(quality["distributed"][1])
    assert float(quality["contiguous shares"][1]) < 0.8 * float(quality["distributed"][1])
    check = {row[0]: row for row in doc["cache"]["check"]}
    assert check["partitioned"][1] == check["partitioned"][2]  # simulated == real BlobCache
    sim = [float(x.rstrip("%")) for x in check["distributed"][1].split()]
    real = [float(x.rstrip("%")) for x in check["distributed"][2].split()]
    assert all(abs(a - b) <= 3.0 for a, b in zip(sim, real, strict=True))  # percentage points
    for row in doc["cache"]["data"]:  # a cache at least the node's share: later epochs read nothing
        reads = row["reads"]
        if row["sampler"] == "partitioned" and row["cache"] == "1/2" and row["nodes"] >= 4:
            assert max(reads[1:]) == 0 and reads[0] == doc["cache"]["n"]
        if row["sampler"] == "distributed":
            assert min(reads[1:]) > 0.4 * doc["cache"]["n"]

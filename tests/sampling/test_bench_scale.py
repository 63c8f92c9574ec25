"""benchmarks/bench_scale.py runs end to end at small sizes: the sampler's plan, mapped manifests
shared by processes (each grows by a small part of the file; a copy per process grew by all of it),
and a prefix listed in key ranges identical to page by page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.timeout(600)
def test_bench_scale_quick(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    cmd = [sys.executable, "benchmarks/bench_scale.py", "--quick", "--tmp", str(tmp_path), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=580, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {row[1] for row in doc["sampler"]} >= {"partitioned", "elastic keyed"}
    for row in doc["manifest"]:
        share = float(row[5].rstrip("%"))
        assert share < 15 if row[2] == "mapped" else share > 90, row
    (listing,) = doc["listing"]
    assert listing[-1] == "yes"  # the ranges' list is the page-by-page list

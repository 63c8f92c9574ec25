"""benchmarks/bench_latency.py runs end to end on a tiny dataset: pinned CPUs, a worker sweep, saved rows."""

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
@pytest.mark.timeout(400)
def test_worker_sweep_with_pinned_cpus(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    client, server = str(cpus[0]), str(cpus[-1])
    save = tmp_path / "rows.json"
    cmd = [sys.executable, "benchmarks/bench_latency.py", "--images", "48", "--classes", "4", "--rtt", "0",
           "--systems", "local,blobdata", "--workers", "1,2", "--no-raw", "--client-cpus", client,
           "--server-cpus", server, "--epoch-limit", "30", "--timeout", "150",
           "--save", str(save)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=380, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert f"client on CPUs [{client}]" in out and "scaling curve:" in out
    rows = json.loads(save.read_text())["rows"]
    got = {(r["workers"], r["system"]) for r in rows}
    assert got == {(w, s) for w in (1, 2) for s in ("local disk", "blobdata cold", "blobdata warm")}
    assert all(r["images_per_s"] > 0 and r["client_cpu_ms_per_image"] > 0 for r in rows)
    assert "previously measured" not in out  # no hard-coded numbers from another run

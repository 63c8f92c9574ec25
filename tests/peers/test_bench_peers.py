"""benchmarks/bench_peers.py runs end to end at a small size: two simulated nodes whose caches hold half
of the data each, a global shuffle; from the second epoch on the bucket is read only for hedges or
fallbacks, every other object comes from a cache (its home's or this node's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
OBJECTS = 64


def _bench(script: str, args: list[str], out: Path, timeout: float) -> tuple[str, Any]:
    """Run ``benchmarks/<script> ARGS --json OUT``: what it printed and the figures it wrote."""
    cmd = [sys.executable, f"benchmarks/{script}", *args, "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_peers_small(tmp_path: Path) -> None:
    marker = tmp_path / "prefixed"  # the last node runs under --node-prefix (cachegrind, in docs/peers.md)
    args = [
        "--nodes", "2", "--objects", str(OBJECTS), "--epochs", "2", "--batch-size", "8", "--workers", "0",
        "--no-decode", "--jobs", "peers", "--timeout", "200",
        "--node-prefix", f"sh -c 'echo $$ > {marker}; exec \"$@\"' node",
    ]  # fmt: skip
    printed, doc = _bench("bench_peers.py", args, tmp_path / "out.json", 280)
    assert marker.read_text().strip().isdigit()
    assert "from epoch 2 on: bucket GETs / samples: peers" in printed
    first, second = doc["results"][0]["epochs"]
    assert first["samples"] == second["samples"] == OBJECTS
    # Each object read from the bucket once, by its home (and again only where a read was hedged).
    assert OBJECTS <= first["gets"] <= OBJECTS + first["peer_hedged"] + first["peer_fallbacks"]
    assert second["from_peers"] > 0
    assert second["from_peers"] + second["from_cache"] + second["from_bucket"] == OBJECTS
    assert second["gets"] <= second["peer_hedged"] + second["peer_fallbacks"]
    # The peers' latency proxies relay every peer byte in this script's process: their CPU is reported.
    assert "proxies' CPU s" in printed and second["driver_cpu_s"] > 0
    # The nodes' CPU, split: training processes, workers (none here), the services' processes.
    assert "training processes + workers + services (of which the kernel's): peers" in printed
    for ep in (first, second):
        parts = ep["cpu_trainer_s"] + ep["cpu_workers_s"] + ep["cpu_service_s"]
        assert ep["cpu_trainer_s"] > 0 and abs(parts - ep["cpu_s"]) < 1e-6
        for part in ("trainer", "workers", "service"):  # system time: a part of each
            assert 0 <= ep[f"cpu_kernel_{part}_s"] <= ep[f"cpu_{part}_s"] + 1e-6
        assert ep["cpu_workers_s"] == 0  # the service's process is not taken for a worker
    # Where the first batch's wait went: iter() returned, the batch was made, the loop had it.
    assert "the first batch per node and epoch" in printed
    assert 0 < second["first_iter_s"] <= second["first_made_s"] <= second["first_had_s"]


@pytest.mark.timeout(120)
def test_bench_peer_read_small(tmp_path: Path) -> None:
    """benchmarks/bench_peer_read.py: every object read from the service's cache through a PeerClient,
    both ways (a task per read; started as a batch), a read that went to the bucket failing the run,
    then from a cache of its own; the CPU per object of each side and of a hit is reported, round by
    round and as medians."""
    args = ["--objects", "200", "--size", "3000", "--rounds", "2", "--job-nodes", "40"]  # homes in numpy
    printed, doc = _bench("bench_peer_read.py", args, tmp_path / "out.json", 100)
    assert "median: a peer read" in printed and "a job of 40 nodes" in printed
    assert "x started as a batch" in printed
    assert len(doc["rounds"]) == 2
    for r in doc["rounds"]:
        assert r["service_us"] > 0 and r["asker_us"] > 0 and r["asker_task_us"] > 0 and r["hit_us"] > 0
        assert r["peer_us"] == pytest.approx(r["service_us"] + r["asker_us"])


@pytest.mark.timeout(120)
def test_bench_peer_cold_small(tmp_path: Path) -> None:
    """benchmarks/bench_peer_cold.py: fresh objects read through the node's real service process, with
    one process's concurrency and with the default's, and from the bucket directly: every object read
    from the bucket once (and again only where the asker hedged), the rates and their ratios printed, the
    CPU per object of the service's process and of the asking one."""
    args = ["--objects", "60", "--inflight", "32", "--concurrency", "4", "--rounds", "1", "--size", "2000"]
    printed, doc = _bench("bench_peer_cold.py", args, tmp_path / "out.json", 100)
    from blobdata._peers import SERVICE_READERS

    settings = ["service, 4", f"service, {SERVICE_READERS * 4}", "no peers"]
    assert list(doc["results"]) == settings and "medians, objects/s" in printed
    for setting in settings:
        ((got,),) = [doc["results"][setting]]
        assert got["per_s"] > 0
        assert 60 <= got["gets"] <= 60 + got["hedged"], setting
        assert got["asker_us"] > 0, setting  # the asking process's CPU per object, measured
        assert (got["service_us"] > 0) == (setting != "no peers"), setting  # NaN: no service
    assert "the service's CPU per object" in printed


@pytest.mark.timeout(150)
def test_bench_peer_service_small(tmp_path: Path) -> None:
    """benchmarks/bench_peer_service.py: the training loop's batches timed with node 0's service in a
    thread and in a process of its own, quiet and while node 1 reads from it; node 1's reads are
    answered by the service they were sent to in both placements."""
    args = ["--objects", "200", "--rate", "400", "--batches", "12", "--rounds", "1", "--kinds", "tensor"]
    printed, doc = _bench("bench_peer_service.py", args, tmp_path / "out.json", 130)
    assert "process / thread" in printed
    assert {(r["kind"], r["load"]) for r in doc["results"]} == {("tensor", "quiet"), ("tensor", "served")}
    for r in doc["results"]:
        assert r["thread_ms"] > 0 and r["process_ms"] > 0
    for placement in ("thread", "process"):
        ((rate, answered, _),) = doc["served"][placement]
        assert rate > 0 and answered > 0, placement
        assert f"service in a {placement}: node 1 read" in printed

"""Simulated nodes for the peer tests: a dataset in a bucket whose objects say their number, a job's
store (a ``TCPStore`` in the test process), and :mod:`tests.support.peer_node` processes, one per node,
each on its own loopback address (``127.0.0.<2 + rank>``) with its own cache."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def payload(i: int, size: int = 3000) -> bytes:
    """Object ``i``'s bytes: its number in 8 digits, then ``size - 8`` bytes fixed by ``i``."""
    return f"{i:08d}".encode() + np.random.default_rng(i).bytes(size - 8)


def upload(bucket: Any, n: int, prefix: str = "train") -> dict[int, str]:
    """``n`` objects ``prefix/c<i % 3>/<i>.bin``; returns each one's sha256."""
    items = {f"{prefix}/c{i % 3}/{i:05d}.bin": payload(i) for i in range(n)}
    bucket.put_many(items)
    return {i: hashlib.sha256(payload(i)).hexdigest() for i in range(n)}


class Store:
    """The job's store: a TCPStore served from this process on a free port."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.port = int(self.store.port)

    def address(self) -> list[Any]:
        return ["127.0.0.1", self.port]


def start_node(tmp: Path, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """A node process for ``spec`` (see tests/support/peer_node.py); its log is ``<out>.log``."""
    path = tmp / f"spec-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(spec["out"] + ".log", "wb") as log:  # the child has its own descriptor of it
        return subprocess.Popen(
            [sys.executable, "-m", "tests.support.peer_node", str(path)], cwd=REPO, stdout=log, stderr=log, env=env
        )


def node_spec(tmp: Path, job: str, store: Store, rank: int, nnodes: int, **extra: Any) -> dict[str, Any]:
    cache = tmp / f"{job}-cache-{extra.pop('cache_of', rank)}"
    return {
        "store": store.address(), "job": job, "nnodes": nnodes, "node_rank": rank,
        "host": f"127.0.0.{2 + rank}", "cache": str(cache), "cache_size": "64MB",
        "out": str(tmp / f"{job}-out-{rank}.json"), "batch_size": 8, "workers": 1,
        "epochs": [0], "barrier": nnodes, "final": nnodes, **extra,
    }  # fmt: skip


def run_nodes(tmp: Path, specs: list[dict[str, Any]], timeout: float = 240.0) -> list[dict[str, Any]]:
    """Start every node, wait for all (killed ones included); each one's ``out``, or None if it died."""
    procs = [start_node(tmp, s) for s in specs]
    results: list[dict[str, Any]] = []
    try:
        for proc, spec in zip(procs, specs, strict=True):
            proc.wait(timeout=timeout)
            out = Path(spec["out"])
            results.append(json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None)  # type: ignore[arg-type]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return results


def log_of(spec: dict[str, Any]) -> str:
    return Path(spec["out"] + ".log").read_text(errors="replace")[-4000:]

"""Simulated nodes for the peer tests: a dataset in a bucket whose objects say their number, a job's
store (a ``TCPStore`` in the test process), and :mod:`tests.support.peer_node` processes, one per node,
each on its own loopback address (``127.0.0.<2 + rank>``) with its own cache."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
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


#: The prefix of a job's keys in its store: this, then 16 hex digits of a hash of the job's name.
STORE_PREFIX = "blobdata/peers/v1/"
_OTHER = json.dumps({"name": "other", "address": "127.0.0.9:9", "local": "127.0.0.9:9"}).encode()


def node_1_came(name: str, entry: bytes = _OTHER) -> tuple[Any, str, str]:
    """A ``HashStore``, a fresh job ``name-...`` of 2 nodes in it whose node 1 has left ``entry`` (by
    default a node named "other" whose service never answers: node 0's meeting completes at once),
    and the job's prefix of keys in the store."""
    import torch.distributed as dist

    store = dist.HashStore()
    job = f"{name}-{os.urandom(4).hex()}"
    prefix = STORE_PREFIX + hashlib.sha256(job.encode()).hexdigest()[:16] + "/"
    store.set(prefix + "node/1", entry)
    return store, job, prefix


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
            [sys.executable, "-m", "tests.support.peer_node", str(path)],
            cwd=REPO,
            stdout=log,
            stderr=log,
            env=env,
        )


def node_spec(tmp: Path, job: str, store: Store, rank: int, nnodes: int, **extra: Any) -> dict[str, Any]:
    cache = tmp / f"cache-{extra.pop('cache_of', rank)}"
    return {
        "store": store.address(), "job": job, "nnodes": nnodes, "node_rank": rank,
        "host": f"127.0.0.{2 + rank}", "cache": str(cache), "cache_size": "64MB",
        "out": str(tmp / f"{job}-out-{rank}.json"), "batch_size": 8, "workers": 1, "epochs": [0], **extra,
    }  # fmt: skip


def _points(spec: dict[str, Any]) -> list[str]:
    """The meeting points ``spec``'s node reaches: each epoch's start, and the end unless it dies."""
    die = spec.get("die_after")
    points = [str(e) for e in spec["epochs"] if die is None or e <= die[0]]
    return points if die is not None else [*points, "end"]


def run_nodes(
    tmp: Path, store: Store, specs: list[dict[str, Any]], proxy: Any = None, timeout: float = 200.0
) -> tuple[list[dict[str, Any] | None], dict[str, int]]:
    """Start every node and let them go from meeting point to meeting point together; each one's
    ``out`` (None if it died), and the bucket's GETs counted by ``proxy`` before each point (the
    epoch before it: ``gets["1"]`` is epoch 0's, ``gets["end"]`` the last epoch's)."""
    job = specs[0]["job"]
    order: list[str] = []
    for spec in specs:
        order += [p for p in _points(spec) if p not in order]
    procs = [start_node(tmp, s) for s in specs]
    gets: dict[str, int] = {}
    try:
        for point in order:
            want = sum(point in _points(s) for s in specs)
            deadline = time.monotonic() + timeout
            while int(store.store.add(f"{job}/arrive/{point}", 0)) < want:
                failed = [s for p, s in zip(procs, specs, strict=True) if p.poll() not in (None, -9)]
                if failed or time.monotonic() > deadline:
                    raise AssertionError(
                        f"nodes did not reach {point}: " + "\n".join(log_of(s) for s in specs)
                    )
                time.sleep(0.01)
            if proxy is not None:
                gets[point] = sum(1 for m, t in proxy.requests if m == "GET" and "list-type" not in t)
                proxy.reset_counts()
            store.store.set(f"{job}/go/{point}", "1")
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    results: list[dict[str, Any] | None] = []
    for proc, spec in zip(procs, specs, strict=True):
        out = Path(spec["out"])
        results.append(json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None)
    return results, gets


def log_of(spec: dict[str, Any]) -> str:
    path = Path(spec["out"] + ".log")
    return path.read_text(errors="replace")[-4000:] if path.exists() else ""

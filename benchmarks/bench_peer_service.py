"""What a node's peer service under load costs the training loop: the service on the training process's
own loop (``Peers(service_process=False)``) against the service in a process of its own (the default).

This process is node 0's training process: its cache holds ``--objects`` objects of ``--size`` bytes
homed on it, and it starts the node's service both ways (two jobs of two nodes, met through a
``HashStore``). A second process, node 1 (``--ask``), reads those objects from the service chosen for
the round through a ``PeerClient``, at ``--rate`` objects per second (as the other nodes of a job
read what this node is home for, about as many as it reads itself), at most ``--inflight`` at a time.
Meanwhile the training loop takes ``--batches`` batches from a ``torch.utils.data.DataLoader`` of
``--workers`` workers (a batch of ``--batch`` samples of ``--size`` bytes) as fast as it can, for
each kind of batch:

- ``tensor``  one uint8 tensor (``default_collate``): it crosses in shared memory, a file descriptor
  passed per tensor, a round trip to the worker that needs the training process's GIL;
- ``bytes``   a list of bytes, through the result pipe widened as ``BlobLoader`` widens it
  (both kinds: ``bench_batch_pipe.py``'s loaders, widened).

Settings, each timed ``--rounds`` times, interleaved: ``quiet`` (nobody asks the service) and
``served`` (node 1 reads at ``--rate``), with the service in a ``thread`` of this process or in its own
``process``. Printed: the median milliseconds per batch, the rate node 1 achieved and how many of its
reads the service answered (the others: hedged or fallen back to the bucket), and the ratio process /
thread. On a machine of few cores the service's process competes for the cores it would have had to
itself on a node; its GIL is what this measures.

    python benchmarks/bench_peer_service.py [--objects 3000] [--size 27000] [--rate 3000]
        [--batches 100] [--rounds 3] [--kinds tensor,bytes] [--json out.json]

A benchmark prints; it asserts nothing (tests/peers/test_bench_peers.py runs it small and checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import REPO, add_repo_to_path, table

add_repo_to_path()

ROOT = "s3://bench-peer-service/train/"
NAMES = ("127.0.0.1", "asker")  # node 0: this process's; node 1: the asker's
KINDS = ("tensor", "bytes")
PLACEMENTS = ("thread", "process")
LOADS = ("quiet", "served")


def _objects(n: int, size: int) -> list[tuple[str, str, int]]:
    """``n`` objects homed on node 0: (URL, identity, size)."""
    from blobdata._peers import Homes

    homes, out, i = Homes(NAMES), [], 0
    while len(out) < n:
        url = f"{ROOT}{i:06d}.bin"
        if homes.home_of(url) == 0:
            out.append((url, f"{i:032x}", size))
        i += 1
    return out


# -- node 1: the asker -----------------------------------------------------------------------------------
def _session(spec: dict[str, Any], objects: list[tuple[str, str, int]], address: str, secret: bytes) -> str:
    """One round of node 1's reads from the service at ``address`` until ``stop`` comes on stdin:
    ``objects_per_s answered not``."""
    from blobdata._loop import run
    from blobdata._peers import PeerClient, PeerTable

    client = PeerClient(PeerTable(secret, NAMES, (address, "127.0.0.1:9"), 1, 16))
    stop = asyncio.Event()
    counts = [0, 0]  # answered by the service, not (hedged or fallen back: the "bucket" below)

    async def bucket() -> tuple[bytes, str]:
        return b"", ""

    async def one(url: str, identity: str, size: int, gate: asyncio.Semaphore) -> None:
        try:
            data, from_peer = await client.read(0, url, size, identity, bucket)
            counts[0 if from_peer and len(data) == size else 1] += 1
        finally:
            gate.release()

    async def reads() -> float:
        gate, tasks = asyncio.Semaphore(spec["inflight"]), set()
        t0, k = time.perf_counter(), 0
        while not stop.is_set():
            due = int((time.perf_counter() - t0) * spec["rate"])
            while k < due:  # at the rate, as far as the in-flight bound lets them go
                await gate.acquire()
                u, e, n = objects[k % len(objects)]
                task = asyncio.ensure_future(one(u, e, n, gate))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                k += 1
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
        return time.perf_counter() - t0

    async def until_stopped() -> float:
        # One read first (the connection open), then the rounds' reads at the rate from "going" on.
        url, identity, size = objects[0]
        await client.read(0, url, size, identity, bucket)
        print("going", flush=True)
        waiter = asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        work = asyncio.ensure_future(reads())
        await waiter  # "stop"
        stop.set()
        return await work

    seconds = run(until_stopped(), 3600)
    run(client.aclose())
    return f"{sum(counts) / seconds:.1f} {counts[0]} {counts[1]}"


def ask(spec_json: str) -> int:
    """Node 1 (``--ask SPEC``): reads node 0's objects from the service of each ``go ADDRESS SECRET``
    line of stdin at the spec's rate until ``stop``, then prints ``objects_per_s answered not``."""
    spec = json.loads(spec_json)
    objects = _objects(spec["objects"], spec["size"])
    for line in sys.stdin:
        words = line.split()
        if words[:1] != ["go"] or len(words) != 3:
            break
        print(_session(spec, objects, words[1], bytes.fromhex(words[2])), flush=True)
    return 0


# -- node 0: the training process ----------------------------------------------------------------------
def _ms_per_batch(loader: Any) -> float:
    it = iter(loader)
    next(it)  # the workers started
    t0 = time.perf_counter()
    got = sum(1 for _ in it)
    return 1000.0 * (time.perf_counter() - t0) / max(1, got)


def _services(cache: Any) -> tuple[dict[str, tuple[str, str]], list[Any]]:
    """Node 0's service both ways: each placement's address and job secret (hex), and what must be
    kept alive (owners, handles)."""
    import hashlib

    import torch.distributed as dist

    from blobdata import FetchOptions
    from blobdata._peers import EngineSpec, Peers, join, serve, service_of

    async def unread(*_: Any) -> bytes:
        raise RuntimeError("every object is in the cache")

    class Owner:  # held weakly by a service on this process's loop
        pass

    keep: list[Any] = []
    addresses: dict[str, tuple[str, str]] = {}
    for placement in PLACEMENTS:
        store, job = dist.HashStore(), f"bench-{placement}-{os.getpid()}"
        prefix = "blobdata/peers/v1/" + hashlib.sha256(job.encode()).hexdigest()[:16] + "/"
        other = {"name": NAMES[1], "address": "127.0.0.1:9", "local": "127.0.0.1:9"}
        store.set(prefix + "node/1", json.dumps(other))
        config = Peers(
            store=store, nnodes=2, node_rank=0, host="127.0.0.1", job=job,
            service_process=placement == "process",
        )  # fmt: skip
        table_ = join(config)
        assert table_ is not None
        owner = Owner()
        serve(table_, ROOT, cache, owner, unread, EngineSpec(FetchOptions(), "s3", {"anon": True}))
        keep += [owner, service_of(table_)]
        addresses[placement] = (table_.addresses[0], table_.secret.hex())
    return addresses, keep


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ask"]:
        return ask(argv[1])
    from bench_batch_pipe import make_loader  # (torch: not in node 1's process)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=3000)
    p.add_argument("--size", type=int, default=27000, help="bytes per object and per sample")
    p.add_argument("--rate", type=float, default=3000.0, help="objects per second node 1 reads")
    p.add_argument("--inflight", type=int, default=256, help="node 1's reads in flight at most")
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--batch", type=int, default=32, help="samples per batch")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if set(kinds) - set(KINDS):
        p.error(f"--kinds takes {', '.join(KINDS)}")

    from blobdata import BlobCache

    work = Path(tempfile.mkdtemp(prefix="bench-peer-service-"))
    os.environ.setdefault("BLOBDATA_NODE_DIR", str(work / "node"))
    objects = _objects(args.objects, args.size)
    cache = BlobCache(str(work / "cache"), size_limit=2 * args.objects * args.size + 2**26, policy="admit")
    for k in range(0, len(objects), 256):
        cache.put_many([(u, e, os.urandom(n)) for u, e, n in objects[k : k + 256]])
    addresses, keep = _services(cache)
    spec = {k: getattr(args, k) for k in ("objects", "size", "rate", "inflight")}
    asker = subprocess.Popen(
        [sys.executable, __file__, "--ask", json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert asker.stdin is not None and asker.stdout is not None
    times: dict[tuple[str, str, str], list[float]] = {}
    served: dict[str, list[tuple[float, int, int]]] = {p: [] for p in PLACEMENTS}
    load0 = os.getloadavg()
    try:
        for _ in range(args.rounds):  # interleaved: the machine's noise falls on every setting alike
            for kind in kinds:
                for placement in PLACEMENTS:
                    for load in LOADS:
                        if load == "served":
                            asker.stdin.write("go {} {}\n".format(*addresses[placement]))
                            asker.stdin.flush()
                            if asker.stdout.readline().strip() != "going":
                                raise SystemExit("node 1 did not start reading")
                            time.sleep(0.3)  # its pace set
                        ms = _ms_per_batch(make_loader(kind, True, args))
                        if load == "served":
                            asker.stdin.write("stop\n")
                            asker.stdin.flush()
                            said = asker.stdout.readline().split()
                            if len(said) != 3:
                                raise SystemExit(f"node 1 did not say what it read: {said!r}")
                            served[placement].append((float(said[0]), int(said[1]), int(said[2])))
                        times.setdefault((kind, placement, load), []).append(ms)
    finally:
        asker.stdin.close()
        asker.wait(60)
        for handle in keep:
            if hasattr(handle, "close"):
                handle.close()
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()
    print(
        f"{args.batches} batches of {args.batch} x {args.size} bytes, {args.workers} workers; node 1 reads "
        f"{args.objects} objects of {args.size} bytes at {args.rate:.0f}/s (at most {args.inflight} in "
        f"flight); median of {args.rounds} rounds, ms per batch; load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after"
    )
    rows, out = [], []
    for kind in kinds:
        for load in LOADS:
            med = {pl: statistics.median(times[(kind, pl, load)]) for pl in PLACEMENTS}
            ratio = med["process"] / med["thread"] if med["thread"] else float("nan")
            rows.append([kind, load, f"{med['thread']:.2f}", f"{med['process']:.2f}", f"{ratio:.2f}"])
            out.append({"kind": kind, "load": load, "thread_ms": med["thread"], "process_ms": med["process"]})
    print(table(["batch", "service", "in a thread ms", "own process ms", "process / thread"], rows))
    for placement in PLACEMENTS:
        got = served[placement]
        rate = statistics.median(r for r, _, _ in got)
        ok, other = sum(o for _, o, _ in got), sum(x for _, _, x in got)
        print(f"service in a {placement}: node 1 read {rate:.0f} objects/s, {ok} answered, {other} not")
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        doc = {"args": settings, "results": out, "served": served, "load": [load0, load1]}
        args.json.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A job's first epoch through a node's peer service: how many objects a second the service reads from
the bucket for the other nodes, with the concurrency of one process (``--concurrency``, 64: what it had
before) against ``Peers``' default (``SERVICE_READERS`` processes' worth), and against the asking node
reading the bucket itself.

In a job's first epoch no cache holds the data: each node's service reads from the bucket the node's
share of every node's samples, as much as a whole node reads without peers. The bucket here is a local
S3 server behind a ``LatencyProxy`` of ``--bucket-rtt-ms`` (default 50 ms). The service is the node's
real one, in a process of its own (``blobdata._peers.daemon.start``), serving a fresh cache; this
process is the other node of a job of two, with ``--inflight`` reads in flight to it at once (the
look-ahead of that node's processes; a ``PeerClient`` with ``per_peer`` as large). Each round reads
``--objects`` objects of ``--size`` bytes that nobody read before (a prefix of their own, a cache of
their own) once per setting, the settings in turn:

- ``service, 64``: the service reads the bucket with ``--concurrency`` requests in flight at most;
- ``service, 512``: with ``SERVICE_READERS`` times that (``Peers(service_concurrency=)`` unless given);
- ``no peers``: this process reads the objects from the bucket itself, ``--inflight`` at a time.

Prints objects a second per setting and round, the bucket GETs (one per object, and a read the asking
side hedged to the bucket), the CPU per object of the service's process and of the asking process
(this one), and the medians: the service's CPU per object bounds what one service process can read for
the others on a core of its own.

    python benchmarks/bench_peer_cold.py [--objects 1500] [--inflight 512] [--rounds 3]
        [--bucket-rtt-ms 50] [--json out.json]

A benchmark prints; it asserts nothing (tests/peers/test_bench_peers.py runs it small and checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import add_repo_to_path, cpu_seconds, process_cpu_seconds, table

add_repo_to_path()

SECRET = bytes(range(32))
NAMES = ("127.0.0.2", "127.0.0.3")  # the service's node, then this process's


def _keys(prefix: str, n: int) -> list[str]:
    """``n`` keys under ``prefix`` whose objects are homed on the service's node."""
    from blobdata._peers import Homes

    homes, out, i = Homes(NAMES), [], 0
    while len(out) < n:
        key = f"{prefix}/c{i % 10:02d}/{i:06d}.bin"
        if homes.home_of(f"s3://bench/{key}") == 0:
            out.append(key)
        i += 1
    return out


def _rows(root: str, options: dict[str, Any]) -> list[tuple[str, str, int]]:
    """``(url, identity, size)`` of each object below ``root``, as a dataset lists them."""
    from blobdata import FolderDataset

    m = FolderDataset(root, extensions=(".bin",), storage_options=options).manifest
    return [(m.url(i), m.identity(i), m.size(i)) for i in range(len(m))]


async def _ask_all(
    client: Any, rows: list[tuple[str, str, int]], inflight: int, options: dict[str, Any]
) -> int:
    """Read ``rows`` through ``client`` from the service, ``inflight`` at a time; how many reads the
    client hedged (read the bucket too)."""
    from blobdata import FetchOptions
    from blobdata._fetch import FetchEngine

    gate = asyncio.Semaphore(inflight)
    engine: Any = None
    hedged = 0

    async def bucket_of(url: str, size: int, identity: str) -> tuple[bytes, str]:
        nonlocal engine, hedged
        hedged += 1  # the asking side gave up waiting for the service and read the bucket too
        if engine is None:
            engine = FetchEngine(FetchOptions(concurrency=inflight), "s3", options)
        data, _ = await engine.fetch(url, size=size, identity=identity)
        return bytes(data), "bucket"

    async def one(url: str, identity: str, size: int) -> None:
        async with gate:
            data, _ = await client.read(0, url, size, identity, lambda: bucket_of(url, size, identity))
            if len(data) != size:
                raise RuntimeError(f"{url}: {len(data)} bytes, not {size}")

    try:
        await asyncio.gather(*(one(*r) for r in rows))
    finally:
        if engine is not None:
            await engine.aclose()
    return hedged


async def _direct(rows: list[tuple[str, str, int]], inflight: int, options: dict[str, Any]) -> None:
    from blobdata import FetchOptions
    from blobdata._fetch import FetchEngine

    engine = FetchEngine(FetchOptions(concurrency=inflight), "s3", options)
    try:
        await asyncio.gather(*(engine.fetch(u, size=n, identity=e) for u, e, n in rows))
    finally:
        await engine.aclose()


def _one(
    setting: str, rows: list[tuple[str, str, int]], args: Any, work: Path, options: dict[str, Any]
) -> tuple[float, int, float, float]:
    """Seconds to read ``rows`` one way (``setting``), all of them fresh, the reads hedged, and the CPU
    seconds of the service's process (NaN: none) and of this process (the asking node) meanwhile."""
    from blobdata import BlobCache, FetchOptions
    from blobdata._loop import run
    from blobdata._peers import EngineSpec, PeerClient, PeerTable, daemon

    if setting == "no peers":
        t, c = time.perf_counter(), cpu_seconds()
        run(_direct(rows, args.inflight, options), 600)
        return time.perf_counter() - t, 0, math.nan, cpu_seconds() - c
    concurrency = int(setting.rsplit(" ", 1)[1])
    service = daemon.start(SECRET, "127.0.0.1", 0)
    try:
        service.set_homes(NAMES, 0)
        cache = BlobCache(str(work / f"cache-{os.urandom(4).hex()}"), size_limit=2**32, policy="admit")
        root = rows[0][0].rsplit("/", 2)[0] + "/"
        service.add_source(root, cache, EngineSpec(FetchOptions(concurrency=concurrency), "s3", options))
        client = PeerClient(PeerTable(SECRET, NAMES, (service.address, "127.0.0.1:9"), 1, args.inflight))
        t, c, s = time.perf_counter(), cpu_seconds(), process_cpu_seconds(service.pid)
        hedged = run(_ask_all(client, rows, args.inflight, options), 600)
        seconds = time.perf_counter() - t
        asker, served = cpu_seconds() - c, process_cpu_seconds(service.pid) - s
        run(client.aclose())
        return seconds, hedged, served, asker
    finally:
        service.close()


def _us(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=1500, help="objects read per setting and round")
    p.add_argument("--size", type=int, default=27000, help="bytes per object (bench_peers' JPEGs: ~27 KB)")
    p.add_argument("--inflight", type=int, default=512, help="the asking node's reads in flight")
    p.add_argument("--concurrency", type=int, default=64, help="FetchOptions(concurrency=)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-rtt-ms", type=float, default=50.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    from blobdata._peers import SERVICE_READERS
    from blobdata.testing import LatencyProxy, LocalS3Server, s3_client

    settings = [f"service, {args.concurrency}", f"service, {SERVICE_READERS * args.concurrency}", "no peers"]
    work = Path(tempfile.mkdtemp(prefix="bench-peer-cold-"))
    os.environ.setdefault("BLOBDATA_NODE_DIR", str(work / "node"))
    load0 = os.getloadavg()
    results: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    rows_out = []
    try:
        with LocalS3Server() as server:
            client = s3_client(server)
            client.create_bucket(Bucket="bench")
            body = os.urandom(args.size)
            prefixes = [f"r{r}s{k}" for r in range(args.rounds) for k in range(len(settings))]
            keys = [k for prefix in prefixes for k in _keys(prefix, args.objects)]
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda k: client.put_object(Bucket="bench", Key=k, Body=body), keys))
            host, port = server.endpoint_url.split("://", 1)[1].rsplit(":", 1)
            with LatencyProxy(host, int(port.rstrip("/")), delay_s=args.bucket_rtt_ms / 2000.0) as proxy:
                options = {**server.storage_options, "endpoint_url": proxy.endpoint_url}
                for r in range(args.rounds):
                    for k, setting in enumerate(settings):
                        rows = _rows(f"s3://bench/r{r}s{k}", options)
                        proxy.reset_counts()
                        seconds, hedged, served, asker = _one(setting, rows, args, work, options)
                        gets = sum(1 for m, _ in proxy.requests if m == "GET")
                        got = {
                            "seconds": seconds,
                            "per_s": len(rows) / seconds,
                            "gets": gets,
                            "hedged": hedged,
                            "service_us": 1e6 * served / len(rows),
                            "asker_us": 1e6 * asker / len(rows),
                        }
                        results[setting].append(got)
                        cells = [f"{got['per_s']:.0f}", f"{seconds:.2f}", str(gets), str(hedged)]
                        cells += [_us(got["service_us"]), _us(got["asker_us"])]
                        rows_out.append([str(r + 1), setting, *cells])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()
    print(
        f"{args.objects} objects of {args.size} bytes per setting and round, read once each by the other "
        f"node of a job of 2 with {args.inflight} reads in flight; bucket RTT {args.bucket_rtt_ms:.0f} ms; "
        f"load average {load0[0]:.1f} before, {load1[0]:.1f} after"
    )
    heads = ["round", "setting", "objects/s", "seconds", "bucket GETs", "hedged", "service CPU us/obj",
             "asking CPU us/obj"]  # fmt: skip
    print(table(heads, rows_out))
    med = {s: statistics.median(g["per_s"] for g in results[s]) for s in settings}
    base = med[settings[0]]
    print("medians, objects/s: " + ", ".join(f"{s} {med[s]:.0f} ({med[s] / base:.2f}x)" for s in settings))
    cpu = {s: statistics.median(g["service_us"] for g in results[s]) for s in settings[:2]}
    print(
        "medians, the service's CPU per object read for the other node: "
        + ", ".join(f"{s} {cpu[s]:.0f} us (one core: {1e6 / cpu[s]:,.0f} objects/s)" for s in cpu)
    )
    if args.json is not None:
        kept = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"args": kept, "results": results, "median": med}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

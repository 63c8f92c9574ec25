"""What one peer read costs in CPU, each side in its own process, against a hit in the node's own cache.

A node's peer service (``blobdata._peers.Service``) runs in a child process with a warm cache of
``--objects`` objects of ``--size`` bytes homed on it; this process asks for all of them through a
``PeerClient`` as a look-ahead does: ``--batch`` reads begun together (the reads of one loop turn go as
one request per peer), up to ``--inflight`` in flight. It reads them twice, each read in a task of its
own (``PeerClient.read``) and each started as one of its batch without a task (``PeerClient.start``, the
look-ahead's misses), then reads the same objects from a cache of its own in batches of ``--batch`` (a
batch's cache hits, as ``PartitionedSampler``'s epochs read them). Each round prints the CPU per object of
the service's process, of this process for the peer reads both ways, and of this process for the cache
hits: what a peer read costs a job beyond a hit (``bench_peers.py`` says what that does to an epoch).

``--job-nodes`` makes the job that many nodes (the others never asked): each read finds its object's
home as a dataset's read does, and the service checks that it is home for every object asked.

    python benchmarks/bench_peer_read.py [--objects 4000] [--size 27000] [--inflight 48] [--rounds 5]
        [--job-nodes 2] [--json out.json]

A benchmark prints; it asserts nothing (tests/peers/test_bench_peers.py runs it small and checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import REPO, add_repo_to_path, cpu_seconds, table

add_repo_to_path()

SECRET = bytes(range(32))
NAMES = ("127.0.0.2", "127.0.0.3")  # the service's node is the first, this process's the second


def _names(nodes: int) -> tuple[str, ...]:
    """A job of ``nodes`` nodes: the service's, this process's, and others that are never asked."""
    return NAMES + tuple(f"10.0.{k // 250}.{k % 250 + 1}" for k in range(nodes - len(NAMES)))


ROOT = "s3://bench/train"


def _objects(n: int, size: int, nodes: int) -> list[tuple[str, str, int]]:
    """``n`` objects homed on the service's node in a job of ``nodes``: (URL, identity, size)."""
    from blobdata._peers import Homes

    homes, out, i = Homes(_names(nodes)), [], 0
    while len(out) < n:
        url = f"{ROOT}/c{i % 10:02d}/{i:06d}.jpg"
        if homes.home_of(url) == 0:
            out.append((url, f"{i:032x}", size))  # an ETag's shape: 32 hex digits
        i += 1
    return out


def _fill(cache: Any, objects: list[tuple[str, str, int]]) -> None:
    for k in range(0, len(objects), 256):
        if not all(cache.put_many([(u, e, os.urandom(n)) for u, e, n in objects[k : k + 256]])):
            raise RuntimeError(f"the cache at {cache.directory} did not take every object")


def serve(directory: str, n: int, size: int, nodes: int) -> int:
    """The service's side (``--serve``): a warm cache, the service on a free port of 127.0.0.1 (printed),
    then ``mark`` (CPU from now) and ``cpu`` (seconds since the mark) on stdin, until it closes: read
    here, to the microsecond (another process's CPU time is counted in clock ticks, 10 ms)."""
    from blobdata import BlobCache
    from blobdata._loop import run
    from blobdata._peers import Homes, Service

    cache = BlobCache(directory, size_limit=2 * n * size + 2**26, policy="admit")
    _fill(cache, _objects(n, size, nodes))

    async def unread(*_: Any) -> bytes:
        raise RuntimeError("every object is in the cache")

    class Owner:  # the service holds its sources' owners weakly: this one lives as long as the process
        pass

    owner = Owner()
    service = Service(SECRET)
    service.homes, service.me = Homes(_names(nodes)), 0
    service.add_source(ROOT, cache, owner, unread)
    port = run(service.server.start("127.0.0.1", 0))
    print(f"port {port}", flush=True)
    mark = cpu_seconds()
    for line in sys.stdin:
        if line.strip() == "mark":
            mark = cpu_seconds()
            print("ok", flush=True)
        elif line.strip() == "cpu":
            print(f"{cpu_seconds() - mark:.6f}", flush=True)
    run(service.server.aclose())
    return 0


def _peer_round(
    client: Any, objects: list[tuple[str, str, int]], inflight: int, batch: int, started: bool
) -> float:
    """This process's CPU seconds to read ``objects`` from the peer as a look-ahead does: ``batch`` reads
    begun together, up to ``inflight`` in flight, each batch awaited in turn; each read started as one
    of a batch (``started``: ``PeerClient.start``, the look-ahead's misses now) or in a task of its own
    (``PeerClient.read``, as every read was before)."""
    from blobdata._loop import run

    async def bucket() -> tuple[bytes, str]:
        raise RuntimeError("a peer read went to the bucket: the benchmark's service is not answering")

    def begin(url: str, identity: str, size: int) -> asyncio.Future[Any]:
        # Its home found as a dataset's read finds it (blobdata._dataset.peering).
        home = client.home_of(url)
        if started:
            fut = client.start(home, url, size, identity, bucket)
            if fut is None:
                raise RuntimeError(f"{url}: could not be started")
            return fut
        return asyncio.ensure_future(client.read(home, url, size, identity, bucket))

    async def reads() -> None:
        waiting: collections.deque[tuple[list[tuple[str, str, int]], list[asyncio.Future[Any]]]] = (
            collections.deque()
        )

        async def done() -> None:
            part, futs = waiting.popleft()
            for (url, _, size), got in zip(part, await asyncio.gather(*futs), strict=True):
                data = got if started else got[0]
                if len(data) != size or not (started or got[1]):
                    raise RuntimeError(f"{url}: not read from the peer")

        for k in range(0, len(objects), batch):
            part = objects[k : k + batch]
            waiting.append((part, [begin(*o) for o in part]))
            if len(waiting) * batch >= inflight:
                await done()
        while waiting:
            await done()

    c0 = cpu_seconds()
    run(reads(), 600)
    return cpu_seconds() - c0


def _hit_round(cache: Any, objects: list[tuple[str, str, int]], batch: int) -> float:
    """This process's CPU seconds to read ``objects`` from its own cache, ``batch`` per lookup."""
    c0 = cpu_seconds()
    for k in range(0, len(objects), batch):
        part = objects[k : k + batch]
        got = cache.get_many([(u, e) for u, e, _ in part])
        if any(g is None or len(g) != n for g, (_, _, n) in zip(got, part, strict=True)):
            raise RuntimeError("a cache hit missed")
    return cpu_seconds() - c0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return serve(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=4000)
    p.add_argument("--size", type=int, default=27000, help="bytes per object (bench_peers' JPEGs: ~27 KB)")
    p.add_argument("--inflight", type=int, default=48, help="peer reads in flight (a look-ahead's)")
    p.add_argument("--batch", type=int, default=32, help="reads begun together, and cache hits per lookup")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--job-nodes", type=int, default=2, help="nodes in the job (each read finds its home)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.job_nodes < 2:
        p.error("--job-nodes: a job of peers has 2 nodes or more")

    from blobdata import BlobCache
    from blobdata._loop import run
    from blobdata._peers import PeerClient, PeerTable

    work = Path(tempfile.mkdtemp(prefix="bench-peer-read-"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(work / "home"), str(args.objects), str(args.size),
         str(args.job_nodes)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None

    def say(line: str) -> str:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    load0 = os.getloadavg()
    rows, rounds = [], []
    try:
        head = child.stdout.readline().split()
        if head[:1] != ["port"]:
            raise SystemExit(f"the service did not start: {head!r}")
        objects = _objects(args.objects, args.size, args.job_nodes)
        mine = BlobCache(str(work / "own"), size_limit=2 * args.objects * args.size + 2**26, policy="admit")
        _fill(mine, objects)
        names = _names(args.job_nodes)
        addresses = (f"127.0.0.1:{head[1]}", *["127.0.0.1:9"] * (len(names) - 1))
        table_ = PeerTable(SECRET, names, addresses, 1, 16)
        client = PeerClient(table_)
        for started in (False, True):  # connections open, code warm
            _peer_round(client, objects[:64], args.inflight, args.batch, started)
        n = args.objects
        for r in range(args.rounds):
            say("mark")
            tasks = _peer_round(client, objects, args.inflight, args.batch, False)
            asker = _peer_round(client, objects, args.inflight, args.batch, True)
            service = float(say("cpu")) / 2  # both ways' requests
            hit = _hit_round(mine, objects, args.batch)
            got = {"service_us": service / n * 1e6, "asker_us": asker / n * 1e6, "hit_us": hit / n * 1e6}
            got["asker_task_us"] = tasks / n * 1e6
            got["peer_us"] = got["service_us"] + got["asker_us"]
            rounds.append(got)
            cells = (
                f"{got[k]:.1f}" for k in ("service_us", "asker_task_us", "asker_us", "peer_us", "hit_us")
            )
            rows.append([str(r + 1), *cells])
        run(client.aclose())
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()
    print(
        f"{args.objects} objects of {args.size} bytes, a job of {args.job_nodes} nodes, "
        f"{args.inflight} peer reads in flight, cache hits "
        f"{args.batch} per lookup; load average {load0[0]:.1f} before, {load1[0]:.1f} after"
    )
    heads = ["round", "service us/object", "asker us, a task per read", "asker us, started as a batch"]
    print(table([*heads, "peer read us", "cache hit us"], rows))
    med = {k: statistics.median(g[k] for g in rounds) for k in rounds[0]}
    print(
        f"median: a peer read {med['peer_us']:.1f} us of CPU (service {med['service_us']:.1f}, asker "
        f"{med['asker_us']:.1f}), a cache hit {med['hit_us']:.1f} us: {med['peer_us'] / med['hit_us']:.1f}x; "
        f"the asker with a task per read {med['asker_task_us']:.1f} us: "
        f"{med['asker_task_us'] / med['asker_us']:.2f}x started as a batch"
    )
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"args": settings, "rounds": rounds, "median": med}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Making the dataset in a job of many ranks: one listing for the job, against one per rank.

Starts a local S3 server (``blobdata.testing.LocalS3Server``) behind a latency proxy that counts
requests (default 20 ms round trip), uploads ``--objects`` tiny objects in ``--classes`` class
prefixes, then times ``FolderDataset(url, refresh=True)`` (a fresh listing each time):

* 1 rank;
* ``--ranks`` ranks in a gloo process group, each listing for itself (``share_listing=False``,
  what every rank did before);
* ``--ranks`` ranks, rank 0 listing and broadcasting the manifest's bytes (the default).

Prints, per row, the slowest rank's construction time and the listing requests the server saw.
A benchmark, not a test: no timed assertions. ``python benchmarks/bench_distributed.py --objects 2000``
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common import add_repo_to_path, table

add_repo_to_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, url: str, opts: dict[str, Any], share: bool, out: Any) -> None:
    import torch.distributed as dist

    from blobdata import FolderDataset

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        dist.barrier()
    t0 = time.perf_counter()
    ds = FolderDataset(url, storage_options=opts, refresh=True, share_listing=share)
    out.put((rank, time.perf_counter() - t0, len(ds)))
    if world > 1:
        dist.destroy_process_group()


def _job(world: int, url: str, opts: dict[str, Any], share: bool) -> tuple[float, int]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, url, opts, share, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return max(t for _, t, _ in got), got[0][2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=2000)
    p.add_argument("--classes", type=int, default=20)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rtt-ms", type=float, default=20.0)
    args = p.parse_args()
    os.environ["BLOBDATA_CACHE_HOME"] = tempfile.mkdtemp(prefix="bench-dist-")  # children inherit it

    from blobdata.testing import LatencyProxy, LocalS3Server, s3_client

    with LocalS3Server() as server:
        client = s3_client(server)
        client.create_bucket(Bucket="bench")

        def put(i: int) -> None:
            client.put_object(Bucket="bench", Key=f"train/c{i % args.classes:03d}/{i:06d}.png", Body=b"x")

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, range(args.objects)))
        host, port = server.endpoint_url.split("://", 1)[1].rsplit(":", 1)
        with LatencyProxy(host, int(port.rstrip("/")), delay_s=args.rtt_ms / 2000) as proxy:
            opts = {**server.storage_options, "endpoint_url": proxy.endpoint_url}
            rows = []
            for label, world, share in (
                ("1 rank", 1, True),
                (f"{args.ranks} ranks, each lists", args.ranks, False),
                (f"{args.ranks} ranks, rank 0 lists + broadcast", args.ranks, True),
            ):
                proxy.reset_counts()
                seconds, n = _job(world, "s3://bench/train", opts, share)
                lists = sum(1 for m, t in proxy.requests if m == "GET" and "list-type=2" in t)
                rows.append([label, f"{seconds:.2f}", str(lists), str(n)])
    print(f"{args.objects} objects in {args.classes} classes, RTT {args.rtt_ms:.0f} ms, one run each")
    print(table(["job", "slowest rank: s", "listing requests", "samples"], rows))


if __name__ == "__main__":
    sys.exit(main())

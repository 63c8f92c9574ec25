"""Two nodes, two caches, real torchrun: bucket GETs per epoch with PartitionedSampler and with
(Elastic)DistributedSampler's order.

Starts a local S3 server (``blobdata.testing.LocalS3Server``) behind a ``LatencyProxy`` that counts
requests, uploads ``--objects`` objects of ``--size`` bytes in ``--classes`` class prefixes (the listing
is sorted by class), then, per sampler, runs ``examples/train_ddp.py --smoke`` (DDP, gloo, CPU) as two
"nodes" on 127.0.0.1: ``torchrun --nnodes 2 --node-rank {0,1}`` with a static rendezvous on a free
port and ``--nproc-per-node`` ranks each, each node with its own cache directory of
``--cache-fraction`` of the dataset's bytes. Each epoch is one run of the job that resumes from the
checkpoint of the previous one (the caches stay on disk, as a node's NVMe does), so the proxy's
count between runs is exactly that epoch's GETs. Prints GETs per epoch and the ratio of epochs 2 and 3
to epoch 1; ``--json PATH`` saves them. A benchmark: it asserts nothing
(tests/sampling/test_partition_torchrun.py runs it small and checks the ratios).

    python benchmarks/bench_partition_torchrun.py [--objects 600] [--nproc-per-node 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import REPO, add_repo_to_path, table

add_repo_to_path()

EXAMPLE = REPO / "examples" / "train_ddp.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _epoch(url: str, env: dict[str, str], work: Path, sampler: str, epoch: int, args: Any) -> None:
    """One run of the two-node job, up to the end of ``epoch`` (resuming from the checkpoint)."""
    port = _free_port()
    procs = []
    for node in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
            f"--nproc-per-node={args.nproc_per_node}", "--master-addr=127.0.0.1", f"--master-port={port}",
            str(EXAMPLE), url, "--smoke", "--sampler", sampler, "--epochs", str(epoch),
            "--batch-size", str(args.batch_size), "--workers", str(args.workers),
            "--cache-dir", str(work / f"{sampler}-cache{node}"), "--cache-size", str(args.cache_bytes),
            "--checkpoint", str(work / f"{sampler}-ckpt"),
        ]  # fmt: skip
        log = open(work / f"{sampler}-e{epoch}-node{node}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for proc, log in procs:
        try:
            code = proc.wait(timeout=args.timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        if code != 0:
            text = Path(log.name).read_text(errors="replace")[-3000:]
            raise SystemExit(f"{sampler} epoch {epoch}: torchrun failed ({code}):\n{text}")


def _entries(directory: Path) -> int:
    from blobdata import BlobCache

    with BlobCache.inspect(directory) as cache:
        return cache.stats().entries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=600)
    p.add_argument("--size", type=int, default=40_000, help="bytes per object (default 40000)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--cache-fraction", type=float, default=0.6, help="each node's cache / dataset bytes")
    p.add_argument("--samplers", default="partitioned,elastic", help="train_ddp.py --sampler values")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run of the job")
    p.add_argument("--json", type=Path, default=None, help="save the counts here")
    args = p.parse_args(argv)
    args.cache_bytes = int(args.cache_fraction * args.objects * args.size)

    from blobdata.testing import LatencyProxy, LocalS3Server, s3_client

    work = Path(tempfile.mkdtemp(prefix="bench-partition-"))
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with LocalS3Server() as server:
        client = s3_client(server)
        client.create_bucket(Bucket="bench")
        body = os.urandom(args.size)

        def put(i: int) -> None:
            key = f"train/c{i * args.classes // args.objects:03d}/{i:06d}.png"  # sorted by class
            client.put_object(Bucket="bench", Key=key, Body=i.to_bytes(4, "big") + body[4:])

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, range(args.objects)))
        host, port = server.endpoint_url.split("://", 1)[1].rsplit(":", 1)
        with LatencyProxy(host, int(port.rstrip("/"))) as proxy:
            opts = server.storage_options
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "AWS_ENDPOINT_URL_S3": proxy.endpoint_url,
                "AWS_ACCESS_KEY_ID": opts["key"],
                "AWS_SECRET_ACCESS_KEY": opts["secret"],
                "AWS_REGION": opts["client_kwargs"]["region_name"],
                "BLOBDATA_CACHE_HOME": str(work / "home"),
                "OMP_NUM_THREADS": "1",
            }
            for sampler in args.samplers.split(","):
                gets = []
                for epoch in range(1, args.epochs + 1):
                    proxy.reset_counts()
                    _epoch("s3://bench/train", env, work, sampler, epoch, args)
                    gets.append(sum(1 for m, t in proxy.requests if m == "GET" and "list-type=2" not in t))
                entries = [_entries(work / f"{sampler}-cache{node}") for node in range(2)]
                rows.append({"sampler": sampler, "gets": gets, "cache_entries": entries})
    seconds = time.monotonic() - t0
    cache_mb = args.cache_bytes / 1e6
    print(
        f"{args.objects} objects of {args.size} B, 2 nodes x {args.nproc_per_node} ranks (torchrun, gloo), "
        f"a cache of {args.cache_fraction:.0%} of the dataset ({cache_mb:.1f} MB) per node; {seconds:.0f} s"
    )
    head = ["sampler", *(f"epoch {e} GETs" for e in range(1, args.epochs + 1))]
    head += [f"epoch {e} / epoch 1" for e in range(2, args.epochs + 1)] + ["entries per node cache"]
    body_rows = []
    for r in rows:
        g = r["gets"]
        ratios = [f"{x / g[0]:.1%}" if g[0] else "-" for x in g[1:]]
        body_rows.append([r["sampler"], *map(str, g), *ratios, " / ".join(map(str, r["cache_entries"]))])
    print(table(head, body_rows))
    if args.json is not None:
        doc = {"objects": args.objects, "nproc_per_node": args.nproc_per_node, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cache hit rate per epoch through the whole pipeline: FolderDataset on the local S3 server.

A dataset larger than the cache (by default the cache holds half of it), a fresh shuffled order
each epoch, ``num_workers`` DataLoader workers sharing one cache directory. The hit rate of an
epoch is measured where it matters, on the wire: ``1 - object GETs / samples``, counted by a proxy
in front of the server. Printed per policy next to the optimum for a uniform random order,
``cache size / dataset size`` (what "admit" aims at; LRU and FIFO thrash under a fresh permutation).

    python benchmarks/bench_epochs.py [--objects 1200] [--size 40KB] [--fraction 0.5] [--epochs 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from blobdata import BlobCache, FolderDataset
from blobdata._config import parse_size
from blobdata.testing import LatencyProxy, LocalS3Server, s3_client, upload


def nbytes(f: Any) -> int:
    """A loader that only counts bytes: this benchmark measures the cache, not the decoder."""
    return len(f.read())


def run_policy(
    policy: str,
    url: str,
    opts: dict[str, Any],
    proxy: LatencyProxy,
    args: argparse.Namespace,
    cache_bytes: int,
    workdir: str,
) -> list[tuple[float, float]]:
    """(hit rate, seconds) per epoch for one policy, with a fresh cache directory."""
    os.environ["BLOBDATA_CACHE_HOME"] = os.path.join(workdir, f"home-{policy}")
    ds = FolderDataset(
        url,
        loader=nbytes,
        storage_options=opts,
        cache=BlobCache(os.path.join(workdir, policy), size_limit=cache_bytes, policy=policy),  # type: ignore[arg-type]
    )
    loader = ds.dataloader(
        batch_size=32,
        shuffle=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed),
        persistent_workers=True,
    )
    out = []
    for _ in range(args.epochs):
        proxy.reset_counts()
        t0 = time.perf_counter()
        seen = sum(len(sizes) for sizes, _ in loader)
        dt = time.perf_counter() - t0
        gets = sum(1 for method, path in proxy.requests if method == "GET" and "list-type" not in path)
        out.append((1.0 - gets / seen, dt))
    del loader
    cache = BlobCache(os.path.join(workdir, policy), size_limit=cache_bytes, policy=policy)  # type: ignore[arg-type]
    with cache:
        stats = cache.stats()
    print(
        f"{policy}: the cache holds {stats.entries} entries, {stats.volume_bytes / 1e6:.1f} MB "
        f"(limit {cache_bytes / 1e6:.1f} MB)"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=1200)
    p.add_argument("--size", default="40KB", help="mean object size (sizes vary +-50%%)")
    p.add_argument("--fraction", type=float, default=0.5, help="cache size / dataset size")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    rng = np.random.default_rng(args.seed)
    mean = parse_size(args.size)
    sizes = rng.integers(int(mean * 0.5), int(mean * 1.5), args.objects)
    payload = rng.bytes(int(sizes.max()))
    objects = [(f"ds/c{i % 10:02d}/{i:06d}.jpg", payload[: int(sizes[i])]) for i in range(args.objects)]
    total = int(sizes.sum())
    cache_bytes = int(total * args.fraction)

    with LocalS3Server() as server, tempfile.TemporaryDirectory() as workdir:
        client = s3_client(server)
        client.create_bucket(Bucket="epochs")
        upload(client, "epochs", iter(objects))
        host, port = server.endpoint_url.split("://")[1].split(":")
        with LatencyProxy(host, int(port)) as proxy:
            opts = {**server.storage_options, "endpoint_url": proxy.endpoint_url}
            results = {
                policy: run_policy(policy, "s3://epochs/ds", opts, proxy, args, cache_bytes, workdir)
                for policy in ("admit", "lru")
            }
    optimum = cache_bytes / total
    print(
        f"\n{args.objects} objects, {total / 1e6:.1f} MB; cache {cache_bytes / 1e6:.1f} MB "
        f"({args.fraction:.0%}); {args.workers} workers; shuffled; optimum hit rate {optimum:.3f}"
    )
    print(f"{'epoch':>5}  " + "  ".join(f"{pol + ' hit':>10} {'x opt':>6} {'s':>6}" for pol in results))
    for e in range(args.epochs):
        cells = []
        for runs in results.values():
            rate, dt = runs[e]
            cells.append(f"{rate:>10.3f} {rate / optimum:>6.2f} {dt:>6.1f}")
        print(f"{e + 1:>5}  " + "  ".join(cells))
    later = [r for r, _ in results["admit"][1:]]
    if later:
        worst = min(later) / optimum
        print(
            f"goal: default policy 'admit' >= 0.95 x optimum after epoch 1: {worst:.2f}x "
            f"({'met' if worst >= 0.95 else 'NOT met'})"
        )


if __name__ == "__main__":
    main()

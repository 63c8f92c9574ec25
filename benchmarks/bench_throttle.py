"""A store that throttles: one epoch per store limit and worker count, fixed concurrency vs adaptive.

    python benchmarks/bench_throttle.py                  # 50, 150, 500 GET/s x 2, 8 workers, then no limit
    python benchmarks/bench_throttle.py --quick          # 150 GET/s x 2 workers, and no limit, once
    python benchmarks/bench_throttle.py --rates 150 --workers 2,8 --objects 600

Starts a local S3 server (SeaweedFS) and uploads ``--objects`` objects of 2 KB (4 classes). Each run
puts a fresh :class:`~blobdata.testing.LatencyProxy` in front of it (a fresh store for the node's
throttle controller, which remembers a store by its endpoint) in throttle mode: a token bucket of
``rate`` GET/s (burst: a tenth of a second's worth), ``503 SlowDown`` above it. Then one epoch in this
process: ``FolderDataset(..., on_error="skip")``, batch 16, shuffled, the given DataLoader workers, the
bytes only (no decode). ``fixed`` is ``FetchOptions(adaptive=False)``: every request at the fixed
concurrency, throttled answers spending attempts (blobdata before the controller); ``adaptive`` is the
default. Printed per run: epoch time / (objects / rate) (1.00 is the store's own pace), the share of
GETs answered 503 (counted by the proxy), the samples that failed (``on_error="skip"`` counts them:
with the default ``on_error="raise"`` the first one ends the epoch with Throttled).

Then, with no limit and RTT 50 ms (``delay_s=0.025``), ``--repeat`` epochs of each kind, alternating,
over ``--free-objects`` objects, at ``--free-concurrency`` requests in flight per worker (8: 2 workers
ask 320 GET/s, well under what this machine's CPU serves, so the round trip sets the pace and the
comparison measures the controller, not the box): images/s of each, adaptive's median against
fixed's. Each epoch goes through a new proxy, a store the node has not seen: its slow start included.

Everything is measured in one run, side by side, on whatever machine runs it: compare ratios.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blobdata import FetchOptions, FolderDataset
from blobdata.testing import LatencyProxy, LocalS3Server, s3_client

BUCKET = "bench-throttle"
SIZE = 2000


def raw(fh: Any) -> bytes:
    return bytes(fh.read())


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def upload(s3: LocalS3Server, prefix: str, n: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    client = s3_client(s3, max_pool_connections=32)

    def put(i: int) -> None:
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/c{i % 4}/o{i:05d}.bin", Body=os.urandom(SIZE))

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(put, range(n)))


def epoch(s3: LocalS3Server, prefix: str, *, adaptive: bool, workers: int, rate: float | None,
          delay_s: float = 0.0, concurrency: int | None = None) -> dict[str, Any]:  # fmt: skip
    """One epoch through a fresh proxy; what it took and what the store answered."""
    port = int(s3.endpoint_url.rsplit(":", 1)[1])
    with LatencyProxy("127.0.0.1", port, delay_s=delay_s) as proxy:
        opts = {**s3.storage_options, "endpoint_url": proxy.endpoint_url}
        ds = FolderDataset(
            f"s3://{BUCKET}/{prefix}", loader=raw, extensions=(".bin",), storage_options=opts,
            on_error="skip", fetch_options=FetchOptions(adaptive=adaptive, concurrency=concurrency),
        )  # fmt: skip
        n = len(ds)
        if rate is not None:
            proxy.set_throttle(rate)
        proxy.reset_counts()
        loader = ds.dataloader(batch_size=16, shuffle=True, num_workers=workers, collate_fn=as_list)
        served = 0
        t0 = time.perf_counter()
        error = ""
        try:
            for batch in loader:
                served += len(batch)
        except Exception as exc:
            error = f"{type(exc).__name__}"
        seconds = time.perf_counter() - t0
        stats = loader.stats()
        gets = [a for a in proxy.answers if a[1] == "GET"]
        del loader
        ds.close()
    throttled = sum(1 for a in gets if a[2])
    return {
        "objects": n, "served": served, "failed": n - served, "seconds": seconds, "error": error,
        "throttled_share": throttled / len(gets) if gets else 0.0, "gets": len(gets),
        "concurrency_mean": stats.concurrency_mean,
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50,150,500", help="store limits in GET/s (default 50,150,500)")
    ap.add_argument("--workers", default="2,8", help="DataLoader workers (default 2,8)")
    ap.add_argument("--objects", type=int, default=600, help="objects of 2 KB under a limit (default 600)")
    ap.add_argument("--free-objects", type=int, default=3000, help="objects for the no-limit runs (3000)")
    ap.add_argument("--repeat", type=int, default=5, help="no-limit epochs of each kind (default 5)")
    ap.add_argument(
        "--free-concurrency",
        type=int,
        default=8,
        help="requests in flight per worker with no limit (default 8: the RTT bounds the rate)",
    )
    ap.add_argument("--quick", action="store_true", help="150 GET/s, 2 workers; no limit once")
    args = ap.parse_args()
    rates = [150.0] if args.quick else [float(r) for r in args.rates.split(",") if r]
    workers = [2] if args.quick else [int(w) for w in args.workers.split(",") if w]
    repeat = 1 if args.quick else args.repeat
    import warnings

    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 8 workers on few cores
    logging.getLogger("blobdata").setLevel(logging.ERROR)  # each skipped sample is counted, not logged
    with LocalS3Server() as s3:
        s3.create_bucket(BUCKET)
        t = time.perf_counter()
        upload(s3, "limited", args.objects)
        upload(s3, "free", args.free_objects)
        took = time.perf_counter() - t
        print(f"uploaded {args.objects} + {args.free_objects} objects of {SIZE} B in {took:.0f}s "
              f"({os.cpu_count()} cores here)\n", flush=True)  # fmt: skip
        head = f"{'GET/s':>6} {'workers':>7} {'mode':>9} {'time/ideal':>10} {'throttled':>9} {'failed':>7} " \
               f"{'in flight':>9}  note"  # fmt: skip
        print(head)
        for rate in rates:
            for w in workers:
                for adaptive in (False, True):
                    r = epoch(s3, "limited", adaptive=adaptive, workers=w, rate=rate)
                    ideal = r["objects"] / rate
                    note = f"died: {r['error']}" if r["error"] else ""
                    print(f"{rate:>6.0f} {w:>7} {'adaptive' if adaptive else 'fixed':>9} "
                          f"{r['seconds'] / ideal:>10.2f} {r['throttled_share']:>9.0%} {r['failed']:>7} "
                          f"{r['concurrency_mean']:>9.1f}  {note}", flush=True)  # fmt: skip
        conc = args.free_concurrency
        print(
            f"\nno limit, RTT 50 ms, {args.free_objects} objects, 2 workers, concurrency {conc}, "
            f"{repeat} epochs of each (alternating; each through a new proxy: a store the node does not know)"
        )
        rows: dict[bool, list[float]] = {False: [], True: []}
        free: dict[str, Any] = {"workers": 2, "rate": None, "delay_s": 0.025, "concurrency": conc}
        epoch(s3, "free", adaptive=False, **free)  # warms the server's reads
        for i in range(repeat):
            for adaptive in (False, True) if i % 2 == 0 else (True, False):
                r = epoch(s3, "free", adaptive=adaptive, **free)
                rows[adaptive].append(r["served"] / r["seconds"])
                print(f"  {'adaptive' if adaptive else 'fixed':>8}: {rows[adaptive][-1]:7.0f} img/s, "
                      f"{r['throttled_share']:.0%} throttled, {r['failed']} failed", flush=True)  # fmt: skip
        fixed, adapt = statistics.median(rows[False]), statistics.median(rows[True])
        ratio = adapt / fixed
        print(f"  median: fixed {fixed:.0f} img/s, adaptive {adapt:.0f} img/s: adaptive/fixed = {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

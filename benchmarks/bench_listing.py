"""Listing a bucket folder: blobdata's concurrent per-class listing next to s3fs's sequential find.

Starts a local S3 server (SeaweedFS, ``blobdata._servers.LocalS3Server``) behind a latency proxy
(default 20 ms round trip), uploads ``--objects`` tiny objects spread over ``--classes`` class
prefixes (``train/nXXXXXXXX/nXXXXXXXX_NNNNNN.JPEG``), then times, through the proxy:

* ``s3fs find``: ``s3fs.S3FileSystem.find(root)``: one paginated listing, 1,000 keys per request,
  each page waiting for the previous one (what ``fsspec``-based loaders do);
* ``blobdata``: ``blobdata._listing.list_folder(root)``: one delimiter listing of the root, then
  every class prefix listed concurrently (``--concurrency``), sorted in ImageFolder order and
  packed into a Manifest.

Prints both side by side with the ratio. A benchmark, not a test: no timed assertions.

    python benchmarks/bench_listing.py                       # 100,000 objects, 1,000 classes, 20 ms
    python benchmarks/bench_listing.py --objects 20000 --classes 200 --rtt-ms 50
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BUCKET = "bench-listing"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objects", type=int, default=100_000, help="objects to upload (default 100000)")
    p.add_argument("--classes", type=int, default=1000, help="class prefixes (default 1000)")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="round trip added by the proxy (default 20)")
    p.add_argument("--concurrency", type=int, default=64, help="blobdata class listings at once (default 64)")
    p.add_argument(
        "--repeat", type=int, default=2, help="timed runs of each lister (default 2, median shown)"
    )
    p.add_argument("--upload-threads", type=int, default=48, help="threads uploading (default 48)")
    return p.parse_args(argv)


# -- a latency proxy ----------------------------------------------------------------------------


@contextlib.contextmanager
def latency_proxy(endpoint_url: str, rtt_s: float) -> Iterator[str]:
    """The endpoint URL of a proxy adding ``rtt_s`` per round trip in front of ``endpoint_url``."""
    if rtt_s <= 0:
        yield endpoint_url
        return
    from tests.support.proxy import LatencyProxy

    host, port = endpoint_url.rsplit("/", 1)[-1].rsplit(":", 1)
    # Counting requests parses HTTP in the proxy; a benchmark only needs the delay.
    with LatencyProxy(host, int(port), delay_s=rtt_s / 2, count_requests=False) as proxy:
        yield proxy.endpoint_url


# -- upload and the two listers -----------------------------------------------------------------


def key_of(i: int, n_objects: int, n_classes: int) -> str:
    c = i * n_classes // n_objects
    return f"train/n{c:08d}/n{c:08d}_{i:06d}.JPEG"


def upload(server: Any, n_objects: int, n_classes: int, threads: int) -> float:
    from blobdata._servers import s3_client

    client = s3_client(server, timeout_s=30.0, max_pool_connections=threads)
    client.create_bucket(Bucket=BUCKET)
    t0 = time.perf_counter()
    done = 0

    def put(lo: int, hi: int) -> int:
        for i in range(lo, hi):
            client.put_object(Bucket=BUCKET, Key=key_of(i, n_objects, n_classes), Body=b"x" * (i % 7 + 1))
        return hi - lo

    step = 500
    with ThreadPoolExecutor(threads) as pool:
        for n in pool.map(lambda lo: put(lo, min(lo + step, n_objects)), range(0, n_objects, step)):
            done += n
            if done % 20_000 < step:
                print(f"  uploaded {done}/{n_objects} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return time.perf_counter() - t0


def time_s3fs_find(opts: dict[str, Any], root: str) -> tuple[float, int]:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    t0 = time.perf_counter()
    found = fs.find(root)
    return time.perf_counter() - t0, len(found)


def time_blobdata(opts: dict[str, Any], root: str, concurrency: int) -> tuple[float, int]:
    from blobdata._listing import list_folder

    t0 = time.perf_counter()
    m = list_folder(root, storage_options=opts, concurrency=concurrency)
    return time.perf_counter() - t0, len(m)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from blobdata._servers import LocalS3Server

    root = f"s3://{BUCKET}/train"
    with LocalS3Server(backend="seaweedfs") as server:
        print(
            f"uploading {args.objects} objects in {args.classes} class prefixes to {server.endpoint_url} ..."
        )
        up = upload(server, args.objects, args.classes, args.upload_threads)
        print(f"uploaded in {up:.1f}s ({args.objects / up:.0f} objects/s)")
        with latency_proxy(server.endpoint_url, args.rtt_ms / 1000) as endpoint:
            opts = {**server.storage_options, "endpoint_url": endpoint}
            results: dict[str, list[float]] = {"s3fs find (sequential pages)": [], "blobdata list_folder": []}
            for _ in range(args.repeat):
                t, n = time_s3fs_find(opts, root)
                assert n == args.objects, f"s3fs found {n} objects, expected {args.objects}"
                results["s3fs find (sequential pages)"].append(t)
                t, n = time_blobdata(opts, root, args.concurrency)
                assert n == args.objects, f"blobdata listed {n} samples, expected {args.objects}"
                results["blobdata list_folder"].append(t)
    find_s = statistics.median(results["s3fs find (sequential pages)"])
    ours_s = statistics.median(results["blobdata list_folder"])
    print(
        f"\n{args.objects} objects, {args.classes} classes, RTT {args.rtt_ms:g} ms, "
        f"concurrency {args.concurrency}, median of {args.repeat}"
    )
    print(f"{'lister':<32}{'seconds':>10}{'objects/s':>12}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:<32}{med:>10.2f}{args.objects / med:>12.0f}")
    print(f"{'ratio (s3fs / blobdata)':<32}{find_s / ours_s:>10.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

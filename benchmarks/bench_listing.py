"""Listing a bucket folder: blobdata's concurrent per-class listing next to s3fs's sequential find.

Starts a local S3 server (SeaweedFS, ``blobdata.testing.LocalS3Server``) behind a latency proxy
(default 20 ms round trip), uploads ``--objects`` tiny objects spread over ``--classes`` class
prefixes (``train/nXXXXXXXX/nXXXXXXXX_NNNNNN.JPEG``), then times, through the proxy:

* ``s3fs find``: ``s3fs.S3FileSystem.find(root)``: one paginated listing, 1,000 keys per request,
  each page waiting for the previous one (what ``fsspec``-based loaders do);
* ``blobdata``: ``blobdata._listing.list_folder(root)``: one delimiter listing of the root, then
  every class prefix listed concurrently (``--concurrency``), sorted in ImageFolder order and
  packed into a Manifest. Its pages go through the lean path (``S3Reader.list_page``: signed
  aiohttp GETs parsed with ``xml.etree``);
* ``blobdata (s3fs pages)``: the same listing with its pages through s3fs/botocore, as before the
  lean path (the path kept for ``version_aware``/``requester_pays``).

Prints wall seconds side by side with the ratio, and the client CPU seconds of each (this process's
CPU time minus the in-process latency proxy's thread) next to the S3 server's CPU seconds, so the
client's gain shows even where the local server's own cost dominates the wall time. A benchmark,
not a test: no timed assertions.

    python benchmarks/bench_listing.py                       # 100,000 objects, 1,000 classes, 20 ms
    python benchmarks/bench_listing.py --objects 20000 --classes 200 --rtt-ms 50
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
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
def latency_proxy(endpoint_url: str, rtt_s: float) -> Iterator[tuple[str, int | None]]:
    """(endpoint URL, native id of the proxy's thread or None) of a proxy adding ``rtt_s`` per round
    trip in front of ``endpoint_url``."""
    if rtt_s <= 0:
        yield endpoint_url, None
        return
    from blobdata.testing import LatencyProxy

    host, port = endpoint_url.rsplit("/", 1)[-1].rsplit(":", 1)
    # Counting requests parses HTTP in the proxy; a benchmark only needs the delay.
    with LatencyProxy(host, int(port), delay_s=rtt_s / 2, count_requests=False) as proxy:
        thread = proxy._thread
        yield proxy.endpoint_url, (thread.native_id if thread is not None else None)


class CpuMeter:
    """Client CPU seconds (this process minus the proxy thread) and S3 server CPU seconds."""

    def __init__(self, proxy_tid: int | None, server_pid: int | None) -> None:
        import psutil

        self._me = psutil.Process()
        self._proxy_tid = proxy_tid
        self._server = psutil.Process(server_pid) if server_pid else None

    def _proxy_cpu(self) -> float:
        for t in self._me.threads():
            if t.id == self._proxy_tid:
                return float(t.user_time + t.system_time)
        return 0.0

    def _server_cpu(self) -> float:
        if self._server is None:
            return 0.0
        total = 0.0
        for p in [self._server, *self._server.children(recursive=True)]:
            with contextlib.suppress(Exception):
                c = p.cpu_times()
                total += c.user + c.system
        return total

    def measure(self, fn: Callable[[], int]) -> tuple[float, float, float, int]:
        """Run ``fn``: (wall seconds, client CPU seconds, server CPU seconds, its result)."""
        c0, p0, s0 = time.process_time(), self._proxy_cpu(), self._server_cpu()
        t0 = time.perf_counter()
        n = fn()
        wall = time.perf_counter() - t0
        client = (time.process_time() - c0) - (self._proxy_cpu() - p0)
        return wall, client, self._server_cpu() - s0, n


# -- upload and the two listers -----------------------------------------------------------------


def key_of(i: int, n_objects: int, n_classes: int) -> str:
    c = i * n_classes // n_objects
    return f"train/n{c:08d}/n{c:08d}_{i:06d}.JPEG"


def upload(server: Any, n_objects: int, n_classes: int, threads: int) -> float:
    from blobdata.testing import s3_client

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


_KEEP: list[Any] = []


def s3fs_find(opts: dict[str, Any], root: str) -> int:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    # Kept alive: collected mid-run, its finalizer closes aiobotocore's session on the wrong loop.
    _KEEP.append(fs)
    return len(fs.find(root))


def blobdata_list(opts: dict[str, Any], root: str, concurrency: int, *, lean: bool = True) -> int:
    from blobdata._listing import folders as _listing

    lean_s3 = _listing._lean_s3
    if not lean:
        _listing._lean_s3 = lambda storage_options: False  # the s3fs pages, as before the lean path
    try:
        return len(_listing.list_folder(root, storage_options=opts, concurrency=concurrency))
    finally:
        _listing._lean_s3 = lean_s3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from blobdata.testing import LocalS3Server

    root = f"s3://{BUCKET}/train"
    with LocalS3Server(backend="seaweedfs") as server:
        print(
            f"uploading {args.objects} objects in {args.classes} class prefixes to {server.endpoint_url} ..."
        )
        up = upload(server, args.objects, args.classes, args.upload_threads)
        print(f"uploaded in {up:.1f}s ({args.objects / up:.0f} objects/s)")
        with latency_proxy(server.endpoint_url, args.rtt_ms / 1000) as (endpoint, proxy_tid):
            opts = {**server.storage_options, "endpoint_url": endpoint}
            meter = CpuMeter(proxy_tid, server.pid)
            runs: dict[str, Callable[[], int]] = {
                FIND: lambda: s3fs_find(opts, root),
                "blobdata (s3fs pages)": lambda: blobdata_list(opts, root, args.concurrency, lean=False),
                LEAN: lambda: blobdata_list(opts, root, args.concurrency),
            }
            results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
            for _ in range(args.repeat):
                for name, fn in runs.items():
                    wall, client, srv, n = meter.measure(fn)
                    assert n == args.objects, f"{name} listed {n} objects, expected {args.objects}"
                    results[name].append((wall, client, srv))
    med = {name: [statistics.median(r[i] for r in rs) for i in range(3)] for name, rs in results.items()}
    print(
        f"\n{args.objects} objects, {args.classes} classes, RTT {args.rtt_ms:g} ms, "
        f"concurrency {args.concurrency}, median of {args.repeat}"
    )
    print(f"{'lister':<30}{'wall s':>9}{'objects/s':>11}{'client CPU s':>14}{'server CPU s':>14}")
    for name, (wall, client, srv) in med.items():
        print(f"{name:<30}{wall:>9.2f}{args.objects / wall:>11.0f}{client:>14.2f}{srv:>14.2f}")
    (find_w, find_c, _), (lean_w, lean_c, _) = med[FIND], med[LEAN]
    print(f"{'ratio s3fs find / blobdata':<30}{find_w / lean_w:>8.1f}x{'':>11}{find_c / lean_c:>13.1f}x")
    return 0


FIND = "s3fs find (sequential pages)"
LEAN = "blobdata list_folder"


if __name__ == "__main__":
    raise SystemExit(main())

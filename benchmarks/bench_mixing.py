"""A mixture of three sources on three stores against one dataset holding the same objects (issue 41).

    python benchmarks/bench_mixing.py                 # 3 x 600 objects of 4 KB, 5 rounds
    python benchmarks/bench_mixing.py --quick         # 3 x 240 objects, 1 round

One local S3 server (SeaweedFS) holds the objects twice: under ``a/``, ``b/`` and ``c/`` (a source
each), and all of them again under ``all/`` (one FolderDataset). Each source is read through a
:class:`~blobdata.testing.LatencyProxy` of its own, a store of its own for blobdata (its engine, its
node-wide throttle controller):

- ``a``: RTT 50 ms (``delay_s=0.025``), weight 2
- ``b``: RTT 100 ms, weight 1
- ``c``: RTT 50 ms and a limit of 100 GET/s (``503 SlowDown`` above it), weight 1

``single`` is ``FolderDataset("s3://.../all")`` at RTT 50 ms, no limit, read with shuffle=True.
Both read the bytes only (no decode), 2 DataLoader workers, batches of 32, one epoch of the same
number of samples (the sum of the sources' sizes). Two loops, rounds alternating (mixture, single,
single, mixture, ...), the median kept:

- ``training``: each batch followed by a compute step of ``--step-ms`` (default 100 ms for 32
  samples: a loop that takes 320 samples/s, c's quarter 80 GET/s, under its limit). The figure that
  matters: does the mixture keep the loop as fed as one dataset does? ``mixture/single`` >= 0.95.
- ``flat out``: no compute step. The mixture's pace is then bounded by ``c``'s limit (a quarter of the
  samples at 100 GET/s: at most 400 samples/s), which the single dataset does not have; the ratio says
  how close to that bound the mixture runs, and its stats name ``c`` as the source that limits it.

Printed per loop: samples/s of each, the ratio, the mixture's realised proportions (the sources of the
samples the loop received, against the weights), and its per-source stats (samples, GETs, GET p50,
throttled, the seconds batches waited for it) with ``summary()``'s verdict. The load average is printed
at the start and the end: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blobdata import FolderDataset, Mixture
from blobdata.testing import LatencyProxy, LocalS3Server, s3_client

BUCKET = "bench-mixing"
SOURCES = {"a": (0.025, None, 2), "b": (0.05, None, 1), "c": (0.025, 100.0, 1)}  # delay_s, GET/s, weight


def raw(fh: Any) -> bytes:
    return bytes(fh.read())


def as_list(batch: list[Any]) -> list[Any]:
    return batch


def upload(s3: LocalS3Server, n: int, size: int) -> None:
    client = s3_client(s3, max_pool_connections=32)
    blobs = {name: [os.urandom(size) for _ in range(n)] for name in SOURCES}

    def put(item: tuple[str, int]) -> None:
        name, i = item
        body = blobs[name][i]
        client.put_object(Bucket=BUCKET, Key=f"{name}/c{i % 4}/o{i:05d}.bin", Body=body)
        client.put_object(Bucket=BUCKET, Key=f"all/{name}{i % 4}/o{i:05d}.bin", Body=body)

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(put, [(name, i) for name in SOURCES for i in range(n)]))


def run(loader: Any, step_s: float) -> tuple[float, list[Any]]:
    served: list[Any] = []
    t0 = time.perf_counter()
    for batch in loader:
        served += batch
        if step_s:
            time.sleep(step_s)
    return time.perf_counter() - t0, served


def proxy(s3: LocalS3Server, delay_s: float, rate: float | None) -> LatencyProxy:
    p = LatencyProxy("127.0.0.1", int(s3.endpoint_url.rsplit(":", 1)[1]), delay_s=delay_s)
    p.start()
    if rate is not None:
        p.set_throttle(rate)
    return p


def mixture_epoch(s3: LocalS3Server, step_s: float, batch: int) -> dict[str, Any]:
    """One epoch of the mixture, each source through a new proxy (a store the node has not seen)."""
    proxies = {name: proxy(s3, d, r) for name, (d, r, _) in SOURCES.items()}
    try:
        sources = {}
        for name, p in proxies.items():
            opts = {**s3.storage_options, "endpoint_url": p.endpoint_url}
            sources[name] = FolderDataset(f"s3://{BUCKET}/{name}", loader=raw, extensions=(".bin",),
                                          storage_options=opts)  # fmt: skip
        mix = Mixture(sources, {n: w for n, (_, _, w) in SOURCES.items()}, with_source=True)
        loader = mix.dataloader(batch_size=batch, num_workers=2, collate_fn=as_list)
        seconds, served = run(loader, step_s)
        stats = loader.stats()
        got = collections.Counter(mix.names[s[2]] for s in served)
        del loader
        mix.close()
    finally:
        for p in proxies.values():
            p.stop()
    return {"seconds": seconds, "samples": len(served), "got": got, "stats": stats}


def single_epoch(s3: LocalS3Server, step_s: float, batch: int) -> dict[str, Any]:
    p = proxy(s3, 0.025, None)
    try:
        ds = FolderDataset(
            f"s3://{BUCKET}/all", loader=raw, extensions=(".bin",),
            storage_options={**s3.storage_options, "endpoint_url": p.endpoint_url},
        )  # fmt: skip
        loader = ds.dataloader(batch_size=batch, shuffle=True, num_workers=2, collate_fn=as_list)
        seconds, served = run(loader, step_s)
        del loader
        ds.close()
    finally:
        p.stop()
    return {"seconds": seconds, "samples": len(served)}


def report(name: str, mixed: list[dict[str, Any]], single: list[dict[str, Any]]) -> None:
    m = statistics.median(r["samples"] / r["seconds"] for r in mixed)
    s = statistics.median(r["samples"] / r["seconds"] for r in single)
    print(f"\n{name}: mixture {m:.0f} samples/s, single {s:.0f} samples/s: mixture/single = {m / s:.3f}")
    last = mixed[-1]
    total = sum(w for _, _, w in SOURCES.values())
    got, samples = last["got"], last["samples"]
    shares = ", ".join(f"{n} {got[n] / samples:.3f} (weight {w[2] / total:.3f})" for n, w in SOURCES.items())
    print(f"  realised proportions (last mixture epoch, {last['samples']} samples): {shares}")
    st = last["stats"]
    print(f"  {'source':>6} {'samples':>7} {'GETs':>5} {'GET p50':>8} {'throttled':>9} {'waited':>7}")
    for n, p in st.sources.items():
        print(f"  {n:>6} {p.samples:>7} {p.gets:>5} {p.get_p50_s * 1e3:>6.0f}ms {p.throttled:>9} "
              f"{p.fetch_wait_s_per_sample * p.samples:>6.2f}s")  # fmt: skip
    print(f"  summary: {st.summary()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=600, help="objects per source (default 600)")
    ap.add_argument("--size", type=int, default=4096, help="bytes per object (default 4096)")
    ap.add_argument("--rounds", type=int, default=5, help="epochs of each, alternating (default 5)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=100.0, help="the training loop's compute step per batch")
    ap.add_argument("--quick", action="store_true", help="240 objects per source, 1 round")
    args = ap.parse_args()
    n, rounds = (240, 1) if args.quick else (args.objects, args.rounds)
    import warnings

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    logging.getLogger("blobdata").setLevel(logging.ERROR)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average at the start: {load} ({os.cpu_count()} cores)")
    with LocalS3Server() as s3:
        s3.create_bucket(BUCKET)
        upload(s3, n, args.size)
        print(f"{len(SOURCES)} sources x {n} objects of {args.size} B, and the same under all/; batch "
              f"{args.batch_size}, 2 workers, {rounds} rounds", flush=True)  # fmt: skip
        single_epoch(s3, 0.0, args.batch_size)  # warms the server's reads of every object
        for name, step_s in (("training", args.step_ms / 1e3), ("flat out", 0.0)):
            mixed: list[dict[str, Any]] = []
            single: list[dict[str, Any]] = []
            for i in range(rounds):
                for kind in ("mixture", "single") if i % 2 == 0 else ("single", "mixture"):
                    if kind == "mixture":
                        mixed.append(mixture_epoch(s3, step_s, args.batch_size))
                    else:
                        single.append(single_epoch(s3, step_s, args.batch_size))
                    r = (mixed if kind == "mixture" else single)[-1]
                    print(f"  {name} {kind:>7}: {r['samples'] / r['seconds']:6.0f} samples/s", flush=True)
            report(name, mixed, single)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The stall between epochs: the wait for the first batch of an epoch against the epoch's mean per batch.

A cold bucket behind a 50 ms round trip (LatencyProxy in front of the local S3 server), no cache,
``--images`` JPEGs in batches of ``--batch`` on ``--workers`` workers, shuffled, decoded and cropped
by ``blobdata.transforms.RandomResizedCrop(224)`` (``--transform bytes`` only counts bytes). For each
epoch after the first: the gap between the last batch of the previous epoch and the first of this
one, the epoch's mean time per batch (its wall time, the gap included, over its batches), their
ratio, and the second batch's wait over the mean (``2nd/mean``). Settings, one after the other on
the same data, persistent workers first:

- ``per epoch``: the look-ahead stops at each epoch's end (the next epoch's plan published when it
  begins);
- ``staged only``: the next epoch's order published early; each worker stages its first batches of
  the next epoch but does not build them (the state before batches were built ahead);
- ``built ahead``: the default; each idle worker also builds its first batch of the next epoch
  (``blobdata._dataset.ahead``);
- ``no RTT``: the default with no round trip at all;
- ``new workers``: ``persistent_workers=False``, the new workers fetch their first batches;
- ``new, handed``: the default there: the training process fetches the new workers' first batches
  near the epoch's end, and the forked workers find them.

``built``: batches built ahead in the epoch (persistent) or samples staged in it (new workers).
Without batches built ahead, what remains is the DataLoader's own epoch start: the reset of its
workers (or new ones), then one worker's whole batch before the first arrives, about ``workers`` x
the mean per batch when the workers are busy.

    python benchmarks/bench_epoch_gap.py [--images 768] [--batch 32] [--workers 2] [--epochs 3] [--rtt 0.05]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from blobdata import FolderDataset
from blobdata._fetch import LookAhead
from blobdata.testing import LatencyProxy, LocalS3Server, s3_client, synthetic_jpeg, upload
from blobdata.transforms import RandomResizedCrop


def nbytes(f: Any) -> int:
    return len(f.read())


class _NoBuildAhead:
    """Workers stage the next epoch's first batches but do not build them (the state before batches
    were built ahead): the look-ahead never names a batch to build. Forked workers inherit it."""

    def __enter__(self) -> None:
        self.advance = LookAhead.advance

        def advance(la: LookAhead, *a: Any, **kw: Any) -> None:
            self.advance(la, *a, **kw)
            la.next_first = None

        LookAhead.advance = advance  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        LookAhead.advance = self.advance  # type: ignore[method-assign]


def run(
    url: str, opts: dict[str, Any], args: argparse.Namespace, setting: str
) -> tuple[list[list[float]], list[int]]:
    """Arrival times of every batch, and the batches built ahead (or, with workers started each
    epoch, the samples staged), per epoch."""
    persistent = not setting.startswith("new")
    if args.transform == "crop":
        ds = FolderDataset(url, storage_options=opts, transform=RandomResizedCrop(224), refresh=True)
    else:
        ds = FolderDataset(url, storage_options=opts, loader=nbytes, refresh=True)
    loader = ds.dataloader(
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=persistent,
        generator=torch.Generator().manual_seed(0),
    )
    if setting == "per epoch":
        loader._planner.across_epochs = False
    if setting == "new workers":
        loader._planner.hand_over = None
    times: list[list[float]] = []
    built, before = [], 0
    for _ in range(args.epochs):
        marks = []
        for _batch in loader:
            marks.append(time.perf_counter())
        times.append(marks)
        stats = loader.stats()
        now = stats.batches_built_ahead if persistent else stats.samples_staged
        built.append(now - before)
        before = now
    del loader
    return times, built


Row = tuple[float, float, float, float, int]


def summary(times: list[list[float]], built: list[int]) -> list[Row]:
    """(gap s, mean s per batch, gap / mean, second batch's wait / mean, batches built ahead) for
    each epoch after the first."""
    out = []
    for e in range(1, len(times)):
        gap = times[e][0] - times[e - 1][-1]
        mean = (times[e][-1] - times[e - 1][-1]) / len(times[e])
        out.append((gap, mean, gap / mean, (times[e][1] - times[e - 1][-1]) / mean, built[e]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=768)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rtt", type=float, default=0.05, help="round trip, seconds")
    p.add_argument("--transform", choices=["crop", "bytes"], default="crop")
    p.add_argument("--repeat", type=int, default=1, help="runs of each setting, interleaved")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    objects = [(f"ds/c{i % 10:02d}/{i:06d}.jpg", synthetic_jpeg(rng, min_side=200, max_side=400))
               for i in range(args.images)]  # fmt: skip
    total = sum(len(b) for _, b in objects)
    names = ("per epoch", "staged only", "built ahead", "no RTT", "new workers", "new, handed")
    results: dict[str, list[list[Row]]] = {name: [] for name in names}
    with LocalS3Server() as server:
        client = s3_client(server)
        client.create_bucket(Bucket="gap")
        upload(client, "gap", iter(objects))
        host, port = server.endpoint_url.split("://")[1].split(":")
        with LatencyProxy(host, int(port), delay_s=args.rtt / 2, count_requests=False) as proxy:
            opts = {**server.storage_options, "endpoint_url": proxy.endpoint_url}
            direct = server.storage_options
            for _ in range(args.repeat):
                for name in results:
                    where = direct if name == "no RTT" else opts
                    with _NoBuildAhead() if name == "staged only" else contextlib.nullcontext():
                        results[name].append(summary(*run("s3://gap/ds", where, args, name)))
    print(
        f"{args.images} JPEGs ({total / 1e6:.1f} MB), batch {args.batch}, {args.workers} workers, "
        f"RTT {args.rtt * 1e3:.0f} ms, no cache, transform {args.transform}"
    )
    print(f"{'setting':>12} {'run':>3} {'epoch':>5} {'gap s':>7} {'mean s/batch':>12} {'gap/mean':>8} "
          f"{'2nd/mean':>8} {'built':>5}")  # fmt: skip
    for name, runs in results.items():
        for r, rows in enumerate(runs):
            for e, (gap, mean, ratio, second, built) in enumerate(rows):
                print(f"{name:>12} {r:>3} {e + 2:>5} {gap:>7.3f} {mean:>12.3f} {ratio:>8.2f} {second:>8.2f} "
                      f"{built:>5}")  # fmt: skip
    for name, runs in results.items():
        ratios = sorted(row[2] for rows in runs for row in rows)
        means = sorted(row[1] for rows in runs for row in rows)
        print(f"{name}: first batch of an epoch {ratios[len(ratios) // 2]:.2f}x the epoch's mean per batch "
              f"(median; worst {ratios[-1]:.2f}x; target <= 2x); mean {means[len(means) // 2]:.3f} s/batch")


if __name__ == "__main__":
    main()

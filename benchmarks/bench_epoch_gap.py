"""The stall between epochs: the wait for the first batch of an epoch against the epoch's mean per batch.

A cold bucket behind a 50 ms round trip (LatencyProxy in front of the local S3 server), no cache,
``--images`` JPEGs in batches of ``--batch`` on ``--workers`` persistent workers, shuffled, decoded
and cropped by ``blobdata.transforms.RandomResizedCrop(224)`` (``--transform bytes`` only counts
bytes). For each epoch after the first: the gap between the last batch of the previous epoch and
the first of this one, the epoch's mean time per batch (its wall time, the gap included, over its
batches) and their ratio. Run with the look-ahead stopping at each epoch's end ("per epoch": the
next epoch's plan published when it begins) and running across the boundary ("across epochs": the
next epoch's order published early to persistent workers), one after the other, same data; and, for
the floor, with no round trip at all ("no RTT"): what remains there is the DataLoader's own pipeline
at an epoch's start (the reset of its workers, then one worker's whole batch before the first
arrives, about ``workers`` x the mean per batch when the workers are busy).

    python benchmarks/bench_epoch_gap.py [--images 768] [--batch 32] [--workers 2] [--epochs 3] [--rtt 0.05]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from blobdata import FolderDataset
from blobdata.testing import LatencyProxy, LocalS3Server, s3_client, synthetic_jpeg, upload
from blobdata.transforms import RandomResizedCrop


def nbytes(f: Any) -> int:
    return len(f.read())


def run(
    url: str, opts: dict[str, Any], args: argparse.Namespace, across: bool
) -> tuple[list[list[float]], list[int]]:
    """Arrival times of every batch, and the samples served from the look-ahead, per epoch."""
    if args.transform == "crop":
        ds = FolderDataset(url, storage_options=opts, transform=RandomResizedCrop(224), refresh=True)
    else:
        ds = FolderDataset(url, storage_options=opts, loader=nbytes, refresh=True)
    loader = ds.dataloader(
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    loader._planner.across_epochs = across
    times: list[list[float]] = []
    staged, before = [], 0
    for _ in range(args.epochs):
        marks = []
        for _batch in loader:
            marks.append(time.perf_counter())
        times.append(marks)
        now = loader.stats().samples_staged
        staged.append(now - before)
        before = now
    del loader
    return times, staged


def summary(times: list[list[float]], staged: list[int]) -> list[tuple[float, float, float, int]]:
    """(gap s, mean s per batch, gap / mean, samples staged) for each epoch after the first."""
    out = []
    for e in range(1, len(times)):
        gap = times[e][0] - times[e - 1][-1]
        mean = (times[e][-1] - times[e - 1][-1]) / len(times[e])
        out.append((gap, mean, gap / mean, staged[e]))
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
    results: dict[str, list[list[tuple[float, float, float, int]]]] = {
        "per epoch": [], "across epochs": [], "no RTT": []
    }  # fmt: skip
    with LocalS3Server() as server:
        client = s3_client(server)
        client.create_bucket(Bucket="gap")
        upload(client, "gap", iter(objects))
        host, port = server.endpoint_url.split("://")[1].split(":")
        with LatencyProxy(host, int(port), delay_s=args.rtt / 2, count_requests=False) as proxy:
            opts = {**server.storage_options, "endpoint_url": proxy.endpoint_url}
            direct = server.storage_options
            for _ in range(args.repeat):
                for name, across in (("per epoch", False), ("across epochs", True), ("no RTT", True)):
                    where = direct if name == "no RTT" else opts
                    results[name].append(summary(*run("s3://gap/ds", where, args, across)))
    print(
        f"{args.images} JPEGs ({total / 1e6:.1f} MB), batch {args.batch}, {args.workers} persistent workers, "
        f"RTT {args.rtt * 1e3:.0f} ms, no cache, transform {args.transform}"
    )
    print(f"{'look-ahead':>14} {'run':>3} {'epoch':>5} {'gap s':>7} {'mean s/batch':>12} {'gap/mean':>8} "
          f"{'staged':>7}")  # fmt: skip
    for name, runs in results.items():
        for r, rows in enumerate(runs):
            for e, (gap, mean, ratio, staged) in enumerate(rows):
                print(f"{name:>14} {r:>3} {e + 2:>5} {gap:>7.3f} {mean:>12.3f} {ratio:>8.2f} {staged:>7}")
    for name, runs in results.items():
        ratios = sorted(ratio for rows in runs for _, _, ratio, _ in rows)
        print(f"{name}: first batch of an epoch {ratios[len(ratios) // 2]:.2f}x the epoch's mean per batch "
              f"(median; worst {ratios[-1]:.2f}x; target <= 2x)")


if __name__ == "__main__":
    main()

"""What the cache costs per image as DataLoader workers grow: the data path alone, no network, no decode.

    python benchmarks/bench_cached_path.py [--images 4000] [--size 110KB] [--workers 1,2,4,8]

A folder of ``--images`` files of ``--size`` bytes on local disk (in the page cache after a first
read), read four ways with ``--workers`` DataLoader workers and batches of 64, each sample turned
into its length (so no decode hides the data path's own cost):

- ``plain``     a map-style Dataset that opens and reads each file (the local-disk baseline)
- ``no cache``  FolderDataset on the folder, no cache
- ``cold``      FolderDataset with a fresh cache directory: every sample is a miss, then a write
- ``warm``      a cache filled by ``blobdata.warm`` first: every sample is a hit

Printed per worker count: CPU ms per image of the training process and its workers together (user +
system, measured with ``os.times`` over the epoch, workers reaped), and each row against ``plain``;
``written``, the share of the cold epoch's samples the cache took (its writer drops offers it cannot
keep up with rather than slow the epoch: from a source this fast it cannot keep up with all), and
``cache ms/write``, the cold epoch's CPU over the uncached one's per value written.
The question it answers (issue 12, item 2): does the cached path cost more per image as workers
grow? Compare ``cold - no cache`` and ``warm / plain`` down the worker counts. On a machine with fewer
cores than workers, the workers share cores: CPU per image still compares, rates do not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.utils.data

import blobdata
from blobdata import BlobCache, FolderDataset
from blobdata._config import parse_size

BATCH = 64


def length(file: Any) -> int:
    """The loader: the sample's byte count (blobdata hands it a file-like object; ``read()`` of the
    whole of it returns the fetched bytes without a copy, where ``getbuffer()`` would copy them)."""
    return len(file.read())


class Plain(torch.utils.data.Dataset[Any]):
    """The local-disk baseline: open, read, close, per sample."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, int]:
        with open(self.paths[i], "rb") as f:
            return len(f.read()), 0


def make_folder(root: Path, images: int, size: int) -> list[str]:
    paths = []
    for i in range(images):
        d = root / f"class{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"{i:07d}.jpg"
        p.write_bytes(os.urandom(size))
        paths.append(str(p))
    return paths


def epoch(dataset: Any, workers: int) -> tuple[float, float, int]:
    """(CPU seconds of this process and its reaped workers, wall seconds, samples) for one epoch."""
    loader = (
        dataset.dataloader(batch_size=BATCH, shuffle=True, num_workers=workers)
        if isinstance(dataset, FolderDataset)
        else torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
    )
    t0, w0 = os.times(), time.perf_counter()
    n = 0
    for sizes, _ in loader:
        n += len(sizes)
    del loader  # workers exit and are reaped: their CPU is then in os.times().children_*
    t1, w1 = os.times(), time.perf_counter()
    cpu = (t1.user - t0.user) + (t1.system - t0.system)
    cpu += (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
    return cpu, w1 - w0, n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--size", default="110KB")
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--dir", default=None, help="where the folder and caches go (default: the temp dir)")
    args = p.parse_args()
    size = parse_size(args.size, name="--size")
    work = Path(tempfile.mkdtemp(prefix="bench-cached-path-", dir=args.dir))
    try:
        paths = make_folder(work / "data", args.images, size)
        for path in paths:  # into the page cache: every row reads from memory
            Path(path).read_bytes()
        warmed = blobdata.warm(str(work / "data"), cache=work / "warm")
        assert warmed.cache_info["entries"] == args.images, warmed.cache_info
        cores = len(os.sched_getaffinity(0))
        print(f"{args.images} files of {size} bytes, batches of {BATCH}, {cores} cores; CPU ms per image "
              "(training process + workers), and x plain")  # fmt: skip
        print(f"{'workers':>7} {'plain':>8} {'no cache':>15} {'cold':>15} {'warm':>15} {'written':>8} "
              f"{'cache ms/write':>15}")  # fmt: skip
        for workers in [int(w) for w in args.workers.split(",")]:
            cache_dir = work / f"cache-{workers}"
            row: dict[str, float] = {}
            for name, ds in (
                ("plain", Plain(paths)),
                ("no cache", FolderDataset(work / "data", loader=length)),
                ("cold", FolderDataset(work / "data", loader=length, cache=cache_dir)),
                ("warm", FolderDataset(work / "data", loader=length, cache=work / "warm")),
            ):
                cpu, _wall, n = epoch(ds, workers)
                assert n == args.images, (name, n)
                row[name] = 1000 * cpu / n
                if isinstance(ds, FolderDataset):
                    ds.close()
                if name == "cold":  # the writer drops what it cannot keep up with: count what it wrote
                    row["written"] = BlobCache(cache_dir).stats().entries / n
            base = row["plain"]
            cells = " ".join(f"{row[k]:>7.3f} ({row[k] / base:4.2f}x)" for k in ("no cache", "cold", "warm"))
            per_write = (row["cold"] - row["no cache"]) / max(row["written"], 1e-9)
            print(f"{workers:>7} {base:>8.3f} {cells} {row['written']:>8.0%} {per_write:>15.3f}")
            shutil.rmtree(cache_dir, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

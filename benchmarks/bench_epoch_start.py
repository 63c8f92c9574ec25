"""An epoch's start in the main process (#33): the first ``next()`` of the loader's batch sampler, during
which no index goes to any worker, at ImageNet's size (1,281,167 samples) for each sampler kind.

Per sampler (``RandomSampler`` with a seeded generator, ``DistributedSampler``,
``ElasticDistributedSampler``, ``PartitionedSampler``; one rank of one) and batch size:

- "list plan": the epoch start as it was before this benchmark's issue, rebuilt from its parts and
  timed part by part: the batch sampler iterated into lists, each wrapped in a ``KeyedBatch``, the
  lists packed int by int and published (``PlanChannel.publish``), and ``Progress.planned``;
- "first epoch": the first ``next()`` of ``iter(loader._planner)`` of a real ``BlobLoader`` (no
  prediction: the first epoch, or workers that are not persistent);
- "predicted": the same at the second epoch's start with persistent workers, whose order was
  predicted during the first epoch (the whole first epoch is consumed first, then the
  prediction's thread is awaited, so that only the epoch start is timed).

With ``--resumed`` (#43), the start of an epoch resumed from a state saved after 10 batches of rank 0
of 2 (``RandomSampler``: of 1), beside the same sampler's first epoch: resumed as it was saved, at half
the batch size (the rest batched again), and at 4 ranks (a plain ``DistributedSampler``'s rest through
its elastic equivalent).

The dataset is a ``FolderDataset`` over a saved manifest of ``n`` entries (nothing is fetched). Each
figure is the best of ``--repeat`` runs.

    python benchmarks/bench_epoch_start.py [--samples 1281167] [--batch 256,32] [--repeat 3] [--resumed]

A benchmark prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import threading
import time
from typing import Any

from common import add_repo_to_path, table

add_repo_to_path()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_scale import make_manifest  # noqa: E402
from torch.utils.data import RandomSampler  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from blobdata import ElasticDistributedSampler, FolderDataset, PartitionedSampler  # noqa: E402
from blobdata._fetch import PackedBatches  # noqa: E402
from blobdata._fetch.lookahead import KeyedBatch  # noqa: E402

KINDS = ("random", "distributed", "elastic", "partitioned")


def make_sampler(kind: str, ds: Any, world: int = 1) -> Any:
    if kind == "random":
        return RandomSampler(ds, generator=torch.Generator().manual_seed(7))
    cls = {"distributed": DistributedSampler, "elastic": ElasticDistributedSampler,
           "partitioned": PartitionedSampler}[kind]  # fmt: skip
    if kind == "partitioned":  # one rank per node
        return cls(ds, num_replicas=world, rank=0, seed=7, nproc_per_node=1)
    return cls(ds, num_replicas=world, rank=0, seed=7)


def _pack_before(batches: list[KeyedBatch]) -> tuple[np.ndarray, np.ndarray]:
    """How ``PlanChannel.publish`` packed a list plan before #33's change: (flat, offsets)."""
    lengths = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    offsets = np.zeros(len(batches) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((int(i) for b in batches for i in b), dtype=np.int64, count=int(offsets[-1]))
    return flat, offsets


def list_plan(loader: Any) -> dict[str, float]:
    """The epoch start before #33's reuse, part by part (seconds)."""
    planner, progress = loader._planner, loader.progress
    out: dict[str, float] = {}
    t = time.perf_counter()
    lists = [list(b) for b in planner.batch_sampler]
    out["iterate"] = time.perf_counter() - t
    seed = progress.sample_seed() or 0
    t = time.perf_counter()
    batches = [KeyedBatch(b, seed) for b in lists]
    out["wrap"] = time.perf_counter() - t
    t = time.perf_counter()
    loader.channel.publish(PackedBatches(*_pack_before(batches)))
    out["publish"] = time.perf_counter() - t
    t = time.perf_counter()
    progress.planned(batches)
    out["planned"] = time.perf_counter() - t
    out["total"] = sum(out.values())
    return out


def first_next(loader: Any) -> float:
    it = iter(loader._planner)
    t = time.perf_counter()
    next(it)
    dt = time.perf_counter() - t
    it.close()
    return dt


def predicted_start(loader: Any, sampler: Any) -> float:
    """The second epoch's start, its order predicted during the first."""
    loader._planner.across_epochs = True
    before = set(threading.enumerate())
    for _ in loader._planner:  # the whole first epoch: the next one's order is predicted meanwhile
        pass
    for thread in set(threading.enumerate()) - before:
        thread.join()
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(sampler.epoch + 1)
    return first_next(loader)


def saved_state(ds: Any, kind: str, batch: int, world: int, batches: int = 10) -> dict[str, Any]:
    """The state of rank 0 of ``world`` after ``batches`` batches of its first epoch."""
    loader = ds.dataloader(batch_size=batch, sampler=make_sampler(kind, ds, world))
    it = iter(loader._planner)
    next(it)  # the epoch begun and planned
    served = loader.progress.track(itertools.repeat(None))
    for _ in range(batches):
        next(served)
    it.close()
    return dict(loader.state_dict())


def resumed_start(ds: Any, kind: str, batch: int, world: int, state: dict[str, Any]) -> float:
    loader = ds.dataloader(batch_size=batch, sampler=make_sampler(kind, ds, world))
    loader.load_state_dict(state)
    return first_next(loader)


def resumed(ds: Any, args: Any) -> None:
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for kind in args.kinds.split(","):
            world = 1 if kind == "random" else 2
            state = saved_state(ds, kind, batch, world)
            cells: dict[str, list[float]] = {"first": [], "same": [], "half": [], "more": []}
            for _ in range(args.repeat):
                plain = ds.dataloader(batch_size=batch, sampler=make_sampler(kind, ds, world))
                cells["first"].append(first_next(plain))
                cells["same"].append(resumed_start(ds, kind, batch, world, state))
                cells["half"].append(resumed_start(ds, kind, batch // 2, world, state))
                if kind != "random":
                    cells["more"].append(resumed_start(ds, kind, batch, 4, state))
            first = min(cells["first"])
            row = [f"{kind} / {batch}", f"{first * 1000:.0f}"]
            for name in ("same", "half", "more"):
                best = min(cells[name]) if cells[name] else None
                row.append("-" if best is None else f"{best * 1000:.0f} ({best / first:.2f}x)")
            rows.append(row)
    print(f"resumed epoch start, {args.samples:,} samples, rank 0 of 2 (random: of 1), "
          f"ms (best of {args.repeat}; x: over the first epoch's)")  # fmt: skip
    print(table(["sampler / batch", "first epoch", "resumed", "batch / 2", "4 ranks"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_281_167)
    ap.add_argument("--batch", default="256,32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--resumed", action="store_true", help="the start of resumed epochs (#43)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "flat.manifest")
        make_manifest(path, args.samples)
        ds = FolderDataset("s3://bench/flat", manifest=path, storage_options={"anon": True})
        if args.resumed:
            resumed(ds, args)
            return
        rows = []
        for batch in (int(b) for b in args.batch.split(",")):
            for kind in args.kinds.split(","):
                parts: dict[str, float] = {}
                first = predicted = float("inf")
                for _ in range(args.repeat):
                    # A fresh sampler each time: PartitionedSampler keeps its last epoch's order.
                    got = list_plan(ds.dataloader(batch_size=batch, sampler=make_sampler(kind, ds)))
                    parts = {k: min(v, parts.get(k, v)) for k, v in got.items()}
                    plain = ds.dataloader(batch_size=batch, sampler=make_sampler(kind, ds))
                    first = min(first, first_next(plain))
                    fresh = make_sampler(kind, ds)
                    predicted = min(predicted, predicted_start(ds.dataloader(batch_size=batch, sampler=fresh),
                                                               fresh))  # fmt: skip
                ms = lambda s: f"{s * 1000:.0f}"  # noqa: E731
                rows.append([
                    f"{kind} / {batch}", ms(parts["iterate"]), ms(parts["wrap"]), ms(parts["publish"]),
                    ms(parts["planned"]), ms(parts["total"]), ms(first), ms(predicted),
                    f"{parts['total'] / first:.0f}x", f"{parts['total'] / predicted:.0f}x",
                ])  # fmt: skip
        print(f"epoch start, {args.samples:,} samples, ms (best of {args.repeat})")
        print(table(["sampler / batch", "iterate", "wrap", "publish", "planned", "list plan", "first epoch",
                     "predicted", "list/first", "list/predicted"], rows))  # fmt: skip


if __name__ == "__main__":
    main()

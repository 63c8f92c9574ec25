"""PartitionedSampler against DistributedSampler: shuffle quality, a small model's accuracy, and bucket
reads per epoch when every node has a cache smaller than the dataset.

1. Shuffle quality. A listing sorted by class (ImageNet's shape: 1,281,167 samples in 1,000 classes),
   16 nodes x 8 ranks, batches of 256 per rank: distinct classes per batch and the total variation
   distance between each batch's class histogram and the whole dataset's (0 = the same proportions;
   a batch of 256 drawn at random from 1,000 classes sits near 0.5 by chance), over every batch of
   every rank in one epoch; and the same distance for each node's whole epoch. "contiguous shares"
   (node j holds index range j, shuffled within) is what a naive partition of a sorted listing gives.
2. Per-epoch cost of the sampler at that scale (vectorised numpy).
3. A small model (an MLP, CPU) on a synthetic class-sorted set, trained as DDP trains it: the global
   batch of each step is every rank's batch together (16 nodes x 8 ranks x 4), for each sampler and a
   few seeds; test accuracy. "one node, no shuffle" shows that the harness notices a bad order;
   "contiguous shares" that DDP's global batch (every node's batch together) hides a per-rank
   imbalance from a model without batch norm, which is why part 1 measures each rank's batches.
4. Cache simulation: N nodes, a cache per node of a fraction of the dataset, blobdata's "admit" policy
   (keep the first bytes that fit, admit nothing more once full; what ``BlobCache.put`` decides),
   epochs 1-5: bucket reads per epoch as a share of the dataset, summed over the nodes. A faithful
   simulation at ImageNet's size (each node's order as the sampler deals it, object sizes drawn
   around 110 KB, the cache's 4 KiB pack alignment; index pages, ~0.1% here, left out), checked
   against the real ``BlobCache`` (put/get of real bytes) on a small dataset. "mix=0.1" rows show
   what ``PartitionedSampler(mix=0.1)`` costs.

    python benchmarks/bench_partition.py [--quick] [--json out.json] [--parts quality,cost,model,cache]

A benchmark prints; it asserts nothing. ``--quick`` runs small sizes (tests/sampling/test_partition_bench.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import add_repo_to_path, table

add_repo_to_path()

from blobdata._sampling import Layout, epoch_orders  # noqa: E402

IMAGENET = 1_281_167


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def class_sorted_labels(n: int, classes: int, seed: int = 0) -> np.ndarray:
    """Labels of a listing sorted by class, class sizes uneven as ImageNet's (most full, some short)."""
    rng = np.random.default_rng(seed)
    full = -(-n // classes)
    counts = np.full(classes, full, dtype=np.int64)
    short = rng.choice(classes, size=max(1, classes // 8), replace=False)
    deficit = full * classes - n
    counts[short] -= rng.multinomial(deficit, np.ones(len(short)) / len(short))
    return np.repeat(np.arange(classes), counts)


def node_orders(sampler: str, n: int, layout: Layout, epoch: int, seed: int = 0) -> list[np.ndarray]:
    """Each node's samples for ``epoch`` in the order its ranks read them (rank-interleaved).
    ``sampler``: "distributed", "partitioned", "partitioned mix=F" or "contiguous shares"."""
    if sampler.startswith("partitioned"):
        mix = float(sampler.partition("mix=")[2] or 0)
        return epoch_orders(n, seed=seed, epoch=epoch, layout=layout, mix=mix)
    w, p = layout.world, layout.nproc
    per_rank = -(-n // w)
    if sampler == "distributed":  # DistributedSampler's own permutation: torch.randperm(seed + epoch)
        import torch

        g = torch.Generator()
        g.manual_seed(seed + epoch)
        perm = torch.randperm(n, generator=g).numpy()
        padded = np.resize(perm, per_rank * w).reshape(per_rank, w)  # rank r reads column r
        return [padded[:, j * p : (j + 1) * p].ravel() for j in range(layout.nnodes)]
    rng = np.random.default_rng([seed, epoch])  # contiguous shares: index ranges, shuffled within
    out = []
    for j in range(layout.nnodes):
        share = np.arange(j * n // layout.nnodes, (j + 1) * n // layout.nnodes)
        out.append(np.resize(rng.permutation(share), per_rank * p))
    return out


# -- 1. shuffle quality ----------------------------------------------------------------------------------


def quality(n: int, classes: int, layout: Layout, batch: int) -> list[list[str]]:
    labels = class_sorted_labels(n, classes)
    share = np.bincount(labels, minlength=classes) / n
    rows = []
    for sampler in ("distributed", "partitioned", "contiguous shares"):
        orders = node_orders(sampler, n, layout, epoch=1)
        distinct, tv, first, node_tv = [], [], [], []
        for order in orders:
            node_hist = np.bincount(labels[order], minlength=classes) / len(order)
            node_tv.append(0.5 * np.abs(node_hist - share).sum())
            for r in range(layout.nproc):
                stream = order[r :: layout.nproc]
                nb = len(stream) // batch
                lab = labels[stream[: nb * batch]].reshape(nb, batch)
                hist = np.zeros((nb, classes), dtype=np.int32)
                np.add.at(hist, (np.repeat(np.arange(nb), batch), lab.ravel()), 1)
                d = (hist > 0).sum(1)
                distinct.append(d)
                first.append(d[0])
                tv.append(0.5 * np.abs(hist / batch - share).sum(1))
        d_all, tv_all = np.concatenate(distinct), np.concatenate(tv)
        rows.append([sampler, f"{d_all.mean():.1f}", f"{min(first)}", f"{tv_all.mean():.3f}",
                     f"{np.percentile(tv_all, 95):.3f}", f"{np.mean(node_tv):.4f}"])  # fmt: skip
    return rows


# -- 2. per-epoch cost -------------------------------------------------------------------------------------


def cost(n: int) -> list[list[str]]:
    from torch.utils.data.distributed import DistributedSampler

    from blobdata import PartitionedSampler
    from blobdata._sampling import fixed_order

    fixed_order.cache_clear()
    t = time.perf_counter()
    fixed_order(n, 0)
    rows = [["fixed_order (the whole permutation; the samplers no longer build it)",
             f"{(time.perf_counter() - t) * 1e3:.0f} ms"]]  # fmt: skip

    def per_epoch(make: Any, label: str) -> None:
        s = make()
        times = []
        for epoch in range(1, 4):
            s.set_epoch(epoch)
            t = time.perf_counter()
            list(s) if isinstance(s, DistributedSampler) and not isinstance(
                s, PartitionedSampler
            ) else s.indices()
            times.append(time.perf_counter() - t)
        rows.append([label, f"{np.median(times) * 1e3:.1f} ms"])

    sized = _Sized(n)
    for nodes in (16, 2, 1):
        per_epoch(lambda k=nodes: PartitionedSampler(sized, num_replicas=k * 8, rank=5, nproc_per_node=8),
                  f"PartitionedSampler, a rank's epoch, {nodes} x 8 ranks")  # fmt: skip
    per_epoch(lambda: PartitionedSampler(sized, num_replicas=128, rank=5, nproc_per_node=8, mix=0.1),
              "PartitionedSampler mix=0.1, a rank's epoch, 16 x 8")  # fmt: skip
    per_epoch(lambda: DistributedSampler(sized, num_replicas=128, rank=5),
              "DistributedSampler, a rank's epoch (list), 16 x 8")  # fmt: skip
    return rows


# -- 3. a small model --------------------------------------------------------------------------------------


def model(
    classes: int, per_class: int, layout: Layout, batch: int, epochs: int, seeds: int
) -> list[list[str]]:
    import torch
    from torch.utils.data.distributed import DistributedSampler

    from blobdata import PartitionedSampler

    torch.set_num_threads(1)
    dim = 32
    gen = torch.Generator().manual_seed(1234)
    means = torch.randn(classes, dim, generator=gen) * 0.45  # overlapping classes: far from 100%

    def make(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.arange(classes).repeat_interleave(k)  # sorted by class, as a listing is
        return means[y] + torch.randn(len(y), dim, generator=gen), y

    x, y = make(per_class)
    xt, yt = make(max(20, per_class // 4))
    n = len(y)
    rows = []
    for label in ("DistributedSampler", "PartitionedSampler", "contiguous shares", "one node, no shuffle"):
        accs = []
        for seed in range(seeds):
            torch.manual_seed(seed)
            net = torch.nn.Sequential(
                torch.nn.Linear(dim, 128), torch.nn.ReLU(), torch.nn.Linear(128, classes)
            )
            opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
            lay = Layout(1, layout.world) if label.startswith("one node") else layout
            for epoch in range(epochs):
                streams = []
                for rank in range(lay.world):
                    if label == "contiguous shares":
                        order = node_orders(label, n, lay, epoch, seed)[rank // lay.nproc]
                        streams.append(torch.as_tensor(order[rank % lay.nproc :: lay.nproc]))
                        continue
                    if label == "PartitionedSampler":
                        s: Any = PartitionedSampler(_Sized(n), num_replicas=lay.world, rank=rank,
                                                    nproc_per_node=lay.nproc, seed=seed)  # fmt: skip
                    else:
                        s = DistributedSampler(_Sized(n), num_replicas=lay.world, rank=rank, seed=seed,
                                               shuffle=label == "DistributedSampler")  # fmt: skip
                    s.set_epoch(epoch)
                    streams.append(torch.as_tensor(list(s)))
                ranks = torch.stack(streams)  # (world, per_rank)
                for step in range(ranks.shape[1] // batch):
                    idx = ranks[:, step * batch : (step + 1) * batch].reshape(-1)  # DDP's global batch
                    loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            with torch.no_grad():
                accs.append(float((net(xt).argmax(1) == yt).float().mean()))
        rows.append(
            [label, f"{np.mean(accs):.3f}", f"{np.std(accs):.3f}", " ".join(f"{a:.3f}" for a in accs)]
        )
    return rows


# -- 4. the cache ------------------------------------------------------------------------------------------

MIN_FILE = 32 * 1024  # blobdata._cache.values.MIN_FILE_SIZE: larger values go to 4 KiB-aligned pack slices


def object_sizes(n: int, mean: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sigma = 0.5
    return np.maximum(1000, rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n)).astype(np.int64)


def need_bytes(sizes: np.ndarray) -> np.ndarray:
    """What a value takes against the cache's bound (blobdata._cache.cache.BlobCache.put_many)."""
    return np.where(sizes >= MIN_FILE, -(-sizes // 4096) * 4096, sizes + 5)


def simulate(sampler: str, sizes: np.ndarray, layout: Layout, fraction: float, epochs: int) -> list[int]:
    """Bucket reads per epoch, summed over the nodes, under the admit policy (see the docstring)."""
    n = len(sizes)
    need = need_bytes(sizes)
    cap = int(fraction * sizes.sum())
    reads = [0] * epochs
    orders = [node_orders(sampler, n, layout, epoch) for epoch in range(epochs)]
    for j in range(layout.nnodes):
        cached = np.zeros(n, dtype=bool)
        used = 0
        for e in range(epochs):
            order = orders[e][j]
            missed = order[~cached[order]]
            _, first = np.unique(missed, return_index=True)
            missed = missed[np.sort(first)]  # a padded repeat is served by the first one's entry
            reads[e] += len(missed)
            room = cap - used
            if room <= 0 or not len(missed):
                continue
            fits = np.cumsum(need[missed]) <= room
            k = int(np.argmin(fits)) if not fits.all() else len(missed)
            admitted = [missed[:k]]
            room -= int(need[missed[:k]].sum())
            pos = k + 1
            while pos < len(missed):  # after the first refusal, smaller ones may still fit
                small = np.flatnonzero(need[missed[pos:]] <= room)
                if not len(small):
                    break
                pos += int(small[0])
                admitted.append(missed[pos : pos + 1])
                room -= int(need[missed[pos]])
                pos += 1
            cached[np.concatenate(admitted)] = True
            used = cap - room
    return reads


def real_cache(sampler: str, sizes: np.ndarray, layout: Layout, fraction: float, epochs: int) -> list[int]:
    """The same with blobdata's own BlobCache: a get per sample, a put of its bytes on a miss."""
    from blobdata import BlobCache

    n = len(sizes)
    pool = np.random.default_rng(1).integers(0, 256, int(sizes.max()), dtype=np.uint8).tobytes()
    cap = int(fraction * sizes.sum())
    reads = [0] * epochs
    with tempfile.TemporaryDirectory(prefix="bench-partition-") as tmp:
        caches = [BlobCache(Path(tmp) / f"node{j}", size_limit=cap) for j in range(layout.nnodes)]
        for e in range(epochs):
            for j, order in enumerate(node_orders(sampler, n, layout, e)):
                c = caches[j]
                for i in order.tolist():
                    url = f"s3://bench/train/{i:07d}.jpg"
                    if c.get(url, "etag") is None:
                        reads[e] += 1
                        c.put(url, "etag", pool[: sizes[i]])
        for c in caches:
            c.close()
    return reads


def cache_tables(n: int, nodes: list[int], fractions: list[int], epochs: int, check_n: int) -> dict[str, Any]:
    sizes = object_sizes(n, 110_000)
    rows, data = [], []
    for nnodes in nodes:
        for frac in fractions:
            for sampler in ("distributed", "partitioned", *(["partitioned mix=0.1"] if frac == 8 else [])):
                reads = simulate(sampler, sizes, Layout(nnodes, 8), 1 / frac, epochs)
                data.append({"nodes": nnodes, "cache": f"1/{frac}", "sampler": sampler, "reads": reads})
                rows.append([str(nnodes), f"1/{frac}", sampler, *(f"{r / n:.1%}" for r in reads)])
    check = []
    small = object_sizes(check_n, 40_000)
    for sampler in ("distributed", "partitioned"):
        sim = simulate(sampler, small, Layout(16, 2), 1 / 8, epochs)
        real = real_cache(sampler, small, Layout(16, 2), 1 / 8, epochs)
        check.append(
            [
                sampler,
                " ".join(f"{r / check_n:.1%}" for r in sim),
                " ".join(f"{r / check_n:.1%}" for r in real),
            ]
        )
    return {"rows": rows, "data": data, "check": check, "n": n, "check_n": check_n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--parts", default="quality,cost,model,cache")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    q = args.quick
    out: dict[str, Any] = {}
    n = 20_000 if q else IMAGENET
    layout = Layout(4, 2) if q else Layout(16, 8)
    if "quality" in parts:
        classes, batch = (100, 32) if q else (1000, 256)
        rows = quality(n, classes, layout, batch)
        out["quality"] = rows
        print(f"\n1. Shuffle quality: {n:,} samples sorted by class into {classes} classes, {layout.nnodes} "
              f"nodes x {layout.nproc} ranks, batches of {batch} per rank, epoch 1")  # fmt: skip
        print(table(["sampler", "classes per batch", "fewest in a rank's 1st batch", "batch TV distance",
                     "p95", "node's epoch TV"], rows))  # fmt: skip
    if "cost" in parts:
        rows = cost(n)
        out["cost"] = rows
        print(f"\n2. Sampler cost per epoch, {n:,} samples (median of 3 epochs)")
        print(table(["what", "time"], rows))
    if "model" in parts:
        classes, per_class, epochs, seeds = (20, 100, 3, 2) if q else (100, 400, 8, 5)
        rows = model(classes, per_class, layout, 4, epochs, seeds)
        out["model"] = rows
        print(f"\n3. A small model (MLP, CPU), {classes} classes x {per_class} samples sorted by class, "
              f"{layout.world} ranks x batch 4, {epochs} epochs, {seeds} seeds: test accuracy")  # fmt: skip
        print(table(["sampler", "mean", "std", "per seed"], rows))
    if "cache" in parts:
        epochs = 5
        nodes, fracs, check_n = ([2, 4], [2, 8], 800) if q else ([2, 16, 64, 512], [2, 8, 32], 4000)
        res = cache_tables(n, nodes, fracs, epochs, check_n)
        out["cache"] = res
        print(f"\n4. Bucket reads per epoch, share of the dataset ({n:,} objects, ~110 KB), summed over the "
              "nodes, admit policy (simulated)")  # fmt: skip
        print(
            table(
                ["nodes", "cache per node", "sampler", *(f"epoch {e + 1}" for e in range(epochs))],
                res["rows"],
            )
        )
        print(f"\n   check: the simulation against blobdata's BlobCache, {check_n} objects of ~40 KB, "
              "16 nodes x 2 ranks, cache 1/8 each, epochs 1-5")  # fmt: skip
        print(table(["sampler", "simulated", "real BlobCache"], res["check"]))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

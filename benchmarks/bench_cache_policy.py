"""Cache policies under shuffled multi-epoch training: "admit" versus "lru", side by side.

Simulates ``--epochs`` epochs over ``--objects`` objects of about ``--size`` bytes with a cache of
``--fraction`` of the dataset and a fresh random permutation each epoch: for each index, ``get``,
and on a miss ``put``. Prints the per-epoch hit rate of each policy, its ratio to the optimum
(cache/dataset: no policy can beat it under a uniform random permutation), and the cost of a
get-hit, a get-miss and a put in microseconds. A script that prints, never a timed assertion.

    python benchmarks/bench_cache_policy.py [--objects 2000] [--size 100KB] [--dir /local/ssd]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from blobdata._cache import BlobCache
from blobdata._config import parse_size


def run_policy(
    policy: str, directory: str, n: int, size: int, limit: int, epochs: int, seed: int
) -> tuple[list[float], dict[str, float]]:
    """Hit rate per epoch and median costs (µs) of one policy."""
    rng = random.Random(seed)
    # Sizes vary +-20% around ``size``; values are random bytes made outside the timed calls.
    sizes = [int(size * rng.uniform(0.8, 1.2)) for _ in range(n)]
    pool = rng.randbytes(int(size * 1.2) + n)
    times: dict[str, list[float]] = {"get_hit": [], "get_miss": [], "put_stored": [], "put_rejected": []}
    rates = []
    clock = time.perf_counter
    with BlobCache(directory, size_limit=limit, policy=policy) as cache:  # type: ignore[arg-type]
        for _ in range(epochs):
            order = list(range(n))
            rng.shuffle(order)
            hits = 0
            for i in order:
                url = f"s3://bench/train/{i:06d}.jpg"
                t0 = clock()
                data = cache.get(url, "etag-1")
                t1 = clock()
                if data is not None:
                    hits += 1
                    times["get_hit"].append(t1 - t0)
                    continue
                times["get_miss"].append(t1 - t0)
                value = pool[i : i + sizes[i]]
                t0 = clock()
                stored = cache.put(url, "etag-1", value)
                times["put_stored" if stored else "put_rejected"].append(clock() - t0)
            rates.append(hits / n)
        stats = cache.stats()
    costs = {k: statistics.median(v) * 1e6 if v else float("nan") for k, v in times.items()}
    costs["volume_over_limit"] = stats.volume_bytes / limit
    return rates, costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--size", default="100KB", help="mean object size (default 100KB)")
    parser.add_argument("--fraction", type=float, default=0.5, help="cache size / dataset size")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to put the caches (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    size = parse_size(args.size)
    limit = int(args.objects * size * args.fraction)
    optimum = args.fraction
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-cache-") as tmp:
        for policy in ("admit", "lru"):
            results[policy] = run_policy(
                policy, f"{tmp}/{policy}", args.objects, size, limit, args.epochs, args.seed
            )
    print(
        f"{args.objects} objects x ~{size / 1000:.0f} KB, cache {limit / 1e6:.1f} MB "
        f"({args.fraction:.0%} of the dataset), optimum hit rate {optimum:.3f}"
    )
    print(f"{'epoch':>5}  {'admit':>7} {'x opt':>6}  {'lru':>7} {'x opt':>6}")
    for epoch in range(args.epochs):
        a, lr = results["admit"][0][epoch], results["lru"][0][epoch]
        print(f"{epoch + 1:>5}  {a:7.3f} {a / optimum:6.3f}  {lr:7.3f} {lr / optimum:6.3f}")
    print(f"{'cost (median us)':<18} {'admit':>9} {'lru':>9}")
    for name in ("get_hit", "get_miss", "put_stored", "put_rejected", "volume_over_limit"):
        a, lr = results["admit"][1][name], results["lru"][1][name]
        print(f"{name:<18} {a:9.2f} {lr:9.2f}")


if __name__ == "__main__":
    main()

"""Where a cache value is cheaper to keep: inline in the index, or in a pack (the bound,
``blobdata._cache.values.MIN_PACKED_SIZE``).

For each ``--sizes`` value size, two caches of one process, one that keeps every value inline and one
that packs every value, each take ``--objects`` values (puts in batches of 32, as the cache writer
commits them) and are then read back in random batches of 64 through a fresh handle (a DataLoader
worker's), the two caches in turn, round after round (``--rounds``), so that the machine's noise falls
on both alike. Printed: CPU microseconds per value (``thread_time``) of a put and of a read, median of
the rounds, each way, and packed / inline. A put comes once per object, a read every epoch: the bound
is the size from which reads no longer favour inline.

    python benchmarks/bench_value_placement.py [--sizes 8KB 16KB 20KB 24KB 27KB 31KB] [--objects 1600]
        [--rounds 9] [--json out.json]

A benchmark prints; it asserts nothing (tests/cache/test_cache.py runs it small and checks it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import add_repo_to_path, table

add_repo_to_path()

_PUT_BATCH, _GET_BATCH = 32, 64


def _caches(work: Path, size: int) -> dict[str, Any]:
    """Two empty caches: ``inline`` keeps every value inline, ``packed`` packs every value."""
    from blobdata import BlobCache

    out = {}
    for label, bound in (("inline", 2**62), ("packed", 0)):
        cache = BlobCache(str(work / f"{label}-{size}"), size_limit=2**40, policy="admit")
        cache.put_many([("s3://b/first", "e", b"x")])  # the index opened (and its packs decided)
        if label == "packed" and not cache._use_packs:
            raise SystemExit(f"{work}: this filesystem cannot punch holes, so the cache keeps no packs")
        out[label] = (cache, bound)
    return out


def _one_size(work: Path, size: int, objects: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median CPU us per put and per read, each way, at ``size``."""
    import blobdata._cache.cache as cache_module
    from blobdata import BlobCache

    body = os.urandom(size)
    caches = _caches(work, size)
    puts: dict[str, list[float]] = {label: [] for label in caches}
    per_round = -(-objects // rounds)
    keys = [(f"s3://b/{size}/k{i:07d}.bin", f'"e{i}"') for i in range(per_round * rounds)]
    saved = cache_module.MIN_PACKED_SIZE  # the bound where there are packs (both caches have them)
    try:
        for r in range(rounds):
            part = keys[r * per_round : (r + 1) * per_round]
            for label in sorted(caches, reverse=bool(r % 2)):
                cache, bound = caches[label]
                cache_module.MIN_PACKED_SIZE = bound
                t = time.thread_time()
                for k in range(0, len(part), _PUT_BATCH):
                    cache.put_many([(u, e, body) for u, e in part[k : k + _PUT_BATCH]])
                puts[label].append(1e6 * (time.thread_time() - t) / len(part))
    finally:
        cache_module.MIN_PACKED_SIZE = saved
    readers = {
        label: BlobCache(c._directory, size_limit=2**40, policy="admit") for label, (c, _) in caches.items()
    }
    gets: dict[str, list[float]] = {label: [] for label in caches}
    rng = random.Random(size)
    for r in range(rounds):
        order = rng.sample(keys, len(keys))
        for label in sorted(readers, reverse=bool(r % 2)):
            reader = readers[label]
            t = time.thread_time()
            for k in range(0, len(order), _GET_BATCH):
                got = reader.get_many(order[k : k + _GET_BATCH])
                if not all(g is not None and len(g) == size for g in got):
                    raise RuntimeError(f"{label} cache: a value of {size} bytes was not read back whole")
            gets[label].append(1e6 * (time.thread_time() - t) / len(order))
    for cache in [c for c, _ in caches.values()] + list(readers.values()):
        cache.close()
    return {
        label: {"put_us": statistics.median(puts[label]), "get_us": statistics.median(gets[label])}
        for label in caches
    }


def main(argv: list[str] | None = None) -> int:
    from blobdata._config import parse_size

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["8KB", "16KB", "20KB", "24KB", "27KB", "31KB"])
    p.add_argument("--objects", type=int, default=1600, help="values per size and way")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    from blobdata._cache.values import MIN_PACKED_SIZE

    work = Path(tempfile.mkdtemp(prefix="bench-placement-"))
    results: dict[int, dict[str, dict[str, float]]] = {}
    rows = []
    try:
        for text in args.sizes:
            size = parse_size(text)
            got = results[size] = _one_size(work, size, args.objects, args.rounds)
            i, pk = got["inline"], got["packed"]
            where = "packed" if size >= MIN_PACKED_SIZE else "inline"
            rows.append([
                str(size), f"{i['put_us']:.1f}", f"{pk['put_us']:.1f}", f"{pk['put_us'] / i['put_us']:.2f}",
                f"{i['get_us']:.1f}", f"{pk['get_us']:.1f}", f"{pk['get_us'] / i['get_us']:.2f}", where,
            ])  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{args.objects} values per size and way, {args.rounds} rounds interleaved; CPU us per value "
        f"(thread_time), medians; puts in batches of {_PUT_BATCH}, reads in random batches of {_GET_BATCH}"
    )
    heads = ["bytes", "put inline", "put packed", "packed/inline", "read inline", "read packed",
             "packed/inline", "kept (now)"]  # fmt: skip
    print(table(heads, rows))
    if args.json is not None:
        kept = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"args": kept, "results": results, "bound": MIN_PACKED_SIZE}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

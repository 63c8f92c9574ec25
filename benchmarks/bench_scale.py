"""What grows with the dataset on every process: the sampler's epoch plan, the manifest in memory, and
the listing of one big prefix (issue 32); and what a listing of millions of keys costs (issue 42).

1. sampler: one rank of 16 nodes x 8 ranks (``PartitionedSampler``, and ``ElasticDistributedSampler``
   with ``permutation="keyed"``), each size in a fresh process: the first and second epoch's plan
   (``indices()``) and the peak RSS growth over the process after construction (``ru_maxrss``). The
   "whole permutation" rows are the way before issue 32 (a sort of ``n`` hashed keys, the node's share
   sliced out and sorted by epoch keys), measured the same way, at the sizes this machine holds.
2. manifest: ``P`` processes each ``Manifest.load`` one file of ``M`` entries and touch every entry;
   each reports the growth of its anonymous RSS (``RssAnon`` in /proc/self/status) and of its RSS.
3. listing: a synthetic ListObjectsV2 server (``blobdata.testing.SyntheticListServer``, ``N`` keys from a
   formula, a fixed delay per request) listed page by page and with the parallel lister.
4. cpu: the client's CPU per 1,000-key page, listing ``--cpu-keys`` at once, against the regex floor (one
   regex pulling Key, Size and ETag out of each entry of the same page) measured in the same process,
   and each parser alone on that page.
5. memory: peak RSS growth (VmHWM) while listing ``--cpu-keys``, saving and mapping the manifest, against
   the saved file's size.
6. torchrun: 2 ranks (gloo, CPU) listing ``--torchrun-keys`` together: requests per rank, their sum against
   the requests the server answered, and one process alone.
7. share: a ``--share-entries`` manifest, node 5 of ``--share-nodes`` reading every sample of its share:
   the manifest mapped whole (before) or its share cut and mapped; pages in the page cache (mincore)
   against the share's part of the manifest's pages.
8. e2e: ``--e2e-keys`` in ``--e2e-classes`` class folders listed, saved and mapped, in one process.

``--before PATH`` runs parts 4 and 5 with the blobdata of another checkout too (the code before issue 42).

    python benchmarks/bench_scale.py [--parts sampler,manifest,listing,cpu,memory,torchrun,share,e2e]
                                     [--quick] [--json out.json]

A benchmark prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from common import add_repo_to_path, table

add_repo_to_path()

NODES, NPROC = 16, 8
RANK = 5 * NPROC + 3  # node 5, local rank 3


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _whole_permutation_plan(n: int, epoch: int) -> Any:
    """The plan as it was computed before issue 32: the whole dataset's permutation (a sort of n keys,
    once per seed), the node's slice of it, sorted by epoch keys, the rank's stride."""
    import numpy as np

    from blobdata._sampling.shares import _SHARE, _by_key

    global _ORDER_CACHE
    if _ORDER_CACHE is None:
        _ORDER_CACHE = _by_key(np.arange(n, dtype=np.int64), 0, _SHARE)
    node = RANK // NPROC
    share = _ORDER_CACHE[node * n // NODES : (node + 1) * n // NODES]
    order = _by_key(share, 0, epoch, 2)
    per_rank = -(-n // (NODES * NPROC))
    return np.resize(order, NPROC * per_rank)[RANK % NPROC :: NPROC]


_ORDER_CACHE: Any = None


def sampler_child(kind: str, n: int) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import numpy as np  # noqa: F401  (imported before the baseline, as the samplers import it)
    import torch  # noqa: F401

    from blobdata import ElasticDistributedSampler, PartitionedSampler

    ds = _Sized(n)
    if kind == "partitioned":
        s: Any = PartitionedSampler(ds, num_replicas=NODES * NPROC, rank=RANK, nproc_per_node=NPROC)
        plan = s.indices
    elif kind == "elastic keyed":
        s = ElasticDistributedSampler(ds, num_replicas=NODES * NPROC, rank=RANK, permutation="keyed")
        plan = s.indices
    else:
        s = None
    before = _maxrss_mb()
    times = []
    for epoch in (1, 2):
        t = time.perf_counter()
        if s is None:
            out = _whole_permutation_plan(n, epoch)
        else:
            s.set_epoch(epoch)
            out = plan()
        times.append(time.perf_counter() - t)
        share = len(out)
        del out
    return {"epoch1": times[0], "epoch2": times[1], "rss_growth_mb": _maxrss_mb() - before, "share": share}


def make_manifest(path: str, n: int) -> int:
    """A manifest of ``n`` entries shaped like a bucket's (23-byte keys in 1000 classes, quoted
    32-hex-digit ETags), built with numpy (no Python object per entry); its size in bytes."""
    import numpy as np

    from blobdata._listing import Manifest

    i = np.arange(n, dtype=np.int64)
    cls = i * 1000 // max(n, 1)

    def digits(v: Any, width: int, base: int = 10) -> Any:
        out = (v[:, None] // base ** np.arange(width - 1, -1, -1, dtype=np.int64)) % base
        return np.where(out < 10, out + 48, out + 87).astype(np.uint8)  # 0-9, a-f

    keys = np.concatenate(
        [
            np.full((n, 1), ord("c"), np.uint8),
            digits(cls, 5),
            np.full((n, 1), 47, np.uint8),
            digits(i, 12),
            np.frombuffer(b".jpg", np.uint8)[None, :].repeat(n, 0),
        ],
        axis=1,
    )
    h = (i * 0x2545F4914F6CDD1D) & 0x7FFFFFFFFFFFFFFF  # wraps: any pattern of hex digits
    quote = np.full((n, 1), 34, np.uint8)
    ids = np.concatenate([quote, digits(h, 16, 16), digits(h ^ 0x5555, 16, 16), quote], axis=1)
    m = Manifest.from_arrays(
        "s3://bench/flat", [f"c{c:05d}" for c in range(1000)], keys=keys.ravel(),
        key_offsets=np.arange(n + 1, dtype=np.int64) * keys.shape[1], sizes=np.full(n, 110_000),
        targets=cls.astype(np.int32), ids=ids.ravel(),
        id_offsets=np.arange(n + 1, dtype=np.int64) * ids.shape[1],
        listed_at=0.0,
    )  # fmt: skip
    m.save(path)
    return os.path.getsize(path)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def manifest_child(path: str, how: str, go: str) -> dict[str, Any]:
    """Load ``path`` (mapped, or read as before issue 32), touch every entry's arrays, report the growth
    of anonymous and file-backed RSS. Waits for ``go`` to exist first, so that all start together."""
    import numpy as np

    from blobdata._listing import Manifest

    while not os.path.exists(go):
        time.sleep(0.01)
    anon, file_ = _status_kb("RssAnon"), _status_kb("RssFile")
    t = time.perf_counter()
    if how == "read (before)":
        with open(path, "rb") as f:
            m = Manifest.from_bytes(f.read(), source=path)
    else:
        m = Manifest.load(path)
    load_s = time.perf_counter() - t
    arrays = m._arrays()
    touched = sum(int(np.add.reduce(a.view(np.uint8), dtype=np.uint64)) for a in arrays.values())
    keys = [m.relkey(j) for j in range(0, len(m), max(1, len(m) // 1000))]
    return {
        "anon_mb": (_status_kb("RssAnon") - anon) / 1024,
        "file_mb": (_status_kb("RssFile") - file_) / 1024,
        "load_s": load_s,
        "touched": touched % 1000 + len(keys),
    }


def manifest_part(n: int, procs: list[int], tmp: str) -> list[list[str]]:
    path = os.path.join(tmp, f"bench-{n}.manifest")
    t = time.perf_counter()
    size = make_manifest(path, n)
    print(
        f"made a {n:,}-entry manifest of {size / 2**20:.0f} MiB in {time.perf_counter() - t:.1f}s", flush=True
    )
    rows = []
    for how in ("mapped", "read (before)"):
        for p in procs:
            if how != "mapped" and p * size > 4 * 2**30:
                continue  # a copy per process: kept under 4 GiB on a shared machine
            go = os.path.join(tmp, f"go-{how[:4]}-{p}")
            cmd = [sys.executable, __file__, "--child", "manifest", path, how, go]
            children = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(p)]
            time.sleep(0.5)
            open(go, "w").close()
            outs = [json.loads(c.communicate(timeout=900)[0].strip().splitlines()[-1]) for c in children]
            anon = max(o["anon_mb"] for o in outs)
            rows.append([f"{n:,}", f"{size / 2**20:.0f}", how, str(p), f"{anon:.1f}",
                         f"{100 * anon * 2**20 / size:.1f}%", f"{max(o['file_mb'] for o in outs):.0f}",
                         f"{max(o['load_s'] for o in outs):.2f}"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    os.unlink(path)
    return rows


def list_server_child(count: str, delay: str) -> None:
    """A SyntheticListServer in this process (its own CPU and GIL), until stdin closes."""
    from blobdata.testing import SyntheticListServer

    with SyntheticListServer(count=int(count), delay_s=float(delay)) as server:
        print(json.dumps({"endpoint": server.endpoint_url, "url": server.url}), flush=True)
        sys.stdin.read()


def _list_once(url: str, opts: dict[str, Any], concurrency: int) -> tuple[float, float, Any]:
    from blobdata._listing import list_folder

    c0, t = time.process_time(), time.perf_counter()
    m = list_folder(url, storage_options=opts, concurrency=concurrency)
    return time.perf_counter() - t, time.process_time() - c0, m


def listing_part(counts: list[int], delay: float, concurrency: int) -> list[list[str]]:
    rows = []
    for n in counts:
        cmd = [sys.executable, __file__, "--child", "listserver", str(n), str(delay)]
        server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            info = json.loads(server.stdout.readline())  # type: ignore[union-attr]
            opts = {"endpoint_url": info["endpoint"], "key": "synthetic", "secret": "synthetic-secret"}
            floor = -(-n // 1000) * delay
            seq_wall, seq_cpu, seq = _list_once(info["url"], opts, 1)
            par_wall, par_cpu, par = _list_once(info["url"], opts, concurrency)
            picks = range(0, n, 997)
            same = (
                len(seq) == len(par) == n
                and all(seq.relkey(i) == par.relkey(i) and seq.identity(i) == par.identity(i) for i in picks)
                and bool((seq.sizes == par.sizes).all())
            )
            del seq, par
        finally:
            server.stdin.close()  # type: ignore[union-attr]
            server.wait(30)
        rows.append([f"{n:,}", f"{delay * 1000:.0f}", f"{floor:.1f}", f"{seq_wall:.2f}", f"{seq_cpu:.2f}",
                     f"{par_wall:.2f}", f"{par_cpu:.2f}", f"{par_wall / floor:.2f}x",
                     f"{seq_wall / par_wall:.1f}x", "yes" if same else "NO"])  # fmt: skip
        print(" | ".join(rows[-1]), flush=True)
    return rows


def _child(part: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", part, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def sampler_part(sizes: list[int], baseline_max: int) -> list[list[str]]:
    rows = []
    for n in sizes:
        for kind in ("partitioned", "elastic keyed", "whole permutation (before)"):
            if kind.startswith("whole") and n > baseline_max:
                continue
            r = _child("sampler", kind, str(n))
            if "error" in r:
                rows.append([f"{n:,}", kind, "error", str(r["error"]), "", ""])
                continue
            rows.append([f"{n:,}", kind, f"{r['share']:,}", f"{r['epoch1']:.3f}", f"{r['epoch2']:.3f}",
                         f"{r['rss_growth_mb']:.0f}"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
    return rows


def _listing_parts(args: Any, parts: set[str], doc: dict[str, Any]) -> None:
    """Parts 4 to 8 (issue 42): benchmarks/scale_listing.py."""
    import scale_listing as sl

    print(f"\nload average {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f} "
          f"on {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    keys = 20_000 if args.quick else args.cpu_keys
    if "cpu" in parts:
        print(f"\n4. client CPU listing {keys:,} keys at once (no delay), against the regex floor")
        rows = sl.cpu_part(keys, args.concurrency, args.before)
        print(table(["code", "keys", "requests", "client CPU s", "ms / 1000 keys", "ms / request",
                     "regex floor ms", "/ floor", "parser ms/page", "ElementTree ms/page"], rows))
        doc["cpu"] = rows
    if "memory" in parts:
        print(f"\n5. peak RSS while listing {keys:,} keys (list, save, map), against the saved manifest")
        rows = sl.memory_part(keys, args.concurrency, args.before)
        print(table(["code", "keys", "manifest MiB", "peak RSS +MiB", "/ manifest", "wall s", "CPU s"], rows))
        doc["memory"] = rows
    if "torchrun" in parts:
        n = 20_000 if args.quick else args.torchrun_keys
        print(f"\n6. 2 ranks under torchrun (gloo) listing {n:,} keys together, {args.delay_ms:g} ms each")
        rows = sl.torchrun_part(n, args.delay_ms / 1000, args.concurrency)
        print(table(["keys", "folders", "ms/request", "requests rank 0", "rank 1", "sum", "server answered",
                     "wall s", "one process s (requests)"], rows))  # fmt: skip
        doc["torchrun"] = rows
    if "share" in parts:
        n = 400_000 if args.quick else args.share_entries
        nodes = 16 if args.quick else args.share_nodes
        print(f"\n7. node 5 of {nodes} reading every sample of its share of a {n:,}-entry manifest")
        rows = sl.share_part(n, nodes, args.tmp)
        print(table(["entries", "nodes", "how", "share", "its part of the pages", "manifest pages in cache",
                     "share file pages", "/ its part", "map or cut s", "read s"], rows))  # fmt: skip
        doc["share"] = rows
    if "e2e" in parts:
        n = 50_000 if args.quick else args.e2e_keys
        classes = 10 if args.quick else args.e2e_classes
        print(f"\n8. end to end: {n:,} keys in {classes} class folders listed, saved, mapped")
        rows = sl.e2e_part(n, classes, args.concurrency)
        print(table(["keys", "folders", "requests", "wall s", "CPU s", "CPU µs/key", "manifest MiB",
                     "peak RSS +MiB"], rows))  # fmt: skip
        doc["e2e"] = rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="sampler,manifest,listing")
    p.add_argument("--quick", action="store_true", help="small sizes (the test runs this)")
    p.add_argument("--json", help="write the tables here")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--sampler-sizes", default="10000000,50000000,100000000,1000000000")
    p.add_argument(
        "--baseline-max",
        type=int,
        default=50_000_000,
        help="largest size measured the way before issue 32 (it needs ~30 bytes a sample)",
    )
    p.add_argument("--manifest-entries", type=int, default=10_000_000)
    p.add_argument("--list-counts", default="200000,1000000")
    p.add_argument("--delay-ms", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tmp", default=None, help="where the benchmark's manifest is written")
    p.add_argument("--cpu-keys", type=int, default=1_000_000)
    p.add_argument("--torchrun-keys", type=int, default=200_000)
    p.add_argument("--share-entries", type=int, default=20_000_000)
    p.add_argument("--share-nodes", type=int, default=128)
    p.add_argument("--e2e-keys", type=int, default=20_000_000)
    p.add_argument("--e2e-classes", type=int, default=1000)
    p.add_argument("--before", help="a checkout of blobdata before issue 42 (measured in parts cpu, memory)")
    args = p.parse_args(argv)
    if args.child:
        part, *rest = args.child
        if part == "sampler":
            print(json.dumps(sampler_child(rest[0], int(rest[1]))))
        elif part == "manifest":
            print(json.dumps(manifest_child(*rest)))
        elif part == "listserver":
            list_server_child(*rest)
        return 0
    parts = set(args.parts.split(","))
    doc: dict[str, Any] = {"machine": f"{os.cpu_count()} CPUs", "command": " ".join(sys.argv)}
    if "sampler" in parts:
        sizes = [100_000, 1_000_000] if args.quick else [int(x) for x in args.sampler_sizes.split(",")]
        print(f"\n1. sampler: rank {RANK} of {NODES} nodes x {NPROC} ranks, a fresh process per row")
        rows = sampler_part(sizes, 1_000_000 if args.quick else args.baseline_max)
        print(table(["samples", "sampler", "rank's share", "epoch 1 s", "epoch 2 s", "peak RSS +MB"], rows))
        doc["sampler"] = rows
    if "manifest" in parts:
        import tempfile

        n = 200_000 if args.quick else args.manifest_entries
        procs = [1, 4] if args.quick else [1, 4, 8]
        print(f"\n2. manifest: processes each loading one {n:,}-entry manifest and touching every entry")
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            rows = manifest_part(n, procs, tmp)
        print(table(["entries", "file MiB", "load", "processes", "RssAnon +MiB (max)", "of the file",
                     "RssFile +MiB", "load s"], rows))  # fmt: skip
        doc["manifest"] = rows
    if "listing" in parts:
        counts = [20_000] if args.quick else [int(x) for x in args.list_counts.split(",")]
        print(
            f"\n3. listing one prefix: a synthetic ListObjectsV2 server ({args.delay_ms:g} ms a request, in "
            f"its own process), page by page vs key ranges at once (concurrency {args.concurrency})"
        )
        rows = listing_part(counts, args.delay_ms / 1000, args.concurrency)
        print(table(["keys", "ms/request", "floor s", "page by page s", "client CPU s", "ranges s",
                     "client CPU s", "ranges/floor", "speed-up", "identical"], rows))  # fmt: skip
        doc["listing"] = rows
    _listing_parts(args, parts, doc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Client CPU per object: blobdata's FetchEngine against s3fs, on a local S3 server.

Uploads N small objects (default 2000 x 100 KB) to a local SeaweedFS server (or the server given by
``--endpoint``) and measures ``time.process_time()`` of this process (all its threads, the server
excluded: it is another process) while each client reads all of them:

- ``FetchEngine.fetch_many``      all at once, ``--concurrency`` in flight (blobdata's hot path)
- ``FetchEngine.fetch`` 1 by 1    sequential, the per-request cost without overlap
- ``s3fs.cat(paths)``             s3fs's batched read
- ``s3fs._cat_file`` 1 by 1       sequential

Every client reads the same objects once untimed first (connection pools, credential lookup),
then ``--repeat`` timed times; the best run is kept (other processes on the machine add noise).
Prints CPU ms per object side by side with the ratio to the engine and the 0.4 ms goal. The
numbers depend on the machine; compare ratios, not absolute values.

    python benchmarks/bench_fetch_cpu.py [--objects 2000] [--size 100KB] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GOAL_MS = 0.4


def measure(
    name: str, fn: Callable[[], list[Any]], n: int, expect: int, repeat: int
) -> tuple[str, float, float]:
    """Best of ``repeat`` timed runs after one untimed warm-up: (name, CPU ms/object, wall ms/object)."""
    fn()  # warm-up: pools, credentials, DNS
    best = (float("inf"), float("inf"))
    for _ in range(repeat):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        bodies = fn()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        bad = [b for b in bodies if not isinstance(b, (bytes, bytearray)) or len(b) != expect]
        if bad:
            raise SystemExit(f"{name}: {len(bad)} objects wrong, first: {bad[0]!r:.200}")
        best = min(best, (cpu, wall))
    return name, best[0] * 1000 / n, best[1] * 1000 / n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--size", default="100KB", help="object size (default 100KB)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per client, the best is kept")
    parser.add_argument("--endpoint", help="use this S3 endpoint instead of starting a server")
    parser.add_argument("--key", default=os.environ.get("AWS_ACCESS_KEY_ID", ""))
    parser.add_argument("--secret", default=os.environ.get("AWS_SECRET_ACCESS_KEY", ""))
    args = parser.parse_args()

    import fsspec.asyn
    import s3fs

    from blobdata._config import FetchOptions, parse_size
    from blobdata._fetch import FetchEngine

    size = parse_size(args.size)
    n = args.objects
    server: Any = None
    if args.endpoint:
        storage_options: dict[str, Any] = {
            "endpoint_url": args.endpoint,
            "key": args.key,
            "secret": args.secret,
        }
    else:
        from blobdata.testing import LocalS3Server

        server = LocalS3Server()  # SeaweedFS on free 127.0.0.1 ports, its own process
        server.start()
        storage_options = dict(server.storage_options)
    try:
        bucket = f"bench-fetch-{os.getpid()}"
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **storage_options)
        fs.mkdir(bucket)
        payload = os.urandom(size)
        paths = [f"{bucket}/obj/{i:06d}.bin" for i in range(n)]
        t0 = time.perf_counter()
        for i in range(0, n, 200):
            fs.pipe({p: payload for p in paths[i : i + 200]})
        print(f"uploaded {n} x {size} bytes in {time.perf_counter() - t0:.1f}s")

        engine = FetchEngine(FetchOptions(concurrency=args.concurrency), "s3", storage_options)
        items: list[tuple[str, int | None, str | None]] = [("s3://" + p, size, None) for p in paths]

        def engine_many() -> list[Any]:
            return engine.fetch_many_sync(items)

        async def _engine_seq() -> list[Any]:
            return [(await engine.fetch(u, size=s))[0] for u, s, _ in items]

        from blobdata._loop import run

        def engine_seq() -> list[Any]:
            return run(_engine_seq())

        def s3fs_cat() -> list[Any]:
            out = fs.cat(paths, batch_size=args.concurrency)
            return [out[p] for p in paths]

        async def _s3fs_seq() -> list[Any]:
            return [await fs._cat_file(p) for p in paths]

        def s3fs_seq() -> list[Any]:
            return fsspec.asyn.sync(fs.loop, _s3fs_seq)  # type: ignore[no-any-return]

        rows = [
            measure(f"FetchEngine.fetch_many (c={args.concurrency})", engine_many, n, size, args.repeat),
            measure("FetchEngine.fetch 1 by 1", engine_seq, n, size, args.repeat),
            measure(f"s3fs.cat(list) (batch={args.concurrency})", s3fs_cat, n, size, args.repeat),
            measure("s3fs._cat_file 1 by 1", s3fs_seq, n, size, args.repeat),
        ]
        stats = engine.stats()
        run(engine.aclose())
        base = rows[0][1]
        print(f"\n{n} objects x {size} bytes; client CPU (this process) per object; goal <= {GOAL_MS} ms")
        print(f"{'client':42} {'CPU ms/obj':>10} {'vs engine':>10} {'wall ms/obj':>12} {'goal':>6}")
        for name, cpu_ms, wall_ms in rows:
            ok = "ok" if cpu_ms <= GOAL_MS else "over"
            print(f"{name:42} {cpu_ms:10.3f} {cpu_ms / base:9.2f}x {wall_ms:12.3f} {ok:>6}")
        print(f"engine stats: {stats}")
        fs.rm(bucket, recursive=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

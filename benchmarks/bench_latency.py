"""End-to-end latency benchmark: one training epoch from a bucket, per system, at several round-trip times.

    python benchmarks/bench_latency.py                 # 3000 images, RTT 0 and 50 ms, every system
    python benchmarks/bench_latency.py --quick         # a smoke run, under 2 minutes
    python benchmarks/bench_latency.py --rtt 50 --systems local,webdataset,blobdata --images 6000

Starts a local S3 server (SeaweedFS) and, per RTT, a latency proxy in front of it (RTT 0: no proxy);
uploads a synthetic ImageNet-like folder (generated once under bench-data/) and its WebDataset shards;
then runs each system in its own child process (clean imports, caches and CPU accounting): one shuffled
epoch, batch 64, 2 DataLoader workers, the same decode + RandomResizedCrop(224) + flip per sample, the
main process only iterating. Prints per RTT: images/s, time to first batch, ratio to local disk, setup
time (listing) excluded from the epoch, client CPU per image (the child and its workers) and S3-server
CPU per image; then raw fetch throughput without decoding (blobdata FetchEngine vs s3fs ``cat``).
Everything is measured in one run, side by side: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    BENCH_DATA,
    IMAGE_PREFIX,
    REPO,
    cpu_seconds,
    fmt,
    parse_cpus,
    pin_tree,
    place_cpus,
    prepare_dataset,
    process_cpu_seconds,
    table,
)

ALL_SYSTEMS = ["local", "naive", "filecache", "webdataset", "litdata", "blobdata"]
EXTRA_SYSTEMS = ["blobdata-nocache"]  # diagnostics, run only when named in --systems
BUCKET = "bench"
GOAL_RATIO_TO_LOCAL = 0.75


# -- child side: one system, timed ----------------------------------------------------------------------
def _time_epoch(loader: Any, expected: int, server_pid: int | None, limit_s: float) -> dict[str, Any]:
    """Iterate one epoch as a training loop would; CPU is read after the workers have exited."""
    import torch

    cpu0, srv0 = cpu_seconds(), process_cpu_seconds(server_pid)
    main0 = time.process_time()  # the training process alone: what look-ahead must not take from
    t0 = time.perf_counter()
    it = iter(loader)
    n, first, partial = 0, None, False
    for images, labels in it:
        if first is None:
            first = time.perf_counter() - t0
        if images.dtype != torch.uint8 or tuple(images.shape[1:]) != (3, 224, 224):
            raise RuntimeError(f"unexpected batch {images.dtype} {tuple(images.shape)}")
        n += len(labels)
        if time.perf_counter() - t0 > limit_s:
            partial = True
            break
    seconds = time.perf_counter() - t0
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()  # already done at the end of a full epoch; reaps the workers of a partial one
    del it
    return {
        "images": n,
        "seconds": seconds,
        "first_batch_s": first,
        "cpu_s": cpu_seconds() - cpu0,
        "main_cpu_s": time.process_time() - main0,
        "server_cpu_s": process_cpu_seconds(server_pid) - srv0,
        "partial": partial or n < expected,
    }


def _raw_fetch(spec: dict[str, Any], target: Any) -> dict[str, Any]:
    """Fetch every image once without decoding: blobdata's FetchEngine, then s3fs ``cat`` (two settings)."""
    import s3fs

    from blobdata import FetchOptions
    from blobdata._fetch import FetchEngine
    from blobdata._loop import run

    server_pid = spec["server_pid"]
    sizes = spec["sizes"]
    rows: dict[str, Any] = {}

    def measure(name: str, fn: Any, gets: Any) -> None:
        cpu0, srv0, t0 = cpu_seconds(), process_cpu_seconds(server_pid), time.perf_counter()
        bodies = fn()
        seconds = time.perf_counter() - t0
        bad = [b for b in bodies if not isinstance(b, bytes)]
        if bad:
            raise RuntimeError(f"{name}: {len(bad)} of {len(bodies)} fetches failed, first: {bad[0]!r}")
        if sum(map(len, bodies)) != sum(sizes):
            raise RuntimeError(f"{name}: got {sum(map(len, bodies))} bytes, expected {sum(sizes)}")
        rows[name] = {
            "objects": len(bodies),
            "bytes": sum(sizes),
            "seconds": seconds,
            "cpu_s": cpu_seconds() - cpu0,
            "server_cpu_s": process_cpu_seconds(server_pid) - srv0,
            "gets": gets(),
        }

    urls = [f"s3://{target.bucket}/{k}" for k in target.keys]
    engine = FetchEngine(FetchOptions(), "s3", target.s3fs_options())
    items = [(u, s, None) for u, s in zip(urls, sizes, strict=True)]
    run(engine.fetch_many(items[:8]), 60)  # connect before timing, as the s3fs runs below do
    engine.reset_stats()
    measure(
        "blobdata FetchEngine (concurrency 64)",
        lambda: run(engine.fetch_many(items), 600),
        lambda: engine.stats()["requests"],
    )
    engine.close()
    paths = [u[len("s3://") :] for u in urls]
    for name, extra in (
        ("s3fs.cat (defaults: 10 connections)", {}),
        ("s3fs.cat (max_pool_connections=64)", {"max_pool_connections": 64}),
    ):
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **target.s3fs_options(**extra))
        fs.cat(paths[:8])
        measure(name, lambda fs=fs: list(fs.cat(paths).values()), lambda: len(paths))
    return rows


def child_main(spec_path: str) -> int:
    """Run one system (or the raw fetch) described by the JSON file at ``spec_path``; write the result."""
    from peers import SYSTEMS, Target

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("client_cpus"):
        os.sched_setaffinity(0, spec["client_cpus"])  # DataLoader workers inherit it
    for k, v in spec.get("env", {}).items():
        os.environ[k] = v
    target = Target(**spec["target"])
    result: dict[str, Any] = {"system": spec["system"]}
    try:
        if spec["system"] == "rawfetch":
            result["raw"] = _raw_fetch(spec, target)
        else:
            t0 = time.perf_counter()
            prepared = SYSTEMS[spec["system"]](target)
            result.update(setup_s=prepared.setup_s, note=prepared.note, prepare_s=time.perf_counter() - t0)
            result["epochs"] = []
            try:
                for name, loader in prepared.epochs:
                    row = _time_epoch(loader, len(target.keys), spec["server_pid"], spec["epoch_limit_s"])
                    result["epochs"].append({"name": name, **row})
            finally:
                prepared.close()
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    Path(spec_path + ".result").write_text(json.dumps(result))
    return 0


# -- parent side: servers, data, children, tables ------------------------------------------------------
ROW_NAMES = {
    "local": ["local disk"],
    "naive": ["naive s3fs"],
    "filecache": ["fsspec filecache"],
    "webdataset": ["WebDataset"],
    "litdata": ["LitData raw"],
    "blobdata": ["blobdata cold", "blobdata warm"],
    "blobdata-nocache": ["blobdata no cache"],
}


@dataclasses.dataclass
class Row:
    name: str
    rtt_ms: float
    images: int = 0
    seconds: float = math.nan
    first_batch_s: float | None = None
    setup_s: float | None = None
    cpu_s: float = math.nan
    main_cpu_s: float = math.nan
    server_cpu_s: float = math.nan
    partial: bool = False
    note: str = ""
    gets: int | None = None  # object GETs the proxy saw during the whole child run (both epochs)
    proxy_cpu_s: float = math.nan

    @property
    def rate(self) -> float:
        return self.images / self.seconds if self.images and self.seconds > 0 else math.nan


def run_child(spec: dict[str, Any], workdir: Path, timeout_s: float, log_path: Path) -> dict[str, Any]:
    """Run ``bench_latency.py --child`` on ``spec`` with a wall-clock bound; return its result dict."""
    spec_path = workdir / f"{spec['system']}.json"
    spec_path.write_text(json.dumps(spec))
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a timeout can end the child and its DataLoader workers together
        )
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(10)
            return {"error": f"timed out after {timeout_s:.0f}s (log: {log_path})"}
    result_path = Path(str(spec_path) + ".result")
    if not result_path.exists():
        return {"error": f"child exited with {proc.returncode} and no result (log: {log_path})"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    if "error" in result:
        result["error"] += f" (log: {log_path})"
    return result


def _s3_client(endpoint: str, server: Any) -> Any:
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=botocore.config.Config(
            connect_timeout=10, read_timeout=120, retries={"max_attempts": 3}, max_pool_connections=32
        ),
    )


def system_table(rows: list[Row]) -> str:
    local = next((r for r in rows if r.name == "local disk" and not math.isnan(r.rate)), None)
    out = []
    for r in rows:
        ratio = r.rate / local.rate if local and not math.isnan(r.rate) else math.nan
        per = 1000 / r.images if r.images else math.nan
        rate = fmt(r.rate) + (" (partial)" if r.partial and r.images else "")
        out.append(
            [
                r.name,
                rate if r.images else "n/a",
                fmt(r.first_batch_s, ".2f"),
                fmt(ratio, ".2f"),
                fmt(r.setup_s, ".2f"),
                fmt(r.cpu_s * per, ".1f"),
                fmt(r.main_cpu_s * per, ".2f"),
                fmt(r.server_cpu_s * per, ".2f"),
                fmt(r.proxy_cpu_s * per, ".2f"),
                "-" if r.gets is None else str(r.gets),
                r.note if len(r.note) <= 40 else r.note[:37] + "...",
            ]
        )
    headers = ["system", "images/s", "1st batch s", "x local", "setup s", "cpu ms/img", "main ms/img"]
    headers += ["srv ms/img", "proxy ms/img", "GETs"]
    headers.append("note")
    return table(headers, out)


def goals(rows: list[Row]) -> list[str]:
    by = {r.name: r for r in rows}
    local, wds, cold = by.get("local disk"), by.get("WebDataset"), by.get("blobdata cold")
    if cold is None or math.isnan(cold.rate):
        return ["goals: blobdata cold was not measured"]
    lines = []
    if local is not None and not math.isnan(local.rate):
        ratio = cold.rate / local.rate
        verdict = "met" if ratio >= GOAL_RATIO_TO_LOCAL else "NOT met"
        lines.append(f"goal blobdata cold >= {GOAL_RATIO_TO_LOCAL}x local disk: {ratio:.2f}x -> {verdict}")
    if wds is not None and not math.isnan(wds.rate):
        verdict = "met" if cold.rate >= wds.rate else "NOT met"
        lines.append(
            f"goal blobdata cold >= WebDataset: {cold.rate:.0f} vs {wds.rate:.0f} img/s -> {verdict}"
        )
    return lines


def cpu_budget(rows: list[Row], cores: int | None = None) -> list[str]:
    """Where each system's CPU per image goes, and the rate that CPU allows on this machine's cores.

    Every system here is CPU-bound on a machine it shares with the S3 server and the latency proxy,
    so ``cores / (client + server + proxy)`` bounds its images/s; the terms say where a gap comes from.
    """
    cores = cores or os.cpu_count() or 1
    lines = [f"CPU ms per image (client = the child and its workers) and the bound it sets on {cores} cores:"]
    for r in rows:
        if not r.images or math.isnan(r.cpu_s) or r.name not in ("local disk", "WebDataset", "blobdata cold"):
            continue
        parts = [r.cpu_s, r.server_cpu_s, 0.0 if math.isnan(r.proxy_cpu_s) else r.proxy_cpu_s]
        client, server, proxy = (1000 * x / r.images for x in parts)
        total = client + server + proxy
        lines.append(
            f"  {r.name:14} client {client:.2f} + server {server:.2f} + proxy {proxy:.2f} = {total:.2f}"
            f" -> at most {1000 * cores / total:.0f} img/s (measured {r.rate:.0f})"
        )
    return lines if len(lines) > 1 else []


def scaling_table(saved: list[dict[str, Any]]) -> str:
    """Images/s (x local disk) and client CPU ms per image, per system and worker count, per RTT."""
    out = []
    for rtt in sorted({r["rtt_ms"] for r in saved}):
        at = [r for r in saved if r["rtt_ms"] == rtt]
        local = {r["workers"]: r["images_per_s"] for r in at if r["system"] == "local disk"}
        for r in at:
            base = local.get(r["workers"])
            ratio = r["images_per_s"] / base if base and not math.isnan(base) else math.nan
            cpu = r["client_cpu_ms_per_image"]
            cpu_ms = fmt(cpu if cpu is not None else math.nan, ".2f")
            row = [f"{rtt:g}", str(r["workers"]), r["system"], fmt(r["images_per_s"]), fmt(ratio, ".2f")]
            out.append([*row, cpu_ms, fmt(r["first_batch_s"], ".2f")])
    return "scaling curve:\n" + table(
        ["RTT ms", "workers", "system", "images/s", "x local", "client cpu ms/img", "1st batch s"], out
    )


def raw_table(raw: dict[str, Any]) -> str:
    out = []
    for name, r in raw.items():
        out.append(
            [
                name,
                fmt(r["objects"] / r["seconds"]),
                fmt(r["bytes"] / r["seconds"] / 1e6, ".1f"),
                fmt(r["cpu_s"] * 1000 / r["objects"], ".2f"),
                fmt(r["server_cpu_s"] * 1000 / r["gets"], ".2f") if r["gets"] else "-",
                str(r["gets"]),
            ]
        )
    headers = ["raw fetch, no decode", "objects/s", "MB/s", "client cpu ms/obj", "server cpu ms/GET", "GETs"]
    return table(headers, out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--images", type=int, default=3000, help="synthetic JPEGs (default 3000)")
    p.add_argument("--classes", type=int, default=100, help="class folders (default 100)")
    p.add_argument("--rtt", default="0,50", help="round-trip times in ms, comma-separated (default 0,50)")
    p.add_argument(
        "--systems", default=",".join(ALL_SYSTEMS), help=f"subset of {','.join(ALL_SYSTEMS + EXTRA_SYSTEMS)}"
    )
    p.add_argument(
        "--workers", default="2",
        help="DataLoader workers; a list sweeps them in one run, e.g. 2,4,8,16 (default 2)",
    )
    p.add_argument(
        "--client-cpus", help="CPUs of the system under test (training process, workers), e.g. 0-7"
    )
    p.add_argument("--server-cpus", help="CPUs of the S3 server and the latency proxy, e.g. 8-15")
    p.add_argument("--save", help="write every row as JSON to this file")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--no-raw", action="store_true", help="skip the raw fetch throughput measurement")
    p.add_argument(
        "--epoch-limit",
        type=float,
        default=600.0,
        help="seconds after which an epoch is cut short and reported as partial (default 600)",
    )
    p.add_argument(
        "--timeout", type=float, default=1200.0, help="wall-clock bound per system run, s (default 1200)"
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 384 images, 8 classes, RTT 50, epochs cut at 10 s"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.classes, args.epoch_limit, args.timeout = 384, 8, 10.0, 120.0
        if args.rtt == "0,50":
            args.rtt = "50"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(ALL_SYSTEMS) - set(EXTRA_SYSTEMS)
    if unknown:
        print(f"unknown systems {sorted(unknown)}; choose from {ALL_SYSTEMS}", file=sys.stderr)
        return 2
    rtts = [float(x) for x in args.rtt.split(",") if x.strip()]
    sweep = [int(x) for x in str(args.workers).split(",") if x.strip()]
    asked = parse_cpus(args.client_cpus), parse_cpus(args.server_cpus)
    client_cpus, server_cpus, placement = place_cpus(*asked)
    args.client_cpus_set = sorted(client_cpus) if client_cpus else None
    print(placement, flush=True)
    if server_cpus:
        os.sched_setaffinity(0, server_cpus)  # this process runs the latency proxy's thread

    from blobdata.testing import LatencyProxy, LocalS3Server, upload

    data = prepare_dataset(args.images, args.classes)
    BENCH_DATA.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="bench-latency-", dir=BENCH_DATA))
    logs = workdir / "logs"
    logs.mkdir()
    started = time.perf_counter()
    tables: list[str] = []
    saved: list[dict[str, Any]] = []
    try:
        with LocalS3Server(backend="seaweedfs") as server:
            if server_cpus:
                print(f"pinned {pin_tree(server.pid, server_cpus)} server process(es)", flush=True)
            client = _s3_client(server.endpoint_url, server)
            client.create_bucket(Bucket=BUCKET)
            t0 = time.perf_counter()
            upload(client, BUCKET, data.items())
            sent = data.total_bytes + sum(data.shard_sizes)
            print(
                f"uploaded {len(data.keys)} JPEGs + {len(data.shard_keys)} shards ({sent / 1e6:.0f} MB) to "
                f"s3://{BUCKET} in {time.perf_counter() - t0:.1f}s (SeaweedFS pid {server.pid})",
                flush=True,
            )
            settle_server(client, [*data.keys, *data.shard_keys])
            host, port = server.endpoint_url.rsplit("/", 1)[-1].rsplit(":", 1)
            for rtt in rtts:
                with contextlib.ExitStack() as stack:
                    endpoint = server.endpoint_url
                    if rtt > 0:
                        proxy = stack.enter_context(LatencyProxy(host, int(port), delay_s=rtt / 2000))
                        endpoint = proxy.endpoint_url
                    else:
                        proxy = None
                    for workers in sweep:
                        args.workers = workers
                        text = run_rtt(args, rtt, endpoint, server, proxy, data, systems, workdir, logs)
                        tables.append(text)
                        saved.extend(args.last_rows)
    finally:
        elapsed = time.perf_counter() - started
        print(
            f"\n===== results (one run, {elapsed:.0f}s; {args.images} images, batch {args.batch_size}, "
            f"workers {','.join(map(str, sweep))}; {placement}) ====="
        )
        print("\n\n".join(tables))
        if len(sweep) > 1 and saved:
            print("\n" + scaling_table(saved))
        if args.save:
            Path(args.save).write_text(json.dumps({"placement": placement, "rows": saved}, indent=1))
        shutil.rmtree(workdir / "scratch", ignore_errors=True)
    return 0


def settle_server(client: Any, keys: list[str]) -> None:
    """Read every object once and flush the disks before anything is timed.

    Right after an upload the server is still writing it back and has not yet read any object: the
    first system to read the images then paid ~0.15 ms more server CPU per GET and ran 15-20%
    slower than the same system run later (0.63x vs 0.78x of local disk, measured). A bucket in
    real use was written long ago; this puts every system in front of the same settled server.
    "Cold" stays cold for the clients: nothing here touches their caches.
    """
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        total = sum(pool.map(lambda k: len(client.get_object(Bucket=BUCKET, Key=k)["Body"].read()), keys))
    os.sync()
    print(f"read every object once ({total / 1e6:.0f} MB) and synced in {time.perf_counter() - t0:.1f}s")


def run_rtt(
    args: argparse.Namespace,
    rtt: float,
    endpoint: str,
    server: Any,
    proxy: Any,
    data: Any,
    systems: list[str],
    workdir: Path,
    logs: Path,
) -> str:
    """Run every system (and the raw fetch) at one RTT; return the printed tables."""
    presigner = _s3_client(endpoint, server)
    shard_urls = [
        presigner.generate_presigned_url(
            "get_object", Params={"Bucket": BUCKET, "Key": k}, ExpiresIn=6 * 3600
        )
        for k in data.shard_keys
    ]
    env = {
        # Only LitData reads these (its boto3 client and its fsspec indexer take no common options).
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_DEFAULT_REGION": server.region,
    }
    base = {
        "endpoint_url": endpoint,
        "access_key": server.access_key,
        "secret_key": server.secret_key,
        "region": server.region,
        "bucket": BUCKET,
        "image_prefix": IMAGE_PREFIX,
        "keys": data.keys,
        "classes": data.classes,
        "shard_urls": shard_urls,
        "local_root": str(data.root),
        "workers": args.workers,
        "batch_size": args.batch_size,
    }
    rows: list[Row] = []
    for system in systems:
        scratch = workdir / "scratch" / f"{system}-rtt{rtt:g}"
        scratch.mkdir(parents=True)
        target = {**base, "scratch": str(scratch)}
        spec = {
            "system": system,
            "target": target,
            "server_pid": server.pid,
            "epoch_limit_s": args.epoch_limit,
            "env": env if system == "litdata" else {},
            "client_cpus": args.client_cpus_set,
        }
        print(f"[RTT {rtt:g} ms] {system} ...", end=" ", flush=True)
        if proxy is not None:
            proxy.reset_counts()
        proxy_cpu0 = time.process_time()  # the proxy's thread is this process's only work meanwhile
        res = run_child(spec, workdir, args.timeout, logs / f"{system}-rtt{rtt:g}.log")
        proxy_cpu = time.process_time() - proxy_cpu0 if proxy is not None else math.nan
        gets = _object_gets(proxy)
        if system == "litdata":
            _remove_litdata_index(server)
        shutil.rmtree(scratch, ignore_errors=True)
        epochs = res.get("epochs", [])
        for i, name in enumerate(ROW_NAMES[system]):
            row = Row(
                name,
                rtt,
                setup_s=res.get("setup_s")
                if system in ("blobdata", "blobdata-nocache", "litdata") and i == 0
                else None,
            )
            if i == 0:
                row.gets, row.proxy_cpu_s = gets, proxy_cpu
            if i < len(epochs):
                e = epochs[i]
                row.images, row.seconds, row.first_batch_s = e["images"], e["seconds"], e["first_batch_s"]
                row.cpu_s, row.server_cpu_s, row.partial = e["cpu_s"], e["server_cpu_s"], e["partial"]
                row.main_cpu_s = e["main_cpu_s"]
                row.note = res.get("note", "") if i == 0 else "second epoch, from its cache"
            else:
                row.note = res.get("error", "no result")
            rows.append(row)
        print(
            ", ".join(f"{r.name}: {fmt(r.rate)} img/s" for r in rows[-len(ROW_NAMES[system]) :]), flush=True
        )
        if "error" in res:
            print(f"    error: {res['error']}", flush=True)

    args.last_rows = [
        {
            "rtt_ms": rtt,
            "workers": args.workers,
            "system": r.name,
            "images_per_s": r.rate,
            "first_batch_s": r.first_batch_s,
            "client_cpu_ms_per_image": 1000 * r.cpu_s / r.images if r.images else None,
            "server_cpu_ms_per_image": 1000 * r.server_cpu_s / r.images if r.images else None,
            "partial": r.partial,
        }
        for r in rows
    ]
    parts = [f"--- RTT {rtt:g} ms, {args.workers} workers ---", system_table(rows), *goals(rows)]
    pinned = getattr(args, "client_cpus_set", None)
    parts += cpu_budget(rows, len(pinned) if pinned else None)  # pinned: only the client's cores count
    parts += [f"{r.name}: {r.note}" for r in rows if not r.images and len(r.note) > 40]
    if proxy is not None:
        parts.append(
            "GETs: object GETs seen by the proxy per system run; proxy ms/img: the proxy's CPU (a thread of"
            " this process) over the whole system run, listing included, per image of its first epoch"
        )
    if not args.no_raw:
        spec = {
            "system": "rawfetch",
            "target": {**base, "scratch": str(workdir)},
            "server_pid": server.pid,
            "sizes": data.sizes,
            "epoch_limit_s": args.epoch_limit,
        }
        print(f"[RTT {rtt:g} ms] raw fetch ...", flush=True)
        res = run_child(spec, workdir, args.timeout, logs / f"rawfetch-rtt{rtt:g}.log")
        parts.append(raw_table(res["raw"]) if "raw" in res else f"raw fetch failed: {res.get('error')}")
    text = "\n".join(parts)
    print("\n" + text + "\n", flush=True)
    return text


def _object_gets(proxy: Any) -> int | None:
    """Object GETs the proxy has seen since its last reset (listings excluded); None without a proxy."""
    if proxy is None:
        return None
    return sum(1 for method, path in proxy.requests if method == "GET" and "list-type=" not in path)


def _remove_litdata_index(server: Any) -> None:
    """LitData uploads its index into the dataset folder; remove it so other systems list only images."""
    client = _s3_client(server.endpoint_url, server)
    resp = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{IMAGE_PREFIX}/index")
    for obj in resp.get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=obj["Key"])


if __name__ == "__main__":
    raise SystemExit(main())

"""Node caches that serve each other (``peers=``), against the same job without them and against
``PartitionedSampler``: bucket GETs per epoch, epoch time, bytes between nodes.

N nodes simulated on one machine: one process per node (the training process of its one rank, with
``--workers`` DataLoader workers), each with its own cache directory sized to ``1/N`` of the dataset's
bytes plus ``--slack`` (policy "admit"), its own peer service on its own loopback address
(``127.0.0.2``, ``127.0.0.3``, ...) and, with ``--peer-rtt-ms``, a ``LatencyProxy`` in front of that
service; the nodes meet through a ``TCPStore`` served by this script. The bucket is a local S3 server
(``blobdata.testing.LocalS3Server``) behind a ``LatencyProxy`` of ``--bucket-rtt-ms`` (default 50 ms)
that counts its GETs. Three jobs, each with fresh caches:

- ``peers``: ``ElasticDistributedSampler`` (a global shuffle: each epoch, each node reads a fresh random
  quarter of the dataset) with ``peers=Peers(...)``;
- ``global``: the same sampler without peers (each node's cache holds the first quarter it read);
- ``partitioned``: ``PartitionedSampler`` (each node reads its own share every epoch), no peers;
- ``peers-thread`` (only where ``--jobs`` names it): as ``peers``, with each node's service in a thread
  of its training process (``Peers(service_process=False)``) instead of a process of its own.

Every node waits for the others at the start of each epoch (a barrier in the store, through which this
script reads the proxy's count of GETs between epochs); an epoch's time is its slowest node's, its CPU
the nodes' processes' (their workers' included; not this script's proxies and S3 server). The
proxies' CPU is this script's own over the epoch (its latency proxies' threads, the store's polling):
on a machine of few cores, a cost the peers' 1 ms proxies put on the nodes' cores that a network
would not. Each
sample is decoded and cropped (the default loader, ``blobdata.testing.TrainTransform(64)``) unless
``--no-decode``.
``--step-ms`` adds a training step after each batch (a sleep: the CPU is free meanwhile, as while a
GPU computes), ``--persistent-workers`` keeps the workers across epochs (their CPU read from
``/proc``). Flat out on a machine of few cores the jobs are CPU-bound, and the epoch times say whose
data path costs more CPU; with a step they say whether the training loop waits for data.
Prints a table per job, then the ratios (from epoch 2 on), where the training loop waited, where each
epoch's first batch went (``iter()`` returning, the batch made in a worker, the loop having it) and
the machine's load average.

    python benchmarks/bench_peers.py [--nodes 4] [--objects 1200] [--epochs 3] [--step-ms 0]
        [--persistent-workers] [--per-peer 16] [--lookahead 0] [--node-prefix CMD] [--json out.json]

``--node-prefix`` runs the last node under a command, for a count this machine's noise does not
change: its instructions per sample, from two runs that differ only in ``--epochs`` (docs/peers.md),

    --nodes 2 --workers 0 --no-decode --jobs peers --node-prefix \
        "valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null --log-file=node.txt"

(with ``PYTHONHASHSEED=0``; a run where that slow node hedged reads to the bucket counts more).

A benchmark prints; it asserts nothing (tests/peers/test_bench_peers.py runs it small and checks it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import REPO, add_repo_to_path, table

add_repo_to_path()

JOBS = ("peers", "global", "partitioned")
#: The jobs with peers: the node's service in a process of its own (the default), or in a thread of
#: the node's training process (``Peers(service_process=False)``; not run unless ``--jobs`` names it).
_PEERS = ("peers", "peers-thread")
#: Per node and epoch: when iter() returned, the first batch was made in a worker, the loop had it.
_FIRST = ("first_iter_s", "first_made_s", "first_had_s")


# -- one node ------------------------------------------------------------------------------------------
def _stamped(batch: list[Any]) -> tuple[float, list[Any]]:
    """The batch as a list, and when the worker made it (the clock every process of the machine reads):
    the training loop tells the worker's part of a first batch's wait from its way to the loop."""
    return time.time(), batch


def _raw(fh: Any) -> bytes:
    return bytes(fh.read())


def _cpu_parts() -> tuple[float, ...]:
    """CPU seconds of this process (the training process, and the peer service where it runs in a
    thread of it), of its DataLoader workers (those reaped, of past epochs, and the live ones:
    persistent workers) and of its peer service's process; then the same three's seconds in the kernel
    (system time: the sockets' and the files' work, which an instruction count does not see)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    ticks = {"workers": [0, 0], "service": [0, 0]}  # utime, stime (clock ticks)
    children = []
    # Every thread's children: the peer service's process is started from the event loop's thread.
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        with contextlib.suppress(OSError):  # no CONFIG_PROC_CHILDREN, or a thread that just ended
            children += task.read_text().split()
    for child in children:
        with contextlib.suppress(OSError, IndexError, ValueError):  # it may have just exited
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            service = b"blobdata._peers" in Path(f"/proc/{child}/cmdline").read_bytes()
            part = ticks["service" if service else "workers"]
            part[0] += int(fields[11])
            part[1] += int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    workers, service = ticks["workers"], ticks["service"]
    return (
        own.ru_utime + own.ru_stime,
        kids.ru_utime + kids.ru_stime + sum(workers) / tick,
        sum(service) / tick,
        own.ru_stime,
        kids.ru_stime + workers[1] / tick,
        service[1] / tick,
    )


def _wait(store: Any, key: str, timeout: float = 600.0) -> None:
    import datetime

    store.wait([key], datetime.timedelta(seconds=timeout))


def node_main(spec_path: str) -> int:
    """One node of one job (``--node SPEC``): epochs between barriers; writes its figures to ``out``."""
    import torch.distributed as dist

    from blobdata import BlobCache, ElasticDistributedSampler, FolderDataset, PartitionedSampler, Peers
    from blobdata.testing import TrainTransform

    spec = json.loads(Path(spec_path).read_text())
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False)
    job, rank, n = spec["job"], spec["rank"], spec["nodes"]
    peers = None
    if job in _PEERS:
        peers = Peers(
            store=store, nnodes=n, node_rank=rank, host=spec["host"], port=spec["port"],
            advertise=spec["advertise"], job=spec["run"], timeout=120, per_peer=spec["per_peer"],
            service_process=job == "peers",
        )  # fmt: skip
    cache = BlobCache(spec["cache"], size_limit=spec["cache_bytes"])
    decode = spec["decode"]
    transform = TrainTransform(64) if decode else None
    ds = FolderDataset(
        spec["url"], transform=transform, loader=None if decode else _raw, cache=cache, peers=peers,
        share_listing=False, **({"lookahead": spec["lookahead"]} if spec["lookahead"] else {}),
    )  # fmt: skip
    if job == "partitioned":
        sampler: Any = PartitionedSampler(ds, num_replicas=n, rank=rank, nproc_per_node=1, seed=1)
    else:
        sampler = ElasticDistributedSampler(ds, num_replicas=n, rank=rank, seed=1)
    loader = ds.dataloader(
        batch_size=spec["batch_size"], sampler=sampler, num_workers=spec["workers"], collate_fn=_stamped,
        persistent_workers=spec["persistent"],
    )
    out = []
    step_s = spec["step_ms"] / 1000.0
    before = loader.stats()
    for epoch in range(spec["epochs"]):
        store.add(f"{spec['run']}/arrive/{epoch}", 1)
        _wait(store, f"{spec['run']}/go/{epoch}")
        sampler.set_epoch(epoch)
        t0, cpu0 = time.perf_counter(), _cpu_parts()
        samples, waits, first = 0, [], (0.0, 0.0)
        start = time.time()
        it = iter(loader)
        began = time.time() - start  # iter(): the hand-over settled, the workers forked
        while True:
            w0 = time.perf_counter()
            batch = next(it, None)
            waits.append(time.perf_counter() - w0)  # the loop waiting for data (its last: the end)
            if batch is None:
                break
            made, items = batch
            if len(waits) == 1:  # when the first batch was made in a worker, and when the loop had it
                first = (made - start, time.time() - start)
            samples += len(items)
            if step_s:
                time.sleep(step_s)  # the training step (a GPU's): the CPU is free meanwhile
        seconds = time.perf_counter() - t0
        trainer, workers, service, *kernel = (b - a for a, b in zip(cpu0, _cpu_parts(), strict=True))
        now = loader.stats()
        out.append({
            "seconds": seconds, "samples": samples, "cpu_s": trainer + workers + service,
            "cpu_trainer_s": trainer, "cpu_workers_s": workers, "cpu_service_s": service,
            **{f"cpu_{k}_s": v for k, v in zip(_CPU_PARTS[3:], kernel, strict=True)},
            "from_peers": now.samples_from_peers - before.samples_from_peers,
            "from_cache": now.samples_from_cache - before.samples_from_cache,
            "from_bucket": now.samples_from_bucket - before.samples_from_bucket,
            "bytes_from_peers": now.bytes_from_peers - before.bytes_from_peers,
            "peer_fallbacks": now.peer_fallbacks - before.peer_fallbacks,
            "peer_hedged": now.peer_hedged - before.peer_hedged,
            "peer_p50_s": now.peer_p50_s, "peer_p99_s": now.peer_p99_s, "waits_s": waits,
            "first_iter_s": began, "first_made_s": first[0], "first_had_s": first[1],
        })  # fmt: skip
        before = now
    Path(spec["out"]).write_text(json.dumps({"epochs": out, "summary": loader.stats().summary()}))
    store.add(f"{spec['run']}/arrive/end", 1)
    _wait(store, f"{spec['run']}/go/end")  # serve the others until every node is done
    return 0


# -- the driver ----------------------------------------------------------------------------------------
def _gets(proxy: Any) -> int:
    return sum(1 for m, t in proxy.requests if m == "GET" and "list-type" not in t)


def _run_job(
    job: str, args: Any, work: Path, url: str, env: dict[str, str], store: Any, proxy: Any
) -> dict[str, Any]:
    from blobdata.testing import LatencyProxy, find_free_port

    run = f"{job}-{os.urandom(4).hex()}"
    share = args.total_bytes / args.nodes
    procs, specs, peer_proxies = [], [], []
    for rank in range(args.nodes):
        host = f"127.0.0.{2 + rank}"
        port = find_free_port()
        advertise = None
        if job in _PEERS and args.peer_rtt_ms > 0:
            p = LatencyProxy(host, port, delay_s=args.peer_rtt_ms / 2000.0, count_requests=False).start()
            peer_proxies.append(p)
            advertise = f"127.0.0.1:{p.port}"
        spec = {
            "job": job, "run": run, "rank": rank, "nodes": args.nodes, "store_port": store.port,
            "host": host, "port": port, "advertise": advertise, "url": url,
            "cache": str(work / run / f"cache{rank}"), "cache_bytes": int(share * (1 + args.slack)) + 2**22,
            "epochs": args.epochs, "batch_size": args.batch_size, "workers": args.workers,
            "decode": not args.no_decode, "per_peer": args.per_peer, "step_ms": args.step_ms,
            "persistent": args.persistent_workers, "lookahead": args.lookahead,
            "out": str(work / run / f"node{rank}.json"),
        }  # fmt: skip
        (work / run).mkdir(parents=True, exist_ok=True)
        path = work / run / f"spec{rank}.json"
        path.write_text(json.dumps(spec))
        log = open(work / run / f"node{rank}.log", "wb")  # noqa: SIM115 - closed below
        prefix = shlex.split(args.node_prefix) if rank == args.nodes - 1 else []
        procs.append((subprocess.Popen([*prefix, sys.executable, __file__, "--node", str(path)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))  # fmt: skip
        specs.append(spec)
    gets, driver_cpu = [], []
    cpu0 = 0.0
    try:
        for epoch in [*range(args.epochs), "end"]:
            key = f"{run}/arrive/{epoch}"
            deadline = time.monotonic() + args.timeout
            while int(store.add(key, 0)) < args.nodes:
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p, _ in procs):
                    logs = [
                        (work / run / f"node{r}.log").read_text(errors="replace")[-2000:]
                        for r in range(args.nodes)
                    ]
                    raise SystemExit(f"{job}: nodes did not reach epoch {epoch}:\n" + "\n".join(logs))
                time.sleep(0.01)
            if epoch != 0:
                gets.append(_gets(proxy))
                driver_cpu.append(time.process_time() - cpu0)
            proxy.reset_counts()
            cpu0 = time.process_time()
            store.set(f"{run}/go/{epoch}", "1")
        for p, _ in procs:
            p.wait(timeout=120)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            log.close()
        for pp in peer_proxies:
            pp.stop()
    nodes = [json.loads(Path(s["out"]).read_text()) for s in specs]
    epochs = []
    for e in range(args.epochs):
        rows = [nd["epochs"][e] for nd in nodes]
        summed = (
            "cpu_s",
            "cpu_trainer_s",
            "cpu_workers_s",
            "cpu_service_s",
            "cpu_kernel_trainer_s",
            "cpu_kernel_workers_s",
            "cpu_kernel_service_s",
            "from_peers",
            "from_cache",
            "from_bucket",
            "bytes_from_peers",
            "peer_fallbacks",
            "peer_hedged",
        )
        epochs.append({
            "gets": gets[e], "driver_cpu_s": driver_cpu[e], "seconds": max(r["seconds"] for r in rows),
            "samples": sum(r["samples"] for r in rows), **{k: sum(r[k] for r in rows) for k in summed},
            "peer_p99_s": max(r["peer_p99_s"] for r in rows),
            "peer_p50_s": max(r["peer_p50_s"] for r in rows),
            "waits_s": [r["waits_s"] for r in rows],
            **{k: sum(r[k] for r in rows) / len(rows) for k in _FIRST},
        })  # fmt: skip
    return {"job": job, "epochs": epochs, "summary": nodes[0]["summary"]}


def _run_jobs(args: Any, work: Path, bodies: list[bytes]) -> list[dict[str, Any]]:
    """Each job of ``--jobs`` in turn, against one bucket (a local S3 server behind a latency proxy)."""
    import torch.distributed as dist

    from blobdata.testing import LatencyProxy, LocalS3Server, s3_client

    results = []
    with LocalS3Server() as server:
        client = s3_client(server)
        client.create_bucket(Bucket="bench")

        def put(i: int) -> None:
            client.put_object(Bucket="bench", Key=f"train/c{i % 10:02d}/{i:06d}.jpg", Body=bodies[i])

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(put, range(args.objects)))
        host, port = server.endpoint_url.split("://", 1)[1].rsplit(":", 1)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with LatencyProxy(host, int(port.rstrip("/")), delay_s=args.bucket_rtt_ms / 2000.0) as proxy:
            opts = server.storage_options
            env = {
                **os.environ, "PYTHONPATH": str(REPO), "AWS_ENDPOINT_URL_S3": proxy.endpoint_url,
                "AWS_ACCESS_KEY_ID": opts["key"], "AWS_SECRET_ACCESS_KEY": opts["secret"],
                "AWS_REGION": opts["client_kwargs"]["region_name"], "BLOBDATA_CACHE_HOME": str(work / "home"),
                "OMP_NUM_THREADS": "1",
            }  # fmt: skip
            for job in args.jobs.split(","):
                results.append(_run_job(job, args, work, "s3://bench/train", env, store, proxy))
    return results


def _cpu_line(results: list[dict[str, Any]]) -> str:
    """Where the nodes' CPU went, from epoch 2 on: per sample, the training processes, their
    DataLoader workers and the peer services' processes (a service in a thread counts as its training
    process's), and of each, the kernel's part (system time)."""
    parts = []
    for r in results:
        eps = r["epochs"][1:]
        n = sum(ep["samples"] for ep in eps) or 1
        us = [sum(ep[f"cpu_{k}_s"] for ep in eps) / n * 1e6 for k in _CPU_PARTS]
        parts.append(
            f"{r['job']} {us[0]:.0f} + {us[1]:.0f} + {us[2]:.0f} = {sum(us[:3]):.0f} "
            f"(kernel {us[3]:.0f} + {us[4]:.0f} + {us[5]:.0f})"
        )
    return (
        "from epoch 2 on, the nodes' CPU per sample (us), training processes + workers + services "
        "(of which the kernel's): " + ", ".join(parts)
    )


_CPU_PARTS = ("trainer", "workers", "service", "kernel_trainer", "kernel_workers", "kernel_service")


def _waits_line(results: list[dict[str, Any]]) -> str:
    """Where the training loop waited for data, from epoch 2 on: per node and epoch, on average, the
    first batch, the next five, and the rest (the end of the epoch included)."""
    parts = []
    for r in results:
        per = [w for ep in r["epochs"][1:] for w in ep["waits_s"]]  # one list of waits per node and epoch
        if not per:
            continue
        first, five, rest = (sum(f(w) for w in per) / len(per) * 1e3 for f in (
            lambda w: sum(w[:1]), lambda w: sum(w[1:6]), lambda w: sum(w[6:])))  # fmt: skip
        parts.append(f"{r['job']} {first:.0f} + {five:.0f} + {rest:.0f} = {first + five + rest:.0f}")
    return "from epoch 2 on, the loop's wait per node and epoch (ms), first batch + next 5 + rest: " + (
        ", ".join(parts))


def _first_line(results: list[dict[str, Any]]) -> str:
    """From epoch 2 on, per node and epoch on average, in ms from calling ``iter()``: when it returned (the
    hand-over settled, the workers forked), when the first batch was made in a worker (its start and
    its reads) and when the training loop had it (its way there)."""
    parts = []
    for r in results:
        eps = [ep for ep in r["epochs"][1:] if ep.get("first_had_s")]
        if eps:
            began, made, had = (sum(ep[k] for ep in eps) / len(eps) * 1e3 for k in _FIRST)
            parts.append(f"{r['job']} iter() {began:.0f}, made {made:.0f}, in the loop {had:.0f}")
    return "from epoch 2 on, the first batch per node and epoch (ms from calling iter()): " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--node"]:
        return node_main(argv[1])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--objects", type=int, default=1200)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slack", type=float, default=0.15, help="each cache: 1/N of the data times 1 + this")
    p.add_argument("--bucket-rtt-ms", type=float, default=50.0)
    p.add_argument(
        "--peer-rtt-ms", type=float, default=1.0, help="a LatencyProxy before each service; 0: none"
    )
    p.add_argument(
        "--step-ms", type=float, default=0.0, help="a training step after each batch (sleeps: a GPU's time)"
    )
    p.add_argument("--persistent-workers", action="store_true", help="the DataLoader's workers live on")
    p.add_argument("--per-peer", type=int, default=16, help="objects a process has in flight to one peer")
    p.add_argument("--lookahead", type=int, default=0, help="samples a process reads ahead (0: the default)")
    p.add_argument("--no-decode", action="store_true", help="read bytes only (no JPEG decode, no transform)")
    p.add_argument("--jobs", default=",".join(JOBS))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a job's epoch may take")
    p.add_argument("--node-prefix", default="", help="a command the last node runs under (valgrind ...)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import numpy as np

    from blobdata.testing import synthetic_jpeg

    load0 = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    rng = np.random.default_rng(0)
    bodies = [synthetic_jpeg(rng, min_side=160, max_side=320) for _ in range(args.objects)]
    args.total_bytes = sum(len(b) for b in bodies)
    t0 = time.monotonic()
    try:
        results = _run_jobs(args, work, bodies)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the nodes' caches, logs and specs

    load1 = os.getloadavg()
    n = args.objects
    print(
        f"{args.nodes} nodes x 1 rank x {args.workers} workers, {n} JPEGs ({args.total_bytes / 1e6:.1f} MB), "
        f"batch {args.batch_size}, each cache 1/{args.nodes} of the data + {args.slack:.0%}, bucket RTT "
        f"{args.bucket_rtt_ms:g} ms, peers RTT {args.peer_rtt_ms:g} ms, "
        f"{'bytes only' if args.no_decode else 'decode + resize'}"
        f"{f', a {args.step_ms:g} ms training step per batch' if args.step_ms else ''}; "
        f"{time.monotonic() - t0:.0f} s; "
        f"load average {load0[0]:.1f} before, {load1[0]:.1f} after"
    )
    head = ["job", "epoch", "bucket GETs", "GETs / samples", "epoch s", "nodes' CPU s", "proxies' CPU s",
            "from peers", "from cache", "peer MB", "peer p50 ms", "peer p99 ms", "fell back",
            "hedged"]  # fmt: skip
    rows = []
    for r in results:
        for e, ep in enumerate(r["epochs"], 1):
            rows.append([
                r["job"], str(e), str(ep["gets"]), f"{ep['gets'] / n:.1%}", f"{ep['seconds']:.2f}",
                f"{ep['cpu_s']:.1f}", f"{ep['driver_cpu_s']:.2f}", str(ep["from_peers"]),
                str(ep["from_cache"]),
                f"{ep['bytes_from_peers'] / 1e6:.1f}", f"{ep['peer_p50_s'] * 1e3:.1f}",
                f"{ep['peer_p99_s'] * 1e3:.1f}", str(ep["peer_fallbacks"]), str(ep["peer_hedged"]),
            ])  # fmt: skip
    print(table(head, rows))
    by = {r["job"]: r for r in results}

    def later(job: str, key: str) -> float:
        return sum(ep[key] for ep in by[job]["epochs"][1:])

    if args.epochs > 1:
        later_samples = n * (args.epochs - 1)
        print("from epoch 2 on: bucket GETs / samples: " + ", ".join(
            f"{job} {later(job, 'gets') / later_samples:.1%}" for job in by))  # fmt: skip
        for job in (j for j in _PEERS if j in by):
            for other in (j for j in by if j != job and j not in ("peers",)):
                ratio = later(job, "seconds") / later(other, "seconds")
                cpu = later(job, "cpu_s") / later(other, "cpu_s")
                both = (later(job, "cpu_s") + later(job, "driver_cpu_s")) / (
                    later(other, "cpu_s") + later(other, "driver_cpu_s"))  # fmt: skip
                print(f"from epoch 2 on, {job} / {other}: epoch time {ratio:.2f}, nodes' CPU {cpu:.2f} "
                      f"(with the proxies' {both:.2f})")  # fmt: skip
    if args.epochs > 1:
        print(_cpu_line(results))
        print(_waits_line(results))
        print(_first_line(results))
    for r in results:
        print(f"{r['job']} (node 0): {r['summary']}")
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        doc = {"args": settings, "load": [load0, load1], "results": results}
        args.json.write_text(json.dumps(doc, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The listing parts of benchmarks/bench_scale.py (issue 42): what a listing of millions of keys costs the
client per page, in memory, split across ranks, end to end, and what a node's share costs its page cache.

Every part runs a ``blobdata.testing.SyntheticListServer`` in a process of its own (its CPU is not the
client's) and measures the client in another, fresh process where memory is measured. ``--before PATH``
runs the same client measurements with the blobdata of another checkout (the code before this work).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = os.path.abspath(__file__)
REPO = Path(HERE).resolve().parent.parent  # not from common: a --before child imports another blobdata
# What the issue called the regex floor: one regex that pulls Key, Size and ETag out of each entry.
FLOOR = re.compile(rb"<Key>(.*?)</Key>.*?<Size>(.*?)</Size>.*?<ETag>(.*?)</ETag>", re.S)


# -- the synthetic server, in its own process ---------------------------------------------------


def server_child(count: str, delay: str, classes: str) -> None:
    """A SyntheticListServer until stdin closes; then the requests it answered, as JSON."""
    from blobdata.testing import SyntheticListServer

    with SyntheticListServer(count=int(count), delay_s=float(delay), classes=int(classes)) as server:
        print(json.dumps({"endpoint": server.endpoint_url, "url": server.url}), flush=True)
        sys.stdin.read()
        print(json.dumps({"requests": server.requests}), flush=True)


class Server:
    def __init__(self, info: dict[str, str], proc: subprocess.Popen[str]) -> None:
        self.url, self.endpoint, self.proc = info["url"], info["endpoint"], proc
        self.opts = {"endpoint_url": self.endpoint, "key": "synthetic", "secret": "synthetic-secret"}
        self.requests = 0


@contextlib.contextmanager
def server(count: int, delay: float = 0.0, classes: int = 1) -> Iterator[Server]:
    cmd = [sys.executable, HERE, "server", str(count), str(delay), str(classes)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    srv = Server(json.loads(proc.stdout.readline()), proc)  # type: ignore[union-attr]
    try:
        yield srv
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        line = proc.stdout.readline()  # type: ignore[union-attr]
        srv.requests = json.loads(line)["requests"] if line else -1
        proc.wait(60)


def _client(args: list[str], before: str | None = None, timeout: float = 3600) -> dict[str, Any]:
    """A measurement in a fresh process (``before``: with that checkout's blobdata)."""
    env = {**os.environ, "PYTHONPATH": before or str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, HERE, *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if done.returncode:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- 1. client CPU per page against the regex floor ----------------------------------------------


def _per_page(fn: Any, body: bytes, reps: int = 30) -> float:
    """CPU seconds of ``fn(body)``, the least of 5 rounds of ``reps`` calls."""
    best = math.inf
    for _ in range(5):
        c = time.process_time()
        for _ in range(reps):
            fn(body)
        best = min(best, (time.process_time() - c) / reps)
    return best


def cpu_child(url: str, endpoint: str, concurrency: str) -> dict[str, Any]:
    """List ``url`` (class folders) once; its CPU, and the regex floor and the parsers on one of its pages,
    measured before and after the listing in this process."""
    from blobdata._listing import list_folder

    with urllib.request.urlopen(
        f"{endpoint}/synthetic?list-type=2&prefix=train/c0000/&max-keys=1000&encoding-type=url"
    ) as resp:
        body = resp.read()
    opts = {"endpoint_url": endpoint, "key": "synthetic", "secret": "synthetic-secret"}
    floor = _per_page(FLOOR.findall, body)
    c0 = time.process_time()
    t0 = time.perf_counter()
    m = list_folder(url, storage_options=opts, concurrency=int(concurrency))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    floor = (floor + _per_page(FLOOR.findall, body)) / 2
    out: dict[str, Any] = {"keys": len(m), "cpu_s": cpu, "wall_s": wall, "floor_ms": floor * 1000}
    try:
        from blobdata._stores.s3.xml import parse_list_page, parse_list_page_tree

        out["parse_ms"] = _per_page(lambda b: parse_list_page(b, "s3://synthetic/train/"), body) * 1000
        out["tree_ms"] = _per_page(lambda b: parse_list_page_tree(b, "s3://synthetic/train/"), body) * 1000
    except ImportError:  # the code before issue 42: ElementTree is its parser
        from blobdata._stores.s3.xml import parse_list_page

        out["parse_ms"] = _per_page(lambda b: parse_list_page(b, "s3://synthetic/train/"), body) * 1000
    return out


def cpu_part(count: int, concurrency: int, before: str | None) -> list[list[str]]:
    rows = []
    for label, path in (("now", None), ("before", before)):
        if label == "before" and not path:
            continue
        with server(count) as srv:
            r = _client(["cpu", srv.url, srv.endpoint, str(concurrency)], path)
        if "error" in r:
            rows.append([label, f"{count:,}", "error", str(r["error"])] + [""] * 6)
            continue
        per_1000 = r["cpu_s"] * 1000 / (r["keys"] / 1000)
        rows.append(
            [
                label,
                f"{r['keys']:,}",
                str(srv.requests),
                f"{r['cpu_s']:.2f}",
                f"{per_1000:.2f}",
                f"{r['cpu_s'] * 1000 / max(srv.requests, 1):.2f}",
                f"{r['floor_ms']:.2f}",
                f"{per_1000 / r['floor_ms']:.1f}x",
                f"{r['parse_ms']:.2f}",
                fmt_ms(r.get("tree_ms")),
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    return rows


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


# -- 2. peak memory while listing, against the saved manifest -----------------------------------


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def memory_child(url: str, endpoint: str, concurrency: str, home: str) -> dict[str, Any]:
    """``load_or_list`` (list, save, map) in this fresh process: its peak RSS growth (VmHWM, reset just
    before) and the saved file's size."""
    os.environ["BLOBDATA_CACHE_HOME"] = home
    from blobdata._errors import BlobdataError
    from blobdata._listing import load_or_list

    opts = {"endpoint_url": endpoint, "key": "synthetic", "secret": "synthetic-secret"}
    with contextlib.suppress(BlobdataError):  # warm up: imports, the loop, a connection
        load_or_list(url + "-none", storage_options=opts, concurrency=int(concurrency), save=False)
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to VmRSS: the peak from here on
    t0, c0 = time.perf_counter(), time.process_time()
    m = load_or_list(url, storage_options=opts, concurrency=int(concurrency))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _status_kb("VmHWM")
    files = [os.path.join(d, f) for d, _, fs in os.walk(home) for f in fs if f.endswith(".manifest")]
    return {
        "keys": len(m),
        "peak_mib": (peak - before) / 1024,
        "file_mib": os.path.getsize(files[0]) / 2**20,
        "wall_s": wall,
        "cpu_s": cpu,
    }


def memory_part(count: int, concurrency: int, before: str | None) -> list[list[str]]:
    rows = []
    for label, path in (("now", None), ("before", before)):
        if label == "before" and not path:
            continue
        with server(count) as srv, tempfile.TemporaryDirectory() as home:
            r = _client(["memory", srv.url, srv.endpoint, str(concurrency), home], path)
        if "error" in r:
            rows.append([label, f"{count:,}", "error", str(r["error"]), "", "", ""])
            continue
        rows.append(
            [
                label,
                f"{r['keys']:,}",
                f"{r['file_mib']:.1f}",
                f"{r['peak_mib']:.0f}",
                f"{r['peak_mib'] / r['file_mib']:.2f}x",
                f"{r['wall_s']:.1f}",
                f"{r['cpu_s']:.1f}",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    return rows


# -- 3. two ranks under torchrun -----------------------------------------------------------------


def torchrun_part(count: int, delay: float, concurrency: int) -> list[list[str]]:
    """2 ranks (gloo) list one folder together; one process alone, the same folder, for comparison."""
    rows = []
    for classes in (1, 100):
        with server(count, delay, classes) as srv:
            r = _client(["cpu", srv.url, srv.endpoint, str(concurrency)])
        alone_wall, alone_requests = r.get("wall_s", float("nan")), srv.requests
        with server(count, delay, classes) as srv, tempfile.TemporaryDirectory() as tmp:
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "OMP_NUM_THREADS": "1",
                "BLOBDATA_SHARED_DIR": tmp,
                "BLOBDATA_CACHE_HOME": tmp,
                "BLOBDATA_CONCURRENCY": str(2 * concurrency),
            }
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=2",
                "--nnodes=1",
                "--master-addr=127.0.0.1",
                f"--master-port={_port()}",
                str(REPO / "tests" / "support" / "split_rank.py"),
                "group",
                srv.url,
                srv.endpoint,
                tmp,
            ]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            ranks = []
            for i in range(2 if not done.returncode else 0):
                with open(os.path.join(tmp, f"rank{i}.json")) as f:
                    ranks.append(json.load(f))
        if not ranks:
            rows.append([f"{count:,}", str(classes), "error", done.stderr.strip()[-200:]] + [""] * 5)
            continue
        asked = [len(x["requests"]) for x in ranks]
        rows.append(
            [
                f"{count:,}",
                str(classes),
                f"{delay * 1000:.0f}",
                str(asked[0]),
                str(asked[1]),
                str(sum(asked)),
                str(srv.requests),
                f"{max(x['wall_s'] for x in ranks):.2f}",
                f"{alone_wall:.2f} ({alone_requests})",
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    return rows


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- 4. a node's share of a big manifest ------------------------------------------------------------


def big_manifest(path: str, n: int, classes: int = 1000) -> int:
    """A manifest of ``n`` entries written a million rows at a time (its arrays on disk, not in memory):
    keys ``cKKKKK/IIIIIIIIIIII.jpg``, quoted 32-hex-digit ETags. Its size in bytes."""
    import numpy as np

    from blobdata._listing import Manifest

    key_len, id_len = 23, 34
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path))
    arrays = {
        "keys": np.lib.format.open_memmap(f"{tmp}/k.npy", "w+", np.uint8, (n * key_len,)),
        "ids": np.lib.format.open_memmap(f"{tmp}/i.npy", "w+", np.uint8, (n * id_len,)),
        "sizes": np.lib.format.open_memmap(f"{tmp}/s.npy", "w+", np.int64, (n,)),
        "targets": np.lib.format.open_memmap(f"{tmp}/t.npy", "w+", np.int32, (n,)),
    }

    def digits(v: Any, width: int, base: int = 10) -> Any:
        out = (v[:, None] // base ** np.arange(width - 1, -1, -1, dtype=np.int64)) % base
        return np.where(out < 10, out + 48, out + 87).astype(np.uint8)

    for lo in range(0, n, 1 << 20):
        i = np.arange(lo, min(n, lo + (1 << 20)), dtype=np.int64)
        cls = i * classes // n
        k = np.concatenate(
            [
                np.full((len(i), 1), 99, np.uint8),
                digits(cls, 5),
                np.full((len(i), 1), 47, np.uint8),
                digits(i, 12),
                np.frombuffer(b".jpg", np.uint8)[None, :].repeat(len(i), 0),
            ],
            axis=1,
        )
        h = (i * 0x2545F4914F6CDD1D) & 0x7FFFFFFFFFFFFFFF
        q = np.full((len(i), 1), 34, np.uint8)
        ids = np.concatenate([q, digits(h, 16, 16), digits(h ^ 0x5555, 16, 16), q], axis=1)
        arrays["keys"][lo * key_len : (lo + len(i)) * key_len] = k.ravel()
        arrays["ids"][lo * id_len : (lo + len(i)) * id_len] = ids.ravel()
        arrays["sizes"][lo : lo + len(i)] = 100_000 + i % 20_000
        arrays["targets"][lo : lo + len(i)] = cls
    m = Manifest.from_arrays(
        "s3://bench/flat",
        [f"c{c:05d}" for c in range(classes)],
        key_offsets=np.arange(n + 1, dtype=np.int64) * key_len,
        id_offsets=np.arange(n + 1, dtype=np.int64) * id_len,
        listed_at=0.0,
        **arrays,
    )
    m.save(path)
    del m, arrays
    for f in os.listdir(tmp):
        os.unlink(os.path.join(tmp, f))
    os.rmdir(tmp)
    return os.path.getsize(path)


def share_child(path: str, n: str, nnodes: str, node: str, how: str, home: str) -> dict[str, Any]:
    """Node ``node`` of ``nnodes`` reads every sample of its share of the manifest at ``path``: mapped
    whole (``whole``, the way before) or as a share cut from it (``share``); the pages of each file in
    the page cache afterwards (mincore), the file's cache dropped before."""
    import numpy as np

    from blobdata._listing import Manifest, cut_share
    from blobdata._sampling import node_share
    from tests.support.pages import drop_cached, resident_pages

    os.environ["BLOBDATA_CACHE_HOME"] = home
    rows = node_share(int(n), seed=0, nnodes=int(nnodes), node=int(node))
    drop_cached(path)
    t0 = time.perf_counter()
    if how == "whole":
        m: Any = Manifest.load(path)
        read = m
        idx = rows
    else:
        m = cut_share(path, rows, {"seed": 0, "nnodes": int(nnodes), "node": int(node)})
        share_files = [os.path.join(home, "shares", f) for f in os.listdir(os.path.join(home, "shares"))]
        drop_cached(share_files[0])  # as on a node where it was cut before: what is read comes in
        read, idx = m, rows
    cut_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    touched = int(np.asarray([read.size(int(i)) for i in idx[:: max(1, len(idx) // 200_000)]]).sum())
    touched += sum(len(read.relkey(int(i))) + len(read.identity(int(i))) + read.target(int(i)) for i in idx)
    read_s = time.perf_counter() - t0
    full = resident_pages(path)
    share_pages = resident_pages(share_files[0])[0] if how == "share" else 0
    fair = math.ceil(full[1] * len(rows) / int(n))
    return {
        "rows": len(rows),
        "manifest_pages": full[1],
        "manifest_resident": full[0],
        "share_resident": share_pages,
        "fair": fair,
        "cut_s": cut_s,
        "read_s": read_s,
        "touched": touched % 7,
    }


def share_part(n: int, nnodes: int, tmp: str | None) -> list[list[str]]:
    rows = []
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        path = os.path.join(d, "big.manifest")
        t0 = time.perf_counter()
        size = big_manifest(path, n)
        print(
            f"made a {n:,}-entry manifest of {size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        for how in ("share", "whole"):
            with tempfile.TemporaryDirectory(dir=d) as home:
                r = _client(["share", path, str(n), str(nnodes), "5", how, home])
            if "error" in r:
                rows.append([f"{n:,}", how, "error", str(r["error"])] + [""] * 5)
                continue
            touched = r["manifest_resident"] + r["share_resident"]
            rows.append(
                [
                    f"{n:,}",
                    f"{nnodes}",
                    how,
                    f"{r['rows']:,}",
                    str(r["fair"]),
                    str(r["manifest_resident"]),
                    str(r["share_resident"]),
                    f"{touched / r['fair']:.2f}x",
                    f"{r['cut_s']:.1f}",
                    f"{r['read_s']:.1f}",
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    return rows


# -- 5. end to end -----------------------------------------------------------------------------------


def e2e_part(count: int, classes: int, concurrency: int) -> list[list[str]]:
    """``load_or_list`` of ``count`` keys in ``classes`` folders: list, save, map; in a fresh process."""
    with server(count, 0.0, classes) as srv, tempfile.TemporaryDirectory() as home:
        r = _client(["memory", srv.url, srv.endpoint, str(concurrency), home])
    if "error" in r:
        return [[f"{count:,}", str(classes), "error", str(r["error"]), "", "", "", ""]]
    row = [
        f"{r['keys']:,}",
        str(classes),
        str(srv.requests),
        f"{r['wall_s']:.1f}",
        f"{r['cpu_s']:.1f}",
        f"{r['cpu_s'] * 1e6 / r['keys']:.2f}",
        f"{r['file_mib']:.0f}",
        f"{r['peak_mib']:.0f} ({r['peak_mib'] / r['file_mib']:.2f}x)",
    ]
    print(" | ".join(row), flush=True)
    return [row]


def main(argv: list[str]) -> None:
    part, *rest = argv
    if part == "server":
        server_child(*rest)
    elif part == "cpu":
        print(json.dumps(cpu_child(*rest)))
    elif part == "memory":
        print(json.dumps(memory_child(*rest)))
    elif part == "share":
        sys.path.insert(0, str(REPO))
        print(json.dumps(share_child(*rest)))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    main(sys.argv[1:])

"""The per-sample path's cost beside a plain Dataset: what blobdata's machinery adds to a read.

2,000 files of 20 KB in 8 class folders (``--files``, ``--size``), batches of 64 shuffled. Each path
reads every sample once per round; rounds are interleaved (A B C D, A B C D, ...) so that the
machine's noise falls on every path alike, and the median of ``--rounds`` is kept. Printed: CPU
microseconds per sample served (this process and its DataLoader workers, every thread, the S3
server excluded) and the ratio to the plain Dataset, for

- ``plain``     a 12-line torch ``Dataset`` that opens and reads each local file
- ``local``     ``FolderDataset(local folder).dataloader(...)``
- ``hit``       ``FolderDataset("s3://...", cache=...)``, every sample a cache hit
- ``get``       ``FolderDataset("s3://...")``, no cache, a local S3 server (round trip ~0)

``--decode``: each sample is decoded (the files are JPEGs; the plain Dataset decodes with PIL as
ImageFolder does), else a loader that returns ``len(f.read())`` so nothing is decoded. Both when
``--decode both`` (default). ``--workers 0 2`` (default): each worker count in turn; with workers,
the workers' CPU is read from /proc before and after each round (persistent workers, one iterator).

    python benchmarks/bench_overhead.py [--files 2000] [--size 20KB] [--rounds 5] [--workers 0 2]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common  # noqa: F401  (puts the repository on sys.path)

PATHS = ("plain", "local", "hit", "get")


def make_files(root: Path, n: int, size: int, classes: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """``n`` JPEGs of about ``size`` bytes (padded with a comment segment), ``classes`` folders."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out: list[tuple[str, bytes]] = []
    img = Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    base = buf.getvalue()
    for i in range(n):
        pad = max(0, size - len(base) - 4)
        seg = b""
        while pad > 0:  # COM segments of at most 65533 bytes after SOI
            k = min(pad, 65533)
            seg += b"\xff\xfe" + (k + 2).to_bytes(2, "big") + bytes([i % 251]) * k
            pad -= k + 4
        data = base[:2] + seg + base[2:]
        key = f"train/c{i % classes}/img{i:06d}.jpg"
        out.append((key, data))
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return out


def read_len(f: Any) -> int:
    return len(f.read())


def pil_loader(f: Any) -> Any:
    from PIL import Image

    return Image.open(f).convert("RGB")


def first_pixel_sum(img: Any) -> int:
    return int(img.size[0])


class PlainDataset:
    """What users write without blobdata: ImageFolder's walk, then open and read per sample."""

    def __init__(self, root: str, decode: bool) -> None:
        self.decode = decode
        self.samples = []
        for ci, c in enumerate(sorted(os.listdir(root))):
            for name in sorted(os.listdir(os.path.join(root, c))):
                self.samples.append((os.path.join(root, c, name), ci))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[int, int]:
        path, target = self.samples[i]
        with open(path, "rb") as f:
            return (first_pixel_sum(pil_loader(f)) if self.decode else len(f.read())), target


def cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) of the processes ``pids`` so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


class Runner:
    """One path's loader, iterated one epoch per round (persistent workers keep their CPU counters)."""

    def __init__(self, name: str, make: Callable[[], Any], workers: int) -> None:
        self.name = name
        self.workers = workers
        self.loader = make()
        self.samples = 0
        self._it: Iterator[Any] | None = None

    def _worker_pids(self) -> list[int]:
        import psutil

        return [c.pid for c in psutil.Process().children() if c.name().startswith(("python", "pt_"))]

    def round(self) -> float:
        """CPU microseconds per sample of one epoch (this process plus its workers)."""
        pids = [os.getpid(), *self._worker_pids()]
        c0 = cpu_of(pids) if self.workers else time.process_time()
        n = 0
        for batch in self.loader:
            n += len(batch[1])
        pids = [os.getpid(), *self._worker_pids()]
        c1 = cpu_of(pids) if self.workers else time.process_time()
        self.samples = n
        return (c1 - c0) * 1e6 / n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", default="20KB")
    parser.add_argument("--classes", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--decode", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = parser.parse_args()

    import torch
    from torch.utils.data import DataLoader

    from blobdata import FolderDataset
    from blobdata._config import parse_size
    from blobdata.testing import LocalS3Server, s3_client, upload

    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    files = make_files(work / "data", args.files, size, args.classes)
    root = str(work / "data" / "train")
    print(f"{len(files)} files of {size} bytes in {args.classes} folders, batches of {args.batch_size}, "
          f"shuffled; CPU us per sample served (median of {args.rounds} interleaved rounds), "
          f"load {os.getloadavg()[0]:.2f}")
    server = None
    if {"hit", "get"} & set(args.paths):
        server = LocalS3Server()
        server.start()
        server.create_bucket("bench")
        upload(s3_client(server), "bench", files)
    try:
        for decode in {"no": [False], "yes": [True], "both": [False, True]}[args.decode]:
            loader_fn = pil_loader if decode else read_len
            transform = first_pixel_sum if decode else None
            for workers in args.workers:
                kw: dict[str, Any] = dict(batch_size=args.batch_size, shuffle=True, num_workers=workers,
                                          generator=torch.Generator())  # fmt: skip
                if workers:
                    kw["persistent_workers"] = True

                def plain(kw: dict[str, Any] = kw, decode: bool = decode) -> Any:
                    return DataLoader(PlainDataset(root, decode), **kw)  # type: ignore[arg-type]

                def local(kw: dict[str, Any] = kw, lf: Any = loader_fn, tf: Any = transform) -> Any:
                    return FolderDataset(root, loader=lf, transform=tf).dataloader(**kw)

                cache_dir = work / f"cache-{decode}-{workers}"

                def hit(
                    kw: dict[str, Any] = kw, lf: Any = loader_fn, tf: Any = transform, c: Path = cache_dir
                ) -> Any:
                    assert server is not None
                    ds = FolderDataset("s3://bench/train", loader=lf, transform=tf,
                                       storage_options=server.storage_options, cache=str(c))  # fmt: skip
                    for _ in ds.dataloader(batch_size=64):  # fills the cache
                        pass
                    ds.close()  # its cache writes flushed
                    return ds.dataloader(**kw)

                def get(kw: dict[str, Any] = kw, lf: Any = loader_fn, tf: Any = transform) -> Any:
                    assert server is not None
                    ds = FolderDataset("s3://bench/train", loader=lf, transform=tf,
                                       storage_options=server.storage_options)  # fmt: skip
                    return ds.dataloader(**kw)

                makers = {"plain": plain, "local": local, "hit": hit, "get": get}
                runners = [Runner(p, makers[p], workers) for p in args.paths]
                for r in runners:  # warm-up: workers started, connections open, page cache warm
                    r.round()
                got: dict[str, list[float]] = {r.name: [] for r in runners}
                for _ in range(args.rounds):
                    for r in runners:
                        got[r.name].append(r.round())
                base = statistics.median(got["plain"]) if "plain" in got else None
                print(f"\ndecode={'yes' if decode else 'no'} num_workers={workers}")
                print(f"  {'path':<8}{'us/sample':>11}{'x plain':>9}   rounds")
                for r in runners:
                    med = statistics.median(got[r.name])
                    ratio = f"{med / base:8.2f}x" if base else "       -"
                    spread = " ".join(f"{x:.0f}" for x in got[r.name])
                    print(f"  {r.name:<8}{med:>11.1f}{ratio}   {spread}")
                del runners
    finally:
        if server is not None:
            server.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

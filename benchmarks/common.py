"""Shared pieces of the benchmarks: the synthetic dataset on local disk, the per-sample work, CPU meters.

The dataset is generated once per (images, classes, seed) under ``bench-data/`` (gitignored) and reused
by later runs: the JPEG folder ``train/nXXXXXXXX/*.JPEG`` exactly as uploaded to the bucket, and the same
samples packed as WebDataset tar shards ``shards/train-NNNNNN.tar`` (about ``SHARD_BYTES`` each, samples
in a shuffled order, as WebDataset's own tools write them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import random
import resource
import shutil
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_DATA = REPO / "bench-data"
# WebDataset's docs suggest shards of 100 MB-1 GB for large corpora; a benchmark of a few thousand
# images needs several shards per DataLoader worker, so 30 MB (~340 of these JPEGs) is used here.
SHARD_BYTES = 30 * 10**6
IMAGE_PREFIX = "train"
SHARD_PREFIX = "shards"


def add_repo_to_path() -> None:
    """Make ``blobdata`` and ``tests.support`` importable when run as ``python benchmarks/x.py``."""
    for p in (str(REPO), str(REPO / "benchmarks")):
        if p not in sys.path:
            sys.path.insert(0, p)


add_repo_to_path()


@dataclasses.dataclass(frozen=True)
class LocalDataset:
    """The generated dataset on local disk. Keys are relative to ``root`` and equal the bucket keys."""

    root: Path
    keys: list[str]
    sizes: list[int]
    classes: list[str]
    shard_keys: list[str]
    shard_sizes: list[int]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def label(self, key: str) -> int:
        """Class index of a key or URL ``.../<class>/<file>`` (classes sorted, as ImageFolder does)."""
        return self.classes.index(key.rsplit("/", 2)[-2])

    def items(self) -> Iterator[tuple[str, bytes]]:
        """``(key, bytes)`` of every image and shard, for upload."""
        for key in [*self.keys, *self.shard_keys]:
            yield key, (self.root / key).read_bytes()


def prepare_dataset(images: int, classes: int, *, seed: int = 0, log: Any = print) -> LocalDataset:
    """Generate (or reuse) ``images`` synthetic JPEGs in ``classes`` classes and their WebDataset shards."""
    from blobdata.testing import synthetic_dataset

    root = BENCH_DATA / f"synth-{images}x{classes}-seed{seed}"
    index = root / "index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        return LocalDataset(root=root, **meta)
    if root.exists():
        shutil.rmtree(root)  # an interrupted earlier generation
    t0 = time.perf_counter()
    keys, sizes = [], []
    for key, data in synthetic_dataset(images, classes, seed=seed, prefix=IMAGE_PREFIX):
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        keys.append(key)
        sizes.append(len(data))
    class_names = sorted({k.split("/")[1] for k in keys})
    shard_keys, shard_sizes = _write_shards(root, keys, sizes, seed)
    meta = {
        "keys": keys,
        "sizes": sizes,
        "classes": class_names,
        "shard_keys": shard_keys,
        "shard_sizes": shard_sizes,
    }
    tmp = index.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, index)  # written last: its presence means the folder is complete
    log(
        f"generated {images} JPEGs ({sum(sizes) / 1e6:.0f} MB) and {len(shard_keys)} WebDataset shards "
        f"under {root} in {time.perf_counter() - t0:.0f}s"
    )
    return LocalDataset(root=root, **meta)


def _write_shards(root: Path, keys: list[str], sizes: list[int], seed: int) -> tuple[list[str], list[int]]:
    """Pack the samples into tar shards of about SHARD_BYTES, a multiple of 4 shards (even worker split)."""
    order = list(range(len(keys)))
    random.Random(seed).shuffle(order)
    n_shards = max(4, 4 * math.ceil(sum(sizes) / SHARD_BYTES / 4))
    per = math.ceil(len(keys) / n_shards)
    class_names = sorted({k.split("/")[1] for k in keys})
    (root / SHARD_PREFIX).mkdir(parents=True, exist_ok=True)
    shard_keys, shard_sizes = [], []
    for s in range(n_shards):
        chunk = order[s * per : (s + 1) * per]
        if not chunk:
            break
        key = f"{SHARD_PREFIX}/{IMAGE_PREFIX}-{s:06d}.tar"
        with tarfile.open(root / key, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in chunk:
                stem = keys[i].rsplit("/", 1)[1].rsplit(".", 1)[0]  # n00000003_17: no dots, unique
                label = str(class_names.index(keys[i].split("/")[1])).encode()
                for ext, payload in (("jpg", (root / keys[i]).read_bytes()), ("cls", label)):
                    info = tarfile.TarInfo(f"{stem}.{ext}")
                    info.size, info.mode, info.mtime = len(payload), 0o444, 0
                    tar.addfile(info, io.BytesIO(payload))
        shard_keys.append(key)
        shard_sizes.append((root / key).stat().st_size)
    return shard_keys, shard_sizes


class SampleWork:
    """The per-sample work every system does: Pillow decode to RGB, then ``TrainTransform(224)``."""

    def __init__(self, size: int = 224) -> None:
        from blobdata.testing import TrainTransform

        self.transform = TrainTransform(size)

    def __call__(self, data: bytes) -> Any:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
        return self.transform(rgb)


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its reaped children (DataLoader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def process_cpu_seconds(pid: int | None) -> float:
    """CPU seconds of another process (the S3 server), or NaN when it cannot be read."""
    if pid is None:
        return math.nan
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except Exception:
        return math.nan


def fmt(value: float | None, spec: str = ".0f", missing: str = "-") -> str:
    """Format a number for a table cell; None and NaN print as ``missing``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return format(value, spec)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table, first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        out = [str(cells[0]).ljust(widths[0])]
        out += [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


# -- CPU placement: the system under test apart from the server and the proxy -------------------------


def parse_cpus(text: str | None) -> set[int] | None:
    """``"0-7,12"`` -> {0, ..., 7, 12}; None for None or an empty string."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def place_cpus(
    client: set[int] | None, server: set[int] | None
) -> tuple[set[int] | None, set[int] | None, str]:
    """Clamp the asked CPU sets to this machine's and say what the placement is (one line)."""
    have = set(os.sched_getaffinity(0))
    if client is None and server is None:
        return None, None, f"no CPU pinning: the server, the proxy and the client share {len(have)} cores"
    c = (client & have) or have if client is not None else have
    s = (server & have) or have if server is not None else have
    note = f"client on CPUs {sorted(c)}, S3 server and proxy on CPUs {sorted(s)}"
    if c & s:
        note += f" - this machine has {len(have)} cores, so the server SHARES the client's cores"
    return c, s, note


def pin_tree(pid: int, cpus: set[int]) -> int:
    """Pin ``pid`` and every descendant (by /proc) to ``cpus``; returns how many processes were pinned."""
    pinned, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            os.sched_setaffinity(p, cpus)
            pinned += 1
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
    return pinned

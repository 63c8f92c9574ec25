"""A forked worker that indexes a 1,000,000-sample dataset does not copy the sample table."""

from __future__ import annotations

import gc
import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil
import pytest

from blobdata import FolderDataset, Manifest

N = 1_000_000
CLASSES = 1000


def _synthetic_manifest(root: str) -> Manifest:
    per = N // CLASSES
    classes = [f"n{c:08d}" for c in range(CLASSES)]
    rel = [f"{classes[i // per]}/{classes[i // per]}_{i:07d}.JPEG" for i in range(N)]
    encoded = "".join(rel).encode()
    lengths = np.fromiter((len(s) for s in rel), dtype=np.int64, count=N)
    key_offsets = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(lengths, out=key_offsets[1:])
    ident = b"d41d8cd98f00b204e9800998ecf8427e" * N
    return Manifest.from_arrays(
        root,
        classes,
        keys=np.frombuffer(encoded, dtype=np.uint8),
        key_offsets=key_offsets,
        sizes=np.full(N, 110_000, dtype=np.int64),
        targets=np.repeat(np.arange(CLASSES, dtype=np.int32), per),
        ids=np.frombuffer(ident, dtype=np.uint8),
        id_offsets=np.arange(N + 1, dtype=np.int64) * 32,
        listed_at=time.time(),
    )


def _uss() -> int:
    """The process's private dirty memory (bytes): what a copy of the table grows (a page written after
    the fork becomes the child's own). Not all of its USS, which also counts the clean pages of the
    mapped manifest that only this process has touched: page cache, shared with any process that maps
    the file, not a copy (the parent no longer reads the manifest's arrays to load it)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) * 1024
    return int(psutil.Process().memory_full_info().uss)


def _index_everything(table: Any, conn: Connection) -> None:
    """Runs in the forked child: touch every sample the way a worker does, report USS growth."""
    gc.collect()
    before = _uss()
    checksum = 0
    if isinstance(table, FolderDataset):
        samples, manifest = table.samples, table.manifest
        for i in range(N):
            path, target = samples[i]
            checksum += len(path) + target + manifest.size(i) + len(manifest.identity(i))
    else:
        for path, target in table:
            checksum += len(path) + target
    gc.collect()
    conn.send((_uss() - before, checksum))
    conn.close()


def _growth_in_fork(table: Any) -> tuple[int, int]:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_index_everything, args=(table, child))
    proc.start()
    child.close()
    assert parent.poll(240), "the forked indexer did not answer in time"
    growth, checksum = parent.recv()
    proc.join(30)
    return int(growth), int(checksum)


@pytest.mark.slow
def test_forked_worker_memory_stays_flat_over_a_million_samples(tmp_path: Any) -> None:
    path = tmp_path / "big.manifest"
    _synthetic_manifest("memory:///big").save(path)
    ds = FolderDataset("memory://big", manifest=str(path))
    assert len(ds) == N and len(ds.classes) == CLASSES

    growth, checksum = _growth_in_fork(ds)
    # The same table as ImageFolder holds it: a list of (path, class) tuples of Python objects.
    as_tuples = [(f"memory:///big/{p}", t) for p, t in ds.samples[: N // 4]] * 4
    tuple_growth, _ = _growth_in_fork(as_tuples)
    print(
        f"\nprivate memory a forked worker grew reading {N:,} samples: blobdata {growth / 2**20:.1f} MiB; "
        f"a list of tuples (ImageFolder-style) {tuple_growth / 2**20:.1f} MiB"
    )
    assert checksum > 0
    assert growth < 24 * 2**20, f"the worker grew by {growth / 2**20:.1f} MiB while indexing"
    # the measurement can see copy-on-access: the Python-object table does grow
    assert tuple_growth > 4 * max(growth, 2**20)

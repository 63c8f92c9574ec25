"""A local manifest is mapped read-only, not read: its arrays are views of the file, processes that load
it do not grow by its size in anonymous memory, its checksum is verified once per file and node (and
again when the file changes, even with its modification time put back), and a manifest replaced
while mapped leaves the mapping whole."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobdata import ManifestError
from blobdata._listing import Manifest
from blobdata._listing import mapping as _mapping

ROOT = Path(__file__).resolve().parents[2]


def _manifest(n: int, seed: int = 0) -> Manifest:
    """``n`` entries with fixed-width keys and ids, built with numpy."""
    i = np.arange(n, dtype=np.int64) + seed
    digits = ((i[:, None] // 10 ** np.arange(9, -1, -1)) % 10 + 48).astype(np.uint8)
    keys = np.concatenate([np.full((n, 3), ord("c"), np.uint8), digits], axis=1)  # "ccc0000000042"
    ids = np.concatenate([digits, digits, digits], axis=1)
    return Manifest.from_arrays(
        "s3://b/ds", ["c0", "c1"], keys=keys.ravel(), key_offsets=np.arange(n + 1) * 13,
        sizes=i * 3, targets=(i % 2).astype(np.int32), ids=ids.ravel(), id_offsets=np.arange(n + 1) * 30,
        listed_at=1.0,
    )  # fmt: skip


def _base(a: np.ndarray) -> Any:
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a.obj if isinstance(a, memoryview) else a


def test_a_local_manifest_is_a_read_only_view_of_its_file(tmp_path: Path) -> None:
    m = _manifest(1000)
    m.save(tmp_path / "m.manifest")
    got = Manifest.load(tmp_path / "m.manifest")
    assert isinstance(_base(got.sizes), mmap.mmap) and isinstance(_base(got._keys), mmap.mmap)
    assert not got.sizes.flags.writeable
    assert got.relkey(42) == "ccc0000000042" and got.identity(7) == "0000000007" * 3
    assert (got.sizes == m.sizes).all() and got.to_bytes() == m.to_bytes()
    with pytest.raises(ValueError, match="read-only"):
        got.sizes[0] = 1


def test_the_checksum_is_verified_once_per_file_and_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.manifest"
    path.write_bytes(_manifest(500).to_bytes())  # a file this node did not write (copied in)
    calls: list[int] = []
    crc32 = zlib.crc32

    def counting(data: Any, *args: Any) -> int:
        calls.append(len(data))
        return crc32(data, *args)

    monkeypatch.setattr(zlib, "crc32", counting)
    Manifest.load(path)
    assert len(calls) == 1  # the first load of this file on this node verifies it
    _, mark = _mapping.read_source(str(path), None)
    directory = _mapping._marks_dir()
    assert directory is not None and mark is not None
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(directory, mark)).st_mode & 0o777 == 0o600
    for _ in range(3):
        Manifest.load(path)
    assert len(calls) == 1  # the others find the marker
    # The same bytes in another file (another inode) are verified again.
    copy = tmp_path / "copy.manifest"
    copy.write_bytes(path.read_bytes())
    Manifest.load(copy)
    assert len(calls) == 2
    # A manifest saved on this node is marked by its writer, which summed every byte it wrote: no load
    # reads it whole again (save() sums as it writes: those calls are its own).
    saved = tmp_path / "saved.manifest"
    _manifest(500).save(saved)
    written = len(calls)
    Manifest.load(saved)
    assert len(calls) == written


def test_a_file_changed_in_place_is_verified_again(tmp_path: Path) -> None:
    path = tmp_path / "m.manifest"
    _manifest(500).save(path)
    Manifest.load(path)  # verified, marked
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a byte of the last array, the same size
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its modification time put back
    with pytest.raises(ManifestError, match="checksum mismatch"):
        Manifest.load(path)


def test_a_manifest_replaced_while_mapped_stays_whole(tmp_path: Path) -> None:
    path = tmp_path / "m.manifest"
    _manifest(300).save(path)
    old = Manifest.load(path)
    _manifest(200, seed=5000).save(path)  # a temporary file renamed over it, as blobdata writes
    assert len(old) == 300 and old.relkey(299) == "ccc0000000299" and int(old.sizes[299]) == 897
    new = Manifest.load(path)
    assert len(new) == 200 and new.relkey(0) == "ccc0000005000"


def test_publish_writes_a_file_once(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "job.manifest"
    _mapping.publish(path, b"first")
    inode = path.stat().st_ino
    _mapping.publish(path, b"first")  # another rank of the node, later: the file stays
    assert path.stat().st_ino == inode and path.read_bytes() == b"first"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["job.manifest"]  # no temporary file left


_CHILD = """
import json, sys
import numpy as np
from blobdata._listing import Manifest
def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
before = kb("RssAnon")
m = Manifest.load(sys.argv[1])
total = sum(int(np.add.reduce(a.view(np.uint8), dtype=np.uint64)) for a in m._arrays().values())
keys = [m.relkey(j) for j in range(0, len(m), 997)]
print(json.dumps({"anon_kb": kb("RssAnon") - before, "n": len(m), "keys": len(keys)}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")
@pytest.mark.timeout(300)
def test_processes_over_one_manifest_share_it(tmp_path: Path) -> None:
    """4 processes load one 1 M-entry manifest and touch every byte of it: each grows by at most 15% of
    the file in anonymous memory (reading it, as before, grew each by all of it)."""
    path = tmp_path / "big.manifest"
    _manifest(1_000_000).save(path)
    size = path.stat().st_size
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(4)
    ]
    outs = [json.loads(p.communicate(timeout=280)[0]) for p in procs]
    assert all(o["n"] == 1_000_000 for o in outs)
    for o in outs:
        assert o["anon_kb"] * 1024 <= 0.15 * size, (o, size)

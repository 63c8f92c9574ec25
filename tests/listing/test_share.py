"""A node's share of a manifest, kept alone (blobdata._listing.job.share): the share's entries are the
manifest's, nothing else is answered, and a node that maps its share of a big manifest has about its
share of the manifest's pages in the page cache (mincore), where mapping the manifest would bring in
most of it."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from blobdata import ConfigError, FolderDataset, ManifestError, PartitionedSampler
from blobdata._listing import Manifest, cut_share, share_in_memory
from blobdata._sampling import node_share
from blobdata.testing import SyntheticListServer
from tests.support.pages import drop_cached, resident_pages


def _manifest(path: Path, n: int, classes: int = 100) -> Manifest:
    """``n`` entries shaped like a bucket's (keys ``cKKK/IIIIIIIII.jpg``, 32-digit identities), built with
    numpy and saved at ``path``; the saved file, mapped."""
    i = np.arange(n, dtype=np.int64)
    cls = i * classes // n

    def digits(v: np.ndarray, width: int) -> np.ndarray:
        return ((v[:, None] // 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)) % 10 + 48).astype(np.uint8)

    keys = np.concatenate(
        [
            np.full((n, 1), ord("c"), np.uint8),
            digits(cls, 3),
            np.full((n, 1), 47, np.uint8),
            digits(i, 9),
            np.frombuffer(b".jpg", np.uint8)[None, :].repeat(n, 0),
        ],
        axis=1,
    )
    ids = np.concatenate([digits(i * 7919 % 10**16, 16), digits(i * 104729 % 10**16, 16)], axis=1)
    Manifest.from_arrays(
        "s3://bench/share",
        [f"c{c:03d}" for c in range(classes)],
        keys=keys.ravel(),
        key_offsets=np.arange(n + 1, dtype=np.int64) * keys.shape[1],
        sizes=1000 + i % 5000,
        targets=cls.astype(np.int32),
        ids=ids.ravel(),
        id_offsets=np.arange(n + 1, dtype=np.int64) * 32,
        listed_at=1.0,
    ).save(path)
    return Manifest.load(path)


@pytest.fixture(autouse=True)
def _own_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOBDATA_CACHE_HOME", str(tmp_path / "cache"))


def test_a_share_answers_its_samples_as_the_manifest_and_refuses_the_others(tmp_path: Path) -> None:
    n = 50_000
    m = _manifest(tmp_path / "m.manifest", n)
    rows = node_share(n, seed=7, nnodes=4, node=2)
    spec = {"seed": 7, "nnodes": 4, "node": 2}
    share = cut_share(str(tmp_path / "m.manifest"), rows, spec, verified=lambda: False)
    assert len(share) == n and len(share.rows) == len(rows) and share.spec["node"] == 2
    for i in rows[::97].tolist():
        assert (share.url(i), share.identity(i), share.size(i), share.target(i)) == (
            m.url(i),
            m.identity(i),
            m.size(i),
            m.target(i),
        )
    assert np.array_equal(share.sizes[rows[:50]], m.sizes[rows[:50]])
    outside = int(np.setdiff1d(np.arange(n), rows)[0])
    with pytest.raises(ConfigError, match="not in this node's share"):
        share.url(outside)
    with pytest.raises(ConfigError, match="only this node's"):
        np.asarray(share.targets)
    # The same share from a manifest in memory, and cut again: the file already cut is used.
    in_memory = Manifest.from_bytes(m.to_bytes())
    assert share_in_memory(in_memory, rows, spec).local._arrays().keys() == share.local._arrays().keys()
    for name, array in share_in_memory(in_memory, rows, spec).local._arrays().items():
        assert np.array_equal(array, share.local._arrays()[name]), name
    before = os.stat(next((tmp_path / "cache" / "shares").iterdir())).st_ino
    cut_share(str(tmp_path / "m.manifest"), rows, spec)
    assert os.stat(next((tmp_path / "cache" / "shares").iterdir())).st_ino == before


def test_a_share_of_a_corrupt_manifest_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.manifest"
    _manifest(path, 20_000)
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF
    bad = tmp_path / "bad.manifest"
    bad.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="checksum"):
        cut_share(str(bad), node_share(20_000, seed=0, nnodes=2, node=0), {"seed": 0})


def test_a_node_maps_about_its_share_of_a_big_manifest(tmp_path: Path) -> None:
    """1 M entries, node 5 of 16: the pages of the manifest and of the share file in the page cache
    after every sample of the share was read, against the share's part of the manifest's pages."""
    n, nnodes = 1_000_000, 16
    path = tmp_path / "big.manifest"
    m = _manifest(path, n)
    rows = node_share(n, seed=0, nnodes=nnodes, node=5)
    fair = math.ceil(resident_pages(str(path))[1] * len(rows) / n)  # the share's part of the manifest
    # The way before: the manifest mapped, the share's samples read: most of its pages come in.
    drop_cached(str(path))
    touched = int(m.sizes[rows].sum()) + int(m.targets[rows].sum())
    touched += sum(len(m.relkey(int(i))) + len(m.identity(int(i))) for i in rows[::4])
    mapped_whole = resident_pages(str(path))[0]
    assert mapped_whole > 4 * fair
    del m
    # The share: cut from the file (its pages dropped behind the read), mapped, every sample read.
    drop_cached(str(path))
    share = cut_share(str(path), rows, {"seed": 0, "nnodes": nnodes, "node": 5}, verified=lambda: True)
    shares = list((tmp_path / "cache" / "shares").iterdir())
    drop_cached(str(shares[0]))  # as on a node where it was cut earlier: only what is read comes in
    total = sum(int(np.add.reduce(a.view(np.uint8), dtype=np.uint64)) for a in share.local._arrays().values())
    total += int(share.rows.sum()) + touched
    assert total > 0
    for i in rows[:: len(rows) // 1000].tolist():
        assert share.url(i).endswith(".jpg") and share.identity(i)
    in_cache = resident_pages(str(path))[0] + resident_pages(str(shares[0]))[0]
    assert in_cache <= 2 * fair, (in_cache, fair, mapped_whole)


def test_a_folder_dataset_keeps_its_nodes_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 2 of 4 (torchrun's variables, one rank a node): the dataset maps its share; PartitionedSampler
    of that node reads only it; one of another seed, or with mix, is refused."""
    for name, value in {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "2",
    }.items():
        monkeypatch.setenv(name, value)
    with SyntheticListServer(count=6_000, classes=3) as server:
        ds = FolderDataset(
            server.url, storage_options=server.storage_options, share_listing=False, node_share=True
        )
        whole = FolderDataset(server.url, storage_options=server.storage_options, share_listing=False)
    assert len(ds) == len(whole) == 6_000 and ds.node_share == {
        "seed": 0,
        "nnodes": 4,
        "node": 2,
        "source": ds.node_share["source"],
    }
    sampler = PartitionedSampler(ds, nproc_per_node=1)
    got = np.asarray(list(sampler))
    share = node_share(6_000, seed=0, nnodes=4, node=2)
    assert np.isin(got, share).all()
    for i in got[:20].tolist():
        assert ds.manifest.url(i) == whole.manifest.url(i) and ds.manifest.size(i) == whole.manifest.size(i)
    with pytest.raises(ConfigError, match="node_share"):
        PartitionedSampler(ds, nproc_per_node=1, seed=1)
    with pytest.raises(ConfigError, match="node_share"):
        PartitionedSampler(ds, nproc_per_node=1, mix=0.1)

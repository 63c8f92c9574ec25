"""Manifest: exact round trips, atomic private files, corruption detection, and its size at 1M samples."""

from __future__ import annotations

import json
import os
import stat
import struct
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blobdata._errors import ManifestError, NotFound
from blobdata._listing import Manifest, manifest_path
from blobdata._stores.options import options_token

ROOT = "s3://bucket/imagenet/train"


def small() -> Manifest:
    entries = [
        ("n01/a b+c.JPEG", 10, "etag1", 0),
        ("n01/sub/Ünï.jpg", 0, "etag2@v9", 0),
        ("n02/x//y/../z.png", 2**40, "", 1),
    ]
    return Manifest.from_entries(
        ROOT, ["n01", "n02"], entries, listed_at=1700000000.5, skipped=[ROOT + "//q.jpg"]
    )


def assert_same(a: Manifest, b: Manifest) -> None:
    assert (a.root, a.classes, len(a), a.listed_at, a.skipped) == (
        b.root,
        b.classes,
        len(b),
        b.listed_at,
        b.skipped,
    )
    assert [a.relkey(i) for i in range(len(a))] == [b.relkey(i) for i in range(len(b))]
    assert [a.identity(i) for i in range(len(a))] == [b.identity(i) for i in range(len(b))]
    assert np.array_equal(a.sizes, b.sizes) and np.array_equal(a.targets, b.targets)


def test_accessors() -> None:
    m = small()
    assert len(m) == 3
    assert m.relkey(0) == "n01/a b+c.JPEG"
    assert m.url(0) == ROOT + "/n01/a b+c.JPEG"
    assert m.url(2) == ROOT + "/n02/x//y/../z.png"  # never normalised
    assert m.url(-1) == m.url(2)
    assert m.identity(1) == "etag2@v9" and m.identity(2) == ""
    assert m.size(2) == 2**40 and m.sizes.dtype == np.int64 and m.targets.dtype == np.int32
    assert m.class_counts() == [2, 1] and m.class_to_idx == {"n01": 0, "n02": 1}
    with pytest.raises(IndexError):
        m.relkey(3)


def test_save_load_atomic_private(tmp_path: Path) -> None:
    m = small()
    path = tmp_path / "new" / "deeper" / "x.manifest"
    m.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700
    assert os.listdir(path.parent) == ["x.manifest"]  # no temp file left behind
    assert_same(Manifest.load(path, expect_root=ROOT), m)
    m.save(path)  # replacing an existing file
    assert_same(Manifest.load(str(path)), m)


def test_load_by_url() -> None:
    fs = fsspec.filesystem("memory")
    url = f"memory://manifests-{uuid.uuid4().hex}/train.manifest"
    fs.pipe(url[len("memory://") :], small().to_bytes())
    try:
        assert_same(Manifest.load(url, expect_root=ROOT), small())
        with pytest.raises(NotFound):
            Manifest.load(url + ".missing")
    finally:
        fs.rm(url[len("memory://") :])


def test_no_pickle_in_the_file(tmp_path: Path) -> None:
    data = small().to_bytes()
    assert b"\x80\x04" not in data[:24] and data[:8] == b"BLOBMANI"
    head_len = struct.unpack_from("<Q", data, 12)[0]
    header = json.loads(data[24 : 24 + head_len])
    assert header["root"] == ROOT and header["count"] == 3 and header["format"] == 1


def _expect_error(tmp_path: Path, data: bytes, what: str, **kwargs: Any) -> None:
    path = tmp_path / "bad.manifest"
    path.write_bytes(data)
    with pytest.raises(ManifestError, match=what) as err:
        Manifest.load(path, **kwargs)
    assert str(path) in str(err.value)


def test_corrupt_truncated_foreign(tmp_path: Path) -> None:
    good = small().to_bytes()
    _expect_error(tmp_path, b"", "too short")
    _expect_error(tmp_path, b"PK\x03\x04" + bytes(100), "magic")
    _expect_error(tmp_path, json.dumps({"root": ROOT}).encode(), "magic")
    _expect_error(tmp_path, good[:-1], "corrupt or truncated")
    _expect_error(tmp_path, good + b"\x00", "corrupt or truncated")
    _expect_error(tmp_path, good[:30], "truncated")
    for pos in (30, len(good) // 2, len(good) - 1):
        flipped = bytearray(good)
        flipped[pos] ^= 0x01
        _expect_error(tmp_path, bytes(flipped), "checksum")
    newer = bytearray(good)
    struct.pack_into("<I", newer, 8, 99)
    _expect_error(tmp_path, bytes(newer), "version 99")
    _expect_error(tmp_path, good, "not s3://bucket/val", expect_root="s3://bucket/val")


def test_inconsistent_arrays_refused() -> None:
    with pytest.raises(ManifestError, match="targets"):
        Manifest.from_entries(ROOT, ["a"], [("a/x.jpg", 1, "e", 1)], listed_at=0)
    with pytest.raises(ManifestError, match="offsets"):
        Manifest.from_arrays(
            ROOT, ["a"], keys=b"abc", key_offsets=[0, 5], sizes=[1], targets=[0], ids=b"", id_offsets=[0, 0],
            listed_at=0,
        )  # fmt: skip


def test_manifest_path(isolated_cache_home: Any) -> None:
    a = manifest_path(ROOT, options_token("s3", {"endpoint_url": "http://x"}), {"extensions": [".jpg"]})
    assert a.parent == Path(isolated_cache_home) / "manifests"
    assert a == manifest_path(
        ROOT, options_token("s3", {"endpoint_url": "http://x"}), {"extensions": [".jpg"]}
    )
    assert a != manifest_path(
        ROOT, options_token("s3", {"endpoint_url": "http://y"}), {"extensions": [".jpg"]}
    )
    assert a != manifest_path(
        ROOT, options_token("s3", {"endpoint_url": "http://x"}), {"extensions": [".png"]}
    )
    assert a != manifest_path(
        ROOT + "2", options_token("s3", {"endpoint_url": "http://x"}), {"extensions": [".jpg"]}
    )
    assert "http" not in a.name


_text = st.text(st.characters(codec="utf-8"), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    classes=st.lists(
        st.text(min_size=1, max_size=8).filter(lambda c: "/" not in c), min_size=1, max_size=4, unique=True
    ),
    rows=st.lists(st.tuples(_text, st.integers(0, 2**62), _text, st.integers(0, 3)), max_size=30),
    skipped=st.lists(_text, max_size=3),
    listed_at=st.floats(0, 2e9),
)
def test_round_trip_property(
    classes: list[str], rows: list[tuple[str, int, str, int]], skipped: list[str], listed_at: float
) -> None:
    classes = sorted(classes)
    entries = [(k, s, i, t % len(classes)) for k, s, i, t in rows]
    m = Manifest.from_entries("gs://b/p", classes, entries, listed_at=listed_at, skipped=skipped)
    back = Manifest.from_bytes(m.to_bytes(), source="mem")
    assert_same(back, m)
    assert [
        (back.relkey(i), back.size(i), back.identity(i), int(back.targets[i])) for i in range(len(back))
    ] == entries
    assert [back.url(i) for i in range(len(back))] == ["gs://b/p/" + e[0] for e in entries]


def test_surrogate_escaped_local_names_round_trip() -> None:
    name = os.fsdecode(b"cls/caf\xe9.jpg")  # a Latin-1 file name on a UTF-8 system
    m = Manifest.from_entries("file:///d", ["cls"], [(name, 1, "1-1", 0)], listed_at=0)
    assert Manifest.from_bytes(m.to_bytes()).relkey(0) == name


# -- a 1,000,000-sample manifest: build, save, load; size and time --------------------------------


def synthetic_manifest(n: int = 1_000_000, n_classes: int = 1000) -> Manifest:
    """ImageNet-shaped keys ("n00000123/n00000123_000042.JPEG") and 32-hex ETags, built as arrays."""
    classes = [f"n{c:08d}" for c in range(n_classes)]
    targets = (np.arange(n, dtype=np.int64) * n_classes // n).astype(np.int32)
    key_len = 9 + 1 + 9 + 1 + 6 + 5
    keys = np.frombuffer(
        "".join(f"{classes[t]}/{classes[t]}_{i:06d}.JPEG" for i, t in enumerate(targets.tolist())).encode(),
        np.uint8,
    )
    ids = np.frombuffer(np.random.default_rng(0).integers(48, 58, n * 32, dtype=np.uint8).tobytes(), np.uint8)
    return Manifest.from_arrays(
        "s3://bucket/imagenet/train",
        classes,
        keys=keys,
        key_offsets=np.arange(n + 1, dtype=np.int64) * key_len,
        sizes=np.random.default_rng(1).integers(20_000, 300_000, n),
        targets=targets,
        ids=ids,
        id_offsets=np.arange(n + 1, dtype=np.int64) * 32,
        listed_at=time.time(),
    )


@pytest.mark.slow
def test_one_million_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.perf_counter()
    m = synthetic_manifest()
    t_build = time.perf_counter() - t0
    path = tmp_path / "imagenet.manifest"
    t0 = time.perf_counter()
    m.save(path)
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = Manifest.load(path, expect_root=m.root)
    t_load = time.perf_counter() - t0
    assert len(back) == 1_000_000 and back.class_counts() == [1000] * 1000
    for i in (0, 1, 499_999, 999_999):
        assert back.url(i) == m.url(i) and back.identity(i) == m.identity(i) and back.size(i) == m.size(i)
    assert back.relkey(999_999) == "n00000999/n00000999_999999.JPEG"
    t0 = time.perf_counter()
    entries = [
        (back.relkey(i), back.size(i), back.identity(i), back.target(i)) for i in range(0, len(back), 10)
    ]
    Manifest.from_entries(m.root, m.classes, entries, listed_at=0)
    t_entries = (time.perf_counter() - t0) * 10
    with capsys.disabled():
        print(
            f"\n1M-sample manifest: {path.stat().st_size / 1e6:.1f} MB on disk; build {t_build:.2f}s, "
            f"save {t_save:.2f}s, load+verify {t_load:.2f}s, from_entries ~{t_entries:.1f}s (extrapolated)"
        )

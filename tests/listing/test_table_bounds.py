"""Tables are read in bounded memory, whatever they inflate to (issue 39, rows 6 and 7): an S3 Inventory
report is decompressed and parsed as it is read, a range of the object at a time; a Parquet file row
group by row group, a batch of rows at a time, each bounded before its values are made."""

from __future__ import annotations

import gzip
import io
import itertools
import json
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from blobdata import ConfigError, ObjectChanged
from blobdata._config import FetchOptions
from blobdata._fetch import FetchEngine, RangedFile
from blobdata._listing.index import read_index
from blobdata._tables import rows

MiB = 1 << 20


def _peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``'s result (or the exception it raised) and the peak of Python memory it allocated."""
    tracemalloc.start()
    try:
        try:
            got: Any = fn()
        except Exception as exc:  # the caller checks it
            got = exc
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _opts(bucket: Any) -> dict[str, Any]:
    opts: dict[str, Any] = bucket.storage_options
    return opts


def _inventory(bucket: Any, report: bytes) -> str:
    bucket.put("inv/data/1.csv.gz", report)
    manifest = {
        "sourceBucket": bucket.name,
        "destinationBucket": f"arn:aws:s3:::{bucket.name}",
        "fileFormat": "CSV",
        "fileSchema": "Bucket, Key, Size",
        "files": [{"key": "inv/data/1.csv.gz", "size": len(report), "MD5checksum": "x"}],
    }
    bucket.put("inv/manifest.json", json.dumps(manifest).encode())
    return bucket.url("inv/manifest.json")


def test_a_gzipped_inventory_report_is_streamed_not_inflated_whole(s3_bucket: Any) -> None:
    # 8 MiB of rows of another bucket around four of ours: a few KiB gzipped.
    other = b'"another-bucket","x/y.jpg","10"\n' * (8 * MiB // 32)
    ours = f'"{s3_bucket.name}","ds/a.txt","1"\n"{s3_bucket.name}","ds/b.txt","2"\n'.encode()
    report = gzip.compress(ours + other + ours.replace(b"/a.", b"/c.").replace(b"/b.", b"/d."))
    assert len(report) < MiB
    index = _inventory(s3_bucket, report)
    url, opts = s3_bucket.url("ds"), _opts(s3_bucket)
    first, _ = read_index(url, index, storage_options=opts)  # once first: the S3 client's imports are made
    (samples, _), peak = _peak(lambda: read_index(url, index, storage_options=opts))
    assert samples == first
    assert [key for key, _, _ in samples] == ["a", "b", "c", "d"]
    assert peak < 6 * MiB, f"{peak / MiB:.0f} MiB for a report that inflates to 8 MiB"


def test_a_gzip_bomb_of_one_endless_line_stops_at_the_line_bound(s3_bucket: Any) -> None:
    index = _inventory(s3_bucket, gzip.compress(b"a" * (64 * MiB)))
    url, opts = s3_bucket.url("ds"), _opts(s3_bucket)
    err, peak = _peak(lambda: read_index(url, index, storage_options=opts))
    assert isinstance(err, ConfigError)
    assert "inv/data/1.csv.gz line 1 is longer than" in str(err)
    assert err.url == s3_bucket.url("inv/data/1.csv.gz")
    assert peak < 12 * MiB


def _parquet(path: Path, table: Any, **kwargs: Any) -> int:
    import pyarrow.parquet as pq

    pq.write_table(table, path, compression="zstd", **kwargs)
    return path.stat().st_size


def test_a_small_parquet_file_of_a_million_rows_costs_a_batch_not_the_file(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "index.parquet"
    n = 1_000_000
    size = _parquet(path, pa.table({"key": pa.array(["a.txt"] * n), "label": pa.array([1] * n)}))
    assert size < 16 * 1024  # a small file that names a million rows
    data = path.read_bytes()
    first, peak = _peak(lambda: list(itertools.islice(rows(str(path), data, "parquet", what="index"), 3)))
    assert first == [(1, {"key": "a.txt", "label": 1}), (2, {"key": "a.txt", "label": 1}),
                     (3, {"key": "a.txt", "label": 1})]  # fmt: skip
    assert peak < 12 * MiB, f"{peak / MiB:.0f} MiB for the first rows of a {size}-byte file"


def test_a_parquet_batch_that_would_inflate_past_the_bound_is_refused_before_it_is_made(
    tmp_path: Path,
) -> None:
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "index.parquet"
    n = 2048  # 2,048 rows that each repeat one 64 KiB value: 128 MiB once expanded
    blob = "z" * (64 * 1024)
    _parquet(path, pa.table({"key": pa.array([f"k{i}.txt" for i in range(n)]), "note": pa.array([blob] * n)}))
    assert path.stat().st_size < 64 * 1024
    err, peak = _peak(lambda: read_index("s3://b/ds", str(path), storage_options={}))
    assert isinstance(err, ConfigError)
    assert f"rows 1 to {n}" in str(err) and str(path) in str(err) and "MiB" in str(err)
    assert peak < 12 * MiB


def test_parquet_rows_are_read_row_group_by_row_group(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "index.parquet"
    n = 10_000
    keys = pa.array([f"s{i:05d}.txt" for i in range(n)])
    _parquet(path, pa.table({"key": keys, "label": pa.array(range(n))}), row_group_size=3000)
    samples, where = read_index("s3://b/ds", str(path), storage_options={})
    assert [s[0] for s in samples] == [f"s{i:05d}" for i in range(n)]
    assert [s[2]["label"] for s in samples] == list(range(n)) and where.endswith("row {}")


def test_a_ranged_file_holds_one_range_and_pins_the_object(s3_bucket: Any, s3_proxy: Any) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    s3_bucket.put("big/obj.bin", data)
    engine = FetchEngine(FetchOptions(), "s3", s3_proxy.storage_options)
    try:
        s3_proxy.reset_counts()
        fh = RangedFile(engine, s3_bucket.url("big/obj.bin"), chunk=64 * 1024)
        assert fh.seek(0, io.SEEK_END) == len(data)
        fh.seek(0)
        got = io.BufferedReader(fh).read()
        assert got == data
        assert len(s3_proxy.requests) == 16  # one range per 64 KiB, each asked once
        fh.seek(100)
        assert fh.read(5) == data[100:105]
        s3_bucket.put("big/obj.bin", b"replaced" + data[8:])  # another version, the same size
        fh.seek(512 * 1024)
        with pytest.raises(ObjectChanged):
            fh.read(10)
    finally:
        engine.close()

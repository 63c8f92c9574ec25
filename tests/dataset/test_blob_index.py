"""BlobDataset from an index instead of a listing: not one LIST request (counted at the proxy), sizes and
ETags the index lacks learned at the first read and pinned from then on, and bad indexes named by line."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

import pytest

from blobdata import BlobCache, BlobDataset, ConfigError, ManifestError, NotFound, ObjectChanged


def _keep(batch: list[Any]) -> list[Any]:
    return batch


def _text(s: dict[str, Any]) -> tuple[str, str, Any]:
    return s["__key__"], s["txt"], s.get("label")


def _objects(n: int) -> dict[str, bytes]:
    return {f"ix/s{i:02d}.txt": f"text {i}".encode() for i in range(n)} | {
        f"ix/s{i:02d}.cls": str(i % 4).encode() for i in range(n)
    }


def _csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _no_listing(requests: list[tuple[str, str]]) -> None:
    for method, path in requests:
        assert method == "GET" and "?" not in path and "list-type" not in path, (method, path)


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_index_makes_the_dataset_without_listing(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, fmt: str
) -> None:
    objects = _objects(12)
    s3_bucket.put_many(objects)
    rows: list[dict[str, Any]] = []
    for key, data in sorted(objects.items()):
        row: dict[str, Any] = {"key": key[len("ix/") :], "size": len(data)}
        if key.endswith(".txt"):
            row["label"] = int(key[4:6]) * 2
        rows.append(row)
    if fmt == "csv":
        index = _csv(tmp_path / "index.csv", [dict(r, label=r.get("label", "")) for r in rows])
    else:
        index = tmp_path / "index.jsonl"
        index.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s3_proxy.reset_counts()
    ds = BlobDataset(
        s3_bucket.url("ix"), index=index, transform=_text, storage_options=s3_proxy.storage_options,
        cache=tmp_path / "cache",
    )  # fmt: skip
    assert s3_proxy.requests == []  # built without one request
    loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2, collate_fn=_keep)
    got = sorted(x for b in loader for x in b)
    assert got == [(f"s{i:02d}", f"text {i}", i * 2) for i in range(12)]
    _no_listing(s3_proxy.requests)
    assert len(s3_proxy.requests) == 24  # one GET per object, no LIST, no HEAD
    cache = BlobCache(str(tmp_path / "cache"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and cache.info()["entries"] < 48:  # objects + learned ETags
        time.sleep(0.05)
    s3_proxy.reset_counts()
    assert sorted(x for b in loader for x in b) == got
    assert s3_proxy.requests == []  # epoch 2 from the cache


def test_etags_missing_are_learned_at_first_read_and_pinned(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path
) -> None:
    s3_bucket.put_many({"p/a.txt": b"one", "p/b.txt": b"two"})
    (tmp_path / "index.csv").write_text("key\na.txt\nb.txt\n")  # no size, no etag
    opts = s3_proxy.storage_options
    ds = BlobDataset(s3_bucket.url("p"), index=tmp_path / "index.csv", storage_options=opts)
    assert ds[0]["txt"] == "one"
    s3_bucket.put("p/a.txt", b"changed")
    with pytest.raises(ObjectChanged, match=r"a\.txt"):
        ds[0]  # pinned to what the first read saw
    # With a cache, the identity learned is remembered on the node: another dataset (another process,
    # a later job) pins the same, and reads it from the cache without a request.
    s3_bucket.put("p/b.txt", b"two")
    cached = BlobDataset(
        s3_bucket.url("p"), index=tmp_path / "index.csv", storage_options=opts, cache=tmp_path / "c"
    )
    assert cached[1]["txt"] == "two"
    cached.close()  # flushes the cache writer
    s3_proxy.reset_counts()
    later = BlobDataset(
        s3_bucket.url("p"), index=tmp_path / "index.csv", storage_options=opts, cache=tmp_path / "c"
    )
    assert later[1]["txt"] == "two" and s3_proxy.requests == []
    s3_bucket.put("p/b.txt", b"other")
    fresh = BlobDataset(
        s3_bucket.url("p"), index=tmp_path / "index.csv", storage_options=opts, cache=tmp_path / "c"
    )
    s3_proxy.reset_counts()
    assert fresh[1]["txt"] == "two" and s3_proxy.requests == []  # still the pinned bytes, from the cache


def test_index_naming_a_missing_object(s3_bucket: Any, tmp_path: Path) -> None:
    s3_bucket.put("q/a.txt", b"a")
    (tmp_path / "index.csv").write_text("key,size\na.txt,1\nmissing.txt,3\n")
    ds = BlobDataset(
        s3_bucket.url("q"), index=tmp_path / "index.csv", storage_options=s3_bucket.storage_options
    )
    with pytest.raises(NotFound) as info:
        ds[1]
    msg = str(info.value)
    assert s3_bucket.url("q/missing.txt") in msg and "index.csv line 3" in msg


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("key,size\na.txt,12x\n", r"index\.csv line 2: size '12x'"),
        ("name\na.txt\n", r"index\.csv line 2 has no 'key' column"),
        ("key\na.txt\nb.txt\na.txt\n", r"line 2 and .*line 4 both name .*a\.txt: one row per object"),
        ("key\n../a.txt\n", r"index\.csv line 2: key '\.\./a\.txt' is outside"),
        ("key\ns3://other/a.txt\n", r"outside the dataset's URL"),
        ("key\nREADME\n", r"line 2: 'README' has no extension"),
        ("key,label\na.txt,1\na.cls,2\n", r"line 3 gives label=2 for sample 'a', and .*line 2 gave 1"),
        ("key,size\na.txt,1,2\n", r"index\.csv line 2 has 3 values"),
    ],
)
def test_bad_index_rows_name_file_and_line(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "index.csv").write_text(text)
    with pytest.raises(ConfigError, match=match):
        BlobDataset(f"file://{tmp_path}/data", index=tmp_path / "index.csv")


@pytest.mark.parametrize("name", ["index.csv", "index.jsonl", "index.parquet"])
def test_a_local_index_that_is_missing_or_unreadable_is_named(tmp_path: Path, name: str) -> None:
    (tmp_path / "data").mkdir()
    with pytest.raises(NotFound, match=rf"index file .*{name} does not exist"):
        BlobDataset(f"file://{tmp_path}/data", index=tmp_path / name)
    (tmp_path / name).mkdir()  # a directory where the file should be
    with pytest.raises(ConfigError, match=rf"index file .*{name} cannot be read: "):
        BlobDataset(f"file://{tmp_path}/data", index=tmp_path / name)


def test_parquet_index(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    root = tmp_path / "d"
    root.mkdir()
    (root / "a.txt").write_bytes(b"A")
    (root / "b.txt").write_bytes(b"B")
    pq.write_table(
        pa.table({"key": ["b.txt", "a.txt"], "size": [1, 1], "label": [2, 1]}), tmp_path / "i.parquet"
    )
    ds = BlobDataset(root, index=tmp_path / "i.parquet")
    assert [(s["__key__"], s["txt"], s["label"]) for s in (ds[0], ds[1])] == [("a", "A", 1), ("b", "B", 2)]


def test_parquet_without_pyarrow_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "i.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match="needs pyarrow: pip install pyarrow"):
        BlobDataset(tmp_path, index=tmp_path / "i.parquet")


@pytest.mark.parametrize("etag", ["abc\r\nX-Injected: 1", "ab\ncd", "\u20ac-not-latin-1"])
def test_an_etag_no_header_can_carry_is_an_error_naming_the_row_and_skippable(
    s3_bucket: Any, tmp_path: Path, etag: str
) -> None:
    """An index ETag with a line break or a character a request header cannot carry: an error naming the
    index, its line and the object's URL, which on_error="skip" skips (issue 39, row 8)."""
    s3_bucket.put_many({"e/a.txt": b"a", "e/b.txt": b"b"})
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"key": "a.txt"}) + "\n" + json.dumps({"key": "b.txt", "etag": etag}) + "\n")
    opts = s3_bucket.storage_options
    ds = BlobDataset(s3_bucket.url("e"), index=index, storage_options=opts, lookahead=0)
    with pytest.raises(ManifestError) as info:
        ds[1]
    msg = str(info.value)
    assert "index.jsonl line 2" in msg and s3_bucket.url("e/b.txt") in msg and "ETag" in msg
    assert info.value.url == s3_bucket.url("e/b.txt")
    skipping = BlobDataset(
        s3_bucket.url("e"), index=index, storage_options=opts, on_error="skip", lookahead=0
    )
    assert [s["txt"] for s in skipping.__getitems__([0, 1])] == ["a"]
    assert [url for url, _ in skipping.errors] == [s3_bucket.url("e/b")]
    ds.close()
    skipping.close()

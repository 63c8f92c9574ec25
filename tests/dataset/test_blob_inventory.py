"""BlobDataset from an S3 Inventory report (manifest.json with CSV or Parquet files): no LIST request,
keys URL-decoded, only the dataset's bucket and prefix kept, ETags pinned; and Parquet metadata."""

from __future__ import annotations

import gzip
import io
import json
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from blobdata import BlobDataset, ConfigError


def _objects() -> dict[str, bytes]:
    return {"ds/a b+c.txt": b"first", "ds/a b+c.cls": b"1", "ds/z.txt": b"last", "other/x.txt": b"no"}


def _etags(bucket: Any, keys: list[str]) -> dict[str, str]:
    import boto3

    s3 = boto3.client("s3", **_client_kwargs(bucket))
    return {k: s3.head_object(Bucket=bucket.name, Key=k)["ETag"].strip('"') for k in keys}


def _client_kwargs(bucket: Any) -> dict[str, Any]:
    o = bucket.storage_options
    return {
        "endpoint_url": o.get("endpoint_url") or o["client_kwargs"]["endpoint_url"],
        "aws_access_key_id": o["key"],
        "aws_secret_access_key": o["secret"],
        "region_name": "us-east-1",
    }


def _manifest(bucket: Any, fmt: str, files: list[str]) -> bytes:
    return json.dumps(
        {
            "sourceBucket": bucket.name,
            "destinationBucket": f"arn:aws:s3:::{bucket.name}",
            "fileFormat": fmt,
            "fileSchema": "Bucket, Key, Size, LastModifiedDate, ETag",
            "files": [{"key": f, "size": 1, "MD5checksum": "x"} for f in files],
        }
    ).encode()


def _check(ds: BlobDataset) -> None:
    assert ds.keys() == ["a b+c", "z"]
    s = ds[0]
    assert (s["txt"], s["cls"]) == ("first", 1) and ds[1]["txt"] == "last"


def test_csv_inventory(s3_bucket: Any, s3_proxy: Any, tmp_path: Path) -> None:
    objects = _objects()
    s3_bucket.put_many(objects)
    tags = _etags(s3_bucket, list(objects))
    lines = [
        f'"{s3_bucket.name}","{urllib.parse.quote_plus(k)}","{len(v)}","2024-01-01T00:00:00.000Z","{tags[k]}"'
        for k, v in objects.items()
    ]
    half = len(lines) // 2
    s3_bucket.put("inv/data/1.csv.gz", gzip.compress("\n".join(lines[:half]).encode() + b"\n"))
    s3_bucket.put("inv/data/2.csv.gz", gzip.compress("\n".join(lines[half:]).encode() + b"\n"))
    s3_bucket.put(
        "inv/manifest.json", _manifest(s3_bucket, "CSV", ["inv/data/1.csv.gz", "inv/data/2.csv.gz"])
    )
    s3_proxy.reset_counts()
    ds = BlobDataset(
        s3_bucket.url("ds"),
        index=s3_bucket.url("inv/manifest.json"),
        storage_options=s3_proxy.storage_options,
    )
    paths = [p for _, p in s3_proxy.requests]
    assert all("?" not in p for p in paths) and len(paths) == 3  # manifest + 2 files: no LIST
    _check(ds)
    assert all(ds.table.identity(j) for j in range(ds.table.num_objects))  # ETags from the report


def test_parquet_inventory_and_parquet_metadata(s3_bucket: Any, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    objects = _objects()
    s3_bucket.put_many(objects)
    table = pa.table(
        {
            "bucket": [s3_bucket.name] * len(objects),
            "key": list(objects),
            "size": [len(v) for v in objects.values()],
            "e_tag": [None] * len(objects),
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    s3_bucket.put("inv/data/1.parquet", out.getvalue())
    (tmp_path / "manifest.json").write_bytes(_manifest(s3_bucket, "Parquet", ["inv/data/1.parquet"]))
    opts = s3_bucket.storage_options
    _check(BlobDataset(s3_bucket.url("ds"), index=tmp_path / "manifest.json", storage_options=opts))
    meta = io.BytesIO()
    pq.write_table(pa.table({"file_name": ["z.txt", "a b+c.txt"], "label": [9, 8]}), meta)
    s3_bucket.put("ds/metadata.parquet", meta.getvalue())
    ds = BlobDataset(s3_bucket.url("ds"), storage_options=opts)
    assert [(s["__key__"], s["txt"], s["label"]) for s in (ds[0], ds[1])] == [
        ("a b+c", "first", 8),
        ("z", "last", 9),
    ]


def test_inventory_in_another_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(
        json.dumps({"fileFormat": "ORC", "files": [], "destinationBucket": "arn:aws:s3:::b"})
    )
    with pytest.raises(ConfigError, match="reads CSV and Parquet"):
        BlobDataset("s3://b/ds", index=tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="lacks fileFormat"):
        BlobDataset("s3://b/ds", index=tmp_path / "manifest.json")

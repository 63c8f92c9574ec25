"""An S3 Inventory report of all versions, built as AWS documents it (the fileSchema and columns of its
manifest.json, CSV gzipped with URL-encoded keys, or Parquet with AWS's column types) from a real
versioned bucket on the test S3 server (moto): objects overwritten, deleted (a delete marker over a
noncurrent version), deleted with their noncurrent versions expired (a delete marker alone), deleted
then written again. The dataset's objects are exactly what the store's own listing (ListObjectsV2) shows:
the rows with IsLatest true and IsDeleteMarker false."""

from __future__ import annotations

import gzip
import io
import json
import urllib.parse
from typing import Any

import pytest

from blobdata import BlobDataset
from blobdata.testing import s3_client
from tests.support import buckets

#: The columns of an all-versions report with the usual optional fields, in AWS's documented order.
CSV_SCHEMA = "Bucket, Key, VersionId, IsLatest, IsDeleteMarker, Size, LastModifiedDate, ETag, StorageClass"
PARQUET_SCHEMA = (
    "message s3.inventory { required binary bucket (UTF8); required binary key (UTF8); optional binary "
    "version_id (UTF8); optional boolean is_latest; optional boolean is_delete_marker; optional int64 size; "
    "optional int64 last_modified_date (TIMESTAMP_MILLIS); optional binary e_tag (UTF8); optional binary "
    "storage_class (UTF8);}"
)


@pytest.fixture
def versioned(verbatim_s3: Any) -> Any:
    """A versioned bucket whose history holds every case a report of all versions lists."""
    bucket = buckets.s3_bucket(verbatim_s3)
    s3 = s3_client(verbatim_s3)
    s3.put_bucket_versioning(Bucket=bucket.name, VersioningConfiguration={"Status": "Enabled"})

    def put(key: str, body: bytes) -> None:
        s3.put_object(Bucket=bucket.name, Key=key, Body=body)

    put("ds/a b+c.txt", b"first version")
    put("ds/a b+c.txt", b"overwritten")  # the current version; the first stays, noncurrent
    put("ds/a b+c.cls", b"1")
    put("ds/gone.txt", b"deleted")
    s3.delete_object(Bucket=bucket.name, Key="ds/gone.txt")  # a delete marker over a noncurrent version
    put("ds/expired.txt", b"deleted, its versions expired")
    old = s3.list_object_versions(Bucket=bucket.name, Prefix="ds/expired.txt")["Versions"][0]["VersionId"]
    s3.delete_object(Bucket=bucket.name, Key="ds/expired.txt")
    s3.delete_object(Bucket=bucket.name, Key="ds/expired.txt", VersionId=old)  # the marker alone is left
    put("ds/back.txt", b"before")
    s3.delete_object(Bucket=bucket.name, Key="ds/back.txt")
    put("ds/back.txt", b"written again")  # current again, over a delete marker and a version
    put("other/x.txt", b"another prefix")
    yield bucket, s3
    for v in s3.list_object_versions(Bucket=bucket.name).get("Versions", []) + s3.list_object_versions(
        Bucket=bucket.name
    ).get("DeleteMarkers", []):
        s3.delete_object(Bucket=bucket.name, Key=v["Key"], VersionId=v["VersionId"])
    bucket.drop()


def _report(s3: Any, bucket: str) -> list[dict[str, Any]]:
    """Every version and delete marker of ``bucket``, one row each, as an all-versions report lists them."""
    out: list[dict[str, Any]] = []
    for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
        for v in page.get("Versions", []):
            out.append({"bucket": bucket, "key": v["Key"], "version_id": v["VersionId"],
                        "is_latest": v["IsLatest"], "is_delete_marker": False, "size": v["Size"],
                        "last_modified_date": v["LastModified"], "e_tag": v["ETag"].strip('"'),
                        "storage_class": v.get("StorageClass", "STANDARD")})  # fmt: skip
        for m in page.get("DeleteMarkers", []):
            out.append({"bucket": bucket, "key": m["Key"], "version_id": m["VersionId"],
                        "is_latest": m["IsLatest"], "is_delete_marker": True, "size": None,
                        "last_modified_date": m["LastModified"], "e_tag": None,
                        "storage_class": None})  # fmt: skip
    assert any(r["is_delete_marker"] and r["is_latest"] for r in out)  # the cases are all there
    assert any(not r["is_latest"] and not r["is_delete_marker"] for r in out)
    return out


def _csv_line(r: dict[str, Any]) -> str:
    cells = [r["bucket"], urllib.parse.quote_plus(r["key"]), r["version_id"], str(r["is_latest"]).lower(),
             str(r["is_delete_marker"]).lower(), "" if r["size"] is None else str(r["size"]),
             r["last_modified_date"].strftime("%Y-%m-%dT%H:%M:%S.000Z"), r["e_tag"] or "",
             r["storage_class"] or ""]  # fmt: skip
    return ",".join(f'"{c}"' for c in cells)


def _manifest(source: str, dest: str, fmt: str, files: list[str]) -> bytes:
    return json.dumps(
        {
            "sourceBucket": source,
            "destinationBucket": f"arn:aws:s3:::{dest}",
            "version": "2016-11-30",
            "creationTimestamp": "1514944800000",
            "fileFormat": fmt,
            "fileSchema": CSV_SCHEMA if fmt == "CSV" else PARQUET_SCHEMA,
            "files": [{"key": f, "size": 1, "MD5checksum": "0" * 32} for f in files],
        }
    ).encode()


def _parquet(rows: list[dict[str, Any]]) -> bytes:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    types = {"bucket": pa.string(), "key": pa.string(), "version_id": pa.string(), "is_latest": pa.bool_(),
             "is_delete_marker": pa.bool_(), "size": pa.int64(), "last_modified_date": pa.timestamp("ms"),
             "e_tag": pa.string(), "storage_class": pa.string()}  # fmt: skip
    table = pa.table({c: pa.array([r[c] for r in rows], t) for c, t in types.items()})
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["CSV", "Parquet"])
def test_all_versions_report_gives_the_current_objects(versioned: Any, fmt: str) -> None:
    bucket, s3 = versioned
    rows = _report(s3, bucket.name)
    half = len(rows) // 2
    parts = [rows[:half], rows[half:]]  # a key's versions may lie in two files
    if fmt == "CSV":
        files = {f"inv/data/{i}.csv.gz": gzip.compress("\n".join(map(_csv_line, p)).encode() + b"\n")
                 for i, p in enumerate(parts)}  # fmt: skip
    else:
        files = {f"inv/data/{i}.parquet": _parquet(p) for i, p in enumerate(parts)}
    for key, data in files.items():
        s3.put_object(Bucket=bucket.name, Key=key, Body=data)
    s3.put_object(Bucket=bucket.name, Key="inv/manifest.json",
                  Body=_manifest(bucket.name, bucket.name, fmt, list(files)))  # fmt: skip
    current = s3.list_objects_v2(Bucket=bucket.name, Prefix="ds/")["Contents"]  # the store's own listing
    ds = BlobDataset(
        bucket.url("ds"), index=bucket.url("inv/manifest.json"), storage_options=bucket.storage_options,
        decoders=False,
    )  # fmt: skip
    got = [(url, size, identity.partition("@")[0]) for url, size, identity in ds.objects()]
    assert sorted(got) == sorted(
        (f"{bucket.url(o['Key'])}", o["Size"], o["ETag"].strip('"')) for o in current
    )
    assert ds.keys() == ["a b+c", "back"]
    bodies = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in ds}
    assert bodies == {"a b+c": {"txt": b"overwritten", "cls": b"1"}, "back": {"txt": b"written again"}}
    latest = {(r["key"], r["version_id"]) for r in rows if r["is_latest"] and not r["is_delete_marker"]}
    assert {(ds.table.relkey(j), ds.table.identity(j).partition("@")[2]) for j in range(3)} == {
        (k[len("ds/") :], v) for k, v in latest if k.startswith("ds/")
    }  # each object pinned to its current version

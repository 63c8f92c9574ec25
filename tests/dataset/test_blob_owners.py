"""BlobDataset's layouts against their owners' own code, on the same trees, local and on the S3 server:
Hugging Face's imagefolder loader for metadata files (columns typed as it types them, camera-style
upper-case names, absent keys, rows of file_names only, Parquet timestamps, dates and bytes), and
webdataset's grouping of files into samples (suffixes lower-cased, case-only pairs refused)."""

from __future__ import annotations

import csv
import datetime
import decimal
import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from blobdata import BlobDataset, ConfigError
from tests.support.owners import blob_fields, hugging_face, put_tree, typed, webdataset_samples, write_tree


def _png(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (2, 2), (i, 0, 0)).save(out, format="PNG")
    return out.getvalue()


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (2, 2), (i, 0, 0)).save(out, format="JPEG")
    return out.getvalue()


def _csv(rows: list[dict[str, Any]]) -> bytes:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return out.getvalue().encode()


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _where(tmp_path: Path, s3_bucket: Any, tree: dict[str, bytes]) -> tuple[Path, list[tuple[str, Any]]]:
    """The tree on disk (for the oracle and for blobdata) and on the S3 server: (root, [(url, options)])."""
    root = write_tree(tmp_path / "tree", tree)
    url = put_tree(s3_bucket, "tree", tree)
    return root, [(str(root), None), (url, s3_bucket.storage_options)]


def _same_as_hugging_face(ds: BlobDataset, theirs: list[dict[str, Any]], images: dict[str, str]) -> None:
    """Each of Hugging Face's rows is one of ds's samples: the same objects, the same fields, typed alike
    (``images``: Hugging Face's image column -> blobdata's member)."""
    ours = {}
    for i in range(len(ds)):
        objects, fields = blob_fields(ds, i)
        ours[objects[0]] = (objects, fields)
    assert len(ours) == len(theirs)
    for row in theirs:
        paths = {name: row.pop(name) for name in images}
        first = next(iter(paths.values()))
        objects, fields = ours[first[0] if isinstance(first, list) else first]
        want = [p for v in paths.values() for p in (v if isinstance(v, list) else [v])]
        assert sorted(objects) == sorted(want)
        assert typed(fields) == typed(row), (first, fields, row)


# -- Hugging Face: metadata.csv and metadata.jsonl -----------------------------------------------


def test_metadata_csv_columns_typed_as_hugging_face_types_them(tmp_path: Path, s3_bucket: Any) -> None:
    names = ["DCIM/IMG_0001.JPG", "DCIM/IMG_0002.JPG", "DCIM/IMG_0003.jpeg", "DCIM/img_0004.Png"]
    tree = {n: (_png(i) if n.endswith("Png") else _jpeg(i)) for i, n in enumerate(names)}
    rows = [
        {"file_name": names[0], "speaker": "007", "caption": "1984", "label": 7, "score": 1,
         "flag": "True", "maybe": 3, "extreme": "nan", "profile_name": 1},
        {"file_name": names[1], "speaker": "x12", "caption": "a cat", "label": 3, "score": 0.5,
         "flag": "False", "maybe": "", "extreme": "inf", "profile_name": 2},
        {"file_name": names[2], "speaker": "9", "caption": "1e3", "label": 12, "score": 2,
         "flag": "true", "maybe": "NA", "extreme": "-inf", "profile_name": 3},
        {"file_name": names[3], "speaker": "010", "caption": "", "label": 0, "score": 3,
         "flag": "FALSE", "maybe": 4, "extreme": "1.5", "profile_name": 4},
    ]  # fmt: skip
    tree["metadata.csv"] = _csv(rows)
    root, places = _where(tmp_path, s3_bucket, tree)
    theirs = hugging_face(root, tmp_path / "hf")
    for url, opts in places:
        ds = BlobDataset(url, storage_options=opts)
        assert ds.keys() == ["DCIM/IMG_0001", "DCIM/IMG_0002", "DCIM/IMG_0003", "DCIM/img_0004"]
        _same_as_hugging_face(ds, [dict(r) for r in theirs], {"image": "jpg"})
        s = ds[0]
        assert (s["speaker"], s["caption"], s["flag"], s["maybe"]) == ("007", "1984", True, 3.0)
        assert [ds.table.name(j) for j in range(ds.table.num_objects)] == ["jpg", "jpg", "jpeg", "png"]
        assert s["jpg"].size == (2, 2)  # a camera's IMG_0001.JPG is member "jpg", as in a folder


def test_metadata_jsonl_absent_keys_and_mixed_numbers_as_hugging_face(tmp_path: Path, s3_bucket: Any) -> None:
    tree = {f"img/{i}.PNG": _png(i) for i in range(4)}
    rows: list[dict[str, Any]] = [
        {"file_name": "img/0.PNG", "label": 1, "meta": {"w": 1}, "tags": [1, 2]},
        {"file_name": "img/1.PNG", "label": 0.5, "meta": {"h": 2.5}, "extra": True},
        {"file_name": "img/2.PNG", "label": 2, "tags": [0.5]},
        {"file_name": "img/3.PNG", "label": None, "meta": None, "extra": False, "note": "x"},
    ]
    tree["metadata.jsonl"] = _jsonl(rows)
    root, places = _where(tmp_path, s3_bucket, tree)
    theirs = hugging_face(root, tmp_path / "hf")
    for url, opts in places:
        ds = BlobDataset(url, storage_options=opts, decoders=False)
        _same_as_hugging_face(ds, [dict(r) for r in theirs], {"image": "png"})
        s = ds[2]
        assert s["label"] == 2.0 and type(s["label"]) is float  # a column of 1 and 0.5 is float
        assert s["extra"] is None and s["meta"] is None and s["note"] is None  # absent: None, no KeyError
        assert ds[0]["meta"] == {"w": 1, "h": None}


def test_rows_naming_only_file_names_as_hugging_face_accepts_them(tmp_path: Path, s3_bucket: Any) -> None:
    tree = {f"views/{s}_{v}.png": _png(10 * s + v) for s in range(3) for v in range(2)}
    rows = [{"file_names": [f"views/{s}_{v}.png" for v in range(2)], "scene": f"s{s}"} for s in range(3)]
    tree["metadata.jsonl"] = _jsonl(rows)
    root, places = _where(tmp_path, s3_bucket, tree)
    theirs = hugging_face(root, tmp_path / "hf")
    assert [r["images"] for r in theirs] == [r["file_names"] for r in rows]
    for url, opts in places:
        ds = BlobDataset(url, storage_options=opts)
        _same_as_hugging_face(ds, [dict(r) for r in theirs], {"images": "files"})
        assert ds.keys() == ["views/0_0", "views/1_0", "views/2_0"]  # the first object's key
        assert [im.getpixel((0, 0))[0] for im in ds[1]["files"]] == [10, 11]


def test_parquet_metadata_timestamps_dates_and_bytes_as_hugging_face_gives_them(
    tmp_path: Path, s3_bucket: Any
) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    utc = datetime.timezone.utc
    table = pa.table(
        {
            "file_name": [f"{i}.png" for i in range(3)],
            "taken": pa.array([datetime.datetime(2024, 1, i + 1, 5, 6, 7, 123000) for i in range(3)],
                              pa.timestamp("ms")),
            "utc": pa.array([datetime.datetime(2024, 1, i + 1, tzinfo=utc) for i in range(3)],
                            pa.timestamp("us", tz="UTC")),
            "day": pa.array([datetime.date(2024, 2, i + 1) for i in range(3)], pa.date32()),
            "raw": pa.array([bytes([i, 255]) for i in range(3)], pa.binary()),
            "price": pa.array([decimal.Decimal("1.50"), None, decimal.Decimal("-2.25")], pa.decimal128(5, 2)),
            "at": pa.array([datetime.time(1, 2, 3), None, datetime.time(4, 5, 6, 7)], pa.time64("us")),
            "took": pa.array([datetime.timedelta(seconds=5), None, datetime.timedelta(1, 0, 3)],
                             pa.duration("us")),
        }
    )  # fmt: skip
    out = io.BytesIO()
    pq.write_table(table, out)
    tree = {f"{i}.png": _png(i) for i in range(3)} | {"metadata.parquet": out.getvalue()}
    root, places = _where(tmp_path, s3_bucket, tree)
    theirs = hugging_face(root, tmp_path / "hf")
    for url, opts in places:
        ds = BlobDataset(url, storage_options=opts, decoders=False)
        _same_as_hugging_face(ds, [dict(r) for r in theirs], {"image": "png"})
        s = ds[1]
        assert s["taken"] == datetime.datetime(2024, 1, 2, 5, 6, 7, 123000) and s["raw"] == b"\x01\xff"
        assert s["day"] == datetime.date(2024, 2, 2) and s["utc"] == datetime.datetime(2024, 1, 2, tzinfo=utc)
    index = io.BytesIO()  # the same columns in an index: the same fields
    pq.write_table(table.rename_columns(["key", *table.column_names[1:]]), index)
    (tmp_path / "index.parquet").write_bytes(index.getvalue())
    ds = BlobDataset(root, index=tmp_path / "index.parquet", decoders=False)
    _same_as_hugging_face(ds, [dict(r) for r in theirs], {"image": "png"})


# -- webdataset: member names ---------------------------------------------------------------------


def test_member_names_lower_cased_as_webdataset_groups_them(tmp_path: Path, s3_bucket: Any) -> None:
    tree = {
        "DCIM/IMG_0001.JPG": _jpeg(1), "DCIM/IMG_0001.json": b'{"iso": 100}', "DCIM/IMG_0002.Jpg": _jpeg(2),
        "DCIM/IMG_0002.XMP": b"<x/>", "a/x.seg.PNG": _png(3), "a/x.TXT": b"caption", "b/y.tar.GZ": b"gz",
        "b/Y.cls": b"1",
    }  # fmt: skip
    theirs = {
        s["__key__"]: sorted(k for k in s if not k.startswith("__"))
        for s in webdataset_samples(tree, tmp_path)
    }
    assert theirs["DCIM/IMG_0001"] == ["jpg", "json"] and theirs["a/x"] == ["seg.png", "txt"]
    _, places = _where(tmp_path, s3_bucket, tree)
    for url, opts in places:
        ds = BlobDataset(url, storage_options=opts, decoders=False)
        t = ds.table
        ours = {ds.keys()[i]: sorted(t.name(j) for j in t.members(i)) for i in range(len(ds))}
        assert ours == theirs
        assert ds[ds.keys().index("DCIM/IMG_0001")]["jpg"] == tree["DCIM/IMG_0001.JPG"]


def test_members_differing_only_in_case_refused_as_webdataset_refuses_them(
    tmp_path: Path, s3_bucket: Any
) -> None:
    tree = {"x.JPG": _jpeg(1), "x.jpg": _jpeg(2), "y.txt": b"fine"}
    with pytest.raises(ValueError, match="duplicate file name"):
        webdataset_samples(tree, tmp_path)
    root, places = _where(tmp_path, s3_bucket, tree)
    for url, opts in places:
        with pytest.raises(ConfigError) as info:
            BlobDataset(url, storage_options=opts)
        said = str(info.value)
        assert (
            f"{url.rstrip('/') if '://' in url else 'file://' + url}/x.JPG and " in said and "/x.jpg;" in said
        )
        assert "differ only in case" in said and "rename or remove one" in said
    index = tmp_path / "index.csv"
    index.write_text("key\ny.txt\nx.JPG\nx.jpg\n")
    with pytest.raises(ConfigError, match=r"index\.csv line 3 and .*line 4 both give member 'jpg' of 'x' "
                       r"\(.*/x\.JPG and .*/x\.jpg\): their names differ only in case"):  # fmt: skip
        BlobDataset(root, index=index)

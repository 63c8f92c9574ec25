"""An index converted once (``blobdata ls URL --index FILE --save-manifest PATH``): the saved sample table
holds everything the parsed index gave (keys, members, sizes and identities, unknown ones included,
fields, the index's line of each object), loads without parsing or listing, and is refused when corrupt,
truncated or made for another URL."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobdata import BlobDataset, ManifestError
from blobdata._cli import main
from blobdata._config import FetchOptions
from blobdata._listing import SampleTable, build_table, load_table, save_table, table_to_bytes
from tests.cli.test_cli import option_args


def _rows(n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(n):
        # every third sample lacks its sizes and ETags (learned at first read); labels on the txt rows
        known = i % 3 != 0
        rows.append({"key": f"s{i:02d}.txt", "size": len(f"text {i}") if known else "",
                     "etag": "", "label": i * 2, "note": f"n{i}" if i % 2 else ""})  # fmt: skip
        rows.append({"key": f"s{i:02d}.cls", "size": len(str(i % 4)) if known else "", "etag": "",
                     "label": "", "note": ""})  # fmt: skip
    return rows


def _csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _build(root: str, index: Path) -> SampleTable:
    return build_table(
        root, storage_options={}, metadata=None, index=str(index), manifest=None, refresh=False, max_age=None,
        fetch_options=FetchOptions(), share=False,
    )  # fmt: skip


def _same(a: SampleTable, b: SampleTable) -> None:
    head = (a.root, len(a), a.num_objects, a.where_template)
    assert head == (b.root, len(b), b.num_objects, b.where_template)
    for name, x in a.arrays().items():
        assert np.array_equal(x, b.arrays()[name]), name
    for i in range(len(a)):
        assert (a.key(i), a.members(i), a.fields(i)) == (b.key(i), b.members(i), b.fields(i))
    for j in range(a.num_objects):
        assert (a.relkey(j), int(a.sizes[j]), a.identity(j), a.name(j), a.where(j)) == (
            b.relkey(j), int(b.sizes[j]), b.identity(j), b.name(j), b.where(j),
        )  # fmt: skip


def test_round_trip_keeps_everything(tmp_path: Path) -> None:
    rows = _rows(9)
    rows[2]["etag"] = '"abc"'  # one known identity
    index = _csv(tmp_path / "index.csv", rows)
    root = "s3://bucket/ix"
    table = _build(root, index)
    assert int((table.sizes == -1).sum()) == 6  # samples 0, 3, 6: both members unknown
    saved = tmp_path / "t" / "ix.samples"
    save_table(table, saved, source=str(index))
    assert saved.stat().st_mode & 0o777 == 0o600
    assert not [p for p in saved.parent.iterdir() if p.name != saved.name]  # no temporary file left
    back = load_table(str(saved), expect_root=root)
    _same(table, back)
    assert back.fields(1) == {"label": 2, "note": "n1"}
    txt = back.members(1)[1]  # s01.txt (members sorted: cls, txt)
    got = (back.relkey(txt), back.identity(txt), back.where(txt))
    assert got == ("s01.txt", "abc", f"index {index} line 4")
    assert (back.identity(0), int(back.sizes[0])) == ("", -1)  # s00.cls: unknown, learned at first read
    # index= a saved table: the same samples as the index itself gave
    _same(table, _build(root, saved))


def test_corrupt_truncated_or_other_url_refused(tmp_path: Path) -> None:
    index = _csv(tmp_path / "index.csv", _rows(5))
    table = _build("s3://bucket/ix", index)
    data = table_to_bytes(table)
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    cases = {
        "corrupt.samples": (bytes(flipped), "checksum mismatch"),
        "short.samples": (data[: len(data) // 2], "unusable"),
        "tiny.samples": (data[:12], "too short"),
    }
    for name, (body, why) in cases.items():
        (tmp_path / name).write_bytes(body)
        with pytest.raises(ManifestError, match=why) as exc:
            load_table(str(tmp_path / name), expect_root="s3://bucket/ix")
        assert name in str(exc.value)
    save_table(table, tmp_path / "ok.samples")
    with pytest.raises(ManifestError, match="is for s3://bucket/ix, not s3://bucket/other") as exc:
        BlobDataset("s3://bucket/other", index=tmp_path / "ok.samples", share_listing=False)
    assert "ok.samples" in str(exc.value)
    # a truncated file given as index= is refused too (its magic bytes say it is a saved table)
    with pytest.raises(ManifestError, match=r"short\.samples"):
        BlobDataset("s3://bucket/ix", index=tmp_path / "short.samples", share_listing=False)


def test_cli_converts_and_the_dataset_lists_nothing(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    n = 12
    s3_bucket.put_many({f"ix/s{i:02d}.txt": f"text {i}".encode() for i in range(n)})
    s3_bucket.put_many({f"ix/s{i:02d}.cls": str(i % 4).encode() for i in range(n)})
    index = _csv(tmp_path / "index.csv", _rows(n))
    saved = tmp_path / "ix.samples"
    url = s3_bucket.url("ix")
    s3_proxy.reset_counts()
    code = main(["ls", url, "--index", str(index), "--save-manifest", str(saved), "--json",
                 *option_args(s3_proxy.storage_options)])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads(out)
    assert (doc["samples"], doc["objects"], doc["unknown_sizes"]) == (n, 2 * n, 8)
    assert s3_proxy.requests == []  # a local index: converted without a request
    index.unlink()  # the saved table is all the dataset needs
    ds = BlobDataset(url, index=saved, storage_options=s3_proxy.storage_options)
    assert s3_proxy.requests == []  # built without one request
    assert ds.keys() == [f"s{i:02d}" for i in range(n)]
    batches = iter(ds.dataloader(batch_size=4, collate_fn=lambda b: b))
    batch = next(batches)
    assert [(s["__key__"], s["txt"], s["cls"], s["label"]) for s in batch] == [
        (f"s{i:02d}", f"text {i}", i % 4, i * 2) for i in range(4)
    ]
    for method, path in s3_proxy.requests:
        assert method == "GET" and "?" not in path and "list-type" not in path, (method, path)
    paths = [path.rsplit("/ix/", 1)[1] for _, path in s3_proxy.requests]
    assert len(paths) == len(set(paths)) >= 8  # each member at most once (the look-ahead reads on)
    assert {f"s{i:02d}.{e}" for i in range(4) for e in ("txt", "cls")} <= set(paths)
    # Read the epoch to its end while the proxy is up: a look-ahead still fetching after the test
    # would retry against a closed port in the background, into the next tests.
    assert sum(len(b) for b in batches) == n - 4


def test_cli_bad_row_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _rows(4)
    rows[5]["key"] = "../outside.txt"
    index = _csv(tmp_path / "index.csv", rows)
    saved = tmp_path / "ix.samples"
    code = main(["ls", "s3://bucket/ix", "--index", str(index), "--save-manifest", str(saved)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(index) in err and "line 7" in err, err
    assert not saved.exists()


def test_saved_to_a_bucket_and_loaded_from_it(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3_bucket.put_many({f"ix/s{i:02d}.txt": f"text {i}".encode() for i in range(3)})
    s3_bucket.put_many({f"ix/s{i:02d}.cls": str(i % 4).encode() for i in range(3)})
    index = _csv(tmp_path / "index.csv", _rows(3))
    url, saved = s3_bucket.url("ix"), s3_bucket.url("indexes/ix.samples")
    code = main(
        ["ls", url, "--index", str(index), "--save-manifest", saved, *option_args(s3_proxy.storage_options)]
    )
    assert code == 0, capsys.readouterr()
    assert "saved the samples to" in capsys.readouterr().out
    s3_proxy.reset_counts()
    ds = BlobDataset(url, index=saved, storage_options=s3_proxy.storage_options, share_listing=False)
    assert [p.rsplit("/", 2)[-2:] for _, p in s3_proxy.requests] == [["indexes", "ix.samples"]]  # one GET
    assert (ds[2]["__key__"], ds[2]["txt"], ds[2]["label"]) == ("s02", "text 2", 4)

"""blobdata.warm(ds) and ``blobdata warm URL --index/--metadata/--objects``: exactly the objects a
BlobDataset reads, every member, so that training afterwards sends no GET."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import blobdata
from blobdata import BlobCache, BlobDataset
from blobdata._cli import main
from tests.cli.test_cli import option_args


def _keep(batch: list[Any]) -> list[Any]:
    return batch


def _objects(n: int) -> dict[str, bytes]:
    out = {f"w/{i:02d}.txt": f"t{i}".encode() for i in range(n)}
    out.update({f"w/{i:02d}.json": json.dumps({"i": i}).encode() for i in range(n)})
    out["w/unrelated.bin"] = b"x" * 1000  # no row names it: not warmed with an index
    return out


def _epoch(ds: BlobDataset) -> list[tuple[str, int]]:
    loader = ds.dataloader(batch_size=4, num_workers=2, collate_fn=_keep)
    return sorted((s["txt"], s["json"]["i"]) for b in loader for s in b)


def test_warm_ds_then_no_get(s3_bucket: Any, s3_proxy: Any, tmp_path: Path) -> None:
    s3_bucket.put_many(_objects(6))
    (tmp_path / "index.jsonl").write_text(
        "".join(json.dumps({"key": f"{i:02d}.{e}"}) + "\n" for i in range(6) for e in ("txt", "json"))
    )  # no size, no etag: learned by warm
    cache = BlobCache(str(tmp_path / "cache"), size_limit="10MB")
    ds = BlobDataset(
        s3_bucket.url("w"),
        index=tmp_path / "index.jsonl",
        storage_options=s3_proxy.storage_options,
        cache=cache,
    )
    s3_proxy.reset_counts()
    summary = blobdata.warm(ds)
    assert summary.fetched == 12 and summary.failed == 0
    assert sorted(p.rsplit("/", 1)[1] for _, p in s3_proxy.requests) == sorted(
        f"{i:02d}.{e}" for i in range(6) for e in ("txt", "json")
    )  # every member, nothing else, no listing
    s3_proxy.reset_counts()
    assert _epoch(ds) == [(f"t{i}", i) for i in range(6)]
    assert s3_proxy.requests == []
    assert blobdata.warm(ds).skipped == 12  # a second run fetches nothing


def test_warm_command_with_index_and_objects(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s3_bucket.put_many(_objects(4))
    (tmp_path / "index.csv").write_text("key\n" + "".join(f"{i:02d}.txt\n{i:02d}.json\n" for i in range(4)))
    opts = option_args(s3_proxy.storage_options)
    url = s3_bucket.url("w")
    s3_proxy.reset_counts()
    code = main(
        ["warm", url, "--index", str(tmp_path / "index.csv"), "--cache-dir", str(tmp_path / "c"), *opts]
    )
    out = capsys.readouterr().out
    assert code == 0 and "fetched  8 objects" in out
    assert len(s3_proxy.requests) == 8 and all("?" not in p for _, p in s3_proxy.requests)
    ds = BlobDataset(
        url, index=tmp_path / "index.csv", storage_options=s3_proxy.storage_options, cache=tmp_path / "c"
    )
    s3_proxy.reset_counts()
    assert _epoch(ds) == [(f"t{i}", i) for i in range(4)] and s3_proxy.requests == []
    # --objects: everything a BlobDataset(URL) reads (a listing, then every object with an extension)
    code = main(["warm", url, "--objects", "--cache-dir", str(tmp_path / "c2"), *opts])
    assert code == 0 and "fetched  9 objects" in capsys.readouterr().out

"""BlobDataset with a metadata file (Hugging Face's imagefolder convention): one sample per row, file_name
columns naming members, other columns as fields; and its bad inputs, each an error naming the file, the
line and the object."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from blobdata import BlobCache, BlobDataset, ConfigError, NotFound


def _png(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (3, 3), (i, 0, 0)).save(out, format="PNG")
    return out.getvalue()


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _keep(batch: list[Any]) -> list[Any]:
    return batch


def _seg(s: dict[str, Any]) -> tuple[str, int, int, str]:
    return s["__key__"], s["png"].getpixel((0, 0))[0], s["mask"].getpixel((0, 0))[0], s["split"]


def test_metadata_jsonl_on_s3_with_masks_cache_and_workers(
    s3_bucket: Any, s3_proxy: Any, tmp_path: Path
) -> None:
    objects = {f"seg/images/{i}.png": _png(i) for i in range(8)}
    objects.update({f"seg/masks/{i}.png": _png(100 + i) for i in range(8)})
    objects["seg/images/unlisted.png"] = _png(50)  # not in the metadata: not a sample
    rows = [
        {"file_name": f"images/{i}.png", "mask_file_name": f"masks/{i}.png", "split": "train"}
        for i in range(8)
    ]
    objects["seg/metadata.jsonl"] = _jsonl(rows)
    s3_bucket.put_many(objects)
    opts = s3_proxy.storage_options
    ds = BlobDataset(s3_bucket.url("seg"), transform=_seg, storage_options=opts, cache=tmp_path / "c")
    assert ds.keys() == [f"images/{i}" for i in range(8)]
    loader = ds.dataloader(batch_size=3, shuffle=True, num_workers=2, collate_fn=_keep)
    s3_proxy.reset_counts()
    got = sorted(x for b in loader for x in b)
    assert got == [(f"images/{i}", i, 100 + i, "train") for i in range(8)]
    assert len([m for m, _ in s3_proxy.requests if m == "GET"]) == 16  # image + mask, once each
    cache = BlobCache(str(tmp_path / "c"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and cache.info()["entries"] < 16:
        time.sleep(0.05)
    s3_proxy.reset_counts()
    assert sorted(x for b in loader for x in b) == got
    assert [m for m, _ in s3_proxy.requests if m == "GET"] == []
    # The metadata file named explicitly (relative to the URL, or as a URL) gives the same samples.
    again = BlobDataset(
        s3_bucket.url("seg"), metadata=s3_bucket.url("seg/metadata.jsonl"), storage_options=opts
    )
    assert again.keys() == ds.keys()


def test_metadata_csv_fields_and_file_lists(tmp_path: Path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    for name in ("a.jpg", "b.jpg", "a1.txt", "a2.txt"):
        (root / name).write_bytes(_png(1) if name.endswith(".jpg") else name.encode())
    (root / "metadata.csv").write_text(
        'file_name,label,score,caption,notes_file_names\na.jpg,3,0.5,a cat,"[""a1.txt"", ""a2.txt""]"\n'
        "b.jpg,4,1.5,,\n"
    )
    ds = BlobDataset(root)
    a, b = ds[0], ds[1]
    assert a["__key__"] == "a" and isinstance(a["jpg"], Image.Image)
    assert (a["label"], a["score"], a["caption"]) == (3, 0.5, "a cat")
    assert a["notes"] == ["a1.txt", "a2.txt"]  # a <name>_file_names list, decoded by extension
    assert b["label"] == 4 and b["caption"] is None and "notes" not in b
    assert len(ds) == 2  # the metadata file and the text files are not samples of their own


def _dataset_with(tmp_path: Path, metadata: str, name: str = "metadata.jsonl") -> Any:
    root = tmp_path / "d"
    root.mkdir(exist_ok=True)
    (root / "x.jpg").write_bytes(_png(1))
    (root / name).write_text(metadata)
    return lambda: BlobDataset(root)


def test_row_naming_a_missing_object(tmp_path: Path) -> None:
    make = _dataset_with(tmp_path, '{"file_name": "x.jpg"}\n{"file_name": "y.jpg"}\n')
    with pytest.raises(NotFound) as info:
        make()
    msg = str(info.value)
    assert "metadata.jsonl line 2" in msg and f"file://{tmp_path}/d/y.jpg" in msg


def test_missing_member_column(tmp_path: Path) -> None:
    make = _dataset_with(tmp_path, '{"file_name": "x.jpg", "mask_file_name": "masks/x.png"}\n')
    with pytest.raises(NotFound, match=r"metadata\.jsonl line 1 names file://.*/d/masks/x\.png"):
        make()


@pytest.mark.parametrize(
    ("text", "name", "match"),
    [
        (
            '{"file_name": "x.jpg"}\n{"file_name": \n',
            "metadata.jsonl",
            r"metadata\.jsonl line 2 is not valid JSON",
        ),
        ('["x.jpg"]\n', "metadata.jsonl", r"metadata\.jsonl line 1 is not a JSON object"),
        ('{"label": 1}\n', "metadata.jsonl", r"metadata\.jsonl line 1 has no file_name"),
        ("file_name,label\nx.jpg,1,extra\n", "metadata.csv", r"metadata\.csv line 2 has 3 values"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path: Path, text: str, name: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _dataset_with(tmp_path, text, name)()


@pytest.mark.parametrize(
    "outside", ["../x.jpg", "a/../../x.jpg", "/etc/passwd", "s3://elsewhere/x.jpg", "file:///etc/x.jpg"]
)
def test_object_outside_the_url_is_refused(tmp_path: Path, outside: str) -> None:
    make = _dataset_with(tmp_path, json.dumps({"file_name": outside}) + "\n")
    with pytest.raises(ConfigError, match=r"metadata\.jsonl line 1: file_name .* outside the dataset's URL"):
        make()


def test_url_inside_the_root_is_accepted(tmp_path: Path) -> None:
    make = _dataset_with(tmp_path, json.dumps({"file_name": f"file://{tmp_path}/d/x.jpg"}) + "\n")
    assert make().keys() == ["x"]


def test_duplicate_keys(tmp_path: Path) -> None:
    make = _dataset_with(tmp_path, '{"file_name": "x.jpg"}\n{"file_name": "x.jpg", "label": 2}\n')
    with pytest.raises(ConfigError, match=r"line 2 and .*line 1 both describe sample 'x'"):
        make()


def test_a_metadata_file_in_the_working_directory_never_replaces_the_datasets_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_bucket: Any
) -> None:
    """The metadata file found at the dataset's root is read from there, not from a file of the same
    name in the working directory (issue 39, row 4): locally and in a bucket."""
    make = _dataset_with(tmp_path, '{"file_name": "x.jpg", "label": 1}\n')
    s3_bucket.put_many({"d/x.jpg": _png(1), "d/metadata.jsonl": _jsonl([{"file_name": "x.jpg", "label": 1}])})
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "metadata.jsonl").write_text('{"file_name": "x.jpg", "label": 9}\n')
    monkeypatch.chdir(elsewhere)
    for ds in (make(), BlobDataset(s3_bucket.url("d"), storage_options=s3_bucket.storage_options)):
        assert [ds[i]["label"] for i in range(len(ds))] == [1]
        ds.close()

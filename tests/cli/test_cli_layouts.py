"""``blobdata ls``, ``warm`` and ``bench`` read every layout BlobDataset reads (issue 40, item 1): found by
detection, said in one line with how to ask for another; a folder that is not class folders is never
reported as one class. Run as a user runs them: ``python -m blobdata`` against the local S3 server, and
BlobDataset itself, on the same folder, is the oracle for what they should find."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from test_cli import _env, option_args

from blobdata import BlobDataset, FolderDataset

pytestmark = pytest.mark.usefixtures("isolated_cache_home")  # s3_bucket marks its tests network


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (20 + i, 16), (10 * i % 256, 40, 90)).save(buf, "JPEG")
    return buf.getvalue()


def blobdata(bucket: Any, *argv: str, code: int = 0) -> tuple[str, str]:
    """``python -m blobdata ARGV`` with the bucket's options; its stdout and stderr (exit code checked)."""
    done = subprocess.run(
        [sys.executable, "-m", "blobdata", *argv, *option_args(bucket.storage_options)],
        env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == code, (
        f"blobdata {' '.join(argv)} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout, done.stderr


def _layout(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("layout: ")]
    assert len(lines) == 1, out
    return lines[0]


def test_pairs_at_the_root_are_samples_for_ls_warm_and_bench(s3_bucket: Any, tmp_path: Path) -> None:
    """Before: ls said "Couldn't find any class folder" (or "1 classes"), warm warmed 1 object of 10,
    bench measured one file."""
    s3_bucket.put_many(
        {
            **{f"pairs/{i:03d}.jpg": _jpeg(i) for i in range(5)},
            **{f"pairs/{i:03d}.txt": b"cap" for i in range(5)},
        }
    )
    url = s3_bucket.url("pairs")
    ds = BlobDataset(url, storage_options=s3_bucket.storage_options, share_listing=False)
    assert (len(ds), len(ds.objects())) == (5, 10)  # the oracle
    out, _ = blobdata(s3_bucket, "ls", url)
    line = _layout(out)
    assert "samples by file name" in line and "found 5 images at the root" in line
    assert "--classes reads its sub-folders as classes" in line  # how to ask for another
    assert f"{url}: 5 samples, 10 objects" in out and "classes" not in out.split("\n", 1)[1]
    doc = json.loads(blobdata(s3_bucket, "ls", url, "--json")[0])
    assert (doc["layout"], doc["samples"], doc["objects"]) == ("objects", 5, 10)
    assert {m["name"]: m["objects"] for m in doc["members"]} == {"jpg": 5, "txt": 5}

    out, _ = blobdata(s3_bucket, "warm", url, "--cache-dir", str(tmp_path / "c"))
    assert "samples by file name" in _layout(out) and "fetched  10 objects" in out, out
    warmed = BlobDataset(
        url, storage_options=s3_bucket.storage_options, cache=tmp_path / "c", share_listing=False
    )
    loader = warmed.dataloader(batch_size=5, num_workers=0, collate_fn=lambda b: b)
    assert sum(len(b) for b in loader) == 5 and loader.stats().gets == 0  # every member was warmed

    out, _ = blobdata(s3_bucket, "bench", url, "--batches", "2", "--batch-size", "2", "--workers", "1",
                      "--cache-dir", str(tmp_path / "c"))  # fmt: skip
    assert "samples by file name" in _layout(out)
    assert "4 samples in " in out and "hit rate 100%" in out, out


def test_a_metadata_file_found_at_the_root_names_the_samples(s3_bucket: Any, tmp_path: Path) -> None:
    """Before: one class ``images`` and the metadata ignored, exit 0."""
    rows = "".join(f"images/{i}.jpg,a photo {i},{i % 2}\n" for i in range(4))
    s3_bucket.put_many({
        **{f"hf/images/{i}.jpg": _jpeg(i) for i in range(6)},  # two images no row names: not samples
        "hf/metadata.csv": ("file_name,caption,label\n" + rows).encode(),
    })  # fmt: skip
    url = s3_bucket.url("hf")
    ds = BlobDataset(url, storage_options=s3_bucket.storage_options, share_listing=False)
    out, _ = blobdata(s3_bucket, "ls", url)
    assert "the rows of metadata.csv" in _layout(out) and "(found at the root)" in _layout(out)
    assert f"{url}: {len(ds)} samples, {len(ds.objects())} objects" in out and len(ds) == 4
    assert "fields: caption, label" in out
    assert "1 classes" not in out
    out, _ = blobdata(s3_bucket, "warm", url, "--cache-dir", str(tmp_path / "c"))
    assert "fetched  4 objects" in out, out
    # Asked for: the same folder as class folders (one class, as the user said), then by --metadata.
    out, _ = blobdata(s3_bucket, "ls", url, "--classes")
    assert "class folders" in _layout(out) and "(asked: --classes)" in _layout(out) and "1 classes" in out
    out, _ = blobdata(s3_bucket, "ls", url, "--metadata", "metadata.csv")
    assert "(asked: --metadata)" in _layout(out) and "4 samples" in out


@pytest.mark.parametrize(
    ("tree", "why"),
    [
        ({"one/images/a.jpg": 0, "one/images/b.jpg": 1}, "found one sub-folder, images/: not class folders"),
        ({"one/s1/a.jpg": 0, "one/s1/a.txt": 1, "one/s2/b.jpg": 2, "one/s2/b.txt": 3},
         "found samples of several files, e.g. s1/a.jpg and s1/a.txt"),
        ({"one/x/a.wav": 0, "one/y/b.wav": 1}, "found no image"),
    ],
    ids=["one-sub-folder", "pairs-in-sub-folders", "no-image"],
)  # fmt: skip
def test_a_folder_that_is_not_class_folders_is_never_one_class(
    s3_bucket: Any, tree: dict[str, int], why: str
) -> None:
    s3_bucket.put_many({k: _jpeg(v) for k, v in tree.items()})
    url = s3_bucket.url("one")
    ds = BlobDataset(url, storage_options=s3_bucket.storage_options, share_listing=False)
    out, _ = blobdata(s3_bucket, "ls", url)
    assert "samples by file name" in _layout(out) and why in _layout(out), out
    assert f"{len(ds)} samples, {len(ds.objects())} objects" in out
    assert " classes, " not in out


def test_class_folders_are_found_and_objects_asks_for_blobdataset(s3_bucket: Any, tmp_path: Path) -> None:
    s3_bucket.put_many({f"tree/{c}/{i}.jpg": _jpeg(i) for c in ("cat", "dog", "eel") for i in range(3)})
    url = s3_bucket.url("tree")
    out, _ = blobdata(s3_bucket, "ls", url)
    assert "class folders" in _layout(out) and "found 3 sub-folders of images" in _layout(out)
    folder = FolderDataset(url, storage_options=s3_bucket.storage_options, share_listing=False)
    assert "--objects reads it as BlobDataset does" in _layout(out)
    assert f"{len(folder.classes)} classes, {len(folder)} objects" in out
    out, _ = blobdata(s3_bucket, "ls", url, "--objects")
    assert "(asked: --objects)" in _layout(out) and "9 samples, 9 objects" in out
    # Remembered now: the next run sends no listing request and says the layout as before.
    out, err = blobdata(s3_bucket, "warm", url, "--cache-dir", str(tmp_path / "c"))
    assert "class folders" in _layout(out) and "remembered listing" in out and "fetched  9 objects" in out
    assert "WARNING" not in err  # said once, on stdout: the library's warning is left out


def test_an_index_is_a_layout_too(s3_bucket: Any, tmp_path: Path) -> None:
    s3_bucket.put_many({f"ix/{i}.jpg": _jpeg(i) for i in range(4)})
    index = tmp_path / "index.csv"
    index.write_text("key,label\n" + "".join(f"{i}.jpg,{i}\n" for i in range(3)))
    out, _ = blobdata(s3_bucket, "ls", s3_bucket.url("ix"), "--index", str(index))
    assert "the rows of the index" in _layout(out) and "3 samples, 3 objects" in out


def test_every_listing_command_documents_the_layout_options() -> None:
    for command in ("ls", "warm", "bench"):
        done = subprocess.run([sys.executable, "-m", "blobdata", command, "--help"], env=_env(),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0
        for option in ("--classes", "--objects", "--index FILE", "--metadata FILE"):
            assert option in done.stdout, (command, option)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    for option in ("--classes", "--objects", "--index FILE", "--metadata FILE"):
        assert option in docs


@pytest.mark.parametrize(
    ("keys", "kind"),
    [
        (["ä/1.jpg", "ä/2.jpg", "b/3.jpg"], "classes"),
        (["ä/1.jpg", "ä/1.txt", "b/3.jpg"], "objects"),
        (["a/x.b", "a/x.d/y.jpg", "a/x.e", "b/z.jpg"], "objects"),  # one sample's files, a folder between
        (["a/x.jpg", "b/x.jpg", "c/x.d/x.jpg"], "classes"),
    ],
)
def test_detection_reads_every_key_of_the_listing(keys: list[str], kind: str) -> None:
    """The listing's keys as BlobDataset's own listing has them (non-ASCII too), and samples of several
    files found wherever their objects sort."""
    import time

    from blobdata._cli.layout import _relkeys, detect
    from blobdata._listing import FLAT_PARAMS, Manifest

    m = Manifest.from_entries("s3://b/d", [""], ((k, 1, "e", 0) for k in sorted(keys)), listed_at=time.time(),
                              params=FLAT_PARAMS)  # fmt: skip
    assert _relkeys(m) == [m.relkey(j) for j in range(len(m))] == sorted(keys)
    assert detect(m).kind == kind

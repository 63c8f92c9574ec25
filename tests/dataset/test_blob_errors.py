"""Errors that fit BlobDataset (issue 40, item 3): a corrupt member advises ``decoders=`` and names
``on_error="skip"``, a worker's error reaches the loop without the internal fields line, a URL without a
scheme gets the bucket hint, a metadata file naming missing objects says all of them at once (and
``on_error="skip"`` leaves those rows out), and a transform reading a member a sample lacks fails with
an error naming the sample and what it has, still a KeyError."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from blobdata import BlobDataset, DecodeError, FolderDataset, MissingMember, NotFound

ROOT = Path(__file__).resolve().parents[2]


def _jpeg(i: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 16), (30 * i % 256, 60, 90)).save(buf, "JPEG")
    return buf.getvalue()


def _pairs(root: Path, n: int = 4, corrupt: int | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        data = _jpeg(i) if i != corrupt else _jpeg(i)[:150]  # cut short: a truncated upload
        (root / f"{i:03d}.jpg").write_bytes(data)
        (root / f"{i:03d}.txt").write_text(f"caption {i}")
    return root


def test_a_corrupt_member_advises_decoders_and_names_on_error(tmp_path: Path) -> None:
    """Before: 'pass loader=' (BlobDataset has no loader=) and no word of on_error."""
    root = _pairs(tmp_path / "pairs", corrupt=2)
    ds = BlobDataset(root)
    with pytest.raises(DecodeError) as caught:
        ds[2]
    message = str(caught.value)
    assert caught.value.url == f"file://{root}/002.jpg" and message.startswith(
        f"cannot decode file://{root}/002.jpg"
    )
    assert 'decoders={"jpg": fn}' in message and "loader=" not in message, message
    assert 'on_error="skip" trains past samples that cannot be read' in message
    # FolderDataset's own argument is loader=.
    (tmp_path / "cls" / "a").mkdir(parents=True)
    (tmp_path / "cls" / "a" / "x.jpg").write_bytes(_jpeg()[:150])
    with pytest.raises(DecodeError) as folder:
        FolderDataset(tmp_path / "cls")[0]
    assert "loader=" in str(folder.value) and "decoders=" not in str(folder.value)
    assert 'on_error="skip"' in str(folder.value)
    # And on_error="skip" does what the message says.
    skipping = BlobDataset(root, on_error="skip")
    loader = skipping.dataloader(batch_size=4, num_workers=0, collate_fn=lambda b: b)
    assert sorted(s["__key__"] for b in loader for s in b) == ["000", "001", "003"]
    assert [url for url, _ in skipping.errors] == [f"file://{root}/002"]


def test_a_workers_error_reaches_the_user_without_the_internal_fields_line(tmp_path: Path) -> None:
    """Before: the DataLoader's re-raised error printed 'blobdata-error-fields: {...}'."""
    root = _pairs(tmp_path / "pairs", corrupt=1)
    ds = BlobDataset(root)
    loader = ds.dataloader(batch_size=2, num_workers=1, collate_fn=lambda b: b, timeout=120)
    with pytest.raises(DecodeError) as caught:
        list(loader)
    assert "blobdata-error-fields" not in str(caught.value)
    assert caught.value.url == f"file://{root}/001.jpg"  # the fields still come back
    assert 'decoders={"jpg": fn}' in str(caught.value)
    # As a user sees it: the uncaught error of a script.
    script = textwrap.dedent(f"""
        from blobdata import BlobDataset
        loader = BlobDataset({str(root)!r}).dataloader(batch_size=2, num_workers=1, collate_fn=lambda b: b)
        for batch in loader:
            pass
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert done.returncode == 1 and "DecodeError: Caught DecodeError in DataLoader worker" in done.stderr
    assert "001.jpg" in done.stderr and "blobdata-error-fields" not in done.stderr, done.stderr


def test_a_url_without_a_scheme_gets_the_bucket_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotFound) as caught:
        BlobDataset("data/train")
    assert "no such local folder" in str(caught.value)
    assert "for a bucket write s3://data/train (or gs://data/train, az://data/train)" in str(caught.value)


def _metadata_with_missing(root: Path) -> Path:
    _pairs(root, n=3)
    rows = [f'{{"file_name": "{i:03d}.jpg", "mask_file_name": "{i:03d}.txt"}}' for i in range(3)]
    rows += [f'{{"file_name": "gone{i}.jpg", "mask_file_name": "gone{i}.txt"}}' for i in range(4)]
    (root / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return root


def test_a_metadata_file_naming_missing_objects_says_all_at_once(tmp_path: Path) -> None:
    """Before: only the first (one run per missing file), and on_error="skip" did not apply."""
    root = _metadata_with_missing(tmp_path / "d")
    with pytest.raises(NotFound) as caught:
        BlobDataset(root)
    message = str(caught.value)
    assert message.startswith(f"8 objects named in file://{root}/metadata.jsonl (in 4 rows) do not exist")
    for line, name in (
        (4, "gone0.jpg"),
        (4, "gone0.txt"),
        (5, "gone1.jpg"),
        (5, "gone1.txt"),
        (6, "gone2.jpg"),
    ):
        assert f"metadata.jsonl line {line} names file://{root}/{name}" in message
    assert "and 3 more" in message and "gone3" not in message  # the first few, and how many more
    assert 'on_error="skip"' in message and caught.value.url == f"file://{root}/gone0.jpg"


def test_on_error_skip_leaves_out_the_rows_naming_missing_objects(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = _metadata_with_missing(tmp_path / "d")
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        ds = BlobDataset(root, on_error="skip")
    assert ds.keys() == ["000", "001", "002"] and ds[1]["mask"] == "caption 1"
    (warned,) = [r.getMessage() for r in caplog.records if "do not exist" in r.getMessage()]
    assert warned.startswith("8 objects named in") and "those rows are left out" in warned


def test_a_transform_reading_a_member_the_sample_lacks_names_the_sample(tmp_path: Path) -> None:
    """Before: a bare KeyError: 'jpg', naming no sample."""
    root = _pairs(tmp_path / "p", n=2)
    (root / "001.jpg").unlink()  # sample 001 is a caption alone
    ds = BlobDataset(root, transform=lambda s: s["jpg"].size)
    assert ds[0] == (24, 16)
    with pytest.raises(KeyError) as caught:  # except KeyError still works
        ds[1]
    assert isinstance(caught.value, MissingMember)
    message = str(caught.value)
    assert message.startswith(f"sample file://{root}/001 has no member 'jpg'; it has 'txt'."), message
    assert caught.value.url == f"file://{root}/001"
    # Through a worker: the same class and message in the loop, no internal line.
    loader = ds.dataloader(batch_size=2, num_workers=1, collate_fn=lambda b: b, timeout=120)
    with pytest.raises(MissingMember) as again:
        list(loader)
    assert "has no member 'jpg'; it has 'txt'" in str(again.value)
    assert "blobdata-error-fields" not in str(again.value) and again.value.url == f"file://{root}/001"
    # .get() is untouched, and on_error="skip" skips such a sample as any bad one.
    assert BlobDataset(root, transform=lambda s: s.get("jpg"))[1] is None
    skipping = BlobDataset(root, transform=lambda s: s["jpg"].size, on_error="skip")
    got = [x for b in skipping.dataloader(batch_size=2, num_workers=0, collate_fn=lambda b: b) for x in b]
    assert got == [(24, 16)] and len(skipping.errors) == 1


@pytest.mark.network
def test_an_index_naming_a_missing_object_says_how_to_find_them_all(s3_bucket: Any, tmp_path: Path) -> None:
    s3_bucket.put("q/a.txt", b"a")
    (tmp_path / "index.csv").write_text("key\na.txt\nmissing.txt\n")
    ds = BlobDataset(
        s3_bucket.url("q"), index=tmp_path / "index.csv", storage_options=s3_bucket.storage_options
    )
    with pytest.raises(NotFound) as caught:
        ds[1]
    assert "--index FILE --cache-dir D` reads every object once and lists all that are missing" in str(
        caught.value
    )
    assert 'on_error="skip"' in str(caught.value)

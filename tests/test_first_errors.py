"""The errors a newcomer meets first say what to do (issue 30): a URL without its scheme, a flat
folder, a file the default loader cannot decode."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from blobdata import ConfigError, DecodeError, EmptyDatasetError, FolderDataset, NotFound
from blobdata._url import parse_url


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("s3:/data/train", "s3://data/train"), ("s3:data/train", "s3://data/train"),
     ("gs:/b/x", "gs://b/x"), ("az:/c/x", "az://c/x")],
)  # fmt: skip
def test_a_scheme_with_one_slash_is_a_typo(typo: str, meant: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean '{meant}'"):
        parse_url(typo)


def test_a_path_named_like_a_plain_word_is_still_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_url("data/train").protocol == "file"
    assert parse_url("file:/x").protocol == "file"  # not a store's scheme: no typo to suggest


def test_a_missing_local_path_suggests_a_bucket_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotFound) as caught:
        FolderDataset("data/train")
    message = str(caught.value)
    assert "no such local folder" in message
    assert "for a bucket write s3://data/train (or gs://data/train, az://data/train)" in message


def test_an_empty_local_folder_is_not_taken_for_a_url(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyDatasetError) as caught:
        FolderDataset(tmp_path / "empty")
    assert "s3://" not in str(caught.value)


def test_a_flat_local_folder_says_what_it_found(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"{i:02d}.jpg").write_bytes(_jpeg())
    with pytest.raises(EmptyDatasetError) as caught:
        FolderDataset(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"Couldn't find any class folder in {tmp_path}")  # torchvision's words first
    assert "found 20 images at the root (e.g. 00.jpg)" in message
    assert "use blobdata.BlobDataset for folders without class folders" in message


@pytest.mark.network
def test_a_flat_bucket_folder_says_what_it_found(s3_bucket: Any) -> None:
    s3_bucket.put_many({**{f"flat/{i}.jpg": _jpeg() for i in range(5)}, "flat/notes.txt": b"x"})
    with pytest.raises(EmptyDatasetError) as caught:
        FolderDataset(s3_bucket.url("flat"), storage_options=s3_bucket.storage_options)
    assert "found 6 files (5 images) at the root" in str(caught.value)
    assert "blobdata.BlobDataset" in str(caught.value)


def test_a_wav_through_the_default_loader_says_to_pass_loader(tmp_path: Path) -> None:
    (tmp_path / "speech").mkdir()
    (tmp_path / "speech" / "a.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(32))
    ds = FolderDataset(tmp_path, extensions=(".wav",))
    with pytest.raises(DecodeError, match=r"for \.wav files pass loader="):
        ds[0]
    raw = FolderDataset(tmp_path, extensions=(".wav",), loader=lambda f: f.read())
    assert raw[0][0].startswith(b"RIFF")

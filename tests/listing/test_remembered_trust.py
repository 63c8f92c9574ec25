"""Remembered listings under the cache home are mapped only when they are the user's own: another user
who can write ``manifests/`` cannot flip a dataset's labels (issue 39, row 2)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from blobdata._listing import Manifest, load_or_list, manifest_path
from blobdata._listing.remembered import load_remembered
from tests.support.other_user import OTHER_UID, as_other_user, shared_place

ROOT = "s3://bucket/train"


def _listing(targets: list[int]) -> Manifest:
    entries = [(f"{'cat' if t == 0 else 'dog'}/{i}.jpg", 10, f"e{i}", t) for i, t in enumerate(targets)]
    return Manifest.from_entries(ROOT, ["cat", "dog"], entries, listed_at=1e10)


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A cache home both users can reach; ``manifests/`` in it is made by each test."""
    with shared_place() as place:
        monkeypatch.setenv("BLOBDATA_CACHE_HOME", str(place / "home"))
        (place / "home").mkdir(mode=0o755)
        yield place / "home"


def _plant(path: Path, data: bytes) -> None:
    """As the other user: ``data`` written beside ``path``, then renamed over it."""

    def plant() -> None:
        tmp = path.with_name(".planted")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)

    as_other_user(plant)


def test_a_listing_replaced_by_another_user_is_not_used(
    home: Path, s3_bucket: Any, caplog: pytest.LogCaptureFixture
) -> None:
    s3_bucket.put_many({"train/cat/0.jpg": b"c", "train/dog/1.jpg": b"d"})
    url, opts = s3_bucket.url("train"), s3_bucket.storage_options
    first = load_or_list(url, storage_options=opts)
    assert [first.target(i) for i in range(2)] == [0, 1]
    manifests = home / "manifests"
    [path] = manifests.iterdir()  # remembered, 0600 in a 0700 directory of the user's own
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # The directory becomes writable by others (a team's shared cache home); another user swaps the
    # listing for one whose labels are flipped.
    os.chmod(manifests, 0o777)
    forged = Manifest.from_entries(
        first.root, first.classes, [(first.relkey(i), first.size(i), first.identity(i), 1 - first.target(i))
                                    for i in range(2)], listed_at=first.listed_at, params=first.params,
    )  # fmt: skip
    _plant(path, forged.to_bytes())
    assert path.stat().st_uid == OTHER_UID
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        again = load_or_list(url, storage_options=opts)
    assert [again.target(i) for i in range(2)] == [0, 1]  # listed again: the bucket's own labels
    said = caplog.text
    assert str(manifests) in said and "writable by group or others" in said and "listing" in said
    assert path.stat().st_uid == OTHER_UID  # nothing of the user's written into that directory


def test_a_listing_of_another_user_in_a_sticky_directory_is_ignored(
    home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manifests = home / "manifests"
    manifests.mkdir()
    os.chmod(manifests, 0o1777)  # as /tmp: others may create files, not replace the user's
    path = manifests / "planted.manifest"
    _plant(path, _listing([1, 0]).to_bytes())  # planted before the user's first listing
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        assert load_remembered(path, ROOT, None) is None
    assert str(path) in caplog.text and f"uid {OTHER_UID}" in caplog.text


def test_a_listing_in_a_directory_of_another_user_is_ignored(
    home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manifests = home / "manifests"

    def make() -> None:
        manifests.mkdir(mode=0o755)
        (manifests / "x.manifest").write_bytes(_listing([1, 0]).to_bytes())

    os.chmod(home, 0o777)
    as_other_user(make)
    os.chmod(home, 0o755)
    path = manifests / "x.manifest"
    os.chown(path, 0, 0)  # even a file of the user's own is not trusted in a directory of another's
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        assert load_remembered(path, ROOT, None) is None
    assert str(manifests) in caplog.text and f"owned by uid {OTHER_UID}" in caplog.text


def test_a_listing_that_is_a_link_is_not_followed(home: Path, caplog: pytest.LogCaptureFixture) -> None:
    manifests = home / "manifests"
    manifests.mkdir(mode=0o700)
    elsewhere = home / "elsewhere.manifest"
    elsewhere.write_bytes(_listing([1, 0]).to_bytes())
    path = manifests / "x.manifest"
    path.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="blobdata"):
        assert load_remembered(path, ROOT, None) is None
    assert str(path) in caplog.text and "symbolic link" in caplog.text


def test_the_users_own_listing_is_used_and_a_fresh_one_is_remembered(home: Path) -> None:
    path = manifest_path(ROOT, "", {})
    _listing([0, 1]).save(path)  # makes manifests/ 0700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    got = load_remembered(path, ROOT, None)
    assert got is not None and [got.target(i) for i in range(2)] == [0, 1]

"""Rank 0's hand-off of its listing through BLOBDATA_SHARED_DIR trusts only the user's own files, and
its ``.error`` file follows no link (issue 29, finding 9)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from blobdata._errors import ConfigError
from blobdata._listing import Manifest, list_folder, shared_file, shared_manifest

OTHER_UID = 54321


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A two-process job without a process group, handing off through ``tmp_path / "shared"``."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    monkeypatch.setenv("BLOBDATA_SHARED_DIR", str(shared))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("BLOBDATA_SHARED_TIMEOUT", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"trust-{time.time_ns()}")
    for folder in ("data", "evil"):
        (tmp_path / folder / "cat").mkdir(parents=True)
        (tmp_path / folder / "cat" / "a.png").write_bytes(folder.encode())
    return shared


def _planted(tmp_path: Path, root: str) -> Path:
    """A valid hand-off file for ``root`` whose one key is the attacker's choice."""
    path = shared_file(root, "", 1)
    listed = list_folder(str(tmp_path / "evil"))
    forged = Manifest.from_entries(root, ["cat"], [("cat/evil.png", 4, listed.identity(0), 0)], listed_at=0.0)
    forged.save(path)
    return path


def test_a_rank_refuses_a_hand_off_file_of_another_user(
    job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("simulating another owner needs root")
    monkeypatch.setenv("RANK", "1")
    root = list_folder(str(tmp_path / "data")).root
    path = _planted(tmp_path, root)
    os.chmod(job, 0o1777)  # a shared sticky directory, as /tmp: others may create files in it
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError) as info:
        shared_manifest(root, lambda: pytest.fail("only rank 0 lists"))
    assert str(path) in str(info.value) and f"uid {OTHER_UID}" in str(info.value)


def test_a_rank_refuses_a_hand_off_file_that_is_a_link(
    job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    root = list_folder(str(tmp_path / "data")).root
    path = _planted(tmp_path, root)
    elsewhere = tmp_path / "elsewhere.manifest"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="link"):
        shared_manifest(root, lambda: pytest.fail("only rank 0 lists"))


def test_a_rank_refuses_a_shared_directory_anyone_can_write(
    job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    root = list_folder(str(tmp_path / "data")).root
    _planted(tmp_path, root)
    os.chmod(job, 0o777)  # not sticky: anyone could replace rank 0's file
    with pytest.raises(ConfigError) as info:
        shared_manifest(root, lambda: pytest.fail("only rank 0 lists"))
    assert str(job) in str(info.value) and "BLOBDATA_SHARED_DIR" in str(info.value)


def test_the_users_own_hand_off_is_received(
    job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    root = list_folder(str(tmp_path / "data")).root
    _planted(tmp_path, root)
    got = shared_manifest(root, lambda: pytest.fail("only rank 0 lists"))
    assert got.relkey(0) == "cat/evil.png"  # the user's own file: trusted as before


def test_rank_0s_error_file_follows_no_link(
    job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    root = list_folder(str(tmp_path / "data")).root
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    failed = shared_file(root, "", 1).with_suffix(".error")

    def make() -> Manifest:
        failed.symlink_to(victim)  # planted while rank 0 lists
        raise OSError("the store is down")

    with pytest.raises(OSError, match="the store is down"):
        shared_manifest(root, make)
    assert victim.read_text() == "precious"
    assert not failed.is_symlink() and "the store is down" in failed.read_text()
    assert failed.stat().st_mode & 0o077 == 0
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(Exception, match="the store is down"):  # the other ranks get the error
        shared_manifest(root, lambda: pytest.fail("only rank 0 lists"))


def test_a_received_manifest_for_a_local_folder_cannot_name_keys_outside_it(
    job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    root = list_folder(str(tmp_path / "data")).root
    path = shared_file(root, "", 1)
    listed = list_folder(str(tmp_path / "evil"))
    forged = Manifest.from_entries(
        root, ["cat"], [("cat/../../evil/cat/a.png", 4, listed.identity(0), 0)], listed_at=0.0
    )
    forged.save(path)
    with pytest.raises(ConfigError, match="outside"):
        shared_manifest(root, lambda: pytest.fail("only rank 0 lists"))

"""A cache no one else can poison: owner and mode of the directory and index, planted links, the
size floor and bad numbers (issue 29, findings 1, 2, 4 and 8)."""

from __future__ import annotations

import math
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from blobdata._cache import BlobCache
from blobdata._cli import main
from blobdata._errors import CacheError, ConfigError

OTHER_UID = 54321  # a uid no test user has: root (the tests' user here) can chown to it
BIG = 100_000


def warmed(directory: Path) -> None:
    """A cache in ``directory`` holding one value file entry and one inline entry."""
    with BlobCache(directory, size_limit="10MB") as cache:
        assert cache.put("s3://b/big", "e1", b"x" * BIG)
        assert cache.put("s3://b/small", "e1", b"y" * 100)


def needs_chown() -> None:
    if os.geteuid() != 0:
        pytest.skip("simulating another owner needs root (chown to another uid)")


# -- finding 1: a cache owned by someone else, or writable by group or others --------------------


def test_a_cache_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    needs_chown()
    directory = tmp_path / "c"
    warmed(directory)
    os.chown(directory, OTHER_UID, OTHER_UID)
    os.chmod(directory, 0o777)  # the other user shares it with everyone
    with pytest.raises(CacheError) as info:
        BlobCache(directory, size_limit="10MB")
    text = str(info.value)
    assert str(directory) in text and f"uid {OTHER_UID}" in text and "your own" in text


def test_an_index_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    needs_chown()
    directory = tmp_path / "c"
    warmed(directory)
    os.chown(directory / "cache.db", OTHER_UID, OTHER_UID)
    with pytest.raises(CacheError) as info:
        BlobCache(directory, size_limit="10MB")
    assert str(directory / "cache.db") in str(info.value) and f"uid {OTHER_UID}" in str(info.value)


def test_a_group_or_world_writable_cache_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    warmed(directory)
    os.chmod(directory, 0o777)
    with pytest.raises(CacheError) as info:
        BlobCache(directory, size_limit="10MB")
    text = str(info.value)
    assert str(directory) in text and "writable by group or others" in text and "chmod 700" in text
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o777  # refused, not silently tightened
    os.chmod(directory, 0o770)
    with pytest.raises(CacheError, match="writable by group or others"):
        BlobCache(directory, size_limit="10MB")
    os.chmod(directory, 0o700)  # the owner vouches for it: used again, entries intact
    with BlobCache(directory, size_limit="10MB") as cache:
        assert cache.get("s3://b/big", "e1") == b"x" * BIG


def test_a_writable_index_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    warmed(directory)
    os.chmod(directory / "cache.db", 0o666)
    with pytest.raises(CacheError, match="writable by group or others"):
        BlobCache(directory, size_limit="10MB")


def test_an_empty_writable_directory_is_made_private_and_used(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    directory.mkdir(mode=0o777)
    os.chmod(directory, 0o777)
    with BlobCache(directory, size_limit="10MB") as cache:  # nothing in it could have been planted
        assert cache.put("s3://b/k", "e", b"z" * 10)
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700


def test_a_cache_directory_behind_a_link_of_another_user_is_refused(tmp_path: Path) -> None:
    needs_chown()
    real = tmp_path / "real"
    warmed(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    with BlobCache(link, size_limit="10MB") as cache:  # a link of one's own (e.g. to a scratch disk)
        assert cache.get("s3://b/big", "e1") == b"x" * BIG
    os.lchown(link, OTHER_UID, OTHER_UID)
    with pytest.raises(CacheError, match=f"link owned by uid {OTHER_UID}"):
        BlobCache(link, size_limit="10MB")


# -- finding 2: cache.db (or its -wal / -shm) as a planted link ----------------------------------


@pytest.mark.parametrize("name", ["cache.db", "cache.db-wal", "cache.db-shm"])
def test_a_planted_link_in_place_of_the_index_is_refused_and_its_target_untouched(
    tmp_path: Path, name: str
) -> None:
    directory = tmp_path / "c"
    warmed(directory)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    os.chmod(victim, 0o644)
    (directory / name).unlink(missing_ok=True)
    (directory / name).symlink_to(victim)
    with pytest.raises(CacheError) as info:
        BlobCache(directory, size_limit="10MB")
    assert str(directory / name) in str(info.value) and "link" in str(info.value)
    assert victim.read_bytes() == b"precious"
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o644


def test_a_planted_link_in_a_fresh_directory_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (directory / "cache.db").symlink_to(victim)
    with pytest.raises(CacheError, match="link"):
        BlobCache.inspect(directory)
    with pytest.raises(CacheError, match="link"):
        BlobCache(directory, size_limit="10MB")
    assert victim.read_bytes() == b"precious"


def test_a_hard_link_in_place_of_the_index_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    warmed(directory)
    os.link(directory / "cache.db", tmp_path / "elsewhere.db")
    with pytest.raises(CacheError, match="hard link"):
        BlobCache(directory, size_limit="10MB")


def test_the_checks_happen_once_per_process_not_per_get(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    warmed(directory)
    with BlobCache(directory, size_limit="10MB") as cache:
        assert cache.get("s3://b/big", "e1") == b"x" * BIG
        os.chmod(directory, 0o777)  # after the open: the open's verdict stands for this process
        try:
            assert cache.get("s3://b/big", "e1") == b"x" * BIG
        finally:
            os.chmod(directory, 0o700)


# -- finding 4: a limit of 0 (or nearly) would evict every entry of every job ---------------------


@pytest.mark.parametrize("limit", [0, 1, "0.5", "0", "1kB", 65_535])
def test_a_limit_below_the_floor_is_refused_and_evicts_nothing(tmp_path: Path, limit: int | str) -> None:
    directory = tmp_path / "c"
    warmed(directory)
    with pytest.raises(ConfigError) as info:
        BlobCache(directory, size_limit=limit)
    assert "size_limit" in str(info.value) and "64KiB" in str(info.value)
    with BlobCache(directory, size_limit="10MB") as cache:
        assert cache.stats().entries == 2
        assert cache.get("s3://b/big", "e1") == b"x" * BIG
    with pytest.raises(ConfigError):
        BlobCache(tmp_path / "fresh", size_limit=limit)
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("limit", ["0", "0.5", "1"])
def test_warm_refuses_a_cache_size_below_the_floor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: str
) -> None:
    data = tmp_path / "data" / "cat"
    data.mkdir(parents=True)
    (data / "a.jpg").write_bytes(b"a" * 1000)
    directory = tmp_path / "c"
    warmed(directory)
    code = main(["warm", str(tmp_path / "data"), "--cache-dir", str(directory), "--cache-size", limit, "-q"])
    assert code == 2
    assert "--cache-size" in capsys.readouterr().err
    with BlobCache(directory, size_limit="10MB") as cache:
        assert cache.stats().entries == 2


# -- finding 8: numbers that are not sizes ----------------------------------------------------------


@pytest.mark.parametrize("limit", [math.nan, math.inf, -math.inf, 2**70, 1e30, "99999999999TB"])
def test_a_size_limit_that_is_not_a_size_is_refused_before_anything_is_created(
    tmp_path: Path, limit: float | int | str
) -> None:
    with pytest.raises(ConfigError) as info:
        BlobCache(tmp_path / "c", size_limit=limit)
    assert "size_limit" in str(info.value)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("grace", [math.nan, math.inf, 1e300])
def test_durations_of_the_cache_that_are_not_durations_are_refused(tmp_path: Path, grace: float) -> None:
    for name in ("orphan_grace", "write_pause"):
        with pytest.raises(ConfigError, match=name):
            BlobCache(tmp_path / "c", size_limit="10MB", **{name: grace})  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()


# -- issue 39, row 1: the cache's parent directories ----------------------------------------------


@pytest.fixture
def reachable(tmp_path: Path) -> Iterator[Path]:
    """A directory under /tmp that another user can reach (pytest's own base is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="blobdata-trust-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _swap_in_as(uid: int, parent: Path, directory: Path, theirs: Path) -> None:
    """As user ``uid`` (a forked child): rename ``directory`` away and put ``theirs`` in its place."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.rename(directory, parent / "moved")
            os.rename(theirs, directory)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_cache_under_a_parent_others_can_write_is_refused(tmp_path: Path, reachable: Path) -> None:
    needs_chown()
    parent = reachable / "shared"
    parent.mkdir()
    directory = parent / "c"
    warmed(directory)
    with BlobCache(tmp_path / "evil", size_limit="10MB") as evil:  # the same keys, bytes of their choosing
        evil.put("s3://b/small", "e1", b"EVIL" * 25)
    for path in [tmp_path / "evil", *(tmp_path / "evil").rglob("*")]:
        os.chown(path, OTHER_UID, OTHER_UID)
    os.rename(tmp_path / "evil", parent / "staged")
    os.chmod(parent, 0o777)  # no sticky bit: anyone may rename what is in it
    with pytest.raises(CacheError) as info:
        BlobCache(directory, size_limit="10MB")
    text = str(info.value)
    assert str(parent) in text and "writable by group or others" in text and "chmod" in text
    # What the refusal prevents: another user swaps the checked directory for theirs, any time later.
    _swap_in_as(OTHER_UID, parent, directory, parent / "staged")
    with pytest.raises(CacheError):
        BlobCache(directory, size_limit="10MB")
    os.chmod(parent, 0o1777)  # sticky (as /tmp): others may no longer rename our entries
    with pytest.raises(CacheError, match=f"uid {OTHER_UID}"):  # and the swapped-in one is theirs
        BlobCache(directory, size_limit="10MB")


def test_a_parent_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    needs_chown()
    parent = tmp_path / "theirs"
    parent.mkdir()
    directory = parent / "c"
    warmed(directory)
    os.chown(parent, OTHER_UID, OTHER_UID)  # 0755, but its owner can rename anything in it
    with pytest.raises(CacheError) as info:
        BlobCache(directory, size_limit="10MB")
    assert str(parent) in str(info.value) and f"uid {OTHER_UID}" in str(info.value)


def test_a_sticky_or_private_parent_is_fine_and_a_link_is_checked_resolved(tmp_path: Path) -> None:
    sticky = tmp_path / "scratch"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    warmed(sticky / "c")
    with BlobCache(sticky / "c", size_limit="10MB") as cache:
        assert cache.get("s3://b/big", "e1") == b"x" * BIG
    # A link of one's own to a cache whose real parent others may write: the real parent counts.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    warmed(open_dir / "c")
    os.chmod(open_dir, 0o777)
    (tmp_path / "link").symlink_to(open_dir / "c")
    with pytest.raises(CacheError, match=str(open_dir)):
        BlobCache(tmp_path / "link", size_limit="10MB")

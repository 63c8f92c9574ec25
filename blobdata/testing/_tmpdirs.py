"""The temporary directory of a local server: held by its owner's lock for the server's life, and removed
by the next server started when its owner was killed (SIGKILL, the OOM killer) before it could remove it.

A directory ``$TMPDIR/blobdata-<name>-<random>`` (0700) holds ``.owner.lock``, on which the process
that started the server holds an exclusive ``flock`` until it stops it; the kernel drops the lock when
that process exits, however it dies (and the server dies with it: ``PR_SET_PDEATHSIG``). A later start
takes the lock of each such directory of this user that it can (its owner is gone) and removes the
directory. The lock is taken before the file bears its name, so no one ever sees it unlocked; a
directory without one (made before this rule, or by someone else) is never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

__all__ = ["make", "release", "sweep"]

LOCK = ".owner.lock"


def make(name: str) -> tuple[Path, int]:
    """A new directory ``blobdata-<name>-*`` (0700) in the temporary directory, and the descriptor that
    holds its lock (keep it open while the server runs; :func:`release` it)."""
    path = Path(tempfile.mkdtemp(prefix=f"blobdata-{name}-"))
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path / ".owner.new", flags, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(path / ".owner.new", path / LOCK)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path, fd


def release(path: Path, fd: int | None) -> None:
    """Remove ``path`` and drop its lock."""
    shutil.rmtree(path, ignore_errors=True)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def sweep(name: str) -> list[Path]:
    """Remove the directories ``blobdata-<name>-*`` of this user whose owner is gone (see the module);
    returns them."""
    top = Path(tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = [top / n for n in os.listdir(top) if n.startswith(f"blobdata-{name}-")]
    except OSError:
        return removed
    for path in entries:
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(path / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # no lock: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its owner runs
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed

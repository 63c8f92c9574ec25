"""Files one user's processes hand to each other through a shared directory (``BLOBDATA_SHARED_DIR``):
read only if this user's own, written without following a link.

The rule is the cache's (:mod:`blobdata._cache.trust`): a file is trusted only if it is a regular file
(not a link: opened with ``O_NOFOLLOW`` and checked with ``fstat`` on the very descriptor read)
owned by the current user and not writable by group or others, in a directory that nobody else can
replace it in (this user's or root's, and not writable by others unless sticky, as ``/tmp``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile

from .._errors import ConfigError

__all__ = ["check_shared_dir", "read_own", "write_own"]

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _you(uid: int) -> str:
    return f"uid {uid} (you are uid {os.geteuid()})"


def check_shared_dir(directory: str, *, setting: str) -> None:
    """ConfigError unless nobody but this user (and root) can replace files in ``directory`` (set by
    ``setting``, named in the message); nothing to check while it does not exist."""
    euid = os.geteuid()
    try:
        link = os.lstat(directory)
        st = os.stat(directory)
    except FileNotFoundError:
        return
    todo = f"point {setting} at a directory of your own (mode 0700)"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (euid, 0):
        raise ConfigError(
            f"{setting} {directory} is a link owned by {_you(link.st_uid)}; {todo}", url=directory
        )
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{setting} {directory} is not a directory; {todo}", url=directory)
    if st.st_uid not in (euid, 0):
        raise ConfigError(
            f"{setting} {directory} is owned by {_you(st.st_uid)}, who could replace what your ranks "
            f"hand each other; {todo}",
            url=directory,
        )
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"{setting} {directory} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}) "
            f"and not sticky, so anyone could replace what your ranks hand each other; {todo}",
            url=directory,
        )


def read_own(path: str, *, limit: int = -1) -> bytes | None:
    """The bytes of ``path`` (at most ``limit`` if >= 0), or None if it does not exist; ConfigError if
    it is a link, not a regular file, another user's, or writable by group or others."""
    fd = _open_own(path)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as fh:
        return fh.read(limit) if limit >= 0 else fh.read()


def is_own(path: str) -> bool:
    """Whether ``path`` exists as this user's own file (False if it does not exist); ConfigError as
    :func:`read_own` if it is there but not to be trusted. For a file to be mapped, not read."""
    fd = _open_own(path)
    if fd is None:
        return False
    os.close(fd)
    return True


def _open_own(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{path} is a symbolic link; remove it (rm the link, not its target)", url=path
            ) from None
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "it is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"it is owned by {_you(st.st_uid)}"
    elif st.st_mode & _OTHERS_WRITE:
        problem = f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem is not None:
        os.close(fd)
        raise ConfigError(f"{path} is not trusted: {problem}; remove it, it is not your ranks'", url=path)
    return fd


def write_own(path: str, data: bytes) -> None:
    """Write ``path`` atomically (a new 0600 temp file, then a rename that replaces a link, never
    following it)."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

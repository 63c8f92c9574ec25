"""Files one user's processes share on the node (a rank's hand-off in ``BLOBDATA_SHARED_DIR``, the
listings remembered under the cache home): read only if this user's own, written without following a link.

The rule is the cache's (:mod:`blobdata._cache.trust`): a file is trusted only if it is a regular file
(not a link: opened with ``O_NOFOLLOW`` and checked with ``fstat`` on the very descriptor read or mapped)
owned by the current user and not writable by group or others, in a directory that nobody else can
replace it in (this user's or root's, and not writable by others unless sticky, as ``/tmp``). The
directory is checked on a descriptor held while the file is opened relative to it, so a directory
swapped after the check is not the one the file comes from.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile

from .._errors import ConfigError

__all__ = ["check_shared_dir", "is_own", "open_own", "read_own", "write_own"]

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: What to do with a file that is not trusted, unless the caller says otherwise.
_REMOVE = "remove it: only your own files are read"


def _you(uid: int) -> str:
    return f"uid {uid} (you are uid {os.geteuid()})"


def check_shared_dir(directory: str, *, setting: str) -> None:
    """ConfigError unless nobody but this user (and root) can replace files in ``directory`` (set by
    ``setting``, named in the message); nothing to check while it does not exist."""
    try:
        fd = _open_dir(directory, setting)
    except FileNotFoundError:
        return
    os.close(fd)


def _open_dir(directory: str, setting: str) -> int:
    """A descriptor of ``directory`` once checked (see :func:`check_shared_dir`); FileNotFoundError
    when it does not exist."""
    link = os.lstat(directory)
    todo = f"set {setting} to a directory of your own (mode 0700)"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
        raise ConfigError(
            f"{directory} ({setting}) is a link owned by {_you(link.st_uid)}; {todo}", url=directory
        )
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise ConfigError(f"{directory} ({setting}) is not a directory; {todo}", url=directory) from None
    try:
        st = os.fstat(fd)
        if st.st_uid not in (os.geteuid(), 0):
            raise ConfigError(
                f"{directory} ({setting}) is owned by {_you(st.st_uid)}, who could replace the files "
                f"blobdata reads there; {todo}",
                url=directory,
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & _OTHERS_WRITE and not mode & stat.S_ISVTX:
            raise ConfigError(
                f"{directory} ({setting}) is writable by group or others (mode {mode:04o}) and not sticky, "
                f"so anyone could replace the files blobdata reads there; run chmod 700 {directory}, or "
                f"{todo}",
                url=directory,
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_own(path: str, *, setting: str, todo: str = _REMOVE) -> int | None:
    """A read-only descriptor of ``path`` (close it), or None if it or its directory does not exist.

    ConfigError (naming ``path``, the problem and ``todo``) if the file is a link, not a regular file,
    another user's or writable by group or others, or if its directory is not to be trusted (see the
    module; ``setting`` names what chose the directory). The file is opened relative to a descriptor of
    the checked directory, so the checks hold for the file this descriptor reads."""
    directory, name = os.path.split(path)
    try:
        dfd = _open_dir(directory or ".", setting)
    except FileNotFoundError:
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{path} is a symbolic link; remove it (rm the link, not its target)", url=path
            ) from None
        raise
    finally:
        os.close(dfd)
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
        raise ConfigError(f"{path} is not trusted: {problem}; {todo}", url=path)
    return fd


def read_own(path: str, *, setting: str, todo: str = _REMOVE, limit: int = -1) -> bytes | None:
    """The bytes of ``path`` (at most ``limit`` if >= 0), or None if it does not exist; ConfigError as
    :func:`open_own` if it is there but not to be trusted."""
    fd = open_own(path, setting=setting, todo=todo)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as fh:
        return fh.read(limit) if limit >= 0 else fh.read()


def is_own(path: str, *, setting: str, todo: str = _REMOVE) -> bool:
    """Whether ``path`` exists as this user's own file (False if it does not exist); ConfigError as
    :func:`open_own` if it is there but not to be trusted."""
    fd = open_own(path, setting=setting, todo=todo)
    if fd is None:
        return False
    os.close(fd)
    return True


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

"""Whose cache this is: a cache is used only if its directory and index belong to the user opening it.

A CRC proves that bytes were not torn, not who wrote them: anyone who can write the directory or
the index can make any ``(url, ETag)`` a verified hit with bytes of their choosing. So when a
process opens a cache (once per process, never per ``get``), :func:`open_private_dir` requires,
without following links:

* the directory is a directory owned by the current user and not writable by group or others (a
  directory of one's own that is readable by others is made 0700; an *empty* writable one too, as
  nothing can have been planted in it yet). The path given may be a link (a cache on a scratch
  disk), only one owned by the current user or root;
* ``cache.db``, ``cache.db-wal`` and ``cache.db-shm``, where they exist, are regular files (not
  links, not hard-linked elsewhere) owned by the current user and not writable by group or others;
* every directory above it, on the path as given and on the path it resolves to, is owned by the
  current user or root and writable by no one else, or has the sticky bit (``/tmp``): else another
  user could rename the checked directory away after the check and put one of their own in its
  place, whose bytes every later read would take for verified hits (the files are opened by path
  after the check). OpenSSH checks a key file's parents the same way.

Anything else raises :class:`~blobdata.CacheError` naming the path, what is wrong and what to do.
The index itself is checked with ``lstat`` relative to a descriptor of the checked directory,
never opened: closing a descriptor of an open SQLite file would drop this process's locks on it.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat

from .._errors import CacheError
from .packs import PACK_DIR
from .values import DB_NAME

__all__ = ["INDEX_FILES", "open_private_dir"]

INDEX_FILES = (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm")
_CACHE_NAME = re.compile(rf"[0-9a-f]{{2}}|{PACK_DIR}|{re.escape(DB_NAME)}(-wal|-shm)?")
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _refuse(path: str, problem: str, todo: str) -> CacheError:
    return CacheError(f"cache {path} is not safe to use: {problem}; {todo}", url=path)


def _uid_text(uid: int) -> str:
    return f"uid {uid} (you are uid {os.geteuid()})"


def open_private_dir(directory: str) -> None:
    """Create ``directory`` (0700) or check an existing one and its index files (see the module).

    Raises :class:`CacheError` for a directory or index that is not the current user's alone, and
    OSError when the directory cannot be created or read."""
    euid = os.geteuid()
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        os.makedirs(os.path.dirname(directory) or ".", exist_ok=True)  # parents are the user's
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    link = os.lstat(directory)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (euid, 0):
        raise _refuse(
            directory,
            f"it is a link owned by {_uid_text(link.st_uid)}, who can point it anywhere",
            "pass a cache directory of your own (or the link's target, if you trust it)",
        )
    _check_parents(directory, euid)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_dir(directory, fd, euid)
        for name in INDEX_FILES:
            _check_index_file(os.path.join(directory, name), name, fd, euid)
    finally:
        os.close(fd)


def _check_parents(directory: str, euid: int) -> None:
    """Every directory above ``directory`` (as given, and as resolved) is safe from other users: owned
    by the current user or root, and not writable by group or others unless sticky."""
    given = os.path.abspath(directory)
    seen: set[str] = set()
    for path in (given, os.path.realpath(given)):
        parent = os.path.dirname(path)
        while parent not in seen:
            seen.add(parent)
            try:
                st = os.stat(parent)  # the directory itself; a link on the way is checked resolved
            except OSError:
                break
            mode = stat.S_IMODE(st.st_mode)
            if st.st_uid not in (euid, 0):
                raise _refuse(
                    directory,
                    f"its parent directory {parent} is owned by {_uid_text(st.st_uid)}, who could replace "
                    "the cache directory with one of their own",
                    "put the cache in a directory of your own (or one only root can write)",
                )
            if mode & _SHARED_WRITE and not mode & stat.S_ISVTX:
                raise _refuse(
                    directory,
                    f"its parent directory {parent} is writable by group or others (mode {mode:04o}, no "
                    "sticky bit), so another user could replace the cache directory after this check",
                    f"put the cache elsewhere, or run: chmod o-w,g-w {parent} (or chmod +t {parent})",
                )
            if parent == "/":
                break
            parent = os.path.dirname(parent)


def _check_dir(directory: str, fd: int, euid: int) -> None:
    st = os.fstat(fd)
    if st.st_uid != euid:
        raise _refuse(
            directory,
            f"the directory is owned by {_uid_text(st.st_uid)}, whose bytes would come back as verified hits",
            "use a cache directory of your own (one per user on a shared node)",
        )
    mode = stat.S_IMODE(st.st_mode)
    if not mode & 0o077:
        return
    names = os.listdir(fd)
    if mode & _SHARED_WRITE and names:
        raise _refuse(
            directory,
            f"the directory is writable by group or others (mode {mode:04o}), so anyone could have "
            "replaced its entries",
            f"if you trust its content, run: chmod 700 {directory}; else choose another directory",
        )
    # Tighten only a directory that is empty or already a cache, never an arbitrary user folder.
    if all(_CACHE_NAME.fullmatch(n) for n in names):
        os.chmod(fd, 0o700)


def _check_index_file(path: str, name: str, fd: int, euid: int) -> None:
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(
            path,
            f"it is a symbolic link (to {os.readlink(name, dir_fd=fd)!r}), which SQLite would follow "
            "and overwrite",
            "remove the link (rm it, not its target) or choose another cache directory",
        )
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, "it is not a regular file", "remove it or choose another cache directory")
    if st.st_uid != euid:
        raise _refuse(path, f"it is owned by {_uid_text(st.st_uid)}", "use a cache directory of your own")
    if st.st_nlink != 1:
        raise _refuse(
            path,
            f"it has {st.st_nlink} hard links, so it is also another file",
            "remove it (the cache starts empty) or choose another cache directory",
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & _SHARED_WRITE:
        raise _refuse(
            path,
            f"it is writable by group or others (mode {mode:04o}), so anyone could have rewritten it",
            f"if you trust it, run: chmod 600 {path}; else remove it (the cache starts empty)",
        )
    if mode & 0o077:
        os.chmod(name, 0o600, dir_fd=fd)

"""How a manifest file reaches a process: mapped read-only, its checksum verified once per file and node.

A local manifest is memory-mapped (``mmap``, read-only) instead of read: its arrays are views of the
file's pages in the page cache, which every process of the node maps to the same physical memory (the
ranks of a node, their DataLoader workers, later jobs). A process's anonymous memory no longer grows
with the manifest, and a manifest larger than memory still works: pages come and go as the kernel
needs. A manifest must therefore be replaced, never rewritten in place, while jobs read it: blobdata
writes every manifest to a temporary file and renames it over the old one; do the same (``mv``, not
``cp`` over it), as truncating a mapped file makes the processes that map it fail (SIGBUS).

**The checksum, once per file and node.** The CRC-32 over the whole file is what catches a corrupt
or truncated manifest; computing it reads every page. The first process of a node that loads a file
verifies it and leaves a marker named after the file's identity (device, inode, size, modification
and change times, and the CRC the file declares) in this user's node-private directory (``/dev/shm/
blobdata-<uid>/verified/``, mode 0700; the temporary directory where there is no ``/dev/shm``); the
others find the marker and skip the pass. Not per array on first use: that needs a checksum per
array (a format change) and still makes every process read every array it touches once, while a
marker costs one ``stat``; and the CRC protects against files damaged on their way (a truncated
copy, a partial download), not against pages changing later under an unchanged identity. A file
replaced or modified has a new identity, so it is verified again; the markers live in memory, so a
reboot forgets them with the page cache. Without a usable private directory every load verifies.
The marker stands for the manifest's checks of its arrays too (offsets that never decrease, targets
and sizes in range): a marked file is mapped without reading any array, so a process touches only the
pages of the samples it uses. A process that writes a manifest (:func:`write_streamed`) sums every
byte as it writes it, from arrays it checked, and leaves the marker itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from .._errors import ManifestError, NotFound
from .._url import parse_url

__all__ = [
    "Buffer",
    "is_verified",
    "makedirs_private",
    "mark_verified",
    "publish",
    "read_source",
    "write_atomic",
    "write_streamed",
]

Buffer = bytes | mmap.mmap
_MAX_MARKS = 512  # markers kept per user and node; the oldest go first


def _marks_dir() -> str | None:
    from .._node import per_user_dir, user_dir

    top = user_dir()
    return per_user_dir(top, "verified") if top is not None else None


def _mark_name(st: os.stat_result, crc: int) -> str:
    ident = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{crc}"
    return hashlib.sha256(ident.encode("ascii")).hexdigest()[:40]


def is_verified(mark: str | None) -> bool:
    """Whether a process of this node already verified the file whose identity is ``mark``."""
    if mark is None:
        return False
    directory = _marks_dir()
    return directory is not None and os.path.exists(os.path.join(directory, mark))


def mark_verified(mark: str | None) -> None:
    """Record that the file whose identity is ``mark`` passed its checksum (best effort)."""
    directory = _marks_dir() if mark is not None else None
    if directory is None or mark is None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(os.path.join(directory, mark), os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        marks = os.listdir(directory)
        if len(marks) > _MAX_MARKS:
            paths = [os.path.join(directory, m) for m in marks]
            paths.sort(key=lambda p: os.stat(p).st_mtime_ns)
            for old in paths[: len(paths) - _MAX_MARKS]:
                os.unlink(old)


def _open(path: str, source: str, own: str | None) -> int:
    try:
        if own is None:
            fd: int | None = os.open(os.path.expanduser(path), os.O_RDONLY | os.O_CLOEXEC)
        else:  # a file of a shared place: this user's own, no link, in a directory no one else writes
            from .._node import open_own

            fd = open_own(path, setting=own, todo="remove it (blobdata writes its own there)")
    except FileNotFoundError:
        fd = None
    except OSError as exc:
        raise ManifestError(f"manifest {source} cannot be read: {exc.strerror or exc}", url=source) from exc
    if fd is None:
        raise NotFound(f"manifest {source} does not exist", url=source)
    return fd


def _map(path: str, source: str, own: str | None) -> tuple[Buffer, str | None]:
    """``path`` mapped read-only, and the name of its verified-marker; ``own``: see :func:`read_source`."""
    fd = _open(path, source, own)
    try:
        st = os.fstat(fd)
        if st.st_size < 24:  # shorter than the preamble (an empty file cannot be mapped)
            return os.read(fd, 24), None
        try:
            data: Buffer = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # a file system that cannot map (some FUSE mounts): read it
            with os.fdopen(os.dup(fd), "rb") as fh:
                return fh.read(), None
        crc = int.from_bytes(data[20:24], "little")
        return data, _mark_name(st, crc)
    except OSError as exc:
        raise ManifestError(f"manifest {source} cannot be read: {exc.strerror or exc}", url=source) from exc
    finally:
        os.close(fd)  # the mapping stays


def read_source(
    source: str, storage_options: Mapping[str, Any] | None, progress: bool | None = None, *,
    own: str | None = None,
) -> tuple[Buffer, str | None]:  # fmt: skip
    """The bytes of the manifest at ``source``: a local file mapped (with its verified-marker's
    name), a remote one downloaded (no marker: it is verified on every load).

    ``own`` (the setting that chose the place, named in messages: ``"BLOBDATA_CACHE_HOME"``): the file
    lies in a place shared on the node, so it is mapped only if it is this user's own, not a link, in a
    directory no one else can write (:func:`blobdata._node.open_own`, ConfigError otherwise), and the
    descriptor mapped is the one checked."""
    if "://" not in source or source.startswith("file://"):
        return _map(source[len("file://") :] if source.startswith("file://") else source, source, own)
    # Late: fsspec and the store clients are not needed to read a local manifest.
    from .._loop import run
    from .._metrics import progress as _progress
    from .._retry import final_error
    from .._stores import credential_hint, get_fs, resolve_storage_options

    url = parse_url(source)
    fs = get_fs(url.protocol, resolve_storage_options(url.protocol, storage_options))

    async def fetch() -> bytes:
        if getattr(fs, "async_impl", False):
            return bytes(await fs._cat_file(url.fs_path))
        return bytes(fs.cat_file(url.fs_path))

    try:
        show = _progress.enabled(progress) and url.protocol != "memory"
        data = _progress.download(fs, url.fs_path, f"manifest {source}", progress) if show else run(fetch())
        return data, None
    except Exception as exc:
        raise final_error(exc, source, hint=credential_hint(url.protocol), what="manifest") from exc


def makedirs_private(path: Path) -> None:
    """Create ``path`` and missing parents with mode 0700 (existing directories are left alone)."""
    missing: list[Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)
        os.chmod(d, 0o700)  # mkdir's mode is reduced by the umask


def _write_temp(target: Path, data: bytes) -> str:
    """``data`` in a new 0600 temporary file beside ``target`` (missing parents made 0700), fsynced;
    returns its path, which the caller links or renames into place, and removes on failure."""
    makedirs_private(target.parent)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix="." + target.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def write_atomic(target: Path, data: bytes) -> None:
    """``data`` as ``target``: a 0600 temporary file in the same directory, fsync, then ``os.replace`` (a
    process mapping the old file keeps it; nobody sees half a file). Missing parents are made 0700."""
    tmp = _write_temp(target, data)
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_streamed(target: Path, write: Callable[[BinaryIO], int]) -> None:
    """:func:`write_atomic` for a file ``write(fh)`` writes a part at a time (a manifest's arrays) and
    whose declared CRC it returns: the file is never whole in memory. The file is then marked verified
    on this node (its writer summed every byte it wrote), so the first load does not read it all again."""
    makedirs_private(target.parent)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix="." + target.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w+b") as fh:
            crc = write(fh)
            fh.flush()
            os.fsync(fh.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, target)
            st = os.fstat(fh.fileno())  # this file's identity, whatever the path names meanwhile
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    mark_verified(_mark_name(st, crc))


def publish(path: Path, data: bytes) -> None:
    """Write ``data`` as ``path`` once: a 0600 temporary file, fsync, then a hard link to ``path``,
    which fails if another process of the node published it first (then theirs stays: one file, one
    set of pages for every process that maps it). ``path`` never holds part of a file."""
    if path.exists():
        return
    tmp = _write_temp(path, data)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)

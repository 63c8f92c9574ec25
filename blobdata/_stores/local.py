"""Local files (paths and ``file://``): read directly, listed as torchvision lists them.

A local file's identity is ``"{mtime_ns}-{size}"``; a read checks it before and after, so a file
rewritten after listing (or during the read) is :class:`~blobdata._errors.ObjectChanged`.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Mapping
from typing import Any

from .._errors import AccessDenied, BlobdataError, FetchError, NotFound, ObjectChanged
from .._url import BlobURL
from .base import Columns, Entry, ReadResult

__all__ = ["LocalLister", "LocalReader", "identity", "network_mount", "read_file"]


def identity(info: Mapping[str, Any]) -> str:
    """A local file's identity from an fsspec info dict (stat again: its float mtime lost precision)."""
    mtime_ns = info.get("mtime_ns")
    if mtime_ns is None:
        mtime_ns = os.stat(info["name"]).st_mtime_ns
    return f"{int(mtime_ns)}-{int(info.get('size') or 0)}"


class LocalReader:
    """Reads local files in a thread (the look-ahead's path; a batch reads directly, :func:`read_file`)."""

    def __repr__(self) -> str:
        return "LocalReader()"

    async def read(
        self,
        bucket: str,
        key: str,
        *,
        start: int | None,
        end: int | None,
        expect_identity: str | None,
        timeout: float,
        size: int | None = None,
    ) -> ReadResult:
        return await asyncio.wait_for(
            asyncio.to_thread(_read_range, key, start, end, expect_identity, size, f"file://{key}"), timeout
        )

    async def close(self) -> None:
        """Nothing to close."""


def _local_identity(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns}-{st.st_size}"


#: Opened without blocking (a FIFO's open waits for a writer) and never inherited by a child.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def read_file(path: str, size: int | None, expect: str | None, url: str) -> bytes:
    """The whole of the local file ``path`` (``url`` in errors), checked: a regular file (a FIFO, a
    device such as ``/dev/zero`` or a directory is refused, never read), of the listed identity
    ``expect`` (``"{mtime_ns}-{size}"``) and ``size`` when given, and never more bytes than it had when
    opened: one open, one fstat, one read (of one byte more than the file's size, which shows a file
    that grew), one close. Raises NotFound, AccessDenied, ObjectChanged or FetchError naming ``url``."""
    return _read_whole(path, size, expect, url)[0]


def _read_whole(path: str, size: int | None, expect: str | None, url: str) -> tuple[bytes, str]:
    """:func:`read_file`, and the identity the file had."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _open_error(exc, url) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _check_regular(st, url)
        ident = f"{st.st_mtime_ns}-{st.st_size}"
        if expect and ident != expect:
            raise _changed(url, ident, expect)
        if size is not None and st.st_size != size:
            raise _changed(url, f"{st.st_size} bytes", f"{size} bytes")
        n = st.st_size
        data = os.read(fd, n + 1)
        if len(data) < n:  # a large file comes in several reads
            data = _read_rest(fd, data, n, url)
    except BlobdataError:
        raise
    except OSError as exc:
        raise FetchError(f"{url}: cannot read ({exc.strerror or type(exc).__name__})", url) from exc
    finally:
        os.close(fd)
    if len(data) != n:
        raise ObjectChanged(f"{url}: modified while it was read; rebuild the listing with refresh=True", url)
    return data, ident


def _read_rest(fd: int, first: bytes, n: int, url: str) -> bytes:
    parts, got = [first], len(first)
    while got <= n:
        chunk = os.read(fd, n + 1 - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _check_regular(st: os.stat_result, url: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        what = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise FetchError(
            f"{url}: {what}, not a regular file: a dataset reads regular files only (remove it, or "
            'pass on_error="skip")',
            url,
        )


_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket",
}  # fmt: skip


def _changed(url: str, now: str, listed: str) -> ObjectChanged:
    return ObjectChanged(
        f"{url}: changed since it was listed ({now}, listed {listed}); rebuild the listing with refresh=True",
        url,
    )


def _open_error(exc: OSError, url: str) -> BlobdataError:
    if isinstance(exc, FileNotFoundError):
        return NotFound(f"{url}: no such file; the listing may be stale, rebuild it with refresh=True", url)
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{url}: permission denied", url)
    return FetchError(f"{url}: cannot open ({exc.strerror or type(exc).__name__})", url)


def _read_range(
    path: str, start: int | None, end: int | None, expect: str | None, size: int | None, url: str
) -> ReadResult:
    """A local file (or ``[start, end)`` of it) as a store's read: checked as :func:`read_file` is."""
    if start is None and end is None:
        data, ident = _read_whole(path, size, expect, url)
        return ReadResult(data, ident, len(data))
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _open_error(exc, url) from None
    try:
        before = os.fstat(fd)
        _check_regular(before, url)
        if expect and _local_identity(before) != expect:
            raise _changed(url, _local_identity(before), expect)
        first = start or 0
        last = min(before.st_size, end if end is not None else before.st_size)
        data = os.pread(fd, max(0, last - first), first) if last > first else b""
        after = os.fstat(fd)
    except BlobdataError:
        raise
    except OSError as exc:
        raise FetchError(f"{url}: cannot read ({exc.strerror or type(exc).__name__})", url) from exc
    finally:
        os.close(fd)
    if _local_identity(after) != _local_identity(before):
        raise ObjectChanged(f"{url}: modified while it was read; rebuild the listing with refresh=True", url)
    return ReadResult(data, _local_identity(before), before.st_size)


class LocalLister:
    """os.scandir / os.walk(followlinks=True) exactly as torchvision does, in threads."""

    def __init__(self, url: BlobURL) -> None:
        self.url = url

    async def folders(self) -> tuple[list[str], bool]:
        def scan() -> tuple[list[str], bool]:
            with os.scandir(self.url.prefix) as it:
                entries = list(it)
            return [e.name for e in entries if e.is_dir()], bool(entries)

        try:
            return await asyncio.to_thread(scan)
        except (FileNotFoundError, NotADirectoryError):
            return [], False

    async def below(self, folder: str) -> Columns:
        root = self.url.prefix

        def walk() -> Columns:
            out: list[Entry] = []
            cut = len(root.rstrip("/")) + 1
            for dirpath, _dirs, fnames in os.walk(os.path.join(root, folder), followlinks=True):
                for fname in fnames:
                    path = os.path.join(dirpath, fname)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue  # dangling symlink or vanished file: torchvision would fail later
                    out.append((path[cut:], st.st_size, f"{st.st_mtime_ns}-{st.st_size}"))
            return Columns.from_entries(out)

        return await asyncio.to_thread(walk)

    async def aclose(self) -> None:
        """Nothing to close."""


#: Filesystems whose reads cross a network (or a FUSE daemon, such as mountpoint-s3 or gcsfuse): a
#: folder there keeps the look-ahead, whose concurrent reads hide their latency.
_NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p", "afs",
    "ncpfs", "davfs", "orangefs", "pvfs2", "wekafs", "fuse", "fuseblk", "virtiofs",
})  # fmt: skip


def network_mount(path: str) -> bool:
    """Whether ``path`` lies on a network or FUSE filesystem (Linux's ``/proc/self/mountinfo``; False
    where it cannot be read): such a folder is read with the look-ahead, a local disk directly."""
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return False
    best, fstype = -1, ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, fstype = len(point), (right.split() or [""])[0]
    return fstype in _NETWORK_FS or fstype.startswith("fuse.")

"""Append-only pack files for the cache's values: no file is created per object.

Creating a file costs far more than writing 100 KB into one on a journaling filesystem (measured
on ext4: 0.28-0.6 ms per create, 0.05 ms per 110 KB ``pwrite``), and a cold epoch creates one per
image. So each writing process appends values to a pack file of its own (``pk/<random>.pack``,
mode 0600), each at a 4 KiB-aligned offset, and the index row names the slice:
``pk/<32 hex>.pack@<offset>+<length>-<checksum kind><checksum>`` (hex numbers).

Ownership and reclaim
  * A process owns the pack it appends to by an exclusive ``flock``, taken when it creates the
    file and dropped when it closes it (``PACK_BYTES`` reached, fork, exit, crash). Nobody else
    writes into an owned pack.
  * A deleted entry (eviction, a changed object, a corrupt value, ``clear``) frees its blocks at
    once with ``fallocate(PUNCH_HOLE)``: the pack keeps its length but not the disk space, so the
    cache's size bound counts aligned value lengths and holds on disk. Reads of a punched range
    return zeros, which fail the checksum: a race between a read and an eviction is a miss.
  * A crash between appending a value and inserting its row, or between deleting a row and
    punching its range, leaves allocated bytes no row names. The orphan sweep punches every gap
    between the live slices of a pack nobody owns, and deletes a pack without live slices.
  * Packs need a filesystem that can punch holes (ext4, XFS, Btrfs, tmpfs, ...). Where it cannot
    (:func:`punch_supported` probes it once per directory), the cache writes one file per value.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import re
import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable

from .. import _process

__all__ = [
    "ALIGN", "PACK_BYTES", "PACK_DIR", "PackStore", "aligned", "parse_slice", "punch", "punch_supported",
]  # fmt: skip

ALIGN = 4096
"""Every value starts at a multiple of this (the filesystem block), so a punch frees exactly its blocks."""
PACK_BYTES = 256 * 2**20
"""A writer starts a new pack once its pack reaches this length (bytes)."""
PACK_DIR = "pk"
_SLICE_RE = re.compile(r"(pk/[0-9a-f]{32}\.pack)@([0-9a-f]{1,16})\+([0-9a-f]{1,16})-([cz])([0-9a-f]{8})")
"""A slice name: group 1 the pack, 2 the offset, 3 the value length, 4-5 the checksum kind and value."""
_PACK_RE = re.compile(r"[0-9a-f]{32}\.pack")
_MAX_OPEN = 64  # pack descriptors a process keeps open for reads and punches
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_STORES: weakref.WeakSet[PackStore] = weakref.WeakSet()


def aligned(n: int) -> int:
    """``n`` rounded up to ``ALIGN``: the disk space a value of ``n`` bytes takes in a pack."""
    return -(-n // ALIGN) * ALIGN


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    if not hasattr(os, "posix_fallocate"):  # not Linux-like: no fallocate(2) to call
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        func = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    func.restype = ctypes.c_int
    return func  # type: ignore[no-any-return]


_fallocate = _load_fallocate()


def punch(fd: int, offset: int, length: int) -> None:
    """Free the blocks of ``[offset, offset + length)`` in ``fd`` (the file keeps its length)."""
    if _fallocate is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available on this platform")
    if length > 0 and _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


_PROBED: dict[str, bool] = {}


def punch_supported(directory: str) -> bool:
    """Whether the filesystem of ``directory`` punches holes (probed once per directory and process)."""
    known = _PROBED.get(directory)
    if known is not None:
        return known
    path = os.path.join(directory, f"probe-{secrets.token_hex(8)}.tmp")
    ok = False
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, b"\1" * 2 * ALIGN, 0)
            punch(fd, 0, ALIGN)
            ok = os.pread(fd, 2 * ALIGN, 0) == b"\0" * ALIGN + b"\1" * ALIGN
        finally:
            os.close(fd)
            os.unlink(path)
    except OSError:
        ok = False
    _PROBED[directory] = ok
    return ok


class PackStore:
    """The pack files of one cache directory, as this process sees them (thread-safe).

    ``append`` writes a value into this process's own pack and returns its slice name; ``read``
    and ``release`` take slice names. Nothing here touches the index: the cache inserts a row
    after ``append`` and calls ``release`` after deleting one.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._reset()
        _STORES.add(self)

    def _reset(self) -> None:
        self._pid = _process.pid()
        self._fds: OrderedDict[str, int] = OrderedDict()  # pack name -> descriptor (LRU)
        self._own: tuple[str, int] | None = None  # (pack name, descriptor) this process appends to
        self._end = 0

    def _check_pid(self) -> None:
        if self._pid != _process.pid():  # forked without the at-fork hook (should not happen): start over
            self._reset()

    # -- writing --------------------------------------------------------------------------------

    def append(self, data: bytes, kind: str, crc: int) -> str:
        """Write ``data`` at the end of this process's pack; the slice's name.

        Raises OSError (ENOSPC, EIO, ...); the bytes written so far are then punched out again.
        """
        with self._lock:
            self._check_pid()
            if self._own is None or self._end >= PACK_BYTES:
                self._start_pack()
            assert self._own is not None
            name, fd = self._own
            offset = self._end
            try:
                view = memoryview(data)
                pos = offset
                while view:
                    n = os.pwrite(fd, view, pos)
                    view, pos = view[n:], pos + n
            except BaseException:
                with contextlib.suppress(OSError):
                    punch(fd, offset, aligned(len(data)))
                raise
            self._end = offset + aligned(len(data))
        return f"{name}@{offset:x}+{len(data):x}-{kind}{crc:08x}"

    def _start_pack(self) -> None:
        """Close the pack this process owns (if any) and create a new one, owned by ``flock``."""
        if self._own is not None:
            os.close(self._own[1])  # drops the flock: the pack is now anyone's to sweep
            self._own = None
        name = f"{PACK_DIR}/{secrets.token_hex(16)}.pack"
        path = os.path.join(self.directory, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.dirname(path), 0o700)
            fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        self._own, self._end = (name, fd), 0

    # -- reading and freeing ----------------------------------------------------------------------

    def _fd(self, pack: str) -> int:
        """A descriptor of ``pack`` (cached; caller holds the lock). Raises FileNotFoundError."""
        fd = self._fds.get(pack)
        if fd is not None:
            self._fds.move_to_end(pack)
            return fd
        path = os.path.join(self.directory, pack)
        try:
            fd = os.open(path, os.O_RDWR | _O_CLOEXEC)
        except PermissionError:  # a read-only cache: reads still work
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        self._fds[pack] = fd
        if len(self._fds) > _MAX_OPEN:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd

    def read(self, pack: str, offset: int, length: int) -> bytes:
        """The ``length`` bytes at ``offset`` of ``pack`` (fewer if the pack is shorter)."""
        with self._lock:
            self._check_pid()
            fd = self._fd(pack)
            data = os.pread(fd, length, offset)
            while 0 < len(data) < length:  # a short read of a large value: go on
                more = os.pread(fd, length - len(data), offset + len(data))
                if not more:
                    break
                data += more
        return data

    def read_many(self, slices: list[tuple[str, int, int]]) -> list[bytes | OSError]:
        """:meth:`read` of each ``(pack, offset, length)`` (one lock for them all); the OSError met where
        one could not be read."""
        out: list[bytes | OSError] = []
        with self._lock:
            self._check_pid()
            fds, pread = self._fds, os.pread
            for pack, offset, length in slices:
                try:
                    fd = fds.get(pack)
                    if fd is None:
                        fd = self._fd(pack)
                    data = pread(fd, length, offset)
                    while 0 < len(data) < length:  # a short read of a large value: go on
                        more = pread(fd, length - len(data), offset + len(data))
                        if not more:
                            break
                        data += more
                except OSError as exc:
                    out.append(exc)
                    continue
                out.append(data)
        return out

    def release(self, pack: str, offset: int, length: int) -> None:
        """Free the blocks of a deleted entry's slice (its row is already gone)."""
        with self._lock:
            self._check_pid()
            try:
                fd = self._fd(pack)
            except FileNotFoundError:
                return  # the pack is gone already
            with contextlib.suppress(OSError):  # a read-only pack or filesystem: the sweep retries
                punch(fd, offset, aligned(length))

    def close(self) -> None:
        """Close every descriptor (and give up the owned pack); later calls reopen what they need."""
        with self._lock:
            if self._pid == _process.pid():
                for fd in self._fds.values():
                    os.close(fd)
                if self._own is not None:
                    os.close(self._own[1])
            self._reset()

    # -- orphans --------------------------------------------------------------------------------

    def sweep(self, live: Callable[[str], Iterable[tuple[int, int]]], *, grace: float, now: float) -> None:
        """Reclaim crash leftovers in packs that no process owns and nobody wrote for ``grace`` seconds.

        ``live(pack)`` gives the (offset, length) of every slice the index still names in ``pack``.
        Gaps between them are punched; a pack with no live slice is deleted.
        """
        folder = os.path.join(self.directory, PACK_DIR)
        try:
            entries = [e for e in os.scandir(folder) if _PACK_RE.fullmatch(e.name)]
        except OSError:
            return
        with self._lock:
            self._check_pid()
            mine = self._own[0] if self._own is not None else None
        for entry in entries:
            name = f"{PACK_DIR}/{entry.name}"
            if name == mine:
                continue
            try:
                if now - entry.stat().st_mtime < grace:
                    continue
                fd = os.open(entry.path, os.O_RDWR | _O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # owned by a live writer: skip
                slices = sorted(live(name))
                if not slices:
                    os.unlink(entry.path)
                    continue
                start = 0
                for offset, length in [*slices, (os.fstat(fd).st_size, 0)]:
                    if offset > start:
                        punch(fd, start, offset - start)
                    start = max(start, offset + aligned(length))
            except OSError:
                continue
            finally:
                os.close(fd)


def parse_slice(name: str) -> tuple[str, int, int, str, int] | None:
    """(pack, offset, length, checksum kind, checksum) of a slice name; None if it is not one."""
    match = _SLICE_RE.fullmatch(name)
    if match is None:
        return None
    pack, offset, length, kind, crc = match.groups()
    return pack, int(offset, 16), int(length, 16), kind, int(crc, 16)


def _after_fork_in_child() -> None:
    # Descriptors inherited from the parent: close them here (no SQLite lock rides on a pack, so
    # closing is safe); the parent's flock stays, held by the parent's own descriptor.
    for store in list(_STORES):
        if store._pid != _process.pid():
            for fd in store._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            if store._own is not None:
                with contextlib.suppress(OSError):
                    os.close(store._own[1])
            store._lock = threading.Lock()
            store._reset()


_process.at_fork(after_in_child=_after_fork_in_child)

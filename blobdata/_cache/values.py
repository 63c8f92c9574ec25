"""How one value is kept: bytes only, checksummed, in a pack slice, a value file or inline in its row.

:class:`Values` reads what an index row names: bytes only, never anything else (nothing is ever
unpickled: the index stores no objects), and it refuses any row it did not write, so a tampered row
is a counted miss. Every value carries a CRC32C (or zlib CRC32) checksum, verified on every read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import stat
import struct
import zlib
from typing import Any, NamedTuple

from .packs import PACK_DIR, PackStore, parse_slice

google_crc32c: Any
try:  # a dependency of google-cloud-storage (hence gcsfs); hardware CRC32C is ~8x faster than zlib
    import google_crc32c
except ImportError:  # pragma: no cover - zlib's crc32 is the fallback
    google_crc32c = None

DB_NAME = "cache.db"
#: Smaller values live inline in the index where they would otherwise be files of their own (no hole
#: punching, so no packs): no file to create per put nor to open per read. This is the bound from
#: before packs, not measured again against files.
MIN_FILE_SIZE = 32 * 1024
#: Where values go to packs, only the smaller ones live inline. An inline value is written twice (the
#: index's write-ahead log, then its checkpoint), a packed one once; and inline values grow the index
#: past its memory map (64 MiB), beyond which each of its pages is a ``read``. CPU per value,
#: ``bench_value_placement.py`` (the 2-core box), packed against inline: a put costs 0.6-0.75 times as
#: much at 8 KiB, 0.32-0.49 from 16 KiB; a read at 8 KiB 0.73 times as much with 100,000 values, 0.78
#: with 40,000, 0.95 with 12,000, 1.23 with 1,600 (there 9.6 us against 7.8); below 8 KiB reads
#: favour inline in a cache of up to about 12,000 values (4 KiB: 1.17) and packs beyond (0.83).
MIN_PACKED_SIZE = 8 * 1024
CRC32C = google_crc32c is not None and google_crc32c.implementation == "c"
NAME_RE = re.compile(r"([0-9a-f]{2})/[0-9a-f]{32}-([0-9a-f]{1,16})-([cz])([0-9a-f]{8})\.val")
HEADER = struct.Struct("<cI")  # inline values: checksum kind (b"c"/b"z") + checksum


class Refused(Exception):
    """A row this cache did not write the way it writes rows (tampered or foreign)."""


class Corrupt(Exception):
    """A value whose bytes fail their checksum or length."""


@dataclasses.dataclass(frozen=True)
class Staged:
    """A value already on disk (a pack slice, or a value file written and renamed); no row yet."""

    filename: str
    size: int


@dataclasses.dataclass(frozen=True)
class Inline:
    """A small value with its checksum header, stored inside the index row."""

    blob: bytes


class Pending(NamedTuple):
    """A value ready to be committed: its position in the batch, key, URL, value and bytes needed."""

    pos: int
    key: str
    url: str
    value: Staged | Inline
    need: int


def checksum(data: bytes) -> tuple[str, int]:
    if CRC32C:
        return "c", int(google_crc32c.value(data))
    return "z", zlib.crc32(data)


def verify(data: bytes, kind: str, expected: int) -> bool:
    if kind == "z":
        return zlib.crc32(data) == expected
    if google_crc32c is None:  # pragma: no cover - written by a process that had crc32c
        return False
    return int(google_crc32c.value(data)) == expected


class Values:
    """Reads and removes the values the index rows name: bytes only, checksummed, never a path outside.

    A row names a pack slice or a value file (``filename``), or holds the value inline with its
    checksum header. :meth:`fetch` refuses any file name this cache does not write (raising
    :class:`Refused`) and any value that fails its length or checksum (:class:`Corrupt`).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.packs = PackStore(directory)

    def fetch(self, filename: object, inline: object) -> bytes:
        if filename is not None:
            if type(filename) is not str:
                raise Refused(f"unexpected value file name {filename!r}")
            where = parse_slice(filename)
            if where is not None:
                pack, offset, length, kind, crc = where
                data = self.packs.read(pack, offset, length)
                if len(data) != length or not verify(data, kind, crc):
                    raise Corrupt(filename)
                return data
            match = NAME_RE.fullmatch(filename)
            if match is None:
                raise Refused(f"unexpected value file name {filename!r}")
            size = int(match.group(2), 16)
            data = read_file(os.path.join(self.directory, filename), size)
            if len(data) != size or not verify(data, match.group(3), int(match.group(4), 16)):
                raise Corrupt(filename)
            return data
        if type(inline) is bytes and len(inline) >= HEADER.size:
            kind, expected = HEADER.unpack_from(inline)
            data = inline[HEADER.size :]
            if kind not in (b"c", b"z") or not verify(data, kind.decode(), expected):
                raise Corrupt("inline value")
            return data
        raise Refused(f"cache row without a value file or an inline value ({type(inline).__name__})")

    def fetch_many(self, rows: list[tuple[object, object]]) -> list[bytes | Exception]:
        """:meth:`fetch` of each ``(filename, inline)`` row, the pack slices read together (one lock);
        where a value cannot be had, the exception :meth:`fetch` would raise."""
        out: list[bytes | Exception] = []
        slices: list[tuple[int, str, int, int, str, int]] = []
        for k, (filename, inline) in enumerate(rows):
            where = parse_slice(filename) if type(filename) is str else None
            if where is not None:
                slices.append((k, *where))
                out.append(b"")
                continue
            try:
                out.append(self.fetch(filename, inline))
            except (Refused, Corrupt, OSError) as exc:
                out.append(exc)
        if slices:
            got = self.packs.read_many([(pack, offset, length) for _, pack, offset, length, _, _ in slices])
            for (k, _, _, length, kind, crc), data in zip(slices, got, strict=True):
                if isinstance(data, OSError):
                    out[k] = data
                elif len(data) != length or not verify(data, kind, crc):
                    out[k] = Corrupt(str(rows[k][0]))
                else:
                    out[k] = data
        return out

    def remove(self, filename: object) -> None:
        """Free ``filename``'s value; only names this cache writes (a tampered row deletes nothing)."""
        where = parse_slice(filename) if type(filename) is str else None
        if where is not None:
            self.packs.release(where[0], where[1], where[2])
        elif type(filename) is str and NAME_RE.fullmatch(filename):
            with contextlib.suppress(OSError):  # already removed by another process
                os.unlink(os.path.join(self.directory, filename))


def read_file(path: str, size: int) -> bytes:
    """Read up to ``size + 1`` bytes (one syscall for regular files) so a longer file is detected."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        data = os.read(fd, size + 1)
        if len(data) < size:  # short read (very large file or a truncated one): keep reading
            parts, got = [data], len(data)
            while got <= size:
                chunk = os.read(fd, size + 1 - got)
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def key_of(url: str, identity: str) -> str:
    # Length-prefixed so that no (url, identity) pair can collide with another; all identities
    # of one URL share the prefix, which puts() uses to drop stale ones through the key index.
    return f"{len(url)}:{url}\n{identity}"


def url_range(url: str) -> tuple[str, str]:
    prefix = f"{len(url)}:{url}\n"
    return prefix, prefix + "\U0010ffff"


def make_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) and its parents; make an existing cache directory 0700."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if parent == path:
            raise
        os.makedirs(parent, exist_ok=True)  # parents are the user's: default mode
        try:
            os.mkdir(path, 0o700)
            return
        except FileExistsError:
            pass
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{path} exists and is not a directory")
    # Tighten only a directory that is empty or already a cache, never an arbitrary user folder.
    with os.scandir(path) as it:
        names = {e.name for e in it}
    if not names or DB_NAME in names or all(re.fullmatch(rf"[0-9a-f]{{2}}|{PACK_DIR}", n) for n in names):
        chmod_private(path, 0o700)


def chmod_private(path: str, mode: int) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if stat.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, mode)


def write_value_file(directory: str, data: bytes, kind: str, crc: int) -> Staged:
    """Write ``data`` to a new value file (``<name>.tmp`` then renamed: never seen partial)."""
    name = secrets.token_hex(16)
    filename = f"{name[:2]}/{name}-{len(data):x}-{kind}{crc:08x}.val"
    path = os.path.join(directory, filename)
    tmp = path + ".tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        make_private_dir(os.path.dirname(path))
        fd = os.open(tmp, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return Staged(filename, len(data))

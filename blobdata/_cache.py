"""The local SSD cache: size-bounded, shared by every DataLoader worker, rank and job on a node.

One directory holds a diskcache SQLite index (``cache.db``, WAL mode, process-safe) and the values:
appended to pack files, one per writing process (``pk/<random>.pack``, see :mod:`._pack`: creating
a file per object cost more than everything else a put does), or, on a filesystem that cannot
punch holes, one value file per object under 256 subfolders (``ab/<random>-<size>-<checksum>.val``).
Small values (< 32 KiB) live inline in the index. The key is the object URL plus its identity
(ETag, generation, version), so a changed object is a miss and its stale entry is replaced.

Safety
  * Bytes only: :class:`_BytesDisk` stores and returns bytes and refuses every row whose mode is
    not raw/binary or whose key is not a str, so a tampered row never reaches ``pickle``
    (diskcache <= 5.6.3 unpickles by default, CVE-2025-69872). A refused row is a counted miss.
  * Every value carries a CRC32C (or zlib CRC32) checksum, kept in the index row (the file name),
    checked on every read; a mismatch, a short file or a missing file is a miss, the entry is
    deleted and counted as ``corrupt``, so the caller refetches.
  * Atomic writes: a value is appended to the writer's own pack (or written to ``<name>.tmp`` and
    renamed), and only then is its row inserted, so no reader ever sees a partial entry, even
    after SIGKILL. Values are not fsynced: after a power loss a torn value fails its checksum and
    is refetched. Orphans (temp files, value files without a row, pack ranges no row names in
    packs nobody owns, packs without rows) older than ``orphan_grace`` are swept at most once per
    grace period per directory, when a cache opens, examining at most 20,000 value files.
  * Directory mode 0700, every file 0600 (the index is created 0600 before SQLite opens it, and
    SQLite gives its -wal and -shm files the index's mode); the process umask is never changed.
  * Fork and spawn: the SQLite connection is opened lazily per process (``os.getpid()``). The
    forking thread's connection is closed just before ``os.fork()`` (so the child inherits no
    SQLite lock state); any other inherited one is abandoned, never used, in the child. A pickled
    cache is just ``(directory, size_limit, policy)`` and reopens on first use.
  * The index file is never opened outside SQLite once it exists: closing any descriptor of it
    would drop this process's SQLite locks and corrupt concurrent reads.

Size bound
  ``volume_bytes`` = value bytes (in packs: rounded up to 4 KiB blocks, what they take on disk) +
  SQLite index pages. Admission (``"admit"``) or eviction
  (``"lru"``) is decided and the row inserted in one ``BEGIN IMMEDIATE`` transaction, so any
  number of concurrent writers keeps ``volume_bytes <= size_limit + SLACK_BYTES`` (64 KiB: the
  index pages one insert can add after the check). On disk, the SQLite ``-wal`` and ``-shm``
  files come on top, and so does the tail of index pages freed since the last checkpoint (WAL mode
  truncates the index file only then), together <= ``WAL_SLACK_BYTES`` (4 MiB: a put that finds
  the WAL above 2 MiB checkpoints and truncates it), plus crash orphans until swept, block
  rounding of value files, and filesystem metadata (ext4: a 4 KiB extent block per pack with holes).

Policies
  ``"admit"`` (default): once full, keep what is cached and admit nothing new. Under a fresh
  random permutation each epoch this hits ``cache/dataset``, the optimum (CoorDL, VLDB 2021);
  ``get`` then never writes to SQLite. ``"lru"``: evict least-recently-used entries to make
  room; every hit updates an access time.

Failures never stop training: ``put`` returns False on any I/O error (ENOSPC, EDQUOT, EIO,
EFBIG, permissions, a locked index), logs one warning naming the directory, and skips writes for
``write_pause`` seconds; ``get`` turns read errors into misses. Counters in :meth:`stats` are
per process (each worker counts its own); volume and entries come from the shared index.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import random
import re
import secrets
import sqlite3
import stat
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Sequence
from multiprocessing import util as mp_util
from typing import Any, Literal, NamedTuple

import diskcache

from ._config import parse_duration, parse_size
from ._errors import CacheError, ConfigError
from ._pack import PACK_DIR, PackStore, aligned, parse_slice, punch_supported

google_crc32c: Any
try:  # a dependency of google-cloud-storage (hence gcsfs); hardware CRC32C is ~8x faster than zlib
    import google_crc32c
except ImportError:  # pragma: no cover - zlib's crc32 is the fallback
    google_crc32c = None

__all__ = ["SLACK_BYTES", "WAL_SLACK_BYTES", "BlobCache", "CacheStats", "CacheWriter"]

_log = logging.getLogger("blobdata")

SLACK_BYTES = 64 * 1024
"""How far ``volume_bytes`` may exceed ``size_limit``: index pages added by one insert after its check."""
WAL_SLACK_BYTES = 4 * 1024 * 1024
"""The SQLite ``-wal`` and ``-shm`` files on top of ``volume_bytes`` (truncated once the WAL passes half)."""

_DB_NAME = "cache.db"
_MIN_FILE_SIZE = 32 * 1024  # smaller values live inline in the index: one read, no file
_SQLITE_TIMEOUT = 15.0  # seconds a writer waits for the index lock before the put counts as failed
_SWEEP_MAX_FILES = 20_000  # bound of one orphan sweep
_CRC32C = google_crc32c is not None and google_crc32c.implementation == "c"
_NAME_RE = re.compile(r"([0-9a-f]{2})/[0-9a-f]{32}-([0-9a-f]{1,16})-([cz])([0-9a-f]{8})\.val")
_HEADER = struct.Struct("<cI")  # inline values: checksum kind (b"c"/b"z") + checksum
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS Blobdata (key TEXT PRIMARY KEY, value)",
    "CREATE INDEX IF NOT EXISTS Blobdata_filename ON Cache (filename)",
    # The name diskcache uses for its LRU index, so both agree if settings ever change.
    "CREATE INDEX IF NOT EXISTS Cache_access_time ON Cache (access_time)",
)
_ABANDONED: list[Any] = []  # caches inherited through fork: kept alive so GC never closes them here
_INSTANCES: weakref.WeakSet[BlobCache] = weakref.WeakSet()
Policy = Literal["admit", "lru"]


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Counters of this process (hits, misses, ...) and the shared state of the directory.

    ``hits + misses`` is the number of ``get`` calls (``corrupt`` ones are among the misses);
    ``stored + rejected + write_errors`` is the number of ``put`` calls. Sizes in bytes.
    """

    hits: int
    misses: int
    corrupt: int
    stored: int
    rejected: int
    write_errors: int
    evictions: int
    volume_bytes: int
    entries: int
    size_limit: int
    policy: str

    @property
    def hit_rate(self) -> float:
        """Hits per ``get`` call (0.0 before the first one)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class _Refused(Exception):
    """A row this cache did not write the way it writes rows (tampered or foreign)."""


class _Corrupt(Exception):
    """A value whose bytes fail their checksum or length."""


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A value already on disk (a pack slice, or a value file written and renamed); no row yet."""

    filename: str
    size: int


@dataclasses.dataclass(frozen=True)
class _Inline:
    """A small value with its checksum header, stored inside the index row."""

    blob: bytes


class _Pending(NamedTuple):
    """A value ready to be committed: its position in the batch, key, URL, value and bytes needed."""

    pos: int
    key: str
    url: str
    value: _Staged | _Inline
    need: int


def _checksum(data: bytes) -> tuple[str, int]:
    if _CRC32C:
        return "c", int(google_crc32c.value(data))
    return "z", zlib.crc32(data)


def _verify(data: bytes, kind: str, expected: int) -> bool:
    if kind == "z":
        return zlib.crc32(data) == expected
    if google_crc32c is None:  # pragma: no cover - written by a process that had crc32c
        return False
    return int(google_crc32c.value(data)) == expected


class _BytesDisk(diskcache.Disk):  # type: ignore[misc]
    """diskcache serialisation that knows bytes only and never pickles.

    Keys must be ``str``; values are ``_Staged`` files or ``_Inline`` blobs. Reading refuses any
    row whose mode is not MODE_RAW/MODE_BINARY, any non-str key, and any file name that is not
    one this cache writes (no path leaves the directory), raising :class:`_Refused`.
    """

    def __init__(self, directory: str, **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self.packs = PackStore(directory)

    def put(self, key: object) -> tuple[str, bool]:
        if type(key) is not str:
            raise TypeError(f"blobdata cache keys are str, got {type(key).__name__}")
        return key, True

    def get(self, key: object, raw: bool) -> str:
        if not raw or type(key) is not str:
            raise _Refused("non-str key in the cache index")
        return key

    def store(self, value: object, read: bool, key: object = None) -> tuple[int, int, str | None, Any]:
        if isinstance(value, _Staged):
            return value.size, diskcache.core.MODE_BINARY, value.filename, None
        if isinstance(value, _Inline):
            return 0, diskcache.core.MODE_RAW, None, sqlite3.Binary(value.blob)
        raise TypeError(f"blobdata cache stores bytes only, got {type(value).__name__}")

    def fetch(self, mode: int, filename: object, value: object, read: bool) -> bytes:
        if mode == diskcache.core.MODE_BINARY and type(filename) is str:
            where = parse_slice(filename)
            if where is not None:
                pack, offset, length, kind, crc = where
                data = self.packs.read(pack, offset, length)
                if len(data) != length or not _verify(data, kind, crc):
                    raise _Corrupt(filename)
                return data
            match = _NAME_RE.fullmatch(filename)
            if match is None:
                raise _Refused(f"unexpected value file name {filename!r}")
            size = int(match.group(2), 16)
            data = _read_file(os.path.join(self._directory, filename), size)
            if len(data) != size or not _verify(data, match.group(3), int(match.group(4), 16)):
                raise _Corrupt(filename)
            return data
        if mode == diskcache.core.MODE_RAW and type(value) is bytes and len(value) >= _HEADER.size:
            kind, expected = _HEADER.unpack_from(value)
            data = value[_HEADER.size :]
            if kind not in (b"c", b"z") or not _verify(data, kind.decode(), expected):
                raise _Corrupt("inline value")
            return data
        raise _Refused(f"cache row with mode {mode!r} refused (only raw/binary bytes are read)")

    def remove(self, file_path: object) -> None:
        # Only names this cache writes: a tampered row must not delete files elsewhere.
        where = parse_slice(file_path) if type(file_path) is str else None
        if where is not None:
            self.packs.release(where[0], where[1], where[2])
        elif type(file_path) is str and _NAME_RE.fullmatch(file_path):
            with contextlib.suppress(OSError):  # already removed by another process
                os.unlink(os.path.join(self._directory, file_path))


def _read_file(path: str, size: int) -> bytes:
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


def _key(url: str, identity: str) -> str:
    # Length-prefixed so that no (url, identity) pair can collide with another; all identities
    # of one URL share the prefix, which puts() uses to drop stale ones through the key index.
    return f"{len(url)}:{url}\n{identity}"


def _url_range(url: str) -> tuple[str, str]:
    prefix = f"{len(url)}:{url}\n"
    return prefix, prefix + "\U0010ffff"


class BlobCache:
    """A size-bounded, checksummed, process-safe bytes cache in ``directory``.

    directory:     a local directory (created with mode 0700); several processes and jobs may share it.
    size_limit:    bytes or a human size (default ``"100GB"``); ``volume_bytes`` stays within
                   ``size_limit + SLACK_BYTES`` plus the SQLite WAL (see the module docstring).
    policy:        ``"admit"`` (default: keep the first ``size_limit`` bytes, best for shuffled
                   multi-epoch training) or ``"lru"`` (evict least-recently-used).
    orphan_grace:  age in seconds (or ``"10m"``) after which temp files and value files without
                   a row are swept when a cache opens (default 600).
    write_pause:   seconds without write attempts after a write error (default 60).

    Raises :class:`CacheError` if the directory cannot be created or its index opened.
    Thread-safe; SQLite connections are per thread and per process.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        size_limit: int | str = "100GB",
        policy: Policy = "admit",
        orphan_grace: float | str = 600.0,
        write_pause: float | str = 60.0,
    ) -> None:
        if policy not in ("admit", "lru"):
            raise ConfigError(f"cache policy must be 'admit' or 'lru', got {policy!r}")
        self._setup(os.fspath(directory), parse_size(size_limit, name="size_limit"), policy)
        self._grace = parse_duration(orphan_grace, name="orphan_grace") if orphan_grace != 0 else 0.0
        self._pause = parse_duration(write_pause, name="write_pause")
        self._connect()  # fail now, with a clear message, if the directory is unusable

    def _setup(self, directory: str, size_limit: int, policy: Policy) -> None:
        self._directory = os.path.abspath(os.path.expanduser(directory))
        self._wal_path = os.path.join(self._directory, _DB_NAME + "-wal")
        self._size_limit = size_limit
        self._policy: Policy = policy
        self._grace = 600.0
        self._pause = 60.0
        self._lock = threading.RLock()
        self._dc: Any = None
        _INSTANCES.add(self)
        self._pid = -1
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "stored", "rejected", "write_errors", "evictions"), 0
        )
        self._paused_until = 0.0
        self._broken_until = 0.0
        self._warned = False
        self._use_packs = False  # decided when the index opens (hole punching supported there)

    # -- pickling (spawn workers): just the configuration, reopened on first use -----------------

    def __getstate__(self) -> tuple[str, int, str]:
        return (self._directory, self._size_limit, self._policy)

    def __setstate__(self, state: tuple[str, int, Policy]) -> None:
        self._setup(*state)

    def __repr__(self) -> str:
        return f"BlobCache({self._directory!r}, size_limit={self._size_limit}, policy={self._policy!r})"

    def __enter__(self) -> BlobCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def directory(self) -> str:
        """The cache directory (absolute)."""
        return self._directory

    # -- opening ------------------------------------------------------------------------------

    def _connect(self) -> Any:
        """This process's diskcache.Cache, opened on first use and again after fork."""
        pid = os.getpid()
        dc = self._dc
        if dc is not None and self._pid == pid:
            return dc
        if self._pid != pid and self._pid != -1:
            # Inherited through fork. A lock held by a parent thread at fork time would never be
            # released here, and SQLite forbids using (or closing) a parent's connection.
            self._lock = threading.RLock()
            if self._dc is not None:
                _ABANDONED.append(self._dc)
            self._dc = None
            self._counts = dict.fromkeys(self._counts, 0)
        with self._lock:
            if self._dc is None:
                if time.monotonic() < self._broken_until:  # do not retry a failed open on every call
                    raise CacheError(f"cache directory {self._directory} is unusable (retrying later)")
                try:
                    self._dc = self._open()
                except CacheError:
                    self._broken_until = time.monotonic() + self._pause
                    raise
                self._pid = pid
            return self._dc

    def _open(self) -> Any:
        directory = self._directory
        try:
            _make_private_dir(directory)
            db = os.path.join(directory, _DB_NAME)
            # O_EXCL: never open (and close) an existing index here. Closing any descriptor of a
            # file drops every POSIX lock this process holds on it, including those of another
            # open SQLite connection, and readers then see a corrupt image (SQLite howtocorrupt 2.2).
            with contextlib.suppress(FileExistsError):
                os.close(os.open(db, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600))
            for path in (db, db + "-wal", db + "-shm"):
                _chmod_private(path, 0o600)
            dc = diskcache.Cache(
                directory,
                timeout=_SQLITE_TIMEOUT,
                disk=_BytesDisk,
                eviction_policy="none",  # we admit and evict ourselves, inside one transaction
                cull_limit=0,
                size_limit=2**62,
                statistics=0,  # diskcache's counters would make every get a write
                tag_index=0,
                disk_min_file_size=_MIN_FILE_SIZE,
                sqlite_journal_size_limit=WAL_SLACK_BYTES // 2,
            )
            with dc.transact():
                for statement in _SCHEMA:
                    dc._sql(statement)
            self._use_packs = punch_supported(directory)
        except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
            raise CacheError(
                f"cache directory {directory} cannot be used ({exc}); choose a writable local "
                "directory for the cache, or run without a cache"
            ) from exc
        try:
            self._sweep(dc, force=False)
        except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
            _log.debug("blobdata cache %s: orphan sweep skipped (%s)", directory, exc)
        return dc

    # -- reading ------------------------------------------------------------------------------

    def get(self, url: str, identity: str) -> bytes | None:
        """Verified bytes of ``(url, identity)``, or None on a miss (absent, corrupt, unreadable).

        One indexed SQLite read and one file read; with policy ``"admit"`` nothing is written.
        A corrupt or tampered entry is deleted and counted in ``corrupt``.
        """
        try:
            dc = self._connect()
            row = dc._sql(
                "SELECT rowid, mode, filename, value FROM Cache WHERE key = ? AND raw = 1",
                (_key(url, identity),),
            ).fetchone()
        except CacheError as exc:
            self._warn_once(exc)
            self._bump("misses")
            return None
        except (sqlite3.Error, OSError) as exc:
            _log.debug("blobdata cache %s: read of %s failed (%s)", self._directory, url, exc)
            self._bump("misses")
            return None
        if row is None:
            self._bump("misses")
            return None
        rowid, mode, filename, value = row
        try:
            data: bytes = dc.disk.fetch(mode, filename, value, False)
        except (_Corrupt, _Refused, FileNotFoundError) as exc:
            # A missing file is usually an eviction racing this read (row already gone); _drop
            # deletes only a row that is still there, i.e. a dangling or corrupt one.
            if self._drop(dc, rowid, filename):
                _log.debug("blobdata cache %s: dropped bad entry for %s (%r)", self._directory, url, exc)
                self._bump("corrupt")
            self._bump("misses")
            return None
        except OSError as exc:
            _log.debug("blobdata cache %s: read of %s failed (%s)", self._directory, url, exc)
            self._bump("misses")
            return None
        if self._policy == "lru":
            # A lost access-time update (index busy) only makes eviction slightly less exact.
            with contextlib.suppress(sqlite3.Error):
                dc._sql("UPDATE Cache SET access_time = ? WHERE rowid = ?", (time.time(), rowid))
        self._bump("hits")
        return data

    def __contains__(self, key: tuple[str, str]) -> bool:
        """Whether ``(url, identity)`` has an entry (no checksum read)."""
        url, identity = key
        try:
            return (
                self._connect()
                ._sql("SELECT 1 FROM Cache WHERE key = ? AND raw = 1", (_key(url, identity),))
                .fetchone()
                is not None
            )
        except (CacheError, sqlite3.Error, OSError):
            return False

    # -- writing ------------------------------------------------------------------------------

    def put(self, url: str, identity: str, data: bytes) -> bool:
        """Store ``data`` for ``(url, identity)``; True if it is in the cache afterwards.

        False when not admitted (policy ``"admit"`` and full, or larger than the cache) or on any
        I/O error; never raises for those. An entry for another identity of ``url`` is replaced.
        """
        return self.put_many([(url, identity, data)])[0]

    def put_many(self, items: Sequence[tuple[str, str, bytes]]) -> list[bool]:
        """:meth:`put` for several ``(url, identity, data)`` at once, with one index transaction.

        The write lock of the shared index is the contended part of a put (every worker of every
        job on the node takes it); a batch takes it once. Value files are written before the lock.
        """
        results = [False] * len(items)
        for _, _, data in items:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"BlobCache.put takes bytes, got {type(data).__name__}")
        if not items:
            return results
        if time.monotonic() < self._paused_until:
            self._bump("write_errors", len(items))
            return results
        pending: list[_Pending] = []
        dc: Any = None
        try:
            dc = self._connect()
            sql = dc._sql
            page_bytes, size_sum = self._volume(sql)
            planned = 0
            for i, (url, identity, raw) in enumerate(items):
                data = bytes(raw)
                key = _key(url, identity)
                if sql("SELECT 1 FROM Cache WHERE key = ? AND raw = 1", (key,)).fetchone() is not None:
                    results[i] = True
                    self._bump("stored")
                    continue
                packed = self._use_packs and len(data) >= _MIN_FILE_SIZE
                need = aligned(len(data)) if packed else len(data) + _HEADER.size
                # A cheap check before writing anything; the authoritative one is in _commit.
                full = page_bytes + size_sum + planned + need > self._size_limit
                if page_bytes + need > self._size_limit or (
                    self._policy == "admit"
                    and full
                    and page_bytes + size_sum + planned - self._stale_bytes(sql, url) + need
                    > self._size_limit
                ):
                    self._bump("rejected")
                    continue
                if len(data) < _MIN_FILE_SIZE:
                    kind, crc = _checksum(data)
                    value: _Staged | _Inline = _Inline(_HEADER.pack(kind.encode(), crc) + data)
                else:
                    value = self._stage(dc, data)
                pending.append(_Pending(i, key, url, value, need))
                planned += need
            outcome, removed = self._commit(dc, pending) if pending else ({}, [])
        except (OSError, sqlite3.Error, diskcache.Timeout, CacheError) as exc:
            if dc is not None:
                _rollback_quietly(dc)
                for p in pending:
                    if isinstance(p.value, _Staged):
                        dc.disk.remove(p.value.filename)
            self._write_failed(exc)
            return results
        except BaseException:
            for p in pending:
                if isinstance(p.value, _Staged):
                    dc.disk.remove(p.value.filename)
            raise
        stored = evicted = 0
        for p in pending:
            state = outcome.get(p.pos)
            if state is not True and isinstance(p.value, _Staged):
                dc.disk.remove(p.value.filename)  # rejected, or the same key stored by another process
            if state is False:
                self._bump("rejected")
            else:
                results[p.pos] = True
                stored += 1
        for filename in removed:  # after COMMIT: a crash here leaves orphans, swept later
            dc.disk.remove(filename)
            evicted += 1
        if stored:
            self._bound_wal(dc)
            with self._lock:
                self._counts["stored"] += stored
                self._counts["evictions"] += evicted
        return results

    def _commit(self, dc: Any, pending: list[_Pending]) -> tuple[dict[int, bool | None], list[str]]:
        """Check room and insert each pending value in one BEGIN IMMEDIATE transaction.

        Returns ({index: stored}, files to delete). stored is None when the key was already present
        (its staged file is then redundant), False when it did not fit.
        """
        removed: list[str | None] = []
        outcome: dict[int, bool | None] = {}
        with dc.transact():
            sql = dc._sql
            ((page_size,),) = sql("PRAGMA page_size").fetchall()
            for p in pending:
                # One range scan finds both this key (already stored by another process) and the
                # stale entries of other identities of the same URL.
                same_url = sql(
                    "SELECT key FROM Cache WHERE key >= ? AND key < ? AND raw = 1", _url_range(p.url)
                ).fetchall()
                if (p.key,) in same_url:
                    outcome[p.pos] = None
                    continue
                if not same_url:  # the common case: nothing to delete, so no savepoint needed
                    ((pages,),) = sql("PRAGMA page_count").fetchall()
                    ((size_sum,),) = sql("SELECT value FROM Settings WHERE key = 'size'").fetchall()
                    if int(pages) * int(page_size) + int(size_sum) + p.need <= self._size_limit:
                        self._insert(sql, p)
                        outcome[p.pos] = True
                        continue
                # Each value in its own savepoint: one that does not fit leaves the index exactly as
                # it was (no stale entry or evicted row deleted for it), as a lone put would.
                sql("SAVEPOINT blobdata_put")
                mine = self._make_room(sql, p)
                if mine is None:
                    sql("ROLLBACK TO blobdata_put")
                    outcome[p.pos] = False
                else:
                    self._insert(sql, p)
                    removed += mine
                    outcome[p.pos] = True
                sql("RELEASE blobdata_put")
        return outcome, [name for name in removed if name]

    @staticmethod
    def _insert(sql: Any, p: _Pending) -> None:
        """Insert the row of ``p`` (diskcache's columns; its triggers update count and size)."""
        if isinstance(p.value, _Staged):
            size, mode, filename, blob = p.value.size, diskcache.core.MODE_BINARY, p.value.filename, None
        else:
            size, mode, filename, blob = 0, diskcache.core.MODE_RAW, None, sqlite3.Binary(p.value.blob)
        now = time.time()
        sql(
            "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag,"
            " size, mode, filename, value) VALUES (?, 1, ?, NULL, ?, 0, NULL, ?, ?, ?, ?)",
            (p.key, now, now, size, mode, filename, blob),
        )

    def _make_room(self, sql: Any, p: _Pending) -> list[str | None] | None:
        """Delete the stale entries of ``p.url`` and, under LRU, evict until ``p`` fits.

        Returns the value files of the deleted rows, or None if ``p`` does not fit (the caller then
        rolls the deletions back).
        """
        # Entries for other identities of this URL are stale: the object changed.
        stale = sql(
            "SELECT rowid, filename FROM Cache WHERE key >= ? AND key < ? AND raw = 1",
            _url_range(p.url),
        ).fetchall()
        removed: list[str | None] = []
        for rowid, filename in stale:
            sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
            removed.append(filename)
        page_bytes, size_sum = self._volume(sql)
        excess = page_bytes + size_sum + p.need - self._size_limit
        if excess <= 0:
            return removed
        if self._policy == "admit" or page_bytes + p.need > self._size_limit:
            return None
        evicted = self._evict(sql, excess)
        return None if evicted is None else removed + evicted

    def _evict(self, sql: Any, excess: int) -> list[str | None] | None:
        """Delete least-recently-used rows until ``excess`` bytes are freed (inside a transaction).

        None if the index holds too little to free (only when the index alone exceeds the limit).
        """
        removed: list[str | None] = []
        while excess > 0:
            rows = sql(
                "SELECT rowid, filename, size + COALESCE(length(value), 0) FROM Cache"
                " ORDER BY access_time LIMIT 32"
            ).fetchall()
            if not rows:
                return None
            for rowid, filename, nbytes in rows:
                sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
                removed.append(filename)
                excess -= nbytes
                if excess <= 0:
                    break
        return removed

    def _stage(self, dc: Any, data: bytes) -> _Staged:
        """Append ``data`` to this process's pack, or (no hole punching) write it to a value file."""
        kind, crc = _checksum(data)
        if self._use_packs:
            return _Staged(dc.disk.packs.append(data, kind, crc), aligned(len(data)))
        name = secrets.token_hex(16)
        filename = f"{name[:2]}/{name}-{len(data):x}-{kind}{crc:08x}.val"
        path = os.path.join(self._directory, filename)
        tmp = path + ".tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            _make_private_dir(os.path.dirname(path))
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
        return _Staged(filename, len(data))

    # -- bookkeeping ----------------------------------------------------------------------------

    def _bound_wal(self, dc: Any) -> None:
        """Checkpoint and truncate the WAL once it passes half of ``WAL_SLACK_BYTES``.

        SQLite's automatic checkpoints cannot restart the WAL while readers overlap without a
        pause (many workers calling get), so it would grow without bound; TRUNCATE waits for the
        readers of old frames (microseconds each) and empties it.
        """
        try:
            if os.stat(self._wal_path).st_size > WAL_SLACK_BYTES // 2:
                dc._sql("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except (OSError, sqlite3.Error) as exc:
            _log.debug("blobdata cache %s: WAL checkpoint skipped (%s)", self._directory, exc)

    @staticmethod
    def _stale_bytes(sql: Any, url: str) -> int:
        """Bytes held by entries of ``url`` (other identities would be replaced by a put)."""
        ((nbytes,),) = sql(
            "SELECT COALESCE(SUM(size + COALESCE(length(value), 0)), 0) FROM Cache"
            " WHERE key >= ? AND key < ? AND raw = 1",
            _url_range(url),
        ).fetchall()
        return int(nbytes)

    @staticmethod
    def _volume(sql: Any) -> tuple[int, int]:
        """(bytes of index pages, bytes of value files) as the index records them."""
        ((pages,),) = sql("PRAGMA page_count").fetchall()
        ((page_size,),) = sql("PRAGMA page_size").fetchall()
        ((size_sum,),) = sql("SELECT value FROM Settings WHERE key = 'size'").fetchall()
        return int(pages) * int(page_size), int(size_sum)

    def _drop(self, dc: Any, rowid: int, filename: str | None) -> bool:
        """Delete the row if it still points at ``filename``; True if it did."""
        try:
            with dc.transact():
                cursor = dc._sql("DELETE FROM Cache WHERE rowid = ? AND filename IS ?", (rowid, filename))
                deleted = bool(cursor.rowcount > 0)
        except (sqlite3.Error, diskcache.Timeout):
            return False
        if deleted:
            dc.disk.remove(filename)
        return deleted

    def _bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _write_failed(self, exc: BaseException) -> None:
        self._bump("write_errors")
        self._paused_until = time.monotonic() + self._pause
        self._warn_once(exc)

    def _warn_once(self, exc: BaseException) -> None:
        """One warning per cache object and process; later failures are logged at debug level."""
        if not self._warned:
            self._warned = True
            _log.warning(
                "blobdata cache %s: cannot write (%s: %s); cache writes paused for %.0f s, "
                "reading objects from the network instead (free space or choose another cache directory)",
                self._directory,
                type(exc).__name__,
                exc,
                self._pause,
            )
        else:
            _log.debug("blobdata cache %s: write failed again (%s)", self._directory, exc)

    def _shared_state(self) -> tuple[int, int]:
        """(volume_bytes, entries) of the directory; zeros if the index cannot be read."""
        try:
            sql = self._connect()._sql
            page_bytes, size_sum = self._volume(sql)
            ((count,),) = sql("SELECT value FROM Settings WHERE key = 'count'").fetchall()
            return page_bytes + size_sum, int(count)
        except (CacheError, sqlite3.Error, OSError):
            return 0, 0

    def stats(self) -> CacheStats:
        """This process's counters plus the directory's current volume and entry count."""
        volume, entries = self._shared_state()
        with self._lock:
            counts = dict(self._counts)
        return CacheStats(
            **counts, volume_bytes=volume, entries=entries, size_limit=self._size_limit, policy=self._policy
        )

    def info(self) -> dict[str, object]:
        """A summary for ``blobdata cache info``: directory, entries, bytes, limit, policy."""
        volume, entries = self._shared_state()
        return {
            "directory": self._directory,
            "entries": entries,
            "bytes": volume,
            "limit": self._size_limit,
            "policy": self._policy,
        }

    def clear(self) -> None:
        """Remove every entry (for all processes) and sweep old orphans. Raises CacheError on failure."""
        try:
            dc = self._connect()
            dc.clear(retry=True)
            self._sweep(dc, force=True)
        except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
            raise CacheError(f"cannot clear cache directory {self._directory} ({exc})") from exc

    def close(self) -> None:
        """Close this process's connection; a later call reopens it."""
        with self._lock:
            if self._dc is not None and self._pid == os.getpid():
                self._dc.disk.packs.close()
                self._dc.close()
                self._dc = None

    # -- orphans --------------------------------------------------------------------------------

    def _sweep(self, dc: Any, *, force: bool) -> None:
        """Delete temp files and row-less value files older than the grace period (bounded scan).

        One process per directory sweeps per grace period (a timestamp in the index decides).
        """
        now = time.time()
        sql = dc._sql
        with dc.transact():
            row = sql("SELECT value FROM Blobdata WHERE key = 'last_sweep'").fetchone()
            if not force and row is not None and now - float(row[0]) < self._grace:
                return
            sql("INSERT OR REPLACE INTO Blobdata (key, value) VALUES ('last_sweep', ?)", (now,))

        def live(pack: str) -> list[tuple[int, int]]:
            rows = sql(
                "SELECT filename FROM Cache WHERE filename >= ? AND filename < ?", (pack + "@", pack + "A")
            )
            return [(w[1], w[2]) for (name,) in rows if (w := parse_slice(name)) is not None and w[0] == pack]

        dc.disk.packs.sweep(live, grace=self._grace, now=now)
        try:
            subdirs = sorted(
                e.name
                for e in os.scandir(self._directory)
                if e.is_dir() and re.fullmatch("[0-9a-f]{2}", e.name)
            )
        except OSError:
            return
        start = random.randrange(len(subdirs)) if subdirs else 0
        budget = _SWEEP_MAX_FILES
        for sub in subdirs[start:] + subdirs[:start]:
            try:
                entries = list(os.scandir(os.path.join(self._directory, sub)))
            except OSError:
                continue
            for entry in entries[:budget]:
                name = f"{sub}/{entry.name}"
                try:
                    if now - entry.stat().st_mtime < self._grace:
                        continue
                    if name.endswith(".val.tmp"):
                        orphan = _NAME_RE.fullmatch(name[:-4]) is not None
                    else:  # a value file whose row was never inserted or already deleted
                        orphan = _NAME_RE.fullmatch(name) is not None and (
                            sql("SELECT 1 FROM Cache WHERE filename = ?", (name,)).fetchone() is None
                        )
                    if orphan:
                        os.unlink(entry.path)
                except OSError:
                    continue
            budget -= len(entries)
            if budget <= 0:
                break


def _close_before_fork() -> None:
    """Close the forking thread's SQLite connections before ``os.fork()``.

    A child inherits SQLite's per-process lock bookkeeping with any open connection; with none
    open it starts clean, and its own connection takes its own locks. The parent reopens lazily.
    """
    pid = os.getpid()
    for cache in list(_INSTANCES):
        dc = cache._dc
        if dc is not None and cache._pid == pid:
            with contextlib.suppress(sqlite3.Error):
                dc.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_close_before_fork)


def _rollback_quietly(dc: Any) -> None:
    """End a transaction a failed COMMIT left open, so later puts can begin new ones."""
    try:
        con = dc._con
        if con.in_transaction:
            con.execute("ROLLBACK")
    except sqlite3.Error:
        pass


def _make_private_dir(path: str) -> None:
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
    if not names or _DB_NAME in names or all(re.fullmatch(rf"[0-9a-f]{{2}}|{PACK_DIR}", n) for n in names):
        _chmod_private(path, 0o700)


def _chmod_private(path: str, mode: int) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if stat.S_IMODE(st.st_mode) & 0o077 and st.st_uid == os.geteuid():
        os.chmod(path, mode)


class CacheWriter:
    """Writes into a :class:`BlobCache` from one background thread, many entries per transaction.

    The fetch path calls :meth:`offer` and moves on: it never waits for the disk or for the
    index's write lock. Entries queue up to ``max_bytes`` (default 64 MiB); beyond that an offer
    is dropped (the object is simply not cached this time) and counted in ``dropped``. The thread
    commits up to ``batch`` queued entries at a time with one :meth:`BlobCache.put_many`, once
    ``batch`` entries are queued or the oldest has waited ``linger`` seconds (default 0.2): a
    transaction costs ~0.25 ms on top of ~0.15 ms per entry, and a DataLoader worker offers a few
    hundred objects per second, so committing each as it comes would double the cost of caching.
    Pending entries are flushed when the process exits normally, including DataLoader workers (a
    multiprocessing finalizer), within ``flush_timeout`` seconds.
    """

    def __init__(
        self,
        cache: BlobCache,
        *,
        max_bytes: int = 64 * 2**20,
        batch: int = 64,
        linger: float = 0.2,
        flush_timeout: float = 4.0,
    ) -> None:
        self.cache = cache
        self.max_bytes = max_bytes
        self.batch = batch
        self.linger = linger
        self.flush_timeout = flush_timeout
        self._since = 0.0  # when the oldest queued entry arrived (monotonic)
        self._flushing = 0  # threads waiting in flush(): commit at once, do not linger
        self.dropped = 0
        self._queue: list[tuple[str, str, bytes]] = []
        self._bytes = 0
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def offer(self, url: str, identity: str, data: bytes) -> bool:
        """Queue ``data`` for the cache; False (and counted) if the queue is full."""
        with self._cond:
            if self._bytes + len(data) > self.max_bytes and self._queue:
                self.dropped += 1
                return False
            first = not self._queue
            if first:
                self._since = time.monotonic()
            self._queue.append((url, identity, data))
            self._bytes += len(data)
            if first or len(self._queue) >= self.batch:  # start the linger clock, or commit now
                self._cond.notify()
        if self._thread is None or self._pid != os.getpid():
            self._start()
        return True

    def _start(self) -> None:
        with self._cond:
            if self._thread is not None and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="blobdata-cache-writer", daemon=True)
            self._thread.start()
        # Flush at a normal exit: atexit in a main process, multiprocessing's finalizers in its
        # children (DataLoader workers leave through os._exit after running those, not atexit).
        atexit.register(self.flush)
        mp_util.Finalize(self, self.flush, exitpriority=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._queue and (len(self._queue) >= self.batch or self._flushing):
                        break
                    if not self._queue:
                        self._cond.wait()
                        continue
                    left = self._since + self.linger - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                todo, self._queue = self._queue[: self.batch], self._queue[self.batch :]
                self._since = time.monotonic()
                self._busy = True
            try:
                self.cache.put_many(todo)
            except Exception as exc:  # put_many already turns I/O errors into False
                _log.debug("blobdata cache %s: background write failed (%s)", self.cache.directory, exc)
            finally:
                with self._cond:
                    self._bytes -= sum(len(d) for _, _, d in todo)
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything offered so far is written; False if ``timeout`` passed first."""
        if self._thread is None or self._pid != os.getpid():
            return not self._queue
        deadline = time.monotonic() + (self.flush_timeout if timeout is None else timeout)
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                while self._queue or self._busy:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._flushing -= 1
        return True

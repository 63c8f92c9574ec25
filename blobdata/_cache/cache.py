"""The :class:`BlobCache` facade: opening the index per process, reading, writing, stats.

See the package docstring (:mod:`blobdata._cache`) for the safety properties and the size bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Sequence

from .. import _process
from .._config import parse_duration
from .._errors import CacheError, ConfigError
from .db import Index
from .index import VOLUME_AND_COUNT, WAL_SLACK_BYTES, Policy
from .packs import aligned, punch_supported
from .reads import Opened, ReadOps
from .trim import DEFAULT_LIMIT, TrimOps, parse_limit, recorded_bound
from .trust import open_private_dir
from .values import (
    DB_NAME,
    HEADER,
    MIN_FILE_SIZE,
    MIN_PACKED_SIZE,
    Inline,
    Pending,
    Staged,
    Values,
    checksum,
    key_of,
    write_value_file,
)

__all__ = ["BlobCache", "CacheStats"]

_log = logging.getLogger("blobdata")

_SQLITE_TIMEOUT = 15.0  # seconds a writer waits for the index lock before the put counts as failed
_INSTANCES: weakref.WeakSet[BlobCache] = weakref.WeakSet()


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


class BlobCache(ReadOps, TrimOps):
    """A size-bounded, checksummed, process-safe bytes cache in ``directory``.

    directory:     a local directory (created with mode 0700) of the current user's (see :mod:`.trust`);
                   several processes and jobs of that user may share it.
    size_limit:    bytes or a human size, at least 64KiB. The bound belongs to the cache: None (default)
                   keeps the stored one (``"100GB"`` for a new cache); a larger one raises it; a smaller
                   one evicts nothing and keeps the stored one (with a warning) unless ``shrink=True``.
                   ``volume_bytes`` stays within the bound + ``SLACK_BYTES`` plus the SQLite WAL.
    policy:        ``"admit"`` (default: keep the first ``size_limit`` bytes, best for shuffled
                   multi-epoch training) or ``"lru"`` (evict least-recently-used).
    orphan_grace:  age in seconds (or ``"10m"``) after which temp files and value files without
                   a row are swept when a cache opens (default 600).
    write_pause:   seconds without write attempts after a write error (default 60).

    shrink:        lower the stored bound to ``size_limit`` and evict down to it now (announced at WARNING).
    :meth:`trim` evicts first what a node's current share does not need.
    Raises :class:`CacheError` if the directory cannot be created or its index opened.
    Thread-safe; SQLite connections are per thread and per process.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        size_limit: int | str | None = None,
        policy: Policy = "admit",
        orphan_grace: float | str = 600.0,
        write_pause: float | str = 60.0,
        shrink: bool = False,
    ) -> None:
        if policy not in ("admit", "lru"):
            raise ConfigError(f"cache policy must be 'admit' or 'lru', got {policy!r}")
        requested = None if size_limit is None else parse_limit(size_limit, name="size_limit")
        if shrink and requested is None:
            raise ConfigError("BlobCache(shrink=True) needs the size_limit to shrink the cache to")
        self._setup(os.fspath(directory), requested or DEFAULT_LIMIT, policy)
        self._requested, self._shrink = requested, shrink  # settled by the first open (.trim)
        self._grace = parse_duration(orphan_grace, name="orphan_grace") if orphan_grace != 0 else 0.0
        self._pause = parse_duration(write_pause, name="write_pause")
        self._connect()  # fail now, with a clear message, if the directory is unusable

    def _setup(self, directory: str, size_limit: int, policy: Policy) -> None:
        self._directory = os.path.abspath(os.path.expanduser(directory))
        self._wal_path = os.path.join(self._directory, DB_NAME + "-wal")
        self._size_limit = size_limit
        self._policy: Policy = policy
        self._grace = 600.0
        self._pause = 60.0
        self._lock = threading.RLock()
        self._opened: Opened | None = None
        _INSTANCES.add(self)
        self._pid = -1
        self._counts = dict.fromkeys(
            ("hits", "misses", "corrupt", "stored", "rejected", "write_errors", "evictions"), 0
        )
        self._paused_until = 0.0
        self._broken_until = 0.0
        self._warned = False
        self._use_packs = False  # decided when the index opens (hole punching supported there)
        self._passive = False  # inspecting only (cache info/clear): records no limit, trims nothing
        self._requested: int | None = None  # None: the stored bound applies (a pickled copy's case)
        self._shrink = False

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

    @classmethod
    def inspect(cls, directory: str | os.PathLike[str], *, size_limit: int | None = None) -> BlobCache:
        """The cache in ``directory`` opened to look at, trim or clear it: it records no limit and
        trims nothing when it opens. Its ``size_limit`` (what :meth:`trim` aims at) is ``size_limit``,
        else the one the last opener recorded (0 if none). Raises :class:`CacheError` (creating
        nothing) if ``directory`` holds no cache."""
        path = os.fspath(directory)
        if not os.path.isfile(os.path.join(path, DB_NAME)):
            raise CacheError(f"no cache at {path}: it holds no cache index", url=path)
        cache = cls.__new__(cls)
        cache._setup(path, 0, "admit")
        cache._passive = True
        db = cache._connect().db
        cache._size_limit = size_limit if size_limit is not None else (recorded_bound(db) or 0)
        return cache

    @property
    def directory(self) -> str:
        """The cache directory (absolute)."""
        return self._directory

    @property
    def size_limit(self) -> int:
        """The size bound in bytes."""
        return self._size_limit

    @property
    def policy(self) -> Policy:
        """``"admit"`` or ``"lru"``."""
        return self._policy

    # -- opening ------------------------------------------------------------------------------

    def _connect(self) -> Opened:
        """This process's index and value store, opened on first use and again after fork."""
        pid = _process.pid()
        opened = self._opened
        if opened is not None and self._pid == pid:
            return opened
        if self._pid != pid and self._pid != -1:
            # Inherited through fork. A lock held by a parent thread at fork time would never be
            # released here, and SQLite forbids using (or closing) a parent's connection.
            self._lock = threading.RLock()
            if self._opened is not None:
                _process.orphan(self._opened)
            self._opened = None
            self._counts = dict.fromkeys(self._counts, 0)
        with self._lock:
            if self._opened is None:
                if time.monotonic() < self._broken_until:  # do not retry a failed open on every call
                    raise CacheError(f"cache directory {self._directory} is unusable (retrying later)")
                try:
                    self._opened = self._open()
                except CacheError:
                    self._broken_until = time.monotonic() + self._pause
                    raise
                self._pid = pid
            return self._opened

    def _open(self) -> Opened:
        directory = self._directory
        try:
            open_private_dir(directory)  # ours alone, or CacheError (.trust)
            path = os.path.join(directory, DB_NAME)
            # O_EXCL: never open (and close) an existing index here. Closing any descriptor of a
            # file drops every POSIX lock this process holds on it, including those of another
            # open SQLite connection, and readers then see a corrupt image (SQLite howtocorrupt 2.2).
            with contextlib.suppress(FileExistsError):
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                os.close(os.open(path, flags, 0o600))
            db = Index(path, timeout=_SQLITE_TIMEOUT, journal_limit=WAL_SLACK_BYTES // 2)
            opened = Opened(db, Values(directory))
            self._use_packs = punch_supported(directory)
        except (OSError, sqlite3.Error) as exc:
            raise CacheError(
                f"cache directory {directory} cannot be used ({exc}); choose a writable local "
                "directory for the cache, or run without a cache"
            ) from exc
        try:
            self._sweep(db, opened.values, force=False)
        except (OSError, sqlite3.Error) as exc:
            _log.debug("blobdata cache %s: orphan sweep skipped (%s)", directory, exc)
        if not self._passive:
            try:
                self._bound_on_open(db, opened.values)
            except (OSError, sqlite3.Error) as exc:  # the bound holds for new puts all the same
                _log.warning("blobdata cache %s: could not trim it to its limit (%s)", directory, exc)
        return opened

    def _opened_index(self) -> Opened:
        return self._connect()

    # -- reading ------------------------------------------------------------------------------

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
        pending: list[Pending] = []
        opened: Opened | None = None
        try:
            opened = self._connect()
            db, values = opened
            sql = db.sql
            page_bytes, size_sum = self._volume(sql)
            planned = 0
            smallest = MIN_PACKED_SIZE if self._use_packs else MIN_FILE_SIZE  # not inline from this size
            keys = [key_of(url, identity) for url, identity, _ in items]
            present = self._present(sql, keys)
            for i, (url, _, raw) in enumerate(items):
                data = bytes(raw)
                key = keys[i]
                if key in present:
                    results[i] = True
                    self._bump("stored")
                    continue
                inline = len(data) < smallest
                packed = self._use_packs and not inline
                need = aligned(len(data)) if packed else len(data) + HEADER.size
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
                if inline:
                    kind, crc = checksum(data)
                    value: Staged | Inline = Inline(HEADER.pack(kind.encode(), crc) + data)
                else:
                    value = self._stage(values, data)
                pending.append(Pending(i, key, url, value, need))
                planned += need
            outcome, removed = self._commit(db, pending) if pending else ({}, [])
        except (OSError, sqlite3.Error, CacheError) as exc:
            if opened is not None:
                _unstage(opened.values, pending)
            self._write_failed(exc)
            return results
        except BaseException:
            if opened is not None:
                _unstage(opened.values, pending)
            raise
        stored = evicted = 0
        for p in pending:
            state = outcome.get(p.pos)
            if state is not True and isinstance(p.value, Staged):
                values.remove(p.value.filename)  # rejected, or the same key stored by another process
            if state is False:
                self._bump("rejected")
            else:
                results[p.pos] = True
                stored += 1
        for filename in removed:  # after COMMIT: a crash here leaves orphans, swept later
            values.remove(filename)
            evicted += 1
        if stored:
            self._bound_wal(db)
            with self._lock:
                self._counts["stored"] += stored
                self._counts["evictions"] += evicted
        return results

    def _stage(self, values: Values, data: bytes) -> Staged:
        """Append ``data`` to this process's pack, or (no hole punching) write it to a value file."""
        kind, crc = checksum(data)
        if self._use_packs:
            return Staged(values.packs.append(data, kind, crc), aligned(len(data)))
        return write_value_file(self._directory, data, kind, crc)

    def _write_failed(self, exc: BaseException) -> None:
        self._bump("write_errors")
        self._paused_until = time.monotonic() + self._pause
        self._warn_once(exc)

    def _shared_state(self) -> tuple[int, int]:
        """(volume_bytes, entries) of the directory; zeros if the index cannot be read."""
        try:
            sql = self._connect().db.sql
            # One statement, one snapshot: the volume and the count of the same commit.
            ((volume, count),) = sql(VOLUME_AND_COUNT).fetchall()
            return int(volume), int(count)
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
        """A summary for ``blobdata cache info``: directory, entries, bytes, limit, policy, and the
        limit the last opener recorded (``bound``; None if none)."""
        volume, entries = self._shared_state()
        try:
            bound = recorded_bound(self._connect().db)
        except (CacheError, sqlite3.Error, OSError):
            bound = None
        return {
            "directory": self._directory,
            "entries": entries,
            "bytes": volume,
            "limit": self._size_limit,
            "policy": self._policy,
            "bound": bound,
        }

    def close(self) -> None:
        """Close this process's connection; a later call reopens it."""
        with self._lock:
            if self._opened is not None and self._pid == _process.pid():
                self._opened.values.packs.close()
                self._opened.db.close()
                self._opened = None


def _close_before_fork() -> None:
    """Close the forking thread's SQLite connections before ``os.fork()``.

    A child inherits SQLite's per-process lock bookkeeping with any open connection; with none
    open it starts clean, and its own connection takes its own locks. The parent reopens lazily.
    """
    pid = _process.pid()
    for cache in list(_INSTANCES):
        opened = cache._opened
        if opened is not None and cache._pid == pid:
            opened.db.close_thread()


_process.at_fork(before=_close_before_fork)


def _unstage(values: Values, pending: list[Pending]) -> None:
    """Free the values staged for a batch whose index transaction failed or was interrupted."""
    for p in pending:
        if isinstance(p.value, Staged):
            values.remove(p.value.filename)

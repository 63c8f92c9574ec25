"""Reading the cache: one index query for a whole batch of keys, then each value read and verified.

:class:`ReadOps` is the half of :class:`~blobdata._cache.BlobCache` that reads: :meth:`~ReadOps.get`
for one object, :meth:`~ReadOps.get_many` for a batch (the per-batch path of a dataset: one indexed
SQLite query for every key of the batch, then a ``pread`` of each pack slice or the inline value, each
checked against its checksum), :meth:`~ReadOps.has_many` for what a look-ahead need not fetch.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._errors import CacheError
from .db import Index
from .index import CHUNK, IndexOps, marks, rows_of
from .values import Corrupt, Refused, Values, key_of

__all__ = ["Opened", "ReadOps"]

_log = logging.getLogger("blobdata")


class Opened(NamedTuple):
    """One process's handles on a cache directory: the SQLite index and the value store."""

    db: Index
    values: Values


class ReadOps(IndexOps):
    """Reads of a :class:`~blobdata._cache.BlobCache` (a base class: the state is the cache's)."""

    _lock: threading.RLock
    _counts: dict[str, int]
    _warned: bool
    _pause: float

    def _connect(self) -> Opened:
        raise NotImplementedError

    def _bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

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

    def get(self, url: str, identity: str) -> bytes | None:
        """Verified bytes of ``(url, identity)``, or None on a miss (absent, corrupt, unreadable).

        One indexed SQLite read and one file read; with policy ``"admit"`` nothing is written.
        A corrupt or tampered entry is deleted and counted in ``corrupt``.
        """
        return self.get_many(((url, identity),))[0]

    def get_many(self, items: Sequence[tuple[str, str]]) -> list[bytes | None]:
        """:meth:`get` for each ``(url, identity)`` of ``items``, in order: one index query for them
        all (a batch's lookup), then each value read and checked. Counters move once per call."""
        out: list[bytes | None] = [None] * len(items)
        if not items:
            return out
        try:
            db, values = self._connect()
            rows = self._rows(db, [key_of(u, i) for u, i in items])
        except CacheError as exc:
            self._warn_once(exc)
            self._bump("misses", len(items))
            return out
        except (sqlite3.Error, OSError) as exc:
            _log.debug("blobdata cache %s: read of %d objects failed (%s)", self._directory, len(items), exc)
            self._bump("misses", len(items))
            return out
        hits = corrupt = 0
        touched: list[int] = []
        found = [(k, row) for k, row in enumerate(rows) if row is not None]
        got = values.fetch_many([(filename, inline) for _, (_, filename, inline) in found])
        for (k, (rowid, filename, _)), data in zip(found, got, strict=True):
            if isinstance(data, (Corrupt, Refused, FileNotFoundError)):
                # A missing file is usually an eviction racing this read (row already gone); _drop
                # deletes only a row that is still there, i.e. a dangling or corrupt one.
                if self._drop(db, values, rowid, filename):
                    url = items[k][0]
                    _log.debug("blobdata cache %s: dropped bad entry for %s (%r)", self._directory, url, data)
                    corrupt += 1
                continue
            if isinstance(data, Exception):
                _log.debug("blobdata cache %s: read of %s failed (%s)", self._directory, items[k][0], data)
                continue
            out[k] = data
            hits += 1
            touched.append(rowid)
        if self._policy == "lru" and touched:
            # A lost access-time update (index busy) only makes eviction slightly less exact.
            now = time.time()
            with contextlib.suppress(sqlite3.Error):
                db.connection().executemany(
                    "UPDATE entries SET access_time = ? WHERE rowid = ?", [(now, r) for r in touched]
                )
        with self._lock:
            self._counts["hits"] += hits
            self._counts["misses"] += len(items) - hits
            self._counts["corrupt"] += corrupt
        return out

    def has_many(self, items: Sequence[tuple[str, str]]) -> list[bool]:
        """Whether each ``(url, identity)`` has an entry (one index query; no value read, no counter):
        what a look-ahead leaves to be read from the cache when its batch comes."""
        if not items:
            return []
        keys = [key_of(u, i) for u, i in items]
        out: list[bool] = []
        try:
            sql = self._connect().db.sql
            for a in range(0, len(keys), CHUNK):
                part = keys[a : a + CHUNK]
                params = marks(len(part))
                # Usually all or none are there: a count says so without a string per key.
                ((count,),) = sql(f"SELECT count(*) FROM entries WHERE key IN ({params})", part).fetchall()
                if count in (0, len(set(part))):
                    out.extend([bool(count)] * len(part))
                    continue
                found = {r[0] for r in sql(f"SELECT key FROM entries WHERE key IN ({params})", part)}
                out.extend(k in found for k in part)
        except (CacheError, sqlite3.Error, OSError):
            return [False] * len(items)
        return out

    def __contains__(self, key: tuple[str, str]) -> bool:
        """Whether ``(url, identity)`` has an entry (no checksum read)."""
        return self.has_many((key,))[0]

    @staticmethod
    def _rows(db: Index, keys: list[str]) -> list[tuple[int, Any, Any] | None]:
        """The ``(rowid, filename, inline)`` of each key (None where absent), one query per chunk."""
        found: dict[str, tuple[int, Any, Any]] = {}
        for key, rowid, filename, inline in rows_of(db.sql, "key, rowid, filename, inline", keys):
            found[key] = (rowid, filename, inline)
        return [found.get(k) for k in keys]

"""A cache back within its bound: trimmed when it opens over its size limit, and on demand
(:meth:`TrimOps.trim`, ``blobdata cache trim``), evicting first what a node's current share does not
need; and emptied (:meth:`TrimOps.clear`).

The bound belongs to the cache, stored in its index (``meta.bound``), not to the last program that
opened it: a user who warmed 500 GB must not lose 400 GB to a script whose default is 100 GB. An
opener that names no ``size_limit`` uses the stored bound (``DEFAULT_LIMIT`` for a new cache); one
that names a larger one raises it (said at INFO); one that names a smaller one evicts nothing and
keeps the stored bound, with a WARNING naming the two ways to shrink on purpose:
``BlobCache(dir, size_limit=..., shrink=True)`` and ``blobdata cache trim --cache-dir D --cache-size S``
(both store the new bound and evict down to it; the eviction is announced at WARNING). A bound below
``MIN_LIMIT`` (64 KiB: the empty index alone takes 32 KiB) is refused: it would evict every entry
of every job sharing the cache.

Eviction order, oldest first (``access_time``: under ``"admit"`` the time a value was stored) within
each class:

1. entries of the dataset (URLs under ``prefix``) that are not in ``keep``: the node no longer reads
   them (with :class:`~blobdata.PartitionedSampler`, other nodes' shares);
2. other entries not in ``keep`` (other datasets, other jobs);
3. entries in ``keep``, only as far as the bound requires.

``room`` frees that many bytes more for what the share still misses, from class 1 only: it never
evicts another dataset's entries or the share's own to make room. Each transaction deletes at most
``BATCH`` rows and re-reads the volume first, so processes trimming at once do not evict more than
the bound needs; a reader racing an eviction gets a miss, as with ``"lru"``.
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
from collections.abc import Collection, Iterable

import numpy as np

from .._config import parse_size
from .._errors import CacheError, ConfigError
from .db import Index
from .index import SLACK_BYTES, IndexOps
from .values import Values, key_of

__all__ = ["BATCH", "DEFAULT_LIMIT", "MIN_LIMIT", "TrimOps", "TrimResult", "parse_limit"]

BATCH = 512  # rows deleted per transaction
DEFAULT_LIMIT = 100 * 1000**3  # the bound of a new cache whose opener names none (100GB)
MIN_LIMIT = SLACK_BYTES  # 64 KiB: a lower bound holds nothing
_SCAN = 20_000  # rows read per query when classifying entries
_log = logging.getLogger("blobdata")


@dataclasses.dataclass(frozen=True)
class TrimResult:
    """What a trim did: entries and bytes evicted, the volume after it, and the bound it aimed at."""

    evicted: int
    evicted_bytes: int
    volume_bytes: int
    size_limit: int


def parse_limit(value: int | float | str, *, name: str = "size_limit") -> int:
    """A cache's size bound in bytes; ConfigError for what is not a size or is below ``MIN_LIMIT``."""
    limit = parse_size(value, name=name)
    if limit < MIN_LIMIT:
        raise ConfigError(
            f"{name} must be at least 64KiB, got {value!r}: a bound that low holds nothing and would "
            "evict every entry of every job sharing the cache (to empty a cache on purpose, run: "
            "blobdata cache clear --cache-dir DIR)"
        )
    return limit


def _url_of(key: str) -> str:
    length, _, rest = key.partition(":")  # keys are "<len(url)>:<url>\n<identity>" (values.key_of)
    return rest[: int(length)] if length.isdigit() else ""


class TrimOps(IndexOps):
    """Trimming for :class:`~blobdata._cache.BlobCache` (a base class: it holds no state)."""

    def _opened_index(self) -> tuple[Index, Values]:
        raise NotImplementedError

    def trim(
        self,
        keep: Iterable[tuple[str, str]] | None = None,
        *,
        prefix: str | None = None,
        room: int = 0,
    ) -> TrimResult:
        """Evict until the cache is within its ``size_limit`` (and ``room`` bytes are free for the
        share), evicting first the entries under ``prefix`` that are not in ``keep`` (``(url,
        identity)`` pairs: the node's current share), then other entries not in ``keep``, then
        entries in ``keep``; oldest first within each. Returns a :class:`TrimResult`.

        Raises :class:`~blobdata.CacheError` if the index cannot be written."""
        keys = None if keep is None else {key_of(url, identity) for url, identity in keep}
        try:
            db, values = self._opened_index()
            return _trim(db, values, self._size_limit, keys, prefix, max(0, int(room)))
        except (OSError, sqlite3.Error) as exc:
            raise CacheError(f"cannot trim cache directory {self._directory} ({exc})") from exc

    def clear(self) -> None:
        """Remove every entry (for all processes) and sweep old orphans. Raises CacheError on failure."""
        try:
            db, values = self._opened_index()
            while True:  # in batches: other processes keep reading and writing meanwhile
                with db.transact():
                    rows = db.sql("SELECT rowid, filename FROM entries LIMIT 1000").fetchall()
                    db.connection().executemany(
                        "DELETE FROM entries WHERE rowid = ?", [(rowid,) for rowid, _ in rows]
                    )
                for _, filename in rows:  # after COMMIT: a crash here leaves orphans, swept later
                    if filename is not None:
                        values.remove(filename)
                if not rows:
                    break
            self._sweep(db, values, force=True)
        except (OSError, sqlite3.Error) as exc:
            raise CacheError(f"cannot clear cache directory {self._directory} ({exc})") from exc

    _requested: int | None
    _shrink: bool

    def _bound_on_open(self, db: Index, values: Values) -> None:
        """Settle the bound when a process opens the cache (see the module docstring)."""
        stored = recorded_bound(db)
        asked, shrink = self._requested, self._shrink
        self._requested, self._shrink = None, False  # settled: copies (workers) follow the stored one
        if asked is None:
            self._size_limit = stored if stored is not None else self._size_limit
        elif stored is None or asked >= stored or shrink:
            self._size_limit = asked
        else:
            self._size_limit = stored
            _log.warning(
                "blobdata cache %s: opened with a size limit of %d bytes, below its bound of %d bytes: "
                "keeping the bound, evicting nothing. To shrink the cache on purpose, pass "
                "BlobCache(%r, size_limit=%d, shrink=True) or run: blobdata cache trim --cache-dir %s "
                "--cache-size %d",
                self._directory, asked, stored, self._directory, asked, self._directory, asked,
            )  # fmt: skip
        if stored != self._size_limit:
            self.record_bound(db)
            if stored is not None and self._size_limit > stored:
                _log.info(
                    "blobdata cache %s: bound raised from %d to %d bytes",
                    self._directory, stored, self._size_limit,
                )  # fmt: skip
        if stored is None or self._size_limit >= stored:
            return
        done = _trim(db, values, self._size_limit, None, None, 0)
        _log.warning(
            "blobdata cache %s: bound lowered from %d to %d bytes on request (shrink=True); evicted %d "
            "entries (%d bytes), now %d bytes",
            self._directory, stored, self._size_limit, done.evicted, done.evicted_bytes, done.volume_bytes,
        )  # fmt: skip

    def record_bound(self, db: Index | None = None) -> None:
        """Store this cache's ``size_limit`` as its bound (what later openers naming none use)."""
        if db is None:
            db = self._opened_index()[0]
        with db.transact():
            db.sql("INSERT OR REPLACE INTO meta (key, value) VALUES ('bound', ?)", (self._size_limit,))


def recorded_bound(db: Index) -> int | None:
    """The limit the last process that opened the cache set, or None (none recorded yet)."""
    row = db.sql("SELECT value FROM meta WHERE key = 'bound'").fetchone()
    return None if row is None else int(row[0])


def _classify(db: Index, keep: Collection[str] | None, prefix: str | None) -> tuple[np.ndarray, ...]:
    """(rowids, bytes, classes) of every entry, in eviction order (class, then oldest first)."""
    rowids: list[int] = []
    nbytes: list[int] = []
    times: list[float] = []
    classes: list[int] = []
    last = -1
    while True:
        rows = db.sql(
            "SELECT rowid, key, access_time, size + COALESCE(length(inline), 0) FROM entries"
            " WHERE rowid > ? ORDER BY rowid LIMIT ?",
            (last, _SCAN),
        ).fetchall()
        if not rows:
            break
        last = rows[-1][0]
        for rowid, key, when, size in rows:
            kept = keep is not None and key in keep
            mine = prefix is None or _url_of(key).startswith(prefix)
            classes.append(3 if kept else (1 if mine else 2))
            rowids.append(rowid)
            nbytes.append(int(size))
            times.append(float(when))
    order = np.lexsort((np.asarray(times), np.asarray(classes, dtype=np.int8)))
    return (
        np.asarray(rowids, dtype=np.int64)[order],
        np.asarray(nbytes, dtype=np.int64)[order],
        np.asarray(classes, dtype=np.int8)[order],
    )


def _trim(
    db: Index, values: Values, limit: int, keep: Collection[str] | None, prefix: str | None, room: int
) -> TrimResult:
    sql = db.sql
    volume = sum(IndexOps._volume(sql))
    if volume <= limit and (room == 0 or volume + room <= limit):
        return TrimResult(0, 0, volume, limit)
    ranked = keep is not None or prefix is not None
    if ranked:
        rowids, sizes, classes = _classify(db, keep, prefix)
    evicted = freed = pos = 0
    done = False
    while not done:
        names: list[str | None] = []
        with db.transact():
            volume = sum(IndexOps._volume(sql))
            if not ranked:  # plain: oldest first, through the access_time index
                batch = sql(
                    "SELECT rowid, size + COALESCE(length(inline), 0) FROM entries"
                    " ORDER BY access_time LIMIT ?",
                    (BATCH,),
                ).fetchall()
                rows = [(rowid, int(n), 1) for rowid, n in batch]
            else:
                part = slice(pos, pos + BATCH)
                rows = list(
                    zip(rowids[part].tolist(), sizes[part].tolist(), classes[part].tolist(), strict=True)
                )
            done = not rows
            for rowid, n, cls in rows:
                if volume <= (limit - room if cls == 1 else limit):
                    done = True  # classes come in order: a later one's target is no lower
                    break
                pos += 1
                row = sql("SELECT filename FROM entries WHERE rowid = ?", (rowid,)).fetchone()
                if row is None:
                    continue  # another process evicted it first
                sql("DELETE FROM entries WHERE rowid = ?", (rowid,))
                names.append(row[0])
                volume -= n
                evicted += 1
                freed += n
        for name in names:  # after COMMIT: a crash here leaves orphans, swept later
            if name is not None:
                values.remove(name)
    return TrimResult(evicted, freed, sum(IndexOps._volume(sql)), limit)

"""The cache's SQLite index: admission and eviction decided in the same transaction as the insert,
the bound on volume, the WAL kept small, and the sweep of crash orphans.

:class:`IndexOps` is the half of :class:`~blobdata._cache.BlobCache` that writes the index; the
other half (opening, reading, the public API) is in :mod:`.cache`.
"""

from __future__ import annotations

import logging
import os
import random
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from .db import Index
from .packs import parse_slice
from .values import NAME_RE, Pending, Staged, Values, url_range

__all__ = [
    "CHUNK", "SLACK_BYTES", "VOLUME_AND_COUNT", "WAL_SLACK_BYTES", "IndexOps", "Policy", "marks", "rows_of",
]  # fmt: skip

SLACK_BYTES = 64 * 1024
"""How far ``volume_bytes`` may exceed ``size_limit``: index pages added by one insert after its check."""
WAL_SLACK_BYTES = 4 * 1024 * 1024
"""The SQLite ``-wal`` and ``-shm`` files on top of ``volume_bytes`` (truncated once the WAL passes half)."""
SWEEP_MAX_FILES = 20_000  # bound of one orphan sweep
Policy = Literal["admit", "lru"]
Sql = Callable[..., sqlite3.Cursor]

_log = logging.getLogger("blobdata")
#: Keys per index query: well below SQLite's bound on a statement's parameters (32,766).
CHUNK = 512
_PAGE_BYTES = "(SELECT page_count FROM pragma_page_count()) * (SELECT page_size FROM pragma_page_size())"
_VOLUME = f"SELECT {_PAGE_BYTES}, (SELECT value FROM meta WHERE key = 'size')"
#: The volume (index pages and values) and the entry count, of one snapshot.
VOLUME_AND_COUNT = (
    f"SELECT {_PAGE_BYTES} + (SELECT value FROM meta WHERE key = 'size'),"
    " (SELECT value FROM meta WHERE key = 'count')"
)


def marks(n: int) -> str:
    """``n`` parameters of an ``IN (...)`` list."""
    return ",".join("?" * n)


def rows_of(sql: Sql, columns: str, keys: list[str]) -> Iterator[Any]:
    """``columns`` of the entries of ``keys`` that the index holds: one query per :data:`CHUNK` keys."""
    for a in range(0, len(keys), CHUNK):
        part = keys[a : a + CHUNK]
        yield from sql(f"SELECT {columns} FROM entries WHERE key IN ({marks(len(part))})", part)


class IndexOps:
    """Index writes of a :class:`~blobdata._cache.BlobCache` (a base class: it holds no state)."""

    _directory: str
    _wal_path: str
    _size_limit: int
    _policy: Policy
    _grace: float

    def _commit(self, db: Index, pending: list[Pending]) -> tuple[dict[int, bool | None], list[str]]:
        """Check room and insert each pending value in one BEGIN IMMEDIATE transaction.

        Returns ({index: stored}, files to delete). stored is None when the key was already present
        (its staged file is then redundant), False when it did not fit.
        """
        removed: list[str | None] = []
        outcome: dict[int, bool | None] = {}
        with db.transact():
            sql = db.sql
            for p in pending:
                # One range scan finds both this key (already stored by another process) and the
                # stale entries of other identities of the same URL.
                same_url = sql(
                    "SELECT key FROM entries WHERE key >= ? AND key < ?", url_range(p.url)
                ).fetchall()
                if (p.key,) in same_url:
                    outcome[p.pos] = None
                    continue
                if not same_url:  # the common case: nothing to delete, so no savepoint needed
                    page_bytes, size_sum = self._volume(sql)
                    if page_bytes + size_sum + p.need <= self._size_limit:
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
    def _insert(sql: Sql, p: Pending) -> None:
        """Insert the row of ``p`` (the index's triggers update the running count and size)."""
        if isinstance(p.value, Staged):
            size, filename, blob = p.value.size, p.value.filename, None
        else:
            size, filename, blob = 0, None, sqlite3.Binary(p.value.blob)
        now = time.time()
        sql(
            "INSERT INTO entries (key, filename, inline, size, store_time, access_time)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (p.key, filename, blob, size, now, now),
        )

    def _make_room(self, sql: Sql, p: Pending) -> list[str | None] | None:
        """Delete the stale entries of ``p.url`` and, under LRU, evict until ``p`` fits.

        Returns the value files of the deleted rows, or None if ``p`` does not fit (the caller then
        rolls the deletions back).
        """
        # Entries for other identities of this URL are stale: the object changed.
        stale = sql(
            "SELECT rowid, filename FROM entries WHERE key >= ? AND key < ?",
            url_range(p.url),
        ).fetchall()
        removed: list[str | None] = []
        for rowid, filename in stale:
            sql("DELETE FROM entries WHERE rowid = ?", (rowid,))
            removed.append(filename)
        page_bytes, size_sum = self._volume(sql)
        excess = page_bytes + size_sum + p.need - self._size_limit
        if excess <= 0:
            return removed
        if self._policy == "admit" or page_bytes + p.need > self._size_limit:
            return None
        evicted = self._evict(sql, excess)
        return None if evicted is None else removed + evicted

    def _evict(self, sql: Sql, excess: int) -> list[str | None] | None:
        """Delete least-recently-used rows until ``excess`` bytes are freed (inside a transaction).

        None if the index holds too little to free (only when the index alone exceeds the limit).
        """
        removed: list[str | None] = []
        while excess > 0:
            rows = sql(
                "SELECT rowid, filename, size + COALESCE(length(inline), 0) FROM entries"
                " ORDER BY access_time LIMIT 32"
            ).fetchall()
            if not rows:
                return None
            for rowid, filename, nbytes in rows:
                sql("DELETE FROM entries WHERE rowid = ?", (rowid,))
                removed.append(filename)
                excess -= nbytes
                if excess <= 0:
                    break
        return removed

    # -- bookkeeping ----------------------------------------------------------------------------

    def _bound_wal(self, db: Index) -> None:
        """Checkpoint and truncate the WAL once it passes half of ``WAL_SLACK_BYTES``.

        SQLite's automatic checkpoints cannot restart the WAL while readers overlap without a
        pause (many workers calling get), so it would grow without bound; TRUNCATE waits for the
        readers of old frames (microseconds each) and empties it. It needs the write lock too, and
        other processes' writers may keep winning it: the checkpoint then answers busy (a row, not an
        error) and the WAL grows on. Past three quarters of the slack, this writer tries again until
        the WAL is truncated (by it or another) before it writes more, as every writer does there,
        so the writers stop adding to it and one checkpoint gets through (at most the timeout).
        """
        try:
            if os.stat(self._wal_path).st_size <= WAL_SLACK_BYTES // 2:
                return
            deadline = time.monotonic() + db.timeout
            while db.sql("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:  # busy: not truncated
                if os.stat(self._wal_path).st_size <= WAL_SLACK_BYTES * 3 // 4 or time.monotonic() > deadline:
                    return
                time.sleep(0.002)
        except (OSError, sqlite3.Error) as exc:
            _log.debug("blobdata cache %s: WAL checkpoint skipped (%s)", self._directory, exc)

    @staticmethod
    def _present(sql: Sql, keys: list[str]) -> set[str]:
        """Those of ``keys`` the index holds: one query per :data:`CHUNK` keys (a batch's puts), not
        one per key."""
        return {k for (k,) in rows_of(sql, "key", keys)}

    @staticmethod
    def _stale_bytes(sql: Sql, url: str) -> int:
        """Bytes held by entries of ``url`` (other identities would be replaced by a put)."""
        ((nbytes,),) = sql(
            "SELECT COALESCE(SUM(size + COALESCE(length(inline), 0)), 0) FROM entries"
            " WHERE key >= ? AND key < ?",
            url_range(url),
        ).fetchall()
        return int(nbytes)

    @staticmethod
    def _volume(sql: Sql) -> tuple[int, int]:
        """(bytes of index pages, bytes of value files) as the index records them, read in one statement:
        one snapshot, even outside a transaction (two statements could straddle another process's
        commit, and auto_vacuum shrinks the page count at a commit that frees pages)."""
        ((bytes_of_pages, size_sum),) = sql(_VOLUME).fetchall()
        return int(bytes_of_pages), int(size_sum)

    def _drop(self, db: Index, values: Values, rowid: int, filename: str | None) -> bool:
        """Delete the row if it still points at ``filename``; True if it did."""
        try:
            with db.transact():
                cursor = db.sql("DELETE FROM entries WHERE rowid = ? AND filename IS ?", (rowid, filename))
                deleted = bool(cursor.rowcount > 0)
        except sqlite3.Error:
            return False
        if deleted:
            values.remove(filename)
        return deleted

    def _sweep(self, db: Index, values: Values, *, force: bool) -> None:
        """Delete temp files and row-less value files older than the grace period (bounded scan).

        One process per directory sweeps per grace period (a timestamp in the index decides).
        """
        now = time.time()
        sql = db.sql
        with db.transact():
            row = sql("SELECT value FROM meta WHERE key = 'last_sweep'").fetchone()
            if not force and row is not None and now - float(row[0]) < self._grace:
                return
            sql("INSERT OR REPLACE INTO meta (key, value) VALUES ('last_sweep', ?)", (now,))

        def live(pack: str) -> list[tuple[int, int]]:
            rows = sql(
                "SELECT filename FROM entries WHERE filename >= ? AND filename < ?", (pack + "@", pack + "A")
            )
            return [(w[1], w[2]) for (name,) in rows if (w := parse_slice(name)) is not None and w[0] == pack]

        values.packs.sweep(live, grace=self._grace, now=now)
        try:
            subdirs = sorted(
                e.name
                for e in os.scandir(self._directory)
                if e.is_dir() and re.fullmatch("[0-9a-f]{2}", e.name)
            )
        except OSError:
            return
        start = random.randrange(len(subdirs)) if subdirs else 0
        budget = SWEEP_MAX_FILES
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
                        orphan = NAME_RE.fullmatch(name[:-4]) is not None
                    else:  # a value file whose row was never inserted or already deleted
                        orphan = NAME_RE.fullmatch(name) is not None and (
                            sql("SELECT 1 FROM entries WHERE filename = ?", (name,)).fetchone() is None
                        )
                    if orphan:
                        os.unlink(entry.path)
                except OSError:
                    continue
            budget -= len(entries)
            if budget <= 0:
                break

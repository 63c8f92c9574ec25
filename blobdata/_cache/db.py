"""The cache's own SQLite index: our schema, per-thread connections, one write-transaction helper.

The index is one SQLite file (``cache.db``, WAL mode) whose schema blobdata owns:

``entries``
    one row per cached value: ``key`` (URL + identity, unique), ``filename`` (a pack slice or a
    value file, NULL for an inline value), ``inline`` (a small value with its checksum header),
    ``size`` (bytes outside the index: the aligned slice or the file; 0 inline), ``store_time``,
    ``access_time`` (used by the ``"lru"`` policy).
``meta``
    ``count`` and ``size``, the running totals of ``entries`` kept by triggers in the same
    transaction as each insert or delete (so reading the volume never scans the table), and
    ``last_sweep``.

``PRAGMA application_id`` marks the file as blobdata's and ``PRAGMA user_version`` is the schema
version. An index written by blobdata 0.1 (diskcache's ``Cache`` table) is rebuilt in place the
first time it is opened: its byte rows are copied into ``entries`` (values are still verified by
their checksum on every read), every other row is dropped, and diskcache's tables go.

Connections are per thread and per process (:meth:`Index.connection`). A write transaction is
``BEGIN IMMEDIATE`` (:meth:`Index.transact`): it takes the write lock up front, so two writers never
deadlock upgrading a read, and it waits for a busy lock up to the index's ``timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "Index", "IndexBusy"]

APPLICATION_ID = 0x626C6F62  # b"blob"
SCHEMA_VERSION = 1
_MMAP_BYTES = 64 * 2**20
_log = logging.getLogger("blobdata")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS entries ("
    " key TEXT NOT NULL UNIQUE, filename TEXT, inline BLOB, size INTEGER NOT NULL,"
    " store_time REAL NOT NULL, access_time REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS entries_filename ON entries (filename)",
    "CREATE INDEX IF NOT EXISTS entries_access_time ON entries (access_time)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value NOT NULL)",
    "INSERT OR IGNORE INTO meta (key, value) VALUES ('count', 0), ('size', 0)",
    "CREATE TRIGGER IF NOT EXISTS entries_added AFTER INSERT ON entries BEGIN"
    " UPDATE meta SET value = value + 1 WHERE key = 'count';"
    " UPDATE meta SET value = value + NEW.size WHERE key = 'size'; END",
    "CREATE TRIGGER IF NOT EXISTS entries_removed AFTER DELETE ON entries BEGIN"
    " UPDATE meta SET value = value - 1 WHERE key = 'count';"
    " UPDATE meta SET value = value - OLD.size WHERE key = 'size'; END",
    "CREATE TRIGGER IF NOT EXISTS entries_resized AFTER UPDATE OF size ON entries BEGIN"
    " UPDATE meta SET value = value - OLD.size + NEW.size WHERE key = 'size'; END",
)
# diskcache's modes: 1 = raw bytes in the row, 2 = bytes in a file. Nothing else is carried over.
_FROM_DISKCACHE = (
    "INSERT OR IGNORE INTO entries (key, filename, inline, size, store_time, access_time)"
    " SELECT key, filename, CASE WHEN mode = 1 THEN value END, size,"
    " COALESCE(store_time, 0), COALESCE(access_time, store_time, 0) FROM Cache"
    " WHERE raw = 1 AND typeof(key) = 'text' AND ("
    "  (mode = 2 AND typeof(filename) = 'text' AND value IS NULL)"
    "  OR (mode = 1 AND filename IS NULL AND typeof(value) = 'blob' AND size = 0))"
)


# Ours, and those of blobdata 0.1's diskcache index (rebuilt when found).
_KNOWN_TABLES = {"entries", "meta", "Cache", "Settings", "Tag", "Blobdata"}


class IndexBusy(sqlite3.OperationalError):
    """The index's write lock was not free within the timeout."""


class Index:
    """The SQLite index of one cache directory, for one process (made again after a fork).

    ``connection()`` is this thread's connection; ``sql`` runs one statement on it; ``transact``
    wraps statements in one write transaction (nested calls join the outer one).
    """

    def __init__(self, path: str, *, timeout: float, journal_limit: int) -> None:
        self.path = path
        self.timeout = timeout
        self._journal_limit = journal_limit
        self._lock = threading.Lock()
        self._connections: dict[int, sqlite3.Connection] = {}  # by thread ident; reused when one is
        self._depth: dict[int, int] = {}
        self.migrated = 0  # rows carried over from an older layout when this process rebuilt it
        self._prepare()

    # -- connections --------------------------------------------------------------------------

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, opened on first use."""
        ident = threading.get_ident()
        con = self._connections.get(ident)
        if con is None:
            con = sqlite3.connect(
                self.path, timeout=self.timeout, isolation_level=None, check_same_thread=False
            )
            try:
                for pragma in (
                    "PRAGMA synchronous = NORMAL",  # WAL: durable at checkpoints, never corrupt
                    f"PRAGMA journal_size_limit = {int(self._journal_limit)}",
                    f"PRAGMA mmap_size = {_MMAP_BYTES}",
                    "PRAGMA cache_size = -8192",  # KiB
                ):
                    con.execute(pragma).fetchall()
            except BaseException:
                con.close()
                raise
            with self._lock:
                self._connections[ident] = con
        return con

    def sql(self, statement: str, params: Any = ()) -> sqlite3.Cursor:
        return self.connection().execute(statement, params)

    @contextlib.contextmanager
    def transact(self) -> Iterator[None]:
        """One ``BEGIN IMMEDIATE`` write transaction: committed on success, rolled back on error."""
        ident = threading.get_ident()
        depth = self._depth.get(ident, 0)
        if depth:  # joined the enclosing transaction
            self._depth[ident] = depth + 1
            try:
                yield
            finally:
                self._depth[ident] = depth
            return
        con = self.connection()
        self._begin(con)
        self._depth[ident] = 1
        try:
            yield
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                con.execute("ROLLBACK")
            raise
        else:
            try:
                con.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    con.execute("ROLLBACK")
                raise
        finally:
            self._depth[ident] = 0

    def _begin(self, con: sqlite3.Connection) -> None:
        """``BEGIN IMMEDIATE``, retried while another writer holds the lock, up to the timeout.

        SQLite's busy handler already waits inside one call; a WAL index can still answer
        SQLITE_BUSY at once (a checkpoint or recovery in another process), hence the loop.
        """
        deadline = time.monotonic() + self.timeout
        delay = 0.001
        while True:
            try:
                con.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                if time.monotonic() >= deadline:
                    message = f"the cache index {self.path} stayed locked for {self.timeout:.0f} s"
                    raise IndexBusy(message) from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def close(self) -> None:
        """Close every connection this process opened on the index (a later call reopens)."""
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
        for con in connections:
            with contextlib.suppress(sqlite3.Error):
                con.close()

    def close_thread(self) -> None:
        """Close this thread's connection (before ``os.fork()``: the child must inherit none open)."""
        with self._lock:
            con = self._connections.pop(threading.get_ident(), None)
        if con is not None:
            with contextlib.suppress(sqlite3.Error):
                con.close()

    # -- schema ---------------------------------------------------------------------------------

    def _prepare(self) -> None:
        """Create the schema, or rebuild an older layout's index; a no-op read when it is current."""
        con = self.connection()
        if self._current(con):
            return
        self._tables(con)  # refuse a foreign database before changing anything in it
        # Both only take effect on a new database; WAL is persistent once set.
        con.execute("PRAGMA auto_vacuum = FULL").fetchall()
        con.execute("PRAGMA journal_mode = WAL").fetchall()
        with self.transact():
            if self._current(con):  # another process did it while we waited for the lock
                return
            tables = self._tables(con)
            for statement in _SCHEMA:
                con.execute(statement)
            if "Cache" in tables:
                self._from_diskcache(con, tables)
            con.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _tables(self, con: sqlite3.Connection) -> set[str]:
        """The tables of an index this version can take over; raises for any other database."""
        tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        version = int(con.execute("PRAGMA user_version").fetchone()[0])
        app = int(con.execute("PRAGMA application_id").fetchone()[0])
        foreign = app == 0 and bool(tables - _KNOWN_TABLES)
        if app not in (0, APPLICATION_ID) or version > SCHEMA_VERSION or foreign:
            raise sqlite3.DatabaseError(
                f"{self.path} is not a blobdata cache index this version can read (application_id "
                f"{app:#x}, schema version {version}, tables {sorted(tables)}); "
                "choose another cache directory"
            )
        return tables

    @staticmethod
    def _current(con: sqlite3.Connection) -> bool:
        app = int(con.execute("PRAGMA application_id").fetchone()[0])
        version = int(con.execute("PRAGMA user_version").fetchone()[0])
        return app == APPLICATION_ID and version == SCHEMA_VERSION

    def _from_diskcache(self, con: sqlite3.Connection, tables: set[str]) -> None:
        """Carry the byte rows of a diskcache index (blobdata 0.1) over, then drop its tables."""
        total = int(con.execute("SELECT COUNT(*) FROM Cache").fetchone()[0])
        self.migrated = con.execute(_FROM_DISKCACHE).rowcount
        if "Blobdata" in tables:
            con.execute(
                "INSERT OR REPLACE INTO meta (key, value)"
                " SELECT 'last_sweep', value FROM Blobdata WHERE key = 'last_sweep'"
            )
        for table in ("Cache", "Settings", "Tag", "Blobdata"):
            if table in tables:
                con.execute(f"DROP TABLE {table}")
        _log.info(
            "blobdata cache %s: rebuilt the index of an older blobdata version (diskcache layout): "
            "%d entries kept, %d rows that were not plain bytes dropped (their files are swept later)",
            self.path,
            self.migrated,
            total - self.migrated,
        )

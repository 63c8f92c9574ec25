"""The batched background writer of the cache: the fetch path offers, one thread commits many entries
per transaction. The dataset's workers and ``blobdata warm`` both write through it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from multiprocessing import util as mp_util

from .. import _process
from .cache import BlobCache

__all__ = ["CacheWriter"]

_log = logging.getLogger("blobdata")


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
    multiprocessing finalizer), within ``flush_timeout`` seconds. ``on_stored(n)`` is called from
    the writer's thread after each commit with the number of entries it stored, and
    ``on_written(keys)`` with the ``(url, identity)`` of every entry the commit took up, stored or not
    (and of an offer dropped, from the offering thread): those are no longer waiting.
    """

    def __init__(
        self,
        cache: BlobCache,
        *,
        max_bytes: int = 64 * 2**20,
        batch: int = 64,
        linger: float = 0.2,
        flush_timeout: float = 4.0,
        on_stored: Callable[[int], None] | None = None,
        on_written: Callable[[list[tuple[str, str]]], None] | None = None,
    ) -> None:
        self.cache = cache
        self.max_bytes = max_bytes
        self.batch = batch
        self.linger = linger
        self.flush_timeout = flush_timeout
        self.on_stored = on_stored
        self.on_written = on_written
        self._since = 0.0  # when the oldest queued entry arrived (monotonic)
        self._flushing = 0  # threads waiting in flush(): commit at once, do not linger
        self.dropped = 0
        self._queue: list[tuple[str, str, bytes]] = []
        self._bytes = 0
        self._busy = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._pid = _process.pid()

    def offer(self, url: str, identity: str, data: bytes) -> bool:
        """Queue ``data`` for the cache; False (and counted) if the queue is full."""
        with self._cond:
            dropped = self._bytes + len(data) > self.max_bytes and bool(self._queue)
            if dropped:
                self.dropped += 1
            else:
                first = not self._queue
                if first:
                    self._since = time.monotonic()
                self._queue.append((url, identity, data))
                self._bytes += len(data)
                if first or len(self._queue) >= self.batch:  # start the linger clock, or commit now
                    self._cond.notify()
        if dropped:
            self._written([(url, identity)])
            return False
        if self._thread is None or self._pid != _process.pid():
            return self._start()
        return True

    def _start(self) -> bool:
        """Start this process's writer thread; False if it cannot be (at interpreter shutdown, or
        where the process may start no more threads): what is queued is then dropped, counted and
        told to ``on_written`` (nothing would ever write it), and the next offer tries again."""
        with self._cond:
            if self._thread is not None and self._pid == _process.pid():
                return True
            thread = threading.Thread(target=self._run, name="blobdata-cache-writer", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:
                failed: RuntimeError | None = exc
                lost, self._queue, self._bytes = self._queue, [], 0
                self.dropped += len(lost)
            else:
                failed, self._pid, self._thread = None, _process.pid(), thread
        if failed is not None:
            _log.debug("blobdata cache %s: no writer thread (%s): %d entries not cached",
                       self.cache.directory, failed, len(lost))  # fmt: skip
            self._written([(u, e) for u, e, _ in lost])
            return False
        # Flush at a normal exit: atexit in a main process, multiprocessing's finalizers in its
        # children (DataLoader workers leave through os._exit after running those, not atexit).
        atexit.register(self.flush)
        mp_util.Finalize(self, self.flush, exitpriority=10)
        return True

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
                stored = sum(self.cache.put_many(todo))
                if self.on_stored is not None and stored:
                    self.on_stored(stored)
            except Exception as exc:  # put_many already turns I/O errors into False
                _log.debug("blobdata cache %s: background write failed (%s)", self.cache.directory, exc)
            finally:
                with self._cond:
                    self._bytes -= sum(len(d) for _, _, d in todo)
                    self._busy = False
                    self._cond.notify_all()
                if self.on_written is not None:  # (a worker's writer has none: no list per commit)
                    self._written([(u, e) for u, e, _ in todo])

    def _written(self, keys: list[tuple[str, str]]) -> None:
        if self.on_written is not None:
            try:
                self.on_written(keys)
            except Exception as exc:  # the writer goes on whatever its listener does
                _log.debug("blobdata cache %s: on_written failed (%s)", self.cache.directory, exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything offered so far is written; False if ``timeout`` passed first."""
        if self._thread is None or self._pid != _process.pid():
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

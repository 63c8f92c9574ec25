"""``blobdata warm``: fill the local cache from the bucket ahead of training.

Every listed object not already cached (``(url, identity) in cache``) is fetched with many requests in
flight through the fetch engine and written to the cache by a pool of threads; the bytes waiting
between the two are bounded (``buffer_size``). A second run fetches only what is missing. Once the
cache is full ("admit" policy) the run stops admitting and says so. On Ctrl-C in-flight requests are
cancelled and started writes complete (they are atomic), so the cache holds only whole entries.

Sharding (``rank``/``world_size``): node R warms the samples whose index ``i`` in the listing
(ImageFolder order) satisfies ``i % world_size == R``, so the ranks together warm every sample exactly
once, and each node's share is known without talking to the others.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, TextIO

import numpy as np

from .._config import FetchOptions, parse_size
from .._errors import AccessDenied, CacheError, ConfigError
from .._metrics import RequestsLine
from .._url import parse_url
from .warm_summary import WarmSummary, human_size, print_summary, used_bytes

__all__ = ["WarmSummary", "human_size", "open_cache", "print_summary", "used_bytes", "warm"]

log = logging.getLogger("blobdata")

#: When this many objects have failed and none has succeeded, warm stops: the cause is almost always
#: shared (credentials, endpoint, a stale listing) and retrying a million objects would not help.
ABORT_AFTER_FAILURES = 64
_SHOW_FAILURES = 5
#: Threads writing to the cache, each a batch of up to PUT_BATCH objects at a time. A batch spends
#: most of its time in the kernel creating and writing value files (GIL released) and takes the
#: shared index's write lock once, for one transaction.
PUT_WRITERS = 8
PUT_BATCH = 32


class _ByteBudget:
    """At most ``limit`` bytes reserved at once, granted first come, first served.

    An object larger than ``limit`` is granted alone (when nothing else is held), so it neither
    deadlocks nor starves behind a stream of small ones. Used on one event loop only.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, n: int) -> bool:
        return self.used == 0 or self.used + n <= self.limit

    async def acquire(self, n: int) -> None:
        if not self._waiters and self._fits(n):
            self.used += n
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(n)  # granted just as it was cancelled: give the bytes back
            else:
                self._waiters.remove(entry)
                self._grant()  # it may have been the head that held the others back
            raise

    def release(self, n: int) -> None:
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, waiter = self._waiters.popleft()
            self.used += n
            waiter.set_result(None)


@dataclasses.dataclass
class _Job:
    manifest: Any
    todo: list[int]
    engine: Any
    cache: Any
    workers: int
    buffer_bytes: int
    room: int | None  # bytes this run may add before the cache is full; None: no bound
    summary: WarmSummary
    progress: Any
    put_pool: concurrent.futures.ThreadPoolExecutor
    requests: RequestsLine = dataclasses.field(default_factory=RequestsLine)


async def _fetch_all(job: _Job, stop: asyncio.Event) -> None:
    """Fetch every index of ``job.todo`` into the cache, ``job.workers`` at a time, until ``stop``.

    Fetched bytes wait in memory only until their cache write ends, and never exceed
    ``job.buffer_bytes`` in total. Cache writes run in ``job.put_pool`` (diskcache is synchronous).
    """
    loop = asyncio.get_running_loop()
    m, s = job.manifest, job.summary
    budget = _ByteBudget(job.buffer_bytes)
    order: Iterator[int] = iter(job.todo)
    stores: set[asyncio.Future[None]] = set()
    admitted = 0

    def fail(url: str, exc: BaseException) -> None:
        if s.denied or s.interrupted:
            # The requests in flight when the store first refused (the same cause, said once), or
            # what Ctrl-C cut short (a write refused by a pool shutting down is not a failed object).
            return
        s.failed += 1
        if s.first_error is None:
            s.first_error = exc
        if len(s.failures) < _SHOW_FAILURES:
            s.failures.append((url, _without_url(str(exc) or type(exc).__name__, url)))
        if isinstance(exc, AccessDenied):
            # Refused credentials will not get better: stop at the first refusal, not after 64.
            s.denied = s.aborted = True
            stop.set()
        elif s.fetched == 0 and s.failed >= min(ABORT_AFTER_FAILURES, len(job.todo)):
            s.aborted = True
            stop.set()

    # Group commit: fetched objects queue up while up to PUT_WRITERS batches are being written, and
    # each batch is one put_many (one index transaction), so the shared write lock is taken once per
    # batch instead of once per object.
    queue: list[tuple[str, str, bytes, int]] = []
    writing = 0

    def enqueue(url: str, identity: str, data: bytes, size: int) -> None:
        queue.append((url, identity, data, size))
        kick()

    def kick() -> None:
        nonlocal writing
        while queue and writing < PUT_WRITERS:
            batch = queue[:PUT_BATCH]
            del queue[:PUT_BATCH]
            writing += 1
            task = asyncio.ensure_future(write(batch))
            stores.add(task)
            task.add_done_callback(stores.discard)

    async def write(batch: list[tuple[str, str, bytes, int]]) -> None:
        nonlocal writing
        try:
            items = [(url, identity, data) for url, identity, data, _ in batch]
            oks = await loop.run_in_executor(job.put_pool, job.cache.put_many, items)
        except Exception as exc:  # put_many() promises not to raise for I/O; count it if it does
            for url, *_ in batch:
                fail(url, exc)
            return
        finally:
            budget.release(sum(size for *_, size in batch))
            writing -= 1
            kick()
        for (url, _, data, _), ok in zip(batch, oks, strict=True):
            stored(url, data, ok)

    def stored(url: str, data: bytes, ok: bool) -> None:
        if ok:
            s.fetched += 1
            s.fetched_bytes += len(data)
            job.progress.update(len(data))
            job.progress.set_postfix_str(
                f"{s.fetched}/{len(job.todo)} objects, {job.requests}", refresh=False
            )
        elif _refusal(job.cache) == "full":
            # Admit no more, but let the requests in flight finish: smaller ones may still fit.
            s.cache_full = True
            s.not_admitted += 1
            s.not_admitted_bytes += len(data)
        else:
            # The cache pauses writes after an I/O error (ENOSPC, EIO, ...): fetching more is wasted.
            s.write_error = CacheError(
                f"cannot write to the cache in {job.cache.directory} (see the warning above): free space "
                "or choose another --cache-dir",
                url=job.cache.directory,
            )
            stop.set()

    async def worker() -> None:
        nonlocal admitted
        while not stop.is_set() and not s.cache_full:
            i = next(order, None)
            if i is None:
                return
            size = int(m.sizes[i])
            if job.room is not None and admitted + size > job.room:
                # Stop at the first object that does not fit (what is cached is a prefix of the order);
                # the requests in flight, admitted before, finish.
                s.cache_full = True
                s.not_admitted += 1
                s.not_admitted_bytes += size
                return
            admitted += size
            url, identity = m.url(i), m.identity(i)
            learn = getattr(m, "learn", None)  # a BlobDataset's objects: what its index lacks is learned
            await budget.acquire(size)
            try:
                if learn is not None and not identity:
                    data, identity = await job.engine.fetch(url, size=m.known_size(i))
                    learn(url, identity)
                else:
                    data, _ = await job.engine.fetch(url, size=size, identity=identity)
            except Exception as exc:
                budget.release(size)
                fail(url, exc)
                continue
            except BaseException:
                budget.release(size)
                raise
            enqueue(url, identity, data, size)

    workers = [asyncio.ensure_future(worker()) for _ in range(job.workers)]
    stopper = asyncio.ensure_future(stop.wait())
    try:
        # Finish when every worker is done, or stop early (Ctrl-C, cache full, all failing).
        pending: set[asyncio.Future[Any]] = {stopper, *workers}
        while not stopper.done() and any(not w.done() for w in workers):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        for w in workers:
            w.cancel()  # cancels in-flight requests; nothing of theirs reaches the cache
        results = await asyncio.gather(*workers, return_exceptions=True)
        # Writes already handed to a thread finish (each is atomic), and so do the fetched objects
        # still queued for one; wait so the summary is exact.
        while stores:
            await asyncio.gather(*list(stores), return_exceptions=True)
    if s.cache_full:
        for j in order:
            s.not_admitted += 1
            s.not_admitted_bytes += int(m.sizes[j])
    for r in results:
        if isinstance(r, Exception):
            raise r  # a bug, not a fetch failure (those are counted): let it surface


def _without_url(message: str, url: str) -> str:
    """An error's message without its leading URL, for a line that names the URL already."""
    return message[len(url) :].lstrip(": ") if message.startswith(url) else message


def _refusal(cache: Any) -> str:
    """Why the cache refused a put: ``"full"`` (admit policy, no room) or ``"error"`` (I/O error).

    The cache object is this run's own, so its per-process counters count only this run's puts.
    """
    try:
        return "error" if cache.stats().write_errors else "full"
    except Exception:
        return "error"


def has_cache(directory: str) -> bool:
    """Whether ``directory`` holds a cache index (nothing is created to find out)."""
    from .._cache import DB_NAME

    return os.path.isfile(os.path.join(directory, DB_NAME))


def open_cache(
    directory: str, size: int | str | None = None, policy: Literal["admit", "lru"] = "admit"
) -> Any:
    from .._cache import BlobCache

    try:
        return BlobCache(directory, size_limit=size, policy=policy)
    except CacheError:
        raise
    except OSError as exc:
        raise CacheError(
            f"cannot use cache directory {directory}: {exc.strerror or exc}; pick a writable --cache-dir",
            url=directory,
        ) from exc


def warm(
    url: str,
    *,
    cache_dir: str,
    cache_size: int | str | None = None,
    cache_policy: Literal["admit", "lru"] = "admit",
    storage_options: dict[str, Any] | None = None,
    concurrency: int = 64,
    rank: int = 0,
    world_size: int = 1,
    manifest: Any = None,
    indices: Any = None,
    buffer_size: int | str = "256MiB",
    progress: bool = True,
    dry_run: bool = False,
    out: TextIO | None = None,
) -> WarmSummary:
    """Fill ``cache_dir`` with this rank's share of the objects of ``manifest`` (a Manifest of ``url``),
    or with the samples ``indices`` (a node's share of an epoch) when given.

    Objects already cached are skipped, so a second run fetches only what is missing. With the
    ``admit`` policy the run stops at the first object that no longer fits. ``buffer_size`` bounds
    the fetched bytes held in memory (default 256MiB). Ctrl-C cancels in-flight requests, waits for the
    cache writes already started (each is atomic) and returns with ``interrupted`` set.
    """
    from .._fetch import FetchEngine
    from .._loop import submit

    out = out if out is not None else sys.stdout
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"--rank must be in 0..{world_size - 1} and --world-size >= 1, got {rank}/{world_size}"
        )
    from .._cache import DEFAULT_LIMIT, BlobCache, parse_limit

    buffer_bytes = parse_size(buffer_size, name="--buffer-size")
    # None: the cache's stored bound (a smaller one than stored is kept, not shrunk: see BlobCache).
    asked = parse_limit(cache_size, name="--cache-size") if cache_size is not None else None
    m = manifest
    summary = WarmSummary(url=m.root)
    shard = (
        np.arange(rank, len(m), world_size, dtype=np.int64)
        if indices is None
        else np.unique(np.asarray(indices, dtype=np.int64))
    )
    summary.shard_objects = len(shard)
    summary.shard_bytes = int(m.sizes[shard].sum())
    # A dry run writes nothing: no directory and no index are created for it, and no bound recorded.
    if not dry_run:
        cache = open_cache(cache_dir, asked, cache_policy)
        limit = cache.size_limit
    else:
        cache = BlobCache.inspect(cache_dir) if has_cache(cache_dir) else None
        stored = cache.size_limit if cache is not None else 0  # 0: none recorded
        limit = max(stored, asked or 0) or DEFAULT_LIMIT  # what a real run would get
    try:
        todo: list[int] = []
        t_scan = time.monotonic()
        for i in shard.tolist():
            if cache is not None and (m.url(i), m.identity(i)) in cache:
                summary.skipped += 1
                summary.skipped_bytes += int(m.sizes[i])
            else:
                todo.append(i)
        log.debug("checked %d objects against the cache in %.2fs", len(shard), time.monotonic() - t_scan)
        missing = summary.shard_bytes - summary.skipped_bytes
        empty = {"directory": cache_dir, "entries": 0, "bytes": 0}
        used = used_bytes(cache.info()) if cache is not None else 0
        # admit keeps what it admitted: only the free room can be filled. lru would evict to make room,
        # but past its own limit a run would evict what it fetched itself, so it stops there too.
        room = max(0, limit - used) if cache_policy == "admit" else max(0, limit - summary.skipped_bytes)
        summary.fits = missing <= room
        if dry_run:
            fits = "fits in" if summary.fits else "does NOT fit in"
            print(
                f"would fetch {len(todo)} of {len(shard)} objects ({human_size(missing)}); "
                f"{summary.skipped} already cached ({human_size(summary.skipped_bytes)})\n"
                f"{fits} the cache: {human_size(room)} free of {human_size(limit)} ({cache_policy}) "
                f"in {cache_dir}",
                file=out,
            )
            summary.cache_info = cache.info() if cache is not None else empty
            return summary
        if cache is None:  # only a dry run opens nothing
            raise AssertionError("warm needs its cache open")
        if not todo:
            summary.cache_info = cache.info()
            return summary
        from tqdm import tqdm

        bar = tqdm(
            total=missing,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            desc="warm",
            file=sys.stderr,
            disable=not progress,
            dynamic_ncols=True,
            mininterval=0.5 if sys.stderr.isatty() else 10.0,
        )
        engine = FetchEngine(
            FetchOptions(concurrency=concurrency), parse_url(m.root).protocol, storage_options, root=m.root
        )
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(PUT_WRITERS, concurrency), thread_name_prefix="blobdata-put"
        )
        job = _Job(m, todo, engine, cache, concurrency, buffer_bytes, room, summary, bar, pool)
        stop_box: list[asyncio.Event] = []

        async def go() -> None:
            stop = asyncio.Event()
            stop_box.append(stop)
            try:
                await _fetch_all(job, stop)
            finally:
                await engine.aclose()

        t0 = time.monotonic()
        future = submit(go())
        try:
            _wait(future, on_interrupt=lambda: _interrupt(summary, stop_box))
        except KeyboardInterrupt:
            summary.interrupted = True
            try:
                _wait(future, on_interrupt=None, timeout=60.0)
            except (KeyboardInterrupt, concurrent.futures.TimeoutError):
                future.cancel()  # a second Ctrl-C: leave now; cache writes are atomic anyway
        finally:
            summary.seconds = time.monotonic() - t0
            summary.throttled = job.requests.throttled()
            bar.close()
            pool.shutdown(wait=True, cancel_futures=True)
        summary.cache_info = cache.info()
        return summary
    finally:
        if cache is not None:
            cache.close()


def _interrupt(summary: WarmSummary, box: list[asyncio.Event]) -> None:
    """Ctrl-C: from now on nothing counts as failed, and the fetch loop is asked to stop."""
    summary.interrupted = True
    _set_soon(box)


def _set_soon(box: list[asyncio.Event]) -> None:
    from .._loop import get_loop

    if box:
        get_loop().call_soon_threadsafe(box[0].set)


def _wait(
    future: concurrent.futures.Future[None],
    *,
    on_interrupt: Callable[[], None] | None,
    timeout: float | None = None,
) -> None:
    """Wait for ``future`` in short slices so that Ctrl-C is seen promptly; re-raise the result's error.

    On KeyboardInterrupt, ``on_interrupt`` asks the coroutine to stop, and the interrupt propagates.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            future.result(timeout=0.2)
            return
        except concurrent.futures.TimeoutError:
            if deadline is not None and time.monotonic() > deadline:
                raise
        except KeyboardInterrupt:
            if on_interrupt is not None:
                on_interrupt()
            raise

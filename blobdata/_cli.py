"""The ``blobdata`` command line: warm a cache before training, inspect or clear it, list a folder.

::

    blobdata warm s3://bucket/train --cache-dir /mnt/nvme/blobdata [--rank R --world-size N]
    blobdata ls s3://bucket/train [--json] [--save-manifest PATH_OR_URL]
    blobdata cache info --cache-dir D
    blobdata cache clear --cache-dir D --yes
    blobdata demo

Exit codes: 0 success; 1 runtime failure (missing bucket, refused credentials, objects that could not
be fetched, unusable cache); 2 usage or configuration error (bad URL, size, option, manifest);
130 interrupted (Ctrl-C). Errors print one line ``blobdata: error: <message>`` (``--debug`` adds the
traceback). Storage options are printed only through :func:`blobdata._fs.redact`.

Sharding (``warm --rank R --world-size N``): node R warms the samples whose index ``i`` in the
listing (ImageFolder order) satisfies ``i % N == R``, so ranks ``0..N-1`` together warm every sample
exactly once, and each node's share is known without talking to the others.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TextIO

import numpy as np

from ._config import FetchOptions, parse_size
from ._errors import BlobdataError, CacheError, ConfigError, ManifestError
from ._fs import redact, resolve_storage_options
from ._url import parse_url

__all__ = ["WarmSummary", "main", "parse_storage_options", "warm"]

log = logging.getLogger("blobdata")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
#: When this many objects have failed and none has succeeded, warm stops: the cause is almost always
#: shared (credentials, endpoint, a stale listing) and retrying a million objects would not help.
ABORT_AFTER_FAILURES = 64
_SHOW_FAILURES = 5
#: Threads writing to the cache. A cache write spends most of its time in the kernel (creating and
#: writing the value file, GIL released), only its short index commit is serialised, so on a busy or
#: slow disk many writers keep up with the network where a few fall behind.
PUT_THREADS = 32
_SECRET_WORDS = ("secret", "token", "password", "key", "credential", "sas", "connection", "signature")


# -- small helpers -------------------------------------------------------------------------------


def human_size(n: float) -> str:
    """``1234567`` -> ``"1.23 MB"`` (decimal units, as ``parse_size`` reads them)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def parse_storage_options(items: Sequence[str]) -> dict[str, Any]:
    """``["k=v", "client_kwargs.region_name=x"]`` -> nested dict.

    Dotted keys nest; values ``true``/``false``/``null``, numbers and JSON objects or lists are
    decoded, except for secret-looking keys, whose values always stay strings (and never appear in
    an error message).
    """
    out: dict[str, Any] = {}
    for n, item in enumerate(items, 1):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--storage-option expects key=value; occurrence {n} has no key or no '='")
        value: Any = raw
        secret = any(w in key.lower() for w in _SECRET_WORDS)
        if not secret and raw and (raw in ("true", "false", "null") or raw[0] in "{[-0123456789"):
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--storage-option {key}: {part!r} is set both as a value and as a group")
            node = child
        node[leaf] = value
    return out


def _extensions(text: str | None) -> tuple[str, ...] | None:
    if not text:
        return None
    exts = tuple(
        e.strip() if e.strip().startswith(".") else "." + e.strip() for e in text.split(",") if e.strip()
    )
    return exts or None


def _manifest_for(args: argparse.Namespace, url: str, storage_options: dict[str, Any]) -> Any:
    """The listing of ``url``: ``--manifest``, else the remembered one, else a fresh listing."""
    from ._listing import load_or_list

    return load_or_list(
        url,
        storage_options=storage_options,
        refresh=args.refresh,
        manifest=args.manifest,
        extensions=_extensions(args.extensions),
        is_valid_file=None,
        allow_empty=False,
        concurrency=args.concurrency,
    )


# -- warm ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class WarmSummary:
    """What one ``warm`` run did. Byte counts are bytes; ``seconds`` is wall time of the fetch phase."""

    url: str
    shard_objects: int = 0
    shard_bytes: int = 0
    skipped: int = 0
    skipped_bytes: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    failed: int = 0
    not_admitted: int = 0
    not_admitted_bytes: int = 0
    cache_full: bool = False
    interrupted: bool = False
    aborted: bool = False
    seconds: float = 0.0
    failures: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    first_error: BaseException | None = None
    write_error: CacheError | None = None
    cache_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def mb_per_s(self) -> float:
        return self.fetched_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_FAILED if self.failed or self.write_error else EXIT_OK


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
        s.failed += 1
        if s.first_error is None:
            s.first_error = exc
        if len(s.failures) < _SHOW_FAILURES:
            s.failures.append((url, str(exc) or type(exc).__name__))
        if s.fetched == 0 and s.failed >= min(ABORT_AFTER_FAILURES, len(job.todo)):
            s.aborted = True
            stop.set()

    async def store(url: str, identity: str, data: bytes, size: int) -> None:
        try:
            ok = await loop.run_in_executor(job.put_pool, job.cache.put, url, identity, data)
        except Exception as exc:  # put() promises not to raise; count it if it does
            fail(url, exc)
            return
        finally:
            budget.release(size)
        if ok:
            s.fetched += 1
            s.fetched_bytes += len(data)
            job.progress.update(len(data))
            job.progress.set_postfix_str(f"{s.fetched}/{len(job.todo)} objects", refresh=False)
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
            await budget.acquire(size)
            try:
                data, _ = await job.engine.fetch(url, size=size, identity=identity)
            except Exception as exc:
                budget.release(size)
                fail(url, exc)
                continue
            except BaseException:
                budget.release(size)
                raise
            task = asyncio.ensure_future(store(url, identity, data, size))
            stores.add(task)
            task.add_done_callback(stores.discard)

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
        # Writes already handed to a thread finish (each is atomic); wait so the summary is exact.
        if stores:
            await asyncio.gather(*list(stores), return_exceptions=True)
    if s.cache_full:
        for j in order:
            s.not_admitted += 1
            s.not_admitted_bytes += int(m.sizes[j])
    for r in results:
        if isinstance(r, Exception):
            raise r  # a bug, not a fetch failure (those are counted): let it surface


def _refusal(cache: Any) -> str:
    """Why the cache refused a put: ``"full"`` (admit policy, no room) or ``"error"`` (I/O error).

    The cache object is this run's own, so its per-process counters count only this run's puts.
    """
    try:
        return "error" if cache.stats().write_errors else "full"
    except Exception:
        return "error"


def _open_cache(directory: str, size: int | str = "100GB", policy: Literal["admit", "lru"] = "admit") -> Any:
    from ._cache import BlobCache

    try:
        return BlobCache(directory, size_limit=size, policy=policy)
    except CacheError:
        raise
    except OSError as exc:
        raise CacheError(
            f"cannot use cache directory {directory}: {exc.strerror or exc}; pick a writable --cache-dir",
            url=directory,
        ) from exc


def _used_bytes(info: dict[str, Any]) -> int:
    used = info.get("bytes", 0)
    return int(used) if isinstance(used, (int, float)) else 0


def warm(
    url: str,
    *,
    cache_dir: str,
    cache_size: int | str = "100GB",
    cache_policy: Literal["admit", "lru"] = "admit",
    storage_options: dict[str, Any] | None = None,
    concurrency: int = 64,
    rank: int = 0,
    world_size: int = 1,
    manifest: Any = None,
    buffer_size: int | str = "256MiB",
    progress: bool = True,
    dry_run: bool = False,
    out: TextIO | None = None,
) -> WarmSummary:
    """Fill ``cache_dir`` with this rank's share of the objects of ``manifest`` (a Manifest of ``url``).

    Objects already cached are skipped, so a second run fetches only what is missing. With the
    ``admit`` policy the run stops at the first object that no longer fits. ``buffer_size`` bounds
    the fetched bytes held in memory (default 256MiB). Ctrl-C cancels in-flight requests, waits for the
    cache writes already started (each is atomic) and returns with ``interrupted`` set.
    """
    from ._fetch import FetchEngine
    from ._loop import submit

    out = out if out is not None else sys.stdout
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"--rank must be in 0..{world_size - 1} and --world-size >= 1, got {rank}/{world_size}"
        )
    buffer_bytes = parse_size(buffer_size, name="--buffer-size")
    limit = parse_size(cache_size, name="--cache-size")
    m = manifest
    summary = WarmSummary(url=m.root)
    shard = np.arange(rank, len(m), world_size, dtype=np.int64)
    summary.shard_objects = len(shard)
    summary.shard_bytes = int(m.sizes[shard].sum())
    cache = _open_cache(cache_dir, limit, cache_policy)
    try:
        todo: list[int] = []
        t_scan = time.monotonic()
        for i in shard.tolist():
            if (m.url(i), m.identity(i)) in cache:
                summary.skipped += 1
                summary.skipped_bytes += int(m.sizes[i])
            else:
                todo.append(i)
        log.debug("checked %d objects against the cache in %.2fs", len(shard), time.monotonic() - t_scan)
        missing = summary.shard_bytes - summary.skipped_bytes
        used = _used_bytes(cache.info())
        # admit keeps what it admitted: only the free room can be filled. lru would evict to make room,
        # but past its own limit a run would evict what it fetched itself, so it stops there too.
        room = max(0, limit - used) if cache_policy == "admit" else max(0, limit - summary.skipped_bytes)
        if dry_run:
            fits = "fits in" if missing <= room else "does NOT fit in"
            print(
                f"would fetch {len(todo)} of {len(shard)} objects ({human_size(missing)}); "
                f"{summary.skipped} already cached ({human_size(summary.skipped_bytes)})\n"
                f"{fits} the cache: {human_size(room)} free of {human_size(limit)} ({cache_policy}) "
                f"in {cache_dir}",
                file=out,
            )
            summary.cache_info = cache.info()
            return summary
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
            FetchOptions(concurrency=concurrency), parse_url(m.root).protocol, storage_options
        )
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(PUT_THREADS, concurrency), thread_name_prefix="blobdata-put"
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
            _wait(future, on_interrupt=lambda: _set_soon(stop_box))
        except KeyboardInterrupt:
            summary.interrupted = True
            try:
                _wait(future, on_interrupt=None, timeout=60.0)
            except (KeyboardInterrupt, concurrent.futures.TimeoutError):
                future.cancel()  # a second Ctrl-C: leave now; cache writes are atomic anyway
        finally:
            summary.seconds = time.monotonic() - t0
            bar.close()
            pool.shutdown(wait=True, cancel_futures=True)
        summary.cache_info = cache.info()
        return summary
    finally:
        cache.close()


def _set_soon(box: list[asyncio.Event]) -> None:
    from ._loop import get_loop

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


def _print_summary(s: WarmSummary, *, rank: int, world_size: int, cache_dir: str, out: TextIO) -> None:
    head = "interrupted" if s.interrupted else ("stopped" if s.aborted else "warmed")
    shard = f"rank {rank} of {world_size}: " if world_size > 1 else ""
    lines = [
        f"{head} {s.url} ({shard}{s.shard_objects} objects, {human_size(s.shard_bytes)})",
        f"  fetched  {s.fetched} objects, {human_size(s.fetched_bytes)} in {s.seconds:.1f}s"
        f" = {s.mb_per_s:.1f} MB/s",
        f"  skipped  {s.skipped} objects already cached ({human_size(s.skipped_bytes)})",
        f"  failed   {s.failed} objects",
    ]
    for url, message in s.failures:
        lines.append(f"    {url}: {message}")
    if s.failed > len(s.failures):
        lines.append(f"    ... and {s.failed - len(s.failures)} more")
    if s.cache_full:
        lines.append(
            f"  cache full: {s.not_admitted} objects ({human_size(s.not_admitted_bytes)}) not admitted; "
            "raise --cache-size or use a larger disk"
        )
    info = s.cache_info
    if info:
        limit = info.get("limit")
        limit_text = f" of {human_size(limit)}" if isinstance(limit, int) else ""
        lines.append(
            f"  cache    {cache_dir}: {info.get('entries', '?')} entries, "
            f"{human_size(_used_bytes(info))}{limit_text} ({info.get('policy', '?')})"
        )
    print("\n".join(lines), file=out, flush=True)


def _cmd_warm(args: argparse.Namespace) -> int:
    url = str(parse_url(args.url))
    opts = parse_storage_options(args.storage_option or [])
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be a positive integer, got {args.concurrency}")
    size = parse_size(args.cache_size, name="--cache-size")
    parse_size(args.buffer_size, name="--buffer-size")
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise ConfigError(
            f"--rank must be in 0..{args.world_size - 1} for --world-size {args.world_size}, got {args.rank}"
        )
    log.debug("storage options: %s", redact(opts))
    resolved = resolve_storage_options(parse_url(url).protocol, opts)
    t0 = time.monotonic()
    manifest = _manifest_for(args, url, resolved)
    log.debug("listing of %s: %d objects in %.2fs", url, len(manifest), time.monotonic() - t0)
    summary = warm(
        url,
        cache_dir=args.cache_dir,
        cache_size=size,
        cache_policy=args.cache_policy,
        storage_options=resolved,
        concurrency=args.concurrency,
        rank=args.rank,
        world_size=args.world_size,
        manifest=manifest,
        buffer_size=args.buffer_size,
        progress=not args.no_progress,
        dry_run=args.dry_run,
    )
    if args.dry_run:
        return EXIT_OK
    _print_summary(
        summary, rank=args.rank, world_size=args.world_size, cache_dir=args.cache_dir, out=sys.stdout
    )
    if summary.interrupted:
        return EXIT_INTERRUPTED
    if summary.write_error is not None:
        raise summary.write_error
    if summary.aborted and summary.first_error is not None:
        first = summary.first_error
        if isinstance(first, BlobdataError):
            raise first
        raise BlobdataError(f"every object failed; the first: {type(first).__name__}: {first}")
    return summary.exit_code()


# -- ls ------------------------------------------------------------------------------------------


def _cmd_ls(args: argparse.Namespace) -> int:
    url = str(parse_url(args.url))
    opts = resolve_storage_options(parse_url(url).protocol, parse_storage_options(args.storage_option or []))
    m = _manifest_for(args, url, opts)
    counts = (
        np.bincount(m.targets, minlength=len(m.classes)) if len(m) else np.zeros(len(m.classes), np.int64)
    )
    sizes = np.zeros(len(m.classes), dtype=np.int64)
    if len(m):
        np.add.at(sizes, m.targets, m.sizes)  # exact int64 sums (bincount weights would be float64)
    total = int(m.sizes.sum()) if len(m) else 0
    if args.save_manifest:
        _save_manifest(
            m, args.save_manifest, opts if parse_url(args.save_manifest).protocol != "file" else {}
        )
    if args.json:
        doc = {
            "root": m.root,
            "objects": len(m),
            "bytes": total,
            "listed_at": m.listed_at,
            "classes": [
                {"name": c, "objects": int(n), "bytes": int(b)}
                for c, n, b in zip(m.classes, counts, sizes, strict=True)
            ],
            "skipped": list(m.skipped),
        }
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return EXIT_OK
    width = max([len("class"), *(len(c) for c in m.classes)])
    listed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.listed_at))
    print(f"{m.root}: {len(m.classes)} classes, {len(m)} objects, {human_size(total)} (listed {listed})")
    print(f"{'class':<{width}}  {'objects':>10}  {'bytes':>12}")
    for c, n, b in zip(m.classes, counts, sizes, strict=True):
        print(f"{c:<{width}}  {int(n):>10}  {human_size(int(b)):>12}")
    print(f"{'total':<{width}}  {len(m):>10}  {human_size(total):>12}")
    if m.skipped:
        print(f"{len(m.skipped)} objects belong to no class and were skipped, e.g. {m.skipped[0]}")
    if args.save_manifest:
        print(f"saved the listing to {args.save_manifest} (pass it as --manifest / manifest= on other nodes)")
    return EXIT_OK


def _save_manifest(m: Any, target: str, storage_options: dict[str, Any]) -> None:
    if "://" not in target or target.startswith("file://"):
        m.save(target[len("file://") :] if target.startswith("file://") else target)
        return
    from ._fs import get_fs
    from ._listing import translate_error
    from ._loop import run

    dest = parse_url(target)
    fs = get_fs(dest.protocol, resolve_storage_options(dest.protocol, storage_options))
    data = m.to_bytes()

    async def put() -> None:
        if getattr(fs, "async_impl", False):
            await fs._pipe_file(dest.fs_path, data)
        else:
            fs.pipe_file(dest.fs_path, data)

    try:
        run(put())
    except Exception as exc:
        raise translate_error(exc, target, what="manifest upload") from exc


# -- cache ---------------------------------------------------------------------------------------


def _existing_cache(directory: str) -> Any:
    if not os.path.isdir(directory):
        from ._errors import NotFound

        raise NotFound(f"no cache at {directory}: the directory does not exist", url=directory)
    return _open_cache(directory)


def _cmd_cache_info(args: argparse.Namespace) -> int:
    size = parse_size(args.cache_size, name="--cache-size") if args.cache_size else None
    cache = _existing_cache(args.cache_dir)
    try:
        info = cache.info()
    finally:
        cache.close()
    # The limit and policy belong to whoever opens the cache (the dataset, warm): they are not stored.
    info.pop("policy", None)
    info.pop("limit", None)
    if size is not None:
        info["limit"] = size
        info["free"] = max(0, size - _used_bytes(info))
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return EXIT_OK
    for key, value in info.items():
        sizey = isinstance(value, int) and not isinstance(value, bool) and key in ("bytes", "limit", "free")
        print(f"{key + ':':<11} {human_size(value) + f' ({value} bytes)' if sizey else value}")
    return EXIT_OK


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"refusing to clear {args.cache_dir} without --yes (no terminal to ask on)")
        answer = input(f"remove every entry of the cache in {args.cache_dir}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return EXIT_OK
    cache = _existing_cache(args.cache_dir)
    try:
        before = cache.info()
        cache.clear()
    finally:
        cache.close()
    removed = f"{before.get('entries', '?')} entries, {human_size(_used_bytes(before))}"
    print(f"cleared {args.cache_dir}: removed {removed}")
    return EXIT_OK


# -- parser and entry point ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs"
    )
    listing = argparse.ArgumentParser(add_help=False)
    listing.add_argument(
        "url", help="dataset folder: s3://bucket/prefix, gs://..., az://..., or a local path"
    )
    listing.add_argument(
        "--manifest", help="use this saved listing (path or URL) instead of listing the bucket"
    )
    listing.add_argument(
        "--refresh", action="store_true", help="list the bucket again even if a listing is remembered"
    )
    listing.add_argument(
        "--extensions", help="comma-separated file extensions (default: torchvision's image ones)"
    )
    listing.add_argument(
        "--storage-option", "-o", action="append", metavar="KEY=VALUE",
        help="fsspec storage option (repeatable; dotted keys nest: client_kwargs.region_name=eu-west-1)",
    )  # fmt: skip
    listing.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")

    parser = argparse.ArgumentParser(
        prog="blobdata", description="Train PyTorch models straight from a bucket folder.", parents=[common]
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    w = sub.add_parser("warm", parents=[common, listing], help="fill a local cache with a folder's objects")
    w.add_argument("--cache-dir", required=True, help="cache directory (an SSD)")
    w.add_argument(
        "--cache-size", default="100GB", help="cache size bound, e.g. 100GB or 512GiB (default 100GB)"
    )
    w.add_argument("--cache-policy", choices=["admit", "lru"], default="admit", help="admit (default) or lru")
    w.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be fetched and whether it fits; fetch nothing",
    )
    w.add_argument(
        "--rank",
        type=int,
        default=0,
        help="this node's rank: it warms samples i with i %% world-size == rank",
    )
    w.add_argument("--world-size", type=int, default=1, help="number of nodes sharing the work (default 1)")
    w.add_argument(
        "--buffer-size", default="256MiB", help="fetched bytes held in memory at most (default 256MiB)"
    )
    w.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    w.set_defaults(func=_cmd_warm)

    ls = sub.add_parser("ls", parents=[common, listing], help="list a folder: classes, objects, bytes")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--save-manifest", metavar="PATH_OR_URL", help="write the listing there for other nodes")
    ls.set_defaults(func=_cmd_ls)

    cache = sub.add_parser("cache", parents=[common], help="inspect or clear a local cache")
    csub = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    csub.required = True
    info = csub.add_parser("info", parents=[common], help="directory, entries, bytes")
    info.add_argument("--cache-dir", required=True)
    info.add_argument("--cache-size", help="the size bound its users set, to show the free room (e.g. 100GB)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_cmd_cache_info)
    clear = csub.add_parser("clear", parents=[common], help="remove every entry")
    clear.add_argument("--cache-dir", required=True)
    clear.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    clear.set_defaults(func=_cmd_cache_clear)

    sub.add_parser(
        "demo", help="train a small model from a local S3 server (runs blobdata._demo)", add_help=False
    )
    return parser


def _demo(argv: list[str]) -> int:
    from ._demo import main as demo_main

    return int(demo_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    handler: logging.Handler | None = None
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("blobdata: %(levelname)s: %(message)s"))
        log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        return _main(argv, debug)
    finally:
        log.setLevel(old_level)
        if handler is not None:
            log.removeHandler(handler)


def _main(argv: list[str], debug: bool) -> int:
    rest = [a for a in argv if a != "--debug"]
    if rest and rest[0] == "demo":
        return _guarded(lambda: _demo(rest[1:]), debug)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed by argparse)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return _guarded(lambda: int(args.func(args)), debug)


def _guarded(fn: Callable[[], int], debug: bool) -> int:
    """Run a command; map errors to one line on stderr and an exit code."""
    try:
        return fn()
    except KeyboardInterrupt:
        print("\nblobdata: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, ManifestError) as exc:
        return _report(exc, EXIT_USAGE, debug)
    except (BlobdataError, OSError) as exc:
        return _report(exc, EXIT_FAILED, debug)


def _report(exc: BaseException, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    message = str(exc) if isinstance(exc, BlobdataError) else f"{type(exc).__name__}: {exc}"
    print(f"blobdata: error: {message}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

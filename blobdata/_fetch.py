"""The fetch engine: object URLs in, bytes out, with bounded concurrency and one retry budget.

A :class:`FetchEngine` runs on blobdata's background loop (:mod:`blobdata._loop`). Each request
goes through a *reader* (a small :class:`Reader` protocol): :class:`~blobdata._s3.S3Reader` for
``s3://`` (the lean signed-GET path), :class:`~blobdata._gcs.GCSReader` for ``gs://`` (generation
pinned), :class:`~blobdata._azure.AzureReader` for ``az://`` (ETag pinned), :class:`FsspecReader`
for ``file://`` and ``memory://``. Readers make exactly one attempt and raise
:class:`TransientError` for what may be retried; the engine owns the only retry loop (exponential
backoff with full jitter), so retries never stack with a client's own.

Objects larger than ``part_size`` are read as parallel range requests pinned to one identity
(ETag): if the object is replaced mid-read the result is :class:`ObjectChanged`, never bytes mixed
from two versions.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import aiohttp

from . import _loop
from ._config import FetchOptions
from ._errors import (
    AccessDenied,
    BlobdataError,
    ConfigError,
    FetchError,
    FetchTimeout,
    NotFound,
    ObjectChanged,
    Throttled,
)
from ._fs import get_fs, resolve_storage_options
from ._url import parse_url

T = TypeVar("T")

__all__ = ["FetchEngine", "FsspecReader", "ReadResult", "Reader", "TransientError", "with_retries"]


class ReadResult(NamedTuple):
    """One successful read: the bytes, the identity the store reported (``""`` if unknown) and the
    object's total size in bytes (``None`` if the store did not say)."""

    body: bytes
    identity: str
    total: int | None


class TransientError(Exception):
    """A failure worth retrying. ``kind`` is one of ``throttle``, ``server``, ``timeout``,
    ``connection``, ``short_read``; ``retry_after`` is the store's hint in seconds, if any."""

    def __init__(self, kind: str, message: str, *, retry_after: str | float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        try:
            self.retry_after = float(retry_after) if retry_after is not None else None
        except ValueError:
            self.retry_after = None  # an HTTP date: ignored, the backoff applies


class Reader(Protocol):
    """Reads one object (or the byte range ``[start, end)``) in one attempt.

    Must raise NotFound / AccessDenied / ObjectChanged / FetchError for final failures and
    :class:`TransientError` for retryable ones, and honour ``timeout`` (seconds). With
    ``expect_identity`` it must refuse (ObjectChanged) an object whose identity differs, where the
    store can tell. For ``file``/``memory`` the bucket is ``""`` and the key is the path.
    """

    async def read(
        self,
        bucket: str,
        key: str,
        *,
        start: int | None,
        end: int | None,
        expect_identity: str | None,
        timeout: float,
    ) -> ReadResult: ...

    async def close(self) -> None: ...


class FsspecReader:
    """Reads ``file://`` and ``memory://`` (and any other fsspec protocol without a lean reader).

    Local files are read directly and checked against their listed identity (mtime and size) before
    and after the read. Elsewhere the identity is not checked (the expected one is echoed back);
    S3, GCS and Azure have their own pinned readers.
    """

    def __init__(self, protocol: str, storage_options: Mapping[str, Any]) -> None:
        self.protocol = protocol
        self._options = dict(storage_options)

    def __repr__(self) -> str:
        return f"FsspecReader({self.protocol!r})"

    async def read(
        self,
        bucket: str,
        key: str,
        *,
        start: int | None,
        end: int | None,
        expect_identity: str | None,
        timeout: float,
    ) -> ReadResult:
        fs = get_fs(self.protocol, self._options)
        path = f"{bucket}/{key}" if bucket else key
        url = f"{self.protocol}://{path}"
        if self.protocol == "file":
            return await asyncio.wait_for(
                asyncio.to_thread(_read_local, path, start, end, expect_identity, url), timeout
            )
        try:
            if getattr(fs, "async_impl", False):
                body = await asyncio.wait_for(fs._cat_file(path, start=start, end=end), timeout)
            elif self.protocol == "memory":
                body = fs.cat_file(path, start=start, end=end)
            else:
                body = await asyncio.wait_for(asyncio.to_thread(fs.cat_file, path, start, end), timeout)
        except Exception as exc:
            raise _map_generic(url, exc, timeout) from exc
        return ReadResult(bytes(body), expect_identity or "", None)

    async def close(self) -> None:
        """Nothing to do: the filesystem client is shared through :func:`blobdata._fs.get_fs`."""


def _local_identity(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns}-{st.st_size}"  # as blobdata._listing.identity_from_info lists it


def _read_local(path: str, start: int | None, end: int | None, expect: str | None, url: str) -> ReadResult:
    """Read a local file (or a range of it), checking its identity before and after the read."""
    try:
        with open(path, "rb") as fh:
            before = os.fstat(fh.fileno())
            if expect and _local_identity(before) != expect:
                raise ObjectChanged(
                    f"{url}: changed since it was listed (identity {_local_identity(before)}, listed "
                    f"{expect}); rebuild the listing with refresh=True",
                    url,
                )
            fh.seek(start or 0)
            body = fh.read() if end is None else fh.read(max(0, end - (start or 0)))
            after = os.fstat(fh.fileno())
    except BlobdataError:
        raise
    except FileNotFoundError:
        raise NotFound(
            f"{url}: no such file; the listing may be stale, rebuild it with refresh=True", url
        ) from None
    except PermissionError:
        raise AccessDenied(f"{url}: permission denied", url) from None
    except OSError as exc:
        raise FetchError(f"{url}: cannot read ({exc.strerror or type(exc).__name__})", url) from exc
    if _local_identity(after) != _local_identity(before):
        raise ObjectChanged(f"{url}: modified while it was read; rebuild the listing with refresh=True", url)
    return ReadResult(body, _local_identity(before), before.st_size)


def _map_generic(url: str, exc: BaseException, timeout: float) -> BaseException:
    """Translate an fsspec backend's exception (never echoing its text: it may hold a SAS URL)."""
    if isinstance(exc, BlobdataError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return NotFound(f"{url}: no such object; the listing may be stale, rebuild it with refresh=True", url)
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{url}: access denied; check the credentials in storage_options", url)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return TransientError("timeout", f"{url}: no complete response within {timeout:g}s")
    status = next(
        (v for a in ("code", "status", "status_code") if isinstance(v := getattr(exc, a, None), int)), 0
    )
    if status == 404:
        return NotFound(f"{url}: no such object (HTTP 404)", url)
    if status in (401, 403):
        return AccessDenied(f"{url}: access denied (HTTP {status}); check the credentials", url)
    if status in (429, 503):
        return TransientError("throttle", f"{url}: throttled (HTTP {status})")
    if status >= 500 or status == 408:
        return TransientError("server", f"{url}: server error (HTTP {status})")
    if isinstance(exc, (ConnectionError, aiohttp.ClientError)):
        return TransientError("connection", f"{url}: connection failed ({type(exc).__name__})")
    return FetchError(f"{url}: read failed ({type(exc).__name__}{f', HTTP {status}' if status else ''})", url)


class _State(NamedTuple):
    pid: int
    loop: asyncio.AbstractEventLoop
    semaphore: asyncio.Semaphore
    reader: Reader


_ERROR_KINDS = ((NotFound, "not_found"), (AccessDenied, "access_denied"), (ObjectChanged, "changed"))


class FetchEngine:
    """Turns object URLs into bytes for one protocol and one set of storage options.

    ``options.concurrency`` bounds the requests in flight in this process (range parts included);
    each request gets ``options.timeout`` seconds and ``options.retries`` attempts in total.
    The reader and semaphore are created per process and event loop, so an engine inherited
    through fork, or unpickled in a spawn child, works there too.
    """

    def __init__(
        self, options: FetchOptions, protocol: str, storage_options: Mapping[str, Any] | None
    ) -> None:
        self.options = options
        self.protocol = protocol
        self._storage_options = resolve_storage_options(protocol, storage_options)
        self._state: _State | None = None
        self._schemes: dict[str, bool] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self._errors: collections.Counter[str] = collections.Counter()
        # Test hook, awaited after the first part of a ranged read: (url, part index) -> None.
        self._part_hook: Callable[[str, int], Awaitable[None]] | None = None

    def __repr__(self) -> str:
        return f"FetchEngine(protocol={self.protocol!r}, options={self.options!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_state=None, _part_hook=None)  # per-process objects do not travel
        return state

    # -- per-process state -------------------------------------------------------------------
    def _get_state(self) -> _State:
        loop = asyncio.get_running_loop()
        pid = os.getpid()
        st = self._state
        if st is not None and st.pid == pid and st.loop is loop:
            return st
        reader: Reader
        if st is not None:
            # Another process or loop: the reader itself rebuilds its per-process clients (and leaves
            # a parent's connections alone), only the semaphore is bound to a loop.
            reader = st.reader
        elif self.protocol == "s3":
            from ._s3 import S3Reader  # late: _s3 imports this module

            reader = S3Reader(self._storage_options, concurrency=self.options.concurrency)
        elif self.protocol == "gs":
            from ._gcs import GCSReader  # late, as above

            reader = GCSReader(self._storage_options, concurrency=self.options.concurrency)
        elif self.protocol == "az":
            from ._azure import AzureReader  # late, as above

            reader = AzureReader(self._storage_options, concurrency=self.options.concurrency)
        else:
            reader = FsspecReader(self.protocol, self._storage_options)
        st = _State(pid, loop, asyncio.Semaphore(self.options.concurrency), reader)
        _loop.close_at_exit(self)  # connections are closed on the loop at interpreter exit
        self._state = st
        return st

    def _split(self, url: str) -> tuple[str, str]:
        """``scheme://bucket/key`` -> (bucket, key), the key verbatim (no stripping, no normalising)."""
        scheme, sep, rest = url.partition("://")
        if not sep:
            if self.protocol == "file":
                return "", os.path.abspath(url)
            raise ConfigError(f"expected a {self.protocol}:// object URL, got {url!r}", url=url)
        ok = self._schemes.get(scheme)
        if ok is None:
            try:
                ok = parse_url(scheme + "://bucket").protocol == self.protocol
            except ConfigError:
                ok = False
            self._schemes[scheme] = ok
        if not ok:
            raise ConfigError(f"this engine reads {self.protocol}:// URLs, got {url!r}", url=url)
        if self.protocol == "file":
            return "", rest if rest.startswith("/") else "/" + rest
        if self.protocol == "memory":
            return "", "/" + rest.lstrip("/")
        bucket, _, key = rest.partition("/")
        if not bucket or not key:
            raise ConfigError(f"expected {scheme}://bucket/key, got {url!r}", url=url)
        return bucket, key

    # -- one request with the retry budget ---------------------------------------------------
    async def _request(
        self,
        st: _State,
        url: str,
        bucket: str,
        key: str,
        start: int | None,
        end: int | None,
        identity: str | None,
    ) -> ReadResult:
        counts = self._counts

        async def once() -> ReadResult:
            async with st.semaphore:
                counts["requests"] += 1
                return await st.reader.read(
                    bucket, key, start=start, end=end, expect_identity=identity, timeout=self.options.timeout
                )

        def note(exc: TransientError, will_retry: bool) -> None:
            self._errors[exc.kind] += 1
            counts["retries"] += will_retry

        try:
            res = await with_retries(once, url=url, options=self.options, on_error=note)
        except BlobdataError as exc:
            if not isinstance(exc.__cause__, TransientError):
                self._errors[next((k for cls, k in _ERROR_KINDS if isinstance(exc, cls)), "other")] += 1
            raise
        counts["bytes"] += len(res.body)
        return res

    # -- public API --------------------------------------------------------------------------
    async def fetch(
        self, url: str, *, size: int | None = None, identity: str | None = None
    ) -> tuple[bytes, str]:
        """Read one object; returns ``(body, identity)``.

        ``size`` (bytes, from the listing) selects ranged parallel reads above ``part_size`` and is
        verified; ``identity`` (ETag, ``etag@version``) pins the read: a differing object raises
        ObjectChanged. The returned identity is the expected one when given, else the store's.
        """
        bucket, key = self._split(url)
        st = self._get_state()
        if size is not None and size > self.options.part_size:
            body, ident = await self._fetch_parts(st, url, bucket, key, size, identity)
        else:
            res = await self._request(st, url, bucket, key, None, None, identity)
            if size is not None and len(res.body) != size:
                self._errors["changed"] += 1
                raise ObjectChanged(
                    f"{url} has {len(res.body)} bytes but {size} were listed: the listing is stale, "
                    "rebuild it with refresh=True",
                    url,
                )
            body, ident = res.body, res.identity or identity or ""
        self._counts["objects"] += 1
        return body, ident

    async def _fetch_parts(
        self, st: _State, url: str, bucket: str, key: str, size: int, identity: str | None
    ) -> tuple[bytes, str]:
        part = self.options.part_size
        bounds = [(s, min(s + part, size)) for s in range(0, size, part)]
        chunks: list[bytes] = [b""] * len(bounds)
        pinned = identity

        async def one(i: int) -> ReadResult:
            s, e = bounds[i]
            res = await self._request(st, url, bucket, key, s, e, pinned)
            if len(res.body) != e - s or (res.total is not None and res.total != size):
                self._errors["changed"] += 1
                raise ObjectChanged(
                    f"{url} is {res.total if res.total is not None else 'not'} {size} bytes as listed "
                    f"(part {s}-{e} returned {len(res.body)} bytes): rebuild the listing with refresh=True",
                    url,
                )
            chunks[i] = res.body
            return res

        first = 0
        if pinned is None:
            # Unknown identity: the first part's response fixes it for all the others.
            pinned = (await one(0)).identity or None
            first = 1
            if self._part_hook is not None:
                await self._part_hook(url, 0)
        tasks = [asyncio.ensure_future(one(i)) for i in range(first, len(bounds))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()  # a failed part stops the others; their results are dropped
            await asyncio.gather(*tasks, return_exceptions=True)
        return b"".join(chunks), pinned or ""

    async def _fetch_body(self, url: str, size: int | None, identity: str | None) -> bytes:
        return (await self.fetch(url, size=size, identity=identity))[0]

    async def fetch_many(
        self, items: Sequence[tuple[str, int | None, str | None]]
    ) -> list[bytes | BaseException]:
        """Fetch all ``(url, size, identity)`` items at once (bounded by ``concurrency``).

        Returns one entry per item, in order: the bytes or the exception that item raised.
        """
        return await asyncio.gather(*(self._fetch_body(u, s, i) for u, s, i in items), return_exceptions=True)

    def fetch_many_sync(
        self, items: Sequence[tuple[str, int | None, str | None]], *, timeout: float | None = None
    ) -> list[bytes | BaseException]:
        """:meth:`fetch_many` from synchronous code, on the background loop; ``timeout`` in seconds."""
        return _loop.run(self.fetch_many(items), timeout)

    def stats(self) -> dict[str, Any]:
        """Counters since creation or :meth:`reset_stats`: ``requests`` sent, ``retries``, ``bytes``
        received, ``objects`` returned and ``errors`` by kind (throttle, server, timeout, connection,
        short_read, not_found, access_denied, changed, other)."""
        c = self._counts
        return {
            "requests": c["requests"],
            "retries": c["retries"],
            "bytes": c["bytes"],
            "objects": c["objects"],
            "errors": dict(self._errors),
        }

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats`."""
        self._counts.clear()
        self._errors.clear()

    async def aclose(self) -> None:
        """Close this process's connections (the engine reopens them if used again)."""
        st = self._state
        if st is not None:
            self._state = None
            await st.reader.close()

    def close(self) -> None:
        """:meth:`aclose` from synchronous code."""
        if self._state is not None:
            _loop.run(self.aclose(), 10.0)


async def with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    url: str,
    options: FetchOptions,
    on_error: Callable[[TransientError, bool], None] | None = None,
) -> T:
    """Await ``call()`` under the one retry budget of blobdata.

    ``options.retries`` attempts in total, exponential backoff from ``options.backoff`` seconds with
    full jitter, capped at ``options.max_backoff`` and raised to the store's Retry-After. Only
    :class:`TransientError` is retried; the last one becomes Throttled, FetchTimeout or FetchError
    naming ``url``, chained to it. ``on_error(exc, will_retry)`` sees every transient failure.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except TransientError as exc:
            retry = attempt < options.retries
            if on_error is not None:
                on_error(exc, retry)
            if not retry:
                raise _give_up(url, exc, attempt, options.timeout) from exc
            delay = random.uniform(0.0, min(options.max_backoff, options.backoff * 2 ** (attempt - 1)))
            if exc.retry_after:
                delay = max(delay, min(exc.retry_after, options.max_backoff))
            await asyncio.sleep(delay)


def _give_up(url: str, exc: TransientError, attempts: int, timeout: float) -> FetchError:
    if exc.kind == "throttle":
        return Throttled(
            f"{url}: still throttled after {attempts} attempts ({exc}); lower concurrency or retry later", url
        )
    if exc.kind == "timeout":
        return FetchTimeout(
            f"{url}: no complete response within {timeout:g}s on {attempts} attempts; raise timeout= "
            "or check the network",
            url,
        )
    return FetchError(f"{url}: failed after {attempts} attempts ({exc}); retry later", url)

"""The fetch engine: object URLs in, bytes out, with bounded concurrency and one retry budget.

A :class:`FetchEngine` runs on blobdata's background loop (:mod:`blobdata._loop`). Each request
goes through the store's *reader* (:func:`blobdata._stores.reader_for`: the lean signed-GET path for
``s3://``, generation-pinned ``gs://``, ETag-pinned ``az://``, local files, fsspec for the rest).
Readers make exactly one attempt and raise :class:`~blobdata._errors.TransientError` for what may be
retried; every request goes through :func:`blobdata._retry.with_retries`, so retries never stack
with a client's own.

Objects larger than ``part_size`` are read as parallel range requests pinned to one identity
(ETag): if the object is replaced mid-read the result is :class:`ObjectChanged`, never bytes mixed
from two versions.

Each request to a store is admitted by the node's throttle controller first (:mod:`blobdata._fetch.admission`,
:mod:`blobdata._fetch.throttle`): free while the store has never throttled; once it has, at the rate the
store accepts, shared by every process of the node. ``concurrency`` stays the ceiling per process.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .. import _loop, _process
from .._config import FetchOptions
from .._errors import (
    AccessDenied,
    BlobdataError,
    ConfigError,
    NotFound,
    ObjectChanged,
    RangeIgnored,
    TransientError,
)
from .._metrics import stats as _stats
from .._retry import with_retries
from .._stores import Reader, ReadResult, reader_for, resolve_storage_options, store_info
from .._url import parse_url
from .admission import Gate, gate_for, private_gate, store_key

__all__ = ["FetchEngine"]


class _State(NamedTuple):
    pid: int
    loop: asyncio.AbstractEventLoop
    semaphore: asyncio.Semaphore
    reader: Reader
    gates: dict[tuple[str, str], Gate]  # (bucket, prefix) -> the gate to that store
    private: Gate | None  # an injected reader's own controller


def endpoint_of(protocol: str, storage_options: Mapping[str, Any]) -> str:
    """Where a store's requests go, without credentials: the listing's scope (endpoint, or Azure
    account), and for Azure the blob endpoint too (an emulator's accounts share one name)."""
    return store_info(protocol).endpoint_of(storage_options)


#: Stores read in this process (no request rate to share with other processes).
_LOCAL = frozenset({"file", "memory"})


_ERROR_KINDS = ((NotFound, "not_found"), (AccessDenied, "access_denied"), (ObjectChanged, "changed"))


class FetchEngine:
    """Turns object URLs into bytes for one protocol and one set of storage options.

    ``options.concurrency`` bounds the requests in flight in this process (range parts included);
    each request gets ``options.timeout`` seconds and ``options.attempts`` attempts in total.
    The reader and semaphore are created per process and event loop, so an engine inherited
    through fork, or unpickled in a spawn child, works there too.
    """

    def __init__(
        self,
        options: FetchOptions,
        protocol: str,
        storage_options: Mapping[str, Any] | None,
        *,
        reader: Reader | None = None,
        root: str | None = None,
    ) -> None:
        self.options = options
        self.protocol = protocol
        # The folder this engine reads: for S3, which limits request rates per prefix, its first
        # path segment names the node's throttle controller together with the bucket.
        self._prefix = root.partition("://")[2].partition("/")[2].split("/", 1)[0] if root else ""
        self._storage_options = resolve_storage_options(protocol, storage_options)
        self._reader = reader  # None: the store's own, made in each process on first use
        self._state: _State | None = None
        self._schemes: dict[str, bool] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self._errors: collections.Counter[str] = collections.Counter()

    def __repr__(self) -> str:
        return f"FetchEngine(protocol={self.protocol!r}, options={self.options!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_state=None)  # per-process objects do not travel
        return state

    # -- per-process state -------------------------------------------------------------------
    def _get_state(self) -> _State:
        loop = asyncio.get_running_loop()
        pid = _process.pid()
        st = self._state
        if st is not None and st.pid == pid and st.loop is loop:
            return st
        reader: Reader
        if st is not None:
            # Another process or loop: the reader itself rebuilds its per-process clients (and leaves
            # a parent's connections alone), only the semaphore is bound to a loop.
            reader = st.reader
        elif self._reader is not None:
            reader = self._reader
        else:
            reader = reader_for(self.protocol, self._storage_options, concurrency=self.options.concurrency)
        private = private_gate(self.options.concurrency) if self._reader is not None else None
        st = _State(pid, loop, asyncio.Semaphore(self.options.concurrency), reader, {}, private)
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

    def _gate(self, st: _State, bucket: str, key: str) -> Gate | None:
        """The throttle gate of ``bucket``/``key``'s store (None for local files and memory)."""
        if not self.options.adaptive or self.protocol in _LOCAL:
            return None
        if st.private is not None:
            return st.private
        prefix = self._prefix if key.startswith(self._prefix + "/") else ""
        gate = st.gates.get((bucket, prefix))
        if gate is None:
            endpoint = endpoint_of(self.protocol, self._storage_options)
            store = store_key(self.protocol, endpoint, bucket, prefix)
            gate = st.gates[(bucket, prefix)] = gate_for(store, self.options.concurrency)
        return gate

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
        size: int | None,
    ) -> ReadResult:
        """One read (of ``[start, end)``) under the retry budget, its length checked against the
        listed ``size``: a body cut short of an object whose size and identity are the listed ones is
        a truncated transfer, retried like a reset; a different total size is ObjectChanged."""
        counts = self._counts
        want = None if size is None else (end if end is not None else size) - (start or 0)
        gate = self._gate(st, bucket, key)
        options = self.options
        tries = 0
        began = time.monotonic()

        read = functools.partial(
            st.reader.read, bucket, key, start=start, end=end, expect_identity=identity,
            timeout=options.timeout, size=size,
        )  # fmt: skip

        async def once() -> ReadResult:
            nonlocal tries
            tries += 1
            if gate is None:  # local files, memory://, or adaptive=False: the fixed concurrency
                async with st.semaphore:
                    counts["requests"] += 1
                    t = time.perf_counter()
                    _stats.note_inflight(1, time.monotonic())
                    try:
                        res = await read()
                    except TransientError as exc:
                        if exc.kind == "throttle":
                            _stats.note_throttled()
                        raise
                    finally:
                        _stats.note_inflight(-1, time.monotonic())
            else:
                # The gate bounds the requests in flight (concurrency) and admits them as the node's
                # throttle controller allows; what it admits goes at once.
                sent_at = await gate.admit(retry=tries > 1, patience=options.throttle_wait, since=began)
                counts["requests"] += 1
                outcome, pause = "none", 0.0
                t = time.perf_counter()
                try:
                    res = await read()
                    outcome = "ok"
                except TransientError as exc:
                    if exc.kind != "throttle":
                        raise
                    outcome, pause = "throttle", min(exc.retry_after or 0.0, options.max_backoff)
                    if gate.patience_left(began, options.throttle_wait) <= 0.0:
                        # The store accepted nothing of this node's since this read began.
                        raise gate.spent(options.throttle_wait) from exc
                    raise
                except BlobdataError:
                    outcome = "ok"  # a final answer (404, 403, 412): the store took the request
                    raise
                finally:
                    gate.finished(sent_at, outcome, pause)
            _stats.note_get(time.perf_counter() - t, len(res.body))
            if want is not None and len(res.body) != want:
                same = res.total == size or (identity is not None and res.identity == identity)
                if len(res.body) < want and same:
                    raise TransientError("short_read", f"{url}: got {len(res.body)} of {want} bytes")
                raise ObjectChanged(
                    f"{url} has {res.total if res.total is not None else len(res.body)} bytes but {size} "
                    "were listed: the listing is stale, rebuild it with refresh=True",
                    url,
                )
            return res

        def note(exc: TransientError, will_retry: bool) -> None:
            self._errors[exc.kind] += 1
            counts["retries"] += will_retry
            if will_retry:
                _stats.note_retry(exc.kind)

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
        body: bytes | None = None
        if size is not None and size > self.options.part_size:
            try:
                body, ident = await self._fetch_parts(st, url, bucket, key, size, identity)
            except RangeIgnored:  # the store sends the whole object for a range: read it once, whole
                body = None
        if body is None:
            res = await self._request(st, url, bucket, key, None, None, identity, size)
            body, ident = res.body, res.identity or identity or ""
        self._counts["objects"] += 1
        return body, ident

    async def fetch_range(self, url: str, start: int, end: int, *, identity: str | None = None) -> ReadResult:
        """Bytes ``[start, end)`` of one object (fewer only at its end) in one request under the retry
        budget, pinned to ``identity`` when given; with the store's identity and the object's total size
        (None if the store did not say). A store that answers with the whole object raises
        :class:`~blobdata._errors.RangeIgnored`. For what reads an object piece by piece
        (:class:`~blobdata._fetch.ranged.RangedFile`), never the per-sample path."""
        bucket, key = self._split(url)
        return await self._request(self._get_state(), url, bucket, key, start, end, identity, None)

    async def _fetch_parts(
        self, st: _State, url: str, bucket: str, key: str, size: int, identity: str | None
    ) -> tuple[bytes, str]:
        part = self.options.part_size
        bounds = [(s, min(s + part, size)) for s in range(0, size, part)]
        chunks: list[bytes] = [b""] * len(bounds)
        pinned = identity

        async def one(i: int) -> ReadResult:
            s, e = bounds[i]
            res = await self._request(st, url, bucket, key, s, e, pinned, size)
            if res.total is not None and res.total != size:
                self._errors["changed"] += 1
                raise ObjectChanged(
                    f"{url} is {res.total} bytes, not {size} as listed (part {s}-{e}): rebuild the listing "
                    "with refresh=True",
                    url,
                )
            chunks[i] = res.body
            return res

        first = 0
        if pinned is None:
            # Unknown identity: the first part's response fixes it for all the others.
            pinned = (await one(0)).identity or None
            first = 1
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

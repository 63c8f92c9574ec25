"""HTTP plumbing shared by the lean readers: per-process clients (S3, GCS, Azure), lean aiohttp
sessions (GCS, Azure; S3 has its own client, :mod:`blobdata._stores.h1`).

A client (an aiohttp session, an :class:`~blobdata._stores.h1.H1Pool`, an Azure service client) belongs
to the process and event loop that made it. After fork, or on another loop, it must neither be used
nor closed (closing would touch the parent's sockets): :class:`ProcessBound` makes a new one and
keeps the old one referenced (:func:`blobdata._process.orphan`) so that its destructor never runs
against the parent's connections.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import aiohttp

from .. import _process
from .._errors import ObjectChanged, TransientError

__all__ = ["ProcessBound", "check_content_range", "grown", "lean_session", "read_capped"]

_CONTENT_RANGE_RE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19}|\*)")

C = TypeVar("C")


class ProcessBound(Generic[C]):
    """One client per (process, running loop), made on first use by ``make`` and closed by ``close``."""

    def __init__(self, make: Callable[[], C], close: Callable[[C], Awaitable[Any]]) -> None:
        self._make = make
        self._close = close
        self._client: C | None = None
        self._owner: tuple[int, asyncio.AbstractEventLoop] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"_make": self._make, "_close": self._close, "_client": None, "_owner": None}

    def get(self) -> C:
        """This process's client for the running loop (call from a coroutine)."""
        loop = asyncio.get_running_loop()
        client, owner = self._client, self._owner
        if client is not None and owner is not None and owner[0] == _process.pid() and owner[1] is loop:
            return client
        owner = (_process.pid(), loop)
        if self._client is not None:
            _process.orphan(self._client)
        self._client = self._make()
        self._owner = owner
        return self._client

    async def aclose(self) -> None:
        """Close the client if this process and loop own it (safe to call more than once)."""
        client, owner = self._client, self._owner
        self._client = self._owner = None
        if client is None:
            return
        if owner is not None and owner[0] == _process.pid() and owner[1] is asyncio.get_running_loop():
            await self._close(client)
        else:
            _process.orphan(client)


def lean_session(
    concurrency: int, *, verify: bool | str = True, skip_headers: tuple[str, ...] = ("Accept-Encoding",)
) -> aiohttp.ClientSession:
    """A pooled aiohttp session for raw object bytes: ``concurrency`` connections, no cookies.

    Bytes arrive as stored (no transparent gzip decoding). aiohttp silently resends an idempotent
    request once when a pooled connection fails; blobdata's engine owns the one retry budget, so
    that is turned off (aiohttp's own test client does the same). ``verify`` is botocore's: False
    (no certificate check) or a CA bundle path.
    """
    connector = aiohttp.TCPConnector(
        limit=concurrency,
        # No separate per-host cap: it could only equal ``limit``, and it costs bookkeeping per request.
        limit_per_host=0,
        use_dns_cache=True,
        ttl_dns_cache=300,
        ssl=ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify,
    )
    session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=skip_headers,
        read_bufsize=2**18,
    )
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False
    return session


def check_content_range(url: str, header: str | None, first: int, end: int | None, got: int) -> int | None:
    """The object's total size from a 206's ``Content-Range``, which must be the range asked for:
    ``first`` to ``end - 1``, or to the object's last byte when it ends sooner (the engine then
    compares the total with the listing), and as long as the body."""
    m = _CONTENT_RANGE_RE.fullmatch((header or "").strip())
    if m is None:
        raise TransientError("server", f"{url}: bad HTTP response (a 206 with Content-Range {header!r})")
    a, b = int(m.group(1)), int(m.group(2))
    total = None if m.group(3) == "*" else int(m.group(3))
    asked = f"bytes {first}-{end - 1 if end is not None else ''}"
    short_at_end = total is not None and b == total - 1 and (end is None or b < end - 1)
    wrong_end = b != end - 1 and not short_at_end if end is not None else total is not None and b != total - 1
    if a != first or wrong_end or b < a or b - a + 1 != got:
        raise TransientError(
            "server",
            f"{url}: bad HTTP response (Content-Range {header!r} with {got} bytes, but {asked} was "
            "asked for)",
        )
    if total is not None and b >= total:
        raise TransientError("server", f"{url}: bad HTTP response (Content-Range {header!r})")
    return total


async def read_capped(resp: aiohttp.ClientResponse, cap: int, url: str) -> bytes:
    """The body of a 2xx ``resp``, refused (a retryable ``server`` error) when its Content-Length or,
    whatever the framing, the bytes that arrive run past ``cap``; only ``chunked`` transfer coding."""
    te = resp.headers.get("Transfer-Encoding")
    if te is not None and te.strip().lower() != "chunked":
        raise TransientError("server", f"{url}: bad HTTP response (Transfer-Encoding {te[:40]!r})")
    length = resp.content_length
    if length is not None and length > cap:
        raise TransientError(
            "server", f"{url}: bad HTTP response (Content-Length {length} is more than the {cap} bytes asked)"
        )
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = await resp.content.read(2**18)
        if not chunk:
            return b"".join(chunks)
        got += len(chunk)
        if got > cap:
            raise TransientError("server", f"{url}: bad HTTP response (a body over the {cap} bytes asked)")
        chunks.append(chunk)


def grown(url: str, announced: int | None, listed: int, confirmed: bool) -> Exception:
    """The error for a whole read whose answer is larger than the listed size: ``confirmed`` (the
    answer carries the listed identity) means the store answers wrongly, a retryable error; else the
    object changed since it was listed (or nothing shows it did not): ObjectChanged, final."""
    said = f"Content-Length {announced}" if announced is not None else "a longer body"
    if confirmed:
        what = f"{said} for the listed version of {listed} bytes"
        return TransientError("server", f"{url}: bad HTTP response ({what})")
    return ObjectChanged(
        f"{url}: the store answers with {said} but {listed} bytes were listed: the object changed since "
        "it was listed (rebuild the listing with refresh=True), or the store or a proxy answers wrongly",
        url,
    )

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
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import aiohttp

from .. import _process

__all__ = ["ProcessBound", "lean_session"]

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

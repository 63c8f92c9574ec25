"""A small TCP server on 127.0.0.1 with its own asyncio loop on a daemon thread (for the hostile
server and the HTTP proxy of :mod:`blobdata.testing`), and the HTTP/1.1 request-head reader they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from types import TracebackType
from typing import Any

__all__ = ["Request", "ThreadServer", "read_request"]

_MAX_HEAD = 64 * 1024


class Request:
    """One request head: ``method``, ``target`` (as sent), ``version`` and ``headers`` (names in lower
    case, as a list of pairs to keep repeats and order)."""

    def __init__(self, method: str, target: str, version: str, headers: list[tuple[str, str]]) -> None:
        self.method, self.target, self.version, self.headers = method, target, version, headers

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k == name), None)


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request head (its body, if any, is read by the caller); None at the end of the stream."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = raw[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.append((name.strip().lower(), value.strip()))
    return Request(parts[0], parts[1], parts[2], headers)


class ThreadServer:
    """Serves ``handle(reader, writer)`` per connection on 127.0.0.1 (``port`` 0: a free one), on a
    loop of its own thread. ``start()``/``stop()`` or ``with``; ``tls`` makes it an HTTPS server."""

    def __init__(self, *, port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        self.port = port
        self.tls = tls
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        try:
            await self.handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            self._tasks.discard(task)
            self._writers.discard(writer)
            writer.close()

    def start(self) -> ThreadServer:
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._stop = asyncio.Event()
            try:
                server = await asyncio.start_server(
                    self._on_client, "127.0.0.1", self.port, ssl=self.tls, backlog=1024,
                    limit=2 * _MAX_HEAD,
                )  # fmt: skip
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                return
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            async with server:
                await self._stop.wait()
                server.close()
                for w in list(self._writers):
                    w.transport.abort()
                if self._tasks:
                    await asyncio.wait(list(self._tasks), timeout=5)

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            try:
                self.loop.run_until_complete(serve())
            finally:
                self.loop.close()

        self._thread = threading.Thread(target=run, name=f"{type(self).__name__}", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            self._thread.join(5)
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self.loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self.loop.call_soon_threadsafe(self._stop.set)
        thread.join(10)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

"""A small HTTP proxy on 127.0.0.1, as corporate egress proxies are: ``CONNECT`` tunnels for
``https://`` and absolute-form requests (``GET http://host/path``) for ``http://``, optionally asking
for ``Proxy-Authorization: Basic`` (``from blobdata.testing import HttpProxy``)::

    with HttpProxy(auth=("user", "pw")) as proxy:
        os.environ["HTTPS_PROXY"] = proxy.url_with("user", "pw")
        ...
        assert proxy.tunnels == ["s3.example:443"]

``tunnels`` lists the ``host:port`` of every tunnel opened, ``requests`` the (method, absolute
target) of every forwarded request; ``refuse`` (a status such as 403) answers everything with it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from urllib.parse import urlsplit

from ._serving import Request, ThreadServer, read_request

__all__ = ["HttpProxy"]


class HttpProxy(ThreadServer):
    """A CONNECT and forward HTTP/1.1 proxy; ``auth`` (user, password) makes it require credentials."""

    def __init__(
        self, *, auth: tuple[str, str] | None = None, refuse: int | None = None, port: int = 0
    ) -> None:
        super().__init__(port=port)
        self.auth = auth
        self.refuse = refuse
        self.tunnels: list[str] = []
        self.requests: list[tuple[str, str]] = []
        self.refused = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_with(self, user: str, password: str) -> str:
        return f"http://{user}:{password}@127.0.0.1:{self.port}"

    def _denied(self, req: Request) -> bytes | None:
        status = self.refuse
        if status is None and self.auth is not None:
            token = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
            if req.header("proxy-authorization") != f"Basic {token}":
                status = 407
        if status is None:
            return None
        self.refused += 1
        extra = 'Proxy-Authenticate: Basic realm="blobdata-test"\r\n' if status == 407 else ""
        return f"HTTP/1.1 {status} Refused\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n".encode()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        req = await read_request(reader)
        if req is None:
            return
        denied = self._denied(req)
        if denied is not None:
            writer.write(denied)
            await writer.drain()
            return
        if req.method == "CONNECT":
            host, _, port = req.target.rpartition(":")
            self.tunnels.append(req.target)
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await _pipe_both(reader, writer, up_reader, up_writer)
            return
        await self._forward(req, reader, writer)

    async def _forward(
        self, first: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Absolute-form requests on one client connection, each sent on in origin-form to its host;
        the answers are piped back as they come (the client reads their framing)."""
        upstream: tuple[str, asyncio.StreamWriter, asyncio.Task[None]] | None = None
        req: Request | None = first
        try:
            while req is not None:
                parts = urlsplit(req.target)
                if parts.scheme != "http" or not parts.hostname:
                    writer.write(
                        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    )
                    await writer.drain()
                    return
                self.requests.append((req.method, req.target))
                origin = parts.netloc
                if upstream is None or upstream[0] != origin:
                    if upstream is not None:
                        upstream[1].close()
                    up_reader, up_writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
                    upstream = (origin, up_writer, asyncio.ensure_future(_pipe(up_reader, writer)))
                target = parts.path + (f"?{parts.query}" if parts.query else "")
                lines = [f"{req.method} {target or '/'} {req.version}"]
                lines += [f"{k}: {v}" for k, v in req.headers if not k.startswith("proxy-")]
                upstream[1].write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
                length = int(req.header("content-length") or 0)
                if length:
                    upstream[1].write(await reader.readexactly(length))
                await upstream[1].drain()
                req = await read_request(reader)
        finally:
            if upstream is not None:
                upstream[1].close()
                upstream[2].cancel()
                with contextlib.suppress(BaseException):
                    await upstream[2]


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    dst.close()


async def _pipe_both(
    a_reader: asyncio.StreamReader, a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader, b_writer: asyncio.StreamWriter,
) -> None:  # fmt: skip
    tasks = [
        asyncio.ensure_future(_pipe(a_reader, b_writer)),
        asyncio.ensure_future(_pipe(b_reader, a_writer)),
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        a_writer.close()
        b_writer.close()

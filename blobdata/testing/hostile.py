"""A deliberately hostile object store on 127.0.0.1, to see what a pipeline does when a store, gateway
or proxy misbehaves (``from blobdata.testing import HostileServer``)::

    with HostileServer() as store:                      # an in-memory S3 (and GCS JSON API) store
        store.put("data", "train/cat/1.jpg", jpeg_bytes)
        opts = store.storage_options                    # endpoint_url and dummy keys, for s3://
        store.mode = "wrong_range"                      # from now on, ranged GETs get another range
        ...
    with HostileServer(upstream="http://127.0.0.1:9023") as proxy:   # or in front of a real store
        proxy.mode = "endless_chunked"

Without ``upstream`` the server keeps objects in memory and answers S3 path-style requests (GET of an
object with ``Range`` and ``If-Match``; ListObjectsV2 with ``prefix``, ``delimiter``,
``continuation-token``, ``max-keys`` and ``encoding-type=url``) and the GCS JSON API's media
downloads (``generation=``), object metadata and object listing. It checks no signature. With
``upstream`` it forwards each request there and rewrites the answer, so only the modes that change
answers apply, and ``range_ignored`` (which drops the request's ``Range``) only works where the
upstream checks no signature over it.

Modes (:data:`HOSTILE_MODES`; ``None`` is an honest store), applied to object reads unless named
for listings:

==========================  ==========================================================================
``wrong_range``             a ranged GET gets the next range of the same length (the previous one at
                            the object's end), with a ``Content-Range`` that says so (upstream: the
                            range asked, but a ``Content-Range`` naming the next one)
``no_etag``                 ``If-Match`` and ``generation=`` ignored, no ``ETag``/``x-goog-generation``
``range_ignored``           ``Range`` ignored: ``200`` and the whole object
``huge_length``             ``Content-Length: huge_length`` (default 10^9), no body, the line held open
``endless_chunked``         a chunked body that never ends
``endless_body``            a body without a length that never ends (until the client closes)
``gzip_chunked``            ``Transfer-Encoding: gzip, chunked`` with the object gzipped
``lf_only``                 the head's lines end with a bare LF
``long_header``             a 70 KB header line
``bare_cr``                 a header value with a bare CR in it
``endless_listing``         listings: always truncated, the continuation tokens alternate A, B, A, ...
``fresh_tokens``            listings: always truncated, a new token on every page, the same keys
``outside_prefix``          listings: keys outside the requested prefix added (``other/secret/x.jpg``)
``huge_size``               listings: the first object's size is 10^30
==========================  ==========================================================================

``requests`` lists the (method, target) of every request; ``bytes_sent`` counts the body bytes the
server wrote to its clients; ``body_delay_s`` paces bodies (a pause every 64 KiB).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import ssl
import threading
from typing import Literal
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from xml.sax.saxutils import escape

from ._serving import Request, ThreadServer, read_request

__all__ = ["HOSTILE_MODES", "HostileMode", "HostileServer"]

HostileMode = Literal[
    "wrong_range", "no_etag", "range_ignored", "huge_length", "endless_chunked", "endless_body",
    "gzip_chunked", "lf_only", "long_header", "bare_cr", "endless_listing", "fresh_tokens",
    "outside_prefix", "huge_size",
]  # fmt: skip
HOSTILE_MODES: tuple[HostileMode, ...] = (
    "wrong_range", "no_etag", "range_ignored", "huge_length", "endless_chunked", "endless_body",
    "gzip_chunked", "lf_only", "long_header", "bare_cr", "endless_listing", "fresh_tokens",
    "outside_prefix", "huge_size",
)  # fmt: skip
_LISTING_MODES = ("endless_listing", "fresh_tokens", "outside_prefix", "huge_size")
_PIECE = 64 * 1024
Headers = list[tuple[str, str]]


class _Object:
    def __init__(self, data: bytes, generation: int) -> None:
        self.data = data
        self.etag = hashlib.md5(data).hexdigest()
        self.generation = generation


class HostileServer(ThreadServer):
    """An object store (or a proxy in front of ``upstream``, ``http://host:port``) that misbehaves as
    ``mode`` says; see the module docstring. ``tls``: serve HTTPS with this server context."""

    def __init__(
        self,
        *,
        upstream: str | None = None,
        mode: HostileMode | None = None,
        huge_length: int = 10**9,
        port: int = 0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(port=port, tls=tls)
        if mode is not None and mode not in HOSTILE_MODES:
            raise ValueError(f"mode must be one of {HOSTILE_MODES} or None, got {mode!r}")
        self.mode: HostileMode | None = mode
        self.huge_length = huge_length
        self.body_delay_s = 0.0
        self.upstream = urlsplit(upstream) if upstream else None
        self.requests: list[tuple[str, str]] = []
        self.bytes_sent = 0
        self._objects: dict[tuple[str, str], _Object] = {}
        self._generation = 0
        self._lock = threading.Lock()

    # -- the in-memory store ---------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{'localhost' if self.tls else '127.0.0.1'}:{self.port}"

    @property
    def storage_options(self) -> dict[str, str]:
        """s3fs-style options for ``s3://`` URLs served by this store (it checks no signature)."""
        return {"endpoint_url": self.endpoint_url, "key": "hostile", "secret": "hostile-secret"}

    def put(self, bucket: str, key: str, data: bytes) -> str:
        """Store (or replace) an object; returns its ETag (an MD5, as S3's for a single PUT)."""
        with self._lock:
            self._generation += 1
            obj = self._objects[(bucket, key)] = _Object(bytes(data), self._generation)
        return obj.etag

    def generation(self, bucket: str, key: str) -> int:
        return self._objects[(bucket, key)].generation

    # -- serving ---------------------------------------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            req = await read_request(reader)
            if req is None:
                return
            with self._lock:
                self.requests.append((req.method, req.target))
            length = int(req.header("content-length") or 0)
            if length:
                await reader.readexactly(length)
            mode = self.mode
            if self.upstream is not None:
                status, headers, body = await self._forward(req, mode)
            else:
                status, headers, body = self._answer(req, mode)
            if not await self._send(reader, writer, req, mode, status, headers, body):
                return

    async def _send(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: Request,
        mode: HostileMode | None, status: int, headers: Headers, body: bytes,
    ) -> bool:  # fmt: skip
        """Write one answer, hostile as ``mode`` says; False when the connection is done."""
        is_object = 200 <= status < 300 and not _is_listing(req.target) and req.method == "GET"
        head_only = req.method == "HEAD"
        if is_object and mode in ("huge_length", "endless_chunked", "endless_body"):
            headers = [h for h in headers if h[0].lower() not in ("content-length", "transfer-encoding")]
            if mode == "huge_length":
                headers.append(("Content-Length", str(self.huge_length)))
            elif mode == "endless_chunked":
                headers.append(("Transfer-Encoding", "chunked"))
            else:
                headers.append(("Connection", "close"))
            writer.write(_head(status, headers))
            await writer.drain()
            if mode == "huge_length":
                await reader.read()  # held open until the client goes
                return False
            piece = b"x" * _PIECE
            frame = b"%x\r\n%s\r\n" % (len(piece), piece) if mode == "endless_chunked" else piece
            while True:
                writer.write(frame)
                await writer.drain()
                self.bytes_sent += len(piece)
                await asyncio.sleep(self.body_delay_s)
        if is_object and mode == "gzip_chunked":
            packed = gzip.compress(body)
            headers = [h for h in headers if h[0].lower() not in ("content-length", "transfer-encoding")]
            headers.append(("Transfer-Encoding", "gzip, chunked"))
            writer.write(_head(status, headers) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed))
            self.bytes_sent += len(packed)
            await writer.drain()
            return True
        if not any(h[0].lower() == "content-length" for h in headers):
            headers.append(("Content-Length", str(len(body))))
        head = _head(status, headers)
        if is_object and mode == "lf_only":
            head = head.replace(b"\r\n", b"\n")
        elif is_object and mode == "long_header":
            head = head[:-2] + b"X-Padding: " + b"a" * 70_000 + b"\r\n\r\n"
        elif is_object and mode == "bare_cr":
            head = head[:-2] + b"X-Odd: a\rb\r\n\r\n"
        writer.write(head)
        if not head_only:
            for i in range(0, len(body), _PIECE):
                writer.write(body[i : i + _PIECE])
                await writer.drain()
                self.bytes_sent += len(body[i : i + _PIECE])
                if self.body_delay_s:
                    await asyncio.sleep(self.body_delay_s)
        await writer.drain()
        return True

    def _answer(self, req: Request, mode: HostileMode | None) -> tuple[int, Headers, bytes]:
        parts = urlsplit(req.target)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        path = unquote(parts.path)
        if req.method not in ("GET", "HEAD"):
            return _error(405, "MethodNotAllowed")
        if path.startswith("/download/storage/v1/b/") or path.startswith("/storage/v1/b/"):
            return self._gcs(parts.path, query, req, mode)
        bucket, _, key = path.lstrip("/").partition("/")
        if not key:
            if "list-type" in query:
                return self._list_s3(bucket, query, mode)
            return _error(404, "NoSuchKey")
        obj = self._objects.get((bucket, key))
        if obj is None:
            return _error(404, "NoSuchKey")
        headers: Headers = [] if mode == "no_etag" else [("ETag", f'"{obj.etag}"')]
        want = (req.header("if-match") or "").strip('"')
        if want and mode != "no_etag" and want != obj.etag:
            return _error(412, "PreconditionFailed")
        return _ranged(obj.data, req.header("range"), mode, headers)

    def _gcs(self, raw_path: str, query: dict[str, str], req: Request, mode: HostileMode | None,
             ) -> tuple[int, Headers, bytes]:  # fmt: skip
        media = raw_path.startswith("/download/")
        rest = raw_path.split("/storage/v1/b/", 1)[1]
        bucket, _, tail = rest.partition("/o")
        bucket = unquote(bucket)
        if tail in ("", "/"):
            return self._list_gcs(bucket, query)
        key = unquote(tail.lstrip("/"))
        obj = self._objects.get((bucket, key))
        want = query.get("generation")
        if obj is None or (want and mode != "no_etag" and want != str(obj.generation)):
            return 404, [("Content-Type", "application/json")], b'{"error": {"code": 404}}'
        if not media:
            meta = {
                "name": key,
                "bucket": bucket,
                "generation": str(obj.generation),
                "size": str(len(obj.data)),
            }
            return 200, [("Content-Type", "application/json")], json.dumps(meta).encode()
        headers: Headers = [] if mode == "no_etag" else [("x-goog-generation", str(obj.generation))]
        return _ranged(obj.data, req.header("range"), mode, headers)

    def _keys(self, bucket: str, prefix: str) -> list[tuple[str, _Object]]:
        with self._lock:
            found = [(k, o) for (b, k), o in self._objects.items() if b == bucket and k.startswith(prefix)]
        return sorted(found)

    def _list_s3(
        self, bucket: str, query: dict[str, str], mode: HostileMode | None
    ) -> tuple[int, Headers, bytes]:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        max_keys = int(query.get("max-keys") or 1000)
        token = query.get("continuation-token")
        encoded = query.get("encoding-type") == "url"
        entries: list[tuple[str, _Object | None]] = []
        for key, obj in self._keys(bucket, prefix):
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                common = key[: cut + len(delimiter)]
                if not entries or entries[-1][0] != common:
                    entries.append((common, None))
            else:
                entries.append((key, obj))
        endless = mode in ("endless_listing", "fresh_tokens")
        start = 0
        if token and not endless:
            start = next((i for i, (name, _) in enumerate(entries) if name > token), len(entries))
        page = entries[start : start + max_keys]
        truncated = start + max_keys < len(entries)
        if mode == "outside_prefix":
            page = [("other/secret/x.jpg", _Object(b"secret", 0)), *page]
        next_token = page[-1][0] if truncated and page else None
        if endless:
            count = len(self.requests)
            next_token = ("A" if token != "A" else "B") if mode == "endless_listing" else f"t{count}"
        q = (lambda s: quote(s, safe="/")) if encoded else (lambda s: s)
        out = [
            '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        ]
        out.append(
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(q(prefix))}</Prefix><KeyCount>{len(page)}</KeyCount>"
        )
        out.append(
            f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{'true' if next_token else 'false'}</IsTruncated>"
        )
        if encoded:
            out.append("<EncodingType>url</EncodingType>")
        if next_token:
            out.append(f"<NextContinuationToken>{escape(next_token)}</NextContinuationToken>")
        first = True
        for name, entry in page:
            if entry is None:
                out.append(f"<CommonPrefixes><Prefix>{escape(q(name))}</Prefix></CommonPrefixes>")
                continue
            size = 10**30 if mode == "huge_size" and first else len(entry.data)
            first = False
            out.append(f'<Contents><Key>{escape(q(name))}</Key><Size>{size}</Size><ETag>"{entry.etag}"</ETag>'
                       "<StorageClass>STANDARD</StorageClass></Contents>")  # fmt: skip
        out.append("</ListBucketResult>")
        return 200, [("Content-Type", "application/xml")], "".join(out).encode()

    def _list_gcs(self, bucket: str, query: dict[str, str]) -> tuple[int, Headers, bytes]:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        items, prefixes = [], []
        for key, obj in self._keys(bucket, prefix):
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                common = key[: cut + len(delimiter)]
                if common not in prefixes:
                    prefixes.append(common)
                continue
            items.append({
                "kind": "storage#object", "name": key, "bucket": bucket, "size": str(len(obj.data)),
                "generation": str(obj.generation), "etag": obj.etag, "updated": "2024-01-01T00:00:00.000Z",
                "contentType": "application/octet-stream",
            })  # fmt: skip
        out = {"kind": "storage#objects", "items": items, "prefixes": prefixes}
        return 200, [("Content-Type", "application/json")], json.dumps(out).encode()

    # -- in front of a real store ----------------------------------------------------------------
    async def _forward(self, req: Request, mode: HostileMode | None) -> tuple[int, Headers, bytes]:
        assert self.upstream is not None
        host, port = self.upstream.hostname or "127.0.0.1", self.upstream.port or 80
        drop = {"connection", "keep-alive"}
        if mode == "range_ignored":
            drop |= {"range", "x-ms-range"}
        lines = [f"{req.method} {req.target} HTTP/1.1"]
        lines += [f"{k}: {v}" for k, v in req.headers if k not in drop]
        lines.append("Connection: close")
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        rows = head.decode("latin-1").split("\r\n")
        status = int(rows[0].split(" ")[1])
        headers: Headers = []
        chunked = False
        for row in rows[1:]:
            name, _, value = row.partition(":")
            low = name.strip().lower()
            if low == "transfer-encoding":
                chunked = "chunked" in value.lower()
            elif low not in ("connection", "keep-alive"):
                headers.append((name.strip(), value.strip()))
        if chunked:
            body = _dechunk(body)
        if 200 <= status < 300 and not _is_listing(req.target):
            if mode == "no_etag":
                headers = [h for h in headers if h[0].lower() not in ("etag", "x-goog-generation")]
            elif mode == "wrong_range" and status == 206:
                headers = [_shift_range(h) if h[0].lower() == "content-range" else h for h in headers]
        return status, headers, body


def _is_listing(target: str) -> bool:
    parts = urlsplit(target)
    return "list-type=" in parts.query or "comp=list" in parts.query or parts.path.rstrip("/").endswith("/o")


def _head(status: int, headers: Headers) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_REASONS = {200: "OK", 206: "Partial Content", 404: "Not Found", 405: "Method Not Allowed",
            412: "Precondition Failed", 416: "Range Not Satisfiable"}  # fmt: skip


def _error(status: int, code: str) -> tuple[int, Headers, bytes]:
    body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code></Error>'.encode()
    return status, [("Content-Type", "application/xml")], body


def _ranged(
    data: bytes, header: str | None, mode: HostileMode | None, headers: Headers
) -> tuple[int, Headers, bytes]:
    """The answer to a GET of ``data`` with the ``Range`` header given (or None)."""
    if header is None or mode == "range_ignored":
        return 200, headers, data
    spec = header.strip().removeprefix("bytes=")
    first_s, _, last_s = spec.partition("-")
    first = int(first_s)
    last = min(int(last_s), len(data) - 1) if last_s else len(data) - 1
    if first >= len(data) or last < first:
        return _error(416, "InvalidRange")
    if mode == "wrong_range":
        n = last - first + 1
        first = first + n if last + n < len(data) else max(0, first - n)
        last = first + n - 1
    return 206, [*headers, ("Content-Range", f"bytes {first}-{last}/{len(data)}")], data[first : last + 1]


def _shift_range(header: tuple[str, str]) -> tuple[str, str]:
    spec, _, total = header[1].removeprefix("bytes ").partition("/")
    a, _, b = spec.partition("-")
    n = int(b) - int(a) + 1
    return header[0], f"bytes {int(a) + n}-{int(b) + n}/{total}"


def _dechunk(raw: bytes) -> bytes:
    out = bytearray()
    while raw:
        line, _, raw = raw.partition(b"\r\n")
        size = int(line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += raw[:size]
        raw = raw[size + 2 :]
    return bytes(out)

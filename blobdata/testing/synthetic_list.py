"""A ListObjectsV2 server of any number of keys that it never stores: key ``i`` comes from a formula, so
a listing of 10 million keys costs the server no memory (``from blobdata.testing import
SyntheticListServer``)::

    with SyntheticListServer(count=1_000_000, classes=1, delay_s=0.03) as store:
        manifest = blobdata.list_folder(store.url, storage_options=store.storage_options)

Bucket ``bucket`` (default ``"synthetic"``) holds ``count`` keys ``<root>/cKKKK/img_IIIIIIIIII.jpg``
(``classes`` class folders of equal share, ``i`` in order), each of size ``1000 + i % 5000`` and an
ETag from ``i``. The keys increase with ``i``, so every position in the key space (``prefix``,
``start-after``, a continuation token) is found by bisection over ``i``. Every request waits
``delay_s`` before its answer (the round trip of a far store); ``requests`` counts them and ``asked``
holds each one's ``(prefix, delimiter, continuation-token, start-after)``. It
answers ListObjectsV2 (``prefix``, ``delimiter=/`` at the root, ``continuation-token``,
``start-after``, ``max-keys``, ``encoding-type=url``) and nothing else, and checks no signature.
"""

from __future__ import annotations

import asyncio
import bisect
import re
import threading
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from xml.sax.saxutils import escape

from ._serving import ThreadServer, read_request

__all__ = ["SyntheticListServer"]

_PLAIN = re.compile(r"[A-Za-z0-9_./-]*")  # characters quote(safe="/") and XML escaping leave alone


class _Keys:
    """The keys as a lazy sorted sequence (for :func:`bisect`)."""

    def __init__(self, root: str, count: int, classes: int) -> None:
        self.root, self.count, self.per = root, count, -(-count // max(classes, 1))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> str:
        return f"{self.root}c{i // self.per:04d}/img_{i:010d}.jpg"


class SyntheticListServer(ThreadServer):
    """See the module docstring."""

    def __init__(
        self,
        *,
        count: int,
        classes: int = 1,
        delay_s: float = 0.0,
        bucket: str = "synthetic",
        root: str = "train",
        port: int = 0,
    ) -> None:
        super().__init__(port=port)
        self.bucket, self.root, self.delay_s = bucket, root.strip("/"), delay_s
        self.classes = max(1, min(classes, count))
        self.keys = _Keys(self.root + "/", count, self.classes)
        self.requests = 0
        self.asked: list[tuple[str | None, ...]] = []
        self._lock = threading.Lock()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, str]:
        return {"endpoint_url": self.endpoint_url, "key": "synthetic", "secret": "synthetic-secret"}

    @property
    def url(self) -> str:
        """The dataset's URL: ``s3://<bucket>/<root>``."""
        return f"s3://{self.bucket}/{self.root}"

    @staticmethod
    def size(i: int) -> int:
        return 1000 + i % 5000

    @staticmethod
    def etag(i: int) -> str:
        h = (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & (2**64 - 1)
        return f"{h:016x}{h ^ 0xFFFFFFFF:016x}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            req = await read_request(reader)
            if req is None:
                return
            parts = urlsplit(req.target)
            bucket = unquote(parts.path.strip("/").split("/", 1)[0])
            query = dict(parse_qsl(parts.query, keep_blank_values=True))
            with self._lock:
                self.requests += 1
                self.asked.append(tuple(query.get(k) for k in ("prefix", "delimiter", "continuation-token",
                                                                "start-after")))  # fmt: skip
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if req.method != "GET" or bucket != self.bucket or query.get("list-type") != "2":
                status, body = 404, b'<?xml version="1.0"?><Error><Code>NoSuchBucket</Code></Error>'
            else:
                status, body = 200, self._list(query)
            head = (f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\n"
                    f"Content-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
            writer.write(head.encode("latin-1") + body)
            await writer.drain()

    def _entries(self, start: int, end: int) -> bytes:
        """The ``<Contents>`` of keys ``start`` to ``end``, all of one width, made as numpy digits (the
        server's CPU is not what a benchmark of the client should measure)."""
        import numpy as np

        first = (f"<Contents><Key>{self.keys.root}c0000/img_0000000000.jpg</Key><Size>0000</Size><ETag>&quot;"
                 f"{0:032x}&quot;</ETag></Contents>").encode()  # fmt: skip
        n, width = end - start, len(first)
        page = np.tile(np.frombuffer(first, np.uint8), n).reshape(n, width)
        i = np.arange(start, end, dtype=np.uint64)
        with np.errstate(over="ignore"):
            h = i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
        key = first.index(b"<Key>") + 5 + len(self.keys.root)
        etag = first.index(b"&quot;") + 6
        fields = [(key + 1, 4, i // np.uint64(self.keys.per), 10), (key + 10, 10, i, 10),
                  (first.index(b"<Size>") + 6, 4, np.uint64(1000) + i % np.uint64(5000), 10),
                  (etag, 16, h, 16), (etag + 16, 16, h ^ np.uint64(0xFFFFFFFF), 16)]  # fmt: skip
        hexdigits = np.frombuffer(b"0123456789abcdef", np.uint8)
        for at, digits, value, base in fields:
            b = np.uint64(base)
            for k in range(digits):
                page[:, at + digits - 1 - k] = hexdigits[(value // b ** np.uint64(k)) % b]
        return page.tobytes()

    def _span(self, prefix: str) -> tuple[int, int]:
        """The positions of the keys that start with ``prefix``."""
        lo = bisect.bisect_left(self.keys, prefix)
        if not prefix:
            return lo, len(self.keys)
        after = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        return lo, bisect.bisect_left(self.keys, after, lo)

    def _list(self, query: dict[str, str]) -> bytes:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        max_keys = max(1, min(int(query.get("max-keys") or 1000), 1000))
        token, start_after = query.get("continuation-token"), query.get("start-after")
        lo, hi = self._span(prefix)
        encoded = query.get("encoding-type") == "url"
        q = (lambda s: quote(s, safe="/")) if encoded else (lambda s: s)
        out = ['<?xml version="1.0" encoding="UTF-8"?>\n'
               '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
               f"<Name>{escape(self.bucket)}</Name><Prefix>{escape(q(prefix))}</Prefix>"]  # fmt: skip
        if encoded:
            out.append("<EncodingType>url</EncodingType>")
        if delimiter == "/" and prefix.rstrip("/") == self.root:  # the class folders
            names = sorted({self.keys[i].rsplit("/", 1)[0] + "/" for i in range(lo, hi, self.keys.per)})
            out += [f"<CommonPrefixes><Prefix>{escape(q(n))}</Prefix></CommonPrefixes>" for n in names]
            out.append(
                f"<KeyCount>{len(names)}</KeyCount><IsTruncated>false</IsTruncated></ListBucketResult>"
            )
            return "".join(out).encode()
        start = lo
        if token is not None:
            start = max(lo, int(token[4:]) if token.startswith("pos-") else hi)
        elif start_after is not None:
            start = max(lo, bisect.bisect_right(self.keys, start_after, lo, hi))
        end = min(hi, start + max_keys)
        if _PLAIN.fullmatch(self.keys.root) and self.classes <= 10_000:  # no escaping: entries in numpy
            out.append(self._entries(start, end).decode("ascii"))
        else:
            for i in range(start, end):
                out.append(f"<Contents><Key>{escape(q(self.keys[i]))}</Key><Size>{self.size(i)}</Size>"
                           f"<ETag>&quot;{self.etag(i)}&quot;</ETag></Contents>")  # fmt: skip
        out.append(f"<KeyCount>{end - start}</KeyCount><MaxKeys>{max_keys}</MaxKeys>")
        if end < hi:
            out.append(
                f"<IsTruncated>true</IsTruncated><NextContinuationToken>pos-{end}</NextContinuationToken>"
            )
        else:
            out.append("<IsTruncated>false</IsTruncated>")
        out.append("</ListBucketResult>")
        return "".join(out).encode()

"""A node's peer service: the cache entries of the objects this node is home for, served to the job's
other nodes over HTTP/1.1 (:mod:`.server`), to requests signed under the job's secret (:mod:`.auth`).

What a request may name: ``GET /blobdata/v1/object?u=<object URL>&e=<identity>&n=<size>``, an object of
a source registered here (a dataset of this job in this process: its root is a prefix of the URL and
the rest is a plain relative key, no ``.``, ``..`` or empty segment: a path outside the cache is refused
with 404), pinned to an identity (ETag, generation), and whose home is this node (else 421: a request
is never passed on to a third node). The answer is the cache's entry when the cache holds it (read and
checked as every cache read is), else the object read from the bucket through the source's own read
path (the node's throttle state, the one retry budget, pinned to the identity), once however many ask
for it at the same time, and cached. The bytes go with their identity, their CRC32C and a signature
over them (:func:`~blobdata._peers.auth.answer_signature`).

Bounds: requests in flight per asking node (:attr:`Service.per_peer`, beyond: 503), bytes of answers in
flight for all (:attr:`Service.max_bytes`, beyond: 503), connections (:class:`~.server.Server`); the
objects just read from the bucket are kept for a moment (:data:`RECENT_BYTES` at most) so that an ask
that comes before the cache writer committed them is not read twice.
"""

from __future__ import annotations

import asyncio
import collections
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple
from urllib.parse import quote, unquote

from .._cache import BlobCache, checksum
from .._errors import BlobdataError, ConfigError
from .._metrics import stats as _stats
from .._url import safe_relpath
from .auth import Refused, Verifier
from .homes import Homes
from .server import Reply, Request, Server

__all__ = ["PATH", "RECENT_BYTES", "Service", "Source", "crc_text"]

PATH = "/blobdata/v1/object"
RECENT_BYTES = 64 * 2**20
_RECENT_S = 5.0  # seconds an object just read is kept for asks that come before the cache has it
_MAX_URL = 8192

#: ``fetch(owner, url, size, identity)``: one object read from the bucket (the service caches it).
Fetch = Callable[[Any, str, "int | None", str], Awaitable[bytes]]


class Source(NamedTuple):
    """A dataset whose objects this node serves: its root URL (ending in ``/``), its cache, the
    dataset (held weakly: one that is gone serves nothing) and how to read one of its objects."""

    root: str
    cache: BlobCache
    owner: weakref.ref[Any]
    fetch: Fetch


def crc_text(data: bytes) -> str:
    """The checksum an answer carries: the cache's kind letter and 8 hex digits."""
    kind, crc = checksum(data)
    return f"{kind}{crc:08x}"


def _retrieve(fut: asyncio.Future[bytes]) -> None:
    if not fut.cancelled():
        fut.exception()


def _plain(status: int, reason: str) -> Reply:
    return Reply(status, {"Content-Type": "text/plain; charset=utf-8"}, reason.encode("utf-8", "replace"))


class Service:
    """The peer service of this node for one job (see the module docstring)."""

    def __init__(
        self,
        secret: bytes,
        *,
        per_peer: int = 256,
        max_bytes: int = 512 * 2**20,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.verifier = Verifier(secret, clock=clock)
        self.homes: Homes | None = None  # set once every node's name is known
        self.me = -1
        self.per_peer = per_peer
        self.max_bytes = max_bytes
        self.sources: list[Source] = []
        self.server = Server(self.handle)
        self.address = ""
        self.note: tuple[str, int] | None = None  # its directory in the node's state, and the lock held
        self._inflight: collections.Counter[str] = collections.Counter()
        self._bytes = 0
        self._fetching: dict[tuple[str, str], asyncio.Future[bytes]] = {}
        self._recent: collections.OrderedDict[tuple[str, str], tuple[float, bytes]] = (
            collections.OrderedDict()
        )
        self._recent_bytes = 0
        self.refused: collections.Counter[str] = collections.Counter()  # reason -> requests

    def add_source(self, root: str, cache: BlobCache, owner: Any, fetch: Fetch) -> None:
        """Serve the objects below ``root`` (``owner``'s URL) from ``cache``, read by ``fetch``."""
        prefix = root if root.endswith("/") else root + "/"
        self.sources = [s for s in self.sources if s.owner() is not None and s.root != prefix]
        self.sources.append(Source(prefix, cache, weakref.ref(owner), fetch))

    def _source_of(self, url: str) -> tuple[Source, Any] | None:
        """The source ``url`` is an object of, and its dataset; None if none (or a key that is not a
        plain relative path)."""
        for source in self.sources:
            if url.startswith(source.root):
                owner = source.owner()
                if owner is None:
                    continue
                try:
                    safe_relpath(url[len(source.root) :])
                except ConfigError:
                    return None
                return source, owner
        return None

    # -- one request ------------------------------------------------------------------------------
    async def handle(self, req: Request) -> Reply:
        try:
            node, sig = self.verifier.check(req.method, req.target, req.headers)
        except Refused as exc:
            self._refuse(exc.reason)
            return _plain(exc.status, exc.reason)
        url, identity, size = self._parse(req.target)
        if not url:
            self._refuse("malformed")
            return _plain(400, "expected " + PATH + "?u=URL&e=IDENTITY&n=SIZE")
        found = self._source_of(url)
        if found is None:
            self._refuse("outside")
            return _plain(404, "not an object of this job's datasets")
        homes = self.homes
        if homes is None or homes.home_of(url) != self.me:
            self._refuse("not home")
            return _plain(421, "this node is not the object's home")
        need = max(size, 0)
        if self._inflight[node] >= self.per_peer or self._bytes + need > self.max_bytes:
            self._refuse("busy")
            return _plain(503, "busy")
        self._inflight[node] += 1
        self._bytes += need
        try:
            data, origin = await self._object(found, url, identity, size)
        except BlobdataError as exc:
            self._refuse("bucket")
            return _plain(502, f"{type(exc).__name__}: the bucket refused the object")
        finally:
            self._inflight[node] -= 1
            if not self._inflight[node]:
                del self._inflight[node]
            self._bytes -= need
        crc = crc_text(data)
        ident = quote(identity, safe="")
        v = _stats.rec()
        v[_stats.PEER_SERVED] += 1
        v[_stats.PEER_SERVED_BYTES] += len(data)
        headers = {
            "X-Blobdata-Identity": ident,
            "X-Blobdata-Crc": crc,
            "X-Blobdata-From": origin,
            "X-Blobdata-Signature": self.verifier.answer_signature(sig, 200, ident, len(data), crc),
        }
        return Reply(200, headers, data)

    def _refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        _stats.rec()[_stats.PEER_REFUSED] += 1

    @staticmethod
    def _parse(target: str) -> tuple[str, str, int]:
        """``(url, identity, size)`` of a request target ``PATH?u=..&e=..&n=..`` (in this order, as the
        asking side writes it); ``("", "", 0)`` if it is not one."""
        path, _, query = target.partition("?")
        fields = query.split("&")
        if path != PATH or len(target) > _MAX_URL or len(fields) != 3:
            return "", "", 0
        u, e, n = fields
        if not (u.startswith("u=") and e.startswith("e=") and n.startswith("n=")):
            return "", "", 0
        try:
            url, identity = unquote(u[2:], errors="strict"), unquote(e[2:], errors="strict")
        except UnicodeDecodeError:
            return "", "", 0
        size = n[2:]
        if not url or not identity or not size.lstrip("-").isdigit() or len(size) > 19:
            return "", "", 0
        return url, identity, int(size)

    async def _object(
        self, found: tuple[Source, Any], url: str, identity: str, size: int
    ) -> tuple[bytes, str]:
        """The object's bytes and where they came from ("cache", "bucket")."""
        source, owner = found
        key = (url, identity)
        recent = self._recent.get(key)
        if recent is not None:
            return recent[1], "cache"
        data = source.cache.get(url, identity)
        if data is not None and (size < 0 or len(data) == size):
            return data, "cache"
        fut = self._fetching.get(key)
        if fut is None:
            fut = self._fetching[key] = asyncio.ensure_future(
                self._read(source, owner, url, identity, size)
            )
            fut.add_done_callback(_retrieve)  # every asker may have left: its error is read here
        # shield: a request whose asker left does not cancel the read the others wait for
        return await asyncio.shield(fut), "bucket"

    async def local(self, url: str, identity: str, size: int) -> bytes | None:
        """An object this node is home for, read by this process itself (the look-ahead, a hand-over)
        the way the service reads it for a peer: from the cache, else once from the bucket, however
        many ask at the same time. None if no source of this service has it."""
        found = self._source_of(url)
        if found is None:
            return None
        return (await self._object(found, url, identity, size))[0]

    async def _read(self, source: Source, owner: Any, url: str, identity: str, size: int) -> bytes:
        """The object read from the bucket, then put in the cache (in a thread: a put is a transaction)
        before anyone is answered, so that the node's own next read of it is a hit."""
        key = (url, identity)
        try:
            data = await source.fetch(owner, url, size if size >= 0 else None, identity)
            self._remember(key, data)
            await asyncio.get_running_loop().run_in_executor(None, source.cache.put, url, identity, data)
        finally:
            self._fetching.pop(key, None)
        _stats.rec()[_stats.PEER_SERVED_FETCHED] += 1
        return data

    def _remember(self, key: tuple[str, str], data: bytes) -> None:
        now = time.monotonic()
        recent = self._recent
        while recent and (
            self._recent_bytes + len(data) > RECENT_BYTES or next(iter(recent.values()))[0] < now - _RECENT_S
        ):
            _, (_, old) = recent.popitem(last=False)
            self._recent_bytes -= len(old)
        if len(data) <= RECENT_BYTES:
            recent[key] = (now, data)
            self._recent_bytes += len(data)

    def state(self) -> dict[str, Any]:
        """What the service holds now: requests in flight by node, bytes, reads in flight, refusals."""
        return {
            "inflight": dict(self._inflight),
            "bytes": self._bytes,
            "reading": len(self._fetching),
            "refused": dict(self.refused),
        }

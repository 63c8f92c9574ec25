"""A node's peer service: the cache entries of the objects this node is home for, served to the job's
other nodes over HTTP/1.1 (:mod:`.server`), to requests signed under the job's secret (:mod:`.auth`).

A request names one object or a batch of them, each pinned to an identity (ETag, generation) and a
size: ``GET /blobdata/v1/object?u=<object URL>&e=<identity>&n=<size>``, the three fields repeated in
this order for each further object (at most :data:`MAX_OBJECTS`, the target at most
:data:`MAX_TARGET` bytes). The asking side sends one request per peer for what its look-ahead wants of
that peer at once: the signatures, the HTTP heads and the round trip are paid per batch, not per
object. Each object must be of a source registered here (a dataset of this job in this process: its
root is a prefix of the URL and the rest is a plain relative key, no ``.``, ``..`` or empty segment:
else the whole request is refused with 404, a path outside the cache) and homed on this node (else
421: a request is never passed on to a third node). Each answer is the cache's entry when the cache
holds it (the batch's entries found with one index query, read and checked as every cache read is),
else the object read from the bucket through the source's own read path (the node's throttle state,
the one retry budget, pinned to the identity), once however many ask for it at the same time, and
cached before it is answered, through the cache's writer (:class:`~blobdata._cache.CacheWriter`: what
was read meanwhile goes in one transaction, not a transaction per object).

The answer (200) carries the objects' bytes one after the other, in the order asked, and a table
(``X-Blobdata-Table``), one entry per object asked: ``c`` (from the cache) or ``b`` (read from the
bucket first), its length, ``.`` and its CRC32C (:func:`crc_text`); or ``-``: the bucket refused that
object (its asker reads it itself). The table is signed, bound to the request's signature
(:func:`~blobdata._peers.auth.answer_signature`).

Bounds: objects in flight per asking node (:attr:`Service.per_peer`, beyond: 503), bytes of answers in
flight for all (:attr:`Service.max_bytes`, beyond: 503), connections (:class:`~.server.Server`); the
objects just read from the bucket are kept for a moment (:data:`RECENT_BYTES` at most) so that an ask
that comes before the cache writer committed them is not read twice.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, cast
from urllib.parse import unquote

from .. import _process
from .._cache import BlobCache, CacheWriter, checksum
from .._errors import BlobdataError, ConfigError
from .._metrics import stats as _stats
from .._node import make_locked_dir, write_own
from .._url import safe_relpath
from .auth import Refused, Verifier
from .homes import Homes
from .server import Reply, Request, Server, plain

__all__ = [
    "MAX_OBJECTS", "MAX_TARGET", "PATH", "RECENT_BYTES", "Service", "Source", "address_of", "crc_text",
    "leave_note",
]  # fmt: skip

PATH = "/blobdata/v1/object"
RECENT_BYTES = 64 * 2**20
_RECENT_S = 5.0  # seconds an object just read is kept for asks that come before the cache has it
#: Objects one request may ask for, and the bytes of its target (path and query; the head's bound,
#: :data:`~.server.MAX_HEAD`, leaves room for the signature's headers).
MAX_OBJECTS, MAX_TARGET = 256, 12 * 1024

#: ``fetch(owner, url, size, identity)``: one object read from the bucket (the service caches it).
Fetch = Callable[[Any, str, "int | None", str], Awaitable[bytes]]


class Source(NamedTuple):
    """A dataset whose objects this node serves: its root URL (ending in ``/``), its cache, the
    dataset (held weakly: one that is gone serves nothing), how to read one of its objects and the
    writer that caches what was read."""

    root: str
    cache: BlobCache
    owner: weakref.ref[Any]
    fetch: Fetch
    writer: CacheWriter


def crc_text(data: bytes) -> str:
    """The checksum an answer carries: the cache's kind letter and 8 hex digits."""
    kind, crc = checksum(data)
    return f"{kind}{crc:08x}"


def _retrieve(fut: asyncio.Future[bytes]) -> None:
    if not fut.cancelled():
        fut.exception()


class Service:
    """The peer service of this node for one job (see the module docstring)."""

    def __init__(
        self,
        secret: bytes,
        *,
        per_peer: int = 1024,
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
        self._loop: asyncio.AbstractEventLoop | None = None  # the service's, once it read an object
        self._committing: dict[tuple[str, str], asyncio.Future[None]] = {}  # offered to a writer
        self._writers: dict[tuple[str, int, str], CacheWriter] = {}  # by cache (directory, limit, policy)
        self.refused: collections.Counter[str] = collections.Counter()  # reason -> requests

    def add_source(self, root: str, cache: BlobCache, owner: Any, fetch: Fetch) -> None:
        """Serve the objects below ``root`` (``owner``'s URL) from ``cache``, read by ``fetch``."""
        prefix = root if root.endswith("/") else root + "/"
        self.drop_source(prefix)
        self.sources = [s for s in self.sources if s.owner() is not None]
        # One writer (and its thread) per cache, however often a dataset on it is made again.
        writer = self._writers.get(cache.__getstate__())
        if writer is None:
            writer = CacheWriter(cache, linger=0.0, on_written=self._on_written)
            self._writers[cache.__getstate__()] = writer
        self.sources.append(Source(prefix, cache, weakref.ref(owner), fetch, writer))

    def drop_source(self, root: str) -> None:
        """Serve the objects below ``root`` no more (its dataset is gone)."""
        prefix = root if root.endswith("/") else root + "/"
        self.sources = [s for s in self.sources if s.root != prefix]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what was read from the bucket so far is in the caches; False if ``timeout``
        (seconds, per cache) passed first."""
        return all([w.flush(timeout) for w in self._writers.values()])

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
            return plain(exc.status, exc.reason)
        asked = self._parse(req.target)
        if not asked:
            self._refuse("malformed")
            return plain(400, "expected " + PATH + "?u=URL&e=IDENTITY&n=SIZE, repeated for each object")
        found: list[tuple[Source, Any]] = []
        for url, _, _ in asked:
            one = self._source_of(url)
            if one is None:
                self._refuse("outside")
                return plain(404, "not an object of this job's datasets")
            found.append(one)
        homes = self.homes
        if homes is None or bool((homes.homes_of([url for url, _, _ in asked]) != self.me).any()):
            self._refuse("not home")
            return plain(421, "this node is not the object's home")
        need = sum(size for _, _, size in asked)
        if self._inflight[node] + len(asked) > self.per_peer or self._bytes + need > self.max_bytes:
            self._refuse("busy")
            return plain(503, "busy")
        self._inflight[node] += len(asked)
        self._bytes += need
        try:
            got = await self._objects([(f, *one) for f, one in zip(found, asked, strict=True)])
        finally:
            self._inflight[node] -= len(asked)
            if not self._inflight[node]:
                del self._inflight[node]
            self._bytes -= need
        entries: list[str] = []
        datas: list[bytes] = []
        for answer in got:
            if isinstance(answer, BlobdataError):
                entries.append("-")
                self._refuse("bucket")
                continue
            data, origin = answer
            entries.append(f"{origin[0]}{len(data)}.{crc_text(data)}")
            datas.append(data)
        v = _stats.rec()
        v[_stats.PEER_SERVED] += len(datas)
        v[_stats.PEER_SERVED_BYTES] += sum(len(d) for d in datas)
        table = " ".join(entries)
        signature = self.verifier.answer_signature(sig, 200, table)
        headers = {"X-Blobdata-Table": table, "X-Blobdata-Signature": signature}
        return Reply(200, headers, tuple(datas))

    def _refuse(self, reason: str) -> None:
        self.refused[reason] += 1
        _stats.rec()[_stats.PEER_REFUSED] += 1

    @staticmethod
    def _parse(target: str) -> list[tuple[str, str, int]]:
        """``(url, identity, size)`` of each object a request target ``PATH?u=..&e=..&n=..[&u=..]``
        asks for (the three fields in this order, as the asking side writes them); ``[]`` if it is not
        such a target."""
        path, _, query = target.partition("?")
        fields = query.split("&")
        if path != PATH or len(target) > MAX_TARGET or len(fields) % 3 or len(fields) > 3 * MAX_OBJECTS:
            return []
        out: list[tuple[str, str, int]] = []
        for k in range(0, len(fields), 3):
            u, e, n = fields[k : k + 3]
            if not (u.startswith("u=") and e.startswith("e=") and n.startswith("n=")):
                return []
            try:
                url, identity = unquote(u[2:], errors="strict"), unquote(e[2:], errors="strict")
            except UnicodeDecodeError:
                return []
            size = n[2:]
            # A size is the listing's, never unknown: one the answer's bytes are bounded by.
            if not url or not identity or not size.isdigit() or len(size) > 19:
                return []
            out.append((url, identity, int(size)))
        return out

    async def _objects(
        self, asked: list[tuple[tuple[Source, Any], str, str, int]]
    ) -> list[tuple[bytes, str] | BlobdataError]:
        """Each asked object's bytes and where they came from ("cache", "bucket"), or the error the
        bucket gave for it: what was just read, then the cache (one index query per source), then the
        bucket (once per object, however many ask at the same time), all at once."""
        out: list[tuple[bytes, str] | BlobdataError | None] = [None] * len(asked)
        look: dict[int, list[int]] = {}  # id(cache) -> positions to look up there
        for k, ((source, _), url, identity, _) in enumerate(asked):
            recent = self._recent.get((url, identity))
            if recent is not None:
                out[k] = (recent[1], "cache")
            else:
                look.setdefault(id(source.cache), []).append(k)
        for ks in look.values():
            cache = asked[ks[0]][0][0].cache
            for k, data in zip(ks, cache.get_many([asked[k][1:3] for k in ks]), strict=True):
                size = asked[k][3]
                if data is not None and len(data) == size:
                    out[k] = (data, "cache")
        reads = [(k, self._fetch(*asked[k])) for k in range(len(asked)) if out[k] is None]
        if reads:
            # shield: a request whose asker left does not cancel the reads the others wait for
            got = await asyncio.gather(*(asyncio.shield(f) for _, f in reads), return_exceptions=True)
            for (k, _), one in zip(reads, got, strict=True):
                if isinstance(one, BaseException) and not isinstance(one, BlobdataError):
                    raise one
                out[k] = one if isinstance(one, BlobdataError) else (one, "bucket")
        return cast("list[tuple[bytes, str] | BlobdataError]", out)  # every position is filled above

    def _fetch(self, found: tuple[Source, Any], url: str, identity: str, size: int) -> asyncio.Future[bytes]:
        """The read of ``url`` from the bucket: the one in flight, else a new one."""
        key = (url, identity)
        fut = self._fetching.get(key)
        if fut is None:
            source, owner = found
            fut = self._fetching[key] = asyncio.ensure_future(self._read(source, owner, url, identity, size))
            fut.add_done_callback(_retrieve)  # every asker may have left: its error is read here
        return fut

    async def local(self, url: str, identity: str, size: int) -> bytes | None:
        """An object this node is home for, read by this process itself (the look-ahead, a hand-over)
        the way the service reads it for a peer: from the cache, else once from the bucket, however
        many ask at the same time. None if no source of this service has it."""
        found = self._source_of(url)
        if found is None:
            return None
        got = (await self._objects([(found, url, identity, size)]))[0]
        if isinstance(got, BlobdataError):
            raise got
        return got[0]

    async def _read(self, source: Source, owner: Any, url: str, identity: str, size: int) -> bytes:
        """The object read from the bucket, then in the cache before anyone is answered, so that the
        node's own next read of it is a hit: offered to the cache's writer, which commits what the
        service read meanwhile in one transaction (a transaction per object cost its 0.2 ms and more,
        and the node's commits waited for the index's write lock in turn)."""
        key = (url, identity)
        loop = self._loop = asyncio.get_running_loop()
        try:
            data = await source.fetch(owner, url, size, identity)
            self._remember(key, data)
            # One read of a key at a time (``_fetching``), which lasts until its commit: a fresh wait.
            committed = self._committing[key] = loop.create_future()
            source.writer.offer(url, identity, data)  # dropped (its queue full): told as well, not cached
            await committed
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

    def _on_written(self, keys: list[tuple[str, str]]) -> None:
        """The cache writer's word (from its thread) that ``keys`` are committed or given up."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._written, keys)

    def _written(self, keys: list[tuple[str, str]]) -> None:
        for key in keys:
            committed = self._committing.pop(key, None)
            if committed is not None and not committed.done():
                committed.set_result(None)

    def state(self) -> dict[str, Any]:
        """What the service holds now: requests in flight by node, bytes, reads in flight, objects read
        and not in the cache yet, refusals."""
        return {
            "inflight": dict(self._inflight),
            "bytes": self._bytes,
            "reading": len(self._fetching),
            "unwritten": len(self._committing),
            "refused": dict(self.refused),
        }


def address_of(host: str, port: int) -> str:
    """``host:port`` (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def leave_note(service: Service) -> None:
    """A note of ``service`` (its job's public id, address, process) in the node's directory, for
    whoever looks (best effort: none where the directory cannot be made)."""
    try:
        directory, lock = make_locked_dir("peers")
        service.note = (directory, lock)
        note = {"job": service.verifier.job, "address": service.address, "pid": _process.pid()}
        write_own(os.path.join(directory, "service.json"), json.dumps(note).encode())
    except OSError:
        pass

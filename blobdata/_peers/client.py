"""The asking side: a sample this node's cache misses is read from its home node, and from the bucket
whenever the peer cannot give exactly the object's bytes in time.

One :class:`PeerClient` per process (made with the process's read state, so a forked worker has its
own: its own connections, client id and sequence numbers). The reads the loop starts in one turn (a
batch the look-ahead schedules, a batch's misses) wait for their peer together and go as one request
per peer (:mod:`.service`'s batch form): the signing, the HTTP heads, the checks of the signature and
the round trip are paid per request, not per object. Per peer at most ``per_peer`` objects are in
flight; what comes meanwhile waits and goes in the next request once one is answered.

Per peer it keeps latency estimates (RFC 6298's smoothed mean and deviation) of its answers from its
cache and of those it read from the bucket first; a request, once sent, waits for the peer until
``mean + 4 deviations`` of the kind the peer mostly gives lately (at least :data:`HEDGE_MIN_S`, at most
:data:`HEDGE_MAX_S`), then its reads also ask the bucket and take whichever answers first (a hedged
request, Dean and Barroso's "The Tail at Scale"), within a budget of :data:`HEDGE_SHARE` of the reads;
past the budget a read waits for the peer up to a deadline, then the peer is given up for a while.
What the peer sends is checked as a cache entry is, and more: the answer's signature under the job's
secret (bound to this very request, so to each object's URL, identity and size), each object's length
as listed, its CRC32C. A peer that cannot be reached, refuses, answers wrong or not in time is left
alone for a while (1 s, doubling up to 30 s while it keeps failing), and its objects come from the
bucket meanwhile: a peer never costs a wrong byte or a failed read, only bucket reads.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hmac
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from .._metrics import stats as _stats
from .._stores import H1Pool
from .auth import Signer, answer_signature
from .config import PeerTable
from .homes import Homes
from .rendezvous import service_of
from .service import MAX_OBJECTS, MAX_TARGET, PATH, Service, crc_text

__all__ = ["HEDGE_MAX_S", "HEDGE_MIN_S", "HEDGE_SHARE", "PeerClient"]

_log = logging.getLogger("blobdata")

HEDGE_MIN_S = 0.02  # a peer answering from its cache takes ~1 ms; the bucket tens of ms
HEDGE_FIRST_S = 1.0  # before any answer of that kind was timed
_COLD_SHARE = 0.05  # a peer whose answers were cold more often than this: hedge on the cold latency
HEDGE_MAX_S = 2.0
_DOWN_S, _DOWN_MAX_S = 1.0, 30.0
#: Hedges are a budget: each read earns this share of one, and at most this many are saved up (the
#: bucket gets a few percent more reads, not twice as many, from peers that are merely slow now).
HEDGE_SHARE, _HEDGE_BURST = 0.05, 10.0
#: Without a hedge to spend, a read waits for the peer this long (or this many times the hedge's
#: wait, if longer), then gives the peer up for a while and reads the bucket.
_DEADLINE_S, _DEADLINE_TIMES = 5.0, 4.0
#: The most bytes of answer one request asks for (a single larger object goes alone).
_BATCH_BYTES = 64 * 2**20
_TIMEOUT_S = 30.0  # a peer's answer, connect to last byte, at most
#: Left as they are in a request's fields (allowed in a query, and no field separator): a URL is then
#: usually sent as it is, and quoting and unquoting it cost a scan, not a rewrite.
_SAFE = "/:"


class _Latency:
    """RFC 6298's smoothed mean and deviation of one kind of answer's latency (seconds; 0: none yet)."""

    __slots__ = ("mean", "var")

    def __init__(self) -> None:
        self.mean = self.var = 0.0

    def add(self, seconds: float) -> None:
        if not self.mean:
            self.mean, self.var = seconds, seconds / 2.0
        else:
            self.var = 0.75 * self.var + 0.25 * abs(self.mean - seconds)
            self.mean = 0.875 * self.mean + 0.125 * seconds

    def bound(self) -> float:
        return self.mean + 4.0 * self.var if self.mean else HEDGE_FIRST_S


class _Peer:
    """One peer as this process sees it: its latency when it answers from its cache (warm) and when it
    reads an object from the bucket first (cold), how often it did the latter lately, the reads waiting
    for a request to it and the objects in flight."""

    __slots__ = (
        "backoff", "cold", "cold_share", "down_until", "host", "inflight", "origin", "pending", "queued",
        "warm",
    )  # fmt: skip

    def __init__(self, address: str) -> None:
        self.origin = "http://" + address
        self.host = address
        self.warm, self.cold = _Latency(), _Latency()
        self.cold_share = 1.0  # until it answers, what it holds is unknown: a cold start
        self.down_until = 0.0
        self.backoff = _DOWN_S
        self.pending: collections.deque[_Want] = collections.deque()
        self.queued = False  # a dispatch of ``pending`` is scheduled on the loop
        self.inflight = 0  # objects asked of it and not answered yet

    def hedge_after(self) -> float:
        """How long a request may take before the bucket is asked too: as long as a cold answer takes
        while the peer's answers are often cold (the job's first epoch), else as long as a warm one."""
        bound = self.cold.bound() if self.cold_share > _COLD_SHARE else self.warm.bound()
        return min(HEDGE_MAX_S, max(HEDGE_MIN_S, bound))

    def timed(self, seconds: float, cold: bool) -> None:
        (self.cold if cold else self.warm).add(seconds)
        self.cold_share = 0.95 * self.cold_share + 0.05 * cold
        self.backoff = _DOWN_S

    def failed(self, now: float) -> None:
        self.down_until = now + self.backoff
        self.backoff = min(_DOWN_MAX_S, self.backoff * 2.0)


class _Want:
    """One read waiting for a peer: ``fut`` gets the peer's bytes, None (the bucket's turn) or
    :data:`_HEDGE` (the peer is slow: ask the bucket too, and ``late`` gets the peer's answer). A read
    started without a task of its own (:meth:`PeerClient.start`) has its ``bucket`` read and the
    counters its answer goes to (``rec``'s slot ``from_peer`` or ``from_bucket``), and ``fut`` gets its
    bytes (or error) whatever gave them."""

    __slots__ = ("bucket", "from_bucket", "from_peer", "fut", "late", "query", "rec", "size")
    rec: _stats.Slots
    from_peer: int
    from_bucket: int

    def __init__(self, query: str, size: int, fut: asyncio.Future[Any]) -> None:
        self.query, self.size, self.fut = query, size, fut
        self.late: asyncio.Future[bytes | None] | None = None
        self.bucket: Bucket | None = None


_HEDGE = object()

Bucket = Callable[[], Awaitable[tuple[bytes, str]]]


def _query(url: str, identity: str, size: int) -> str:
    return f"u={_quoted(url)}&e={_quoted(identity)}&n={size}"


_UNSAFE = re.compile(r"[^A-Za-z0-9_.~/:-]")  # what quote(text, safe=_SAFE) rewrites in ASCII text


def _escape(m: re.Match[str]) -> str:
    return f"%{ord(m.group()):02X}"


def _quoted(text: str) -> str:
    """``quote(text, safe=_SAFE)``: for ASCII text in one C scan, rewriting only what needs it
    (urllib's rewrites the whole text byte by byte in Python where any byte needs it: an ETag's
    quotes, 2.2 us against 1.2)."""
    return _UNSAFE.sub(_escape, text) if text.isascii() else quote(text, safe=_SAFE)


class PeerClient:
    """Reads of objects homed on other nodes of the job (see the module docstring)."""

    def __init__(self, table: PeerTable) -> None:
        self.table = table
        self.homes = Homes(table.names)
        self.me = table.me
        self._signer = Signer(table.secret, table.names[table.me])
        self._peers = [_Peer(a) for a in table.addresses]
        self._tokens = _HEDGE_BURST  # hedges this process may start now
        self._pool: H1Pool | None = None  # made on the loop at the first ask (one process, one loop)
        self._batches: set[asyncio.Task[None]] = set()  # requests in flight (held: a task is weakly kept)
        self._rests: set[asyncio.Task[None]] = set()  # reads of :meth:`start` gone to the bucket

    def _get_pool(self) -> H1Pool:
        if self._pool is None:
            self._pool = H1Pool(self.table.per_peer * max(1, len(self._peers) - 1))
        return self._pool

    def home_of(self, url: str) -> int:
        """The node ``url`` is homed on (this node: :attr:`me`)."""
        return self.homes.home_of(url)

    async def read(self, home: int, url: str, size: int, identity: str, bucket: Bucket) -> tuple[bytes, bool]:
        """``url``'s bytes (``size`` of them, pinned to ``identity``) from node ``home``, else from
        ``bucket()``; and whether another node's were taken. This node's own objects (``home`` is
        :attr:`me`) that its cache missed are asked of its own service too: it reads each once, however
        many of the node's processes and peers want it at the same time."""
        if home == self.me:
            service = service_of(self.table)
            if isinstance(service, Service):  # this process runs the node's service: no request to itself
                data = await service.local(url, identity, size)
                return (data if data is not None else (await bucket())[0]), False
        peer = self._peers[home]
        hedge: asyncio.Future[tuple[bytes, str]] | None = None
        if peer.down_until <= time.monotonic():
            data, hedge = await self._try(peer, url, size, identity, bucket)
            if data is not None:
                return data, home != self.me
        _stats.rec()[_stats.PEER_FALLBACK] += 1
        return (await (hedge if hedge is not None else bucket()))[0], False

    async def _try(
        self, peer: _Peer, url: str, size: int, identity: str, bucket: Bucket
    ) -> tuple[bytes | None, asyncio.Future[tuple[bytes, str]] | None]:
        """The peer's bytes, or None and the bucket read started meanwhile (if one was: the peer was
        slow). The read joins the next request to the peer (:meth:`_dispatch`); the request decides
        when a read is slow (:meth:`_batch`), and a slow read races the bucket here."""
        loop = asyncio.get_running_loop()
        want = _Want(_query(url, identity, size), size, loop.create_future())
        self._queue(peer, want, loop)
        got = await want.fut
        if got is not _HEDGE:
            return got, None
        assert want.late is not None
        return await _race(want.late, bucket)

    def start(
        self, home: int, url: str, size: int, identity: str, bucket: Bucket
    ) -> asyncio.Future[bytes] | None:
        """:meth:`read` of ``url`` (its bytes only), counted as the dataset counts a read from a home
        (``FROM_PEER`` from another node, else ``FROM_BUCKET``, the next epoch's where
        :func:`~blobdata._metrics.stats.next_epoch`), without a task or coroutine of its own: it joins
        the next request to ``home`` and the answer sets the future; a task is made only for a read the
        peer does not answer in time or with its bytes (the bucket's). For the look-ahead's misses,
        started as a batch. None where a read cannot start so (``home`` is this process's own service,
        or a peer given up for now): :meth:`read` it."""
        if home == self.me and isinstance(service_of(self.table), Service):
            return None
        peer = self._peers[home]
        if peer.down_until > time.monotonic():
            return None
        loop = asyncio.get_running_loop()
        want = _Want(_query(url, identity, size), size, loop.create_future())
        want.bucket, want.rec = bucket, _stats.rec()
        later = _stats.next_epoch()
        want.from_bucket = _stats.N_FROM_BUCKET if later else _stats.FROM_BUCKET
        want.from_peer = _stats.N_FROM_PEER if later else _stats.FROM_PEER
        if home == self.me:  # its own node's service (in another process): counted as a bucket read
            want.from_peer = want.from_bucket
        self._queue(peer, want, loop)
        return want.fut

    def _queue(self, peer: _Peer, want: _Want, loop: asyncio.AbstractEventLoop) -> None:
        peer.pending.append(want)
        if not peer.queued:  # every read the loop starts in this turn joins the same request
            peer.queued = True
            loop.call_soon(self._dispatch, peer)

    def _answer(self, want: _Want, got: Any) -> None:
        """Give ``want`` what its request got for it (its bytes, None or :data:`_HEDGE`): to its reader,
        or, for a read started without one (:meth:`start`), as its bytes, counted, or to a task that
        reads the bucket."""
        fut = want.fut
        if fut.done():  # its reader left
            return
        if want.bucket is None:
            fut.set_result(got)
        elif got is None or got is _HEDGE:
            task = asyncio.get_running_loop().create_task(self._rest(want))
            self._rests.add(task)
            task.add_done_callback(self._rests.discard)
            fut.add_done_callback(functools.partial(_cancel_unless_done, task))
        else:
            want.rec[want.from_peer] += 1
            fut.set_result(got)

    async def _rest(self, want: _Want) -> None:
        """A read started by :meth:`start` that its peer did not answer with its bytes: from the bucket,
        raced against the peer's late answer if the peer was only slow."""
        fut, bucket = want.fut, want.bucket
        assert bucket is not None
        try:
            hedge = None
            if want.late is not None:
                data, hedge = await _race(want.late, bucket)
                if data is not None:
                    want.rec[want.from_peer] += 1
                    _settle(fut, data)
                    return
            want.rec[_stats.PEER_FALLBACK] += 1
            data = (await (hedge if hedge is not None else bucket()))[0]
            want.rec[want.from_bucket] += 1
            _settle(fut, data)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except Exception as exc:  # the bucket's error is the read's
            if not fut.done():
                fut.set_exception(exc)

    def _dispatch(self, peer: _Peer) -> None:
        """Send what waits for ``peer`` as requests of up to :data:`MAX_OBJECTS` objects (and a
        target of :data:`MAX_TARGET` bytes, :data:`_BATCH_BYTES` of answer), while fewer than
        ``per_peer`` objects are in flight to it; the rest waits for one to be answered."""
        peer.queued = False
        pending = peer.pending
        if peer.down_until > time.monotonic():  # it failed meanwhile: the bucket's turn for all
            while pending:
                self._answer(pending.popleft(), None)
            return
        room = self.table.per_peer - peer.inflight
        while pending and room > 0:
            batch: list[_Want] = []
            length, nbytes = len(PATH), 0
            while pending and len(batch) < min(room, MAX_OBJECTS):
                want = pending[0]
                if want.fut.done():  # its reader left
                    pending.popleft()
                    continue
                if batch and (length + 1 + len(want.query) > MAX_TARGET or nbytes + want.size > _BATCH_BYTES):
                    break
                batch.append(pending.popleft())
                length += 1 + len(want.query)
                nbytes += want.size
            if not batch:
                break
            room -= len(batch)
            peer.inflight += len(batch)
            task = asyncio.get_running_loop().create_task(self._batch(peer, batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _batch(self, peer: _Peer, batch: list[_Want]) -> None:
        """One request to ``peer`` for ``batch``, each read given its answer. Past the peer's usual
        latency (:meth:`_Peer.hedge_after`) a read still waiting is told to race the bucket, within the
        hedge budget; the others wait up to a deadline, past which the peer is given up for a while."""
        got: list[bytes | None] | None = None
        try:
            ask = asyncio.ensure_future(self._ask(peer, batch))
            try:
                after = peer.hedge_after()
                done, _ = await asyncio.wait((ask,), timeout=after)
                if done:
                    self._tokens = min(_HEDGE_BURST, self._tokens + HEDGE_SHARE * len(batch))
                else:
                    for want in batch:
                        if not want.fut.done() and self._tokens >= 1.0:
                            self._tokens -= 1.0
                            _stats.rec()[_stats.PEER_HEDGED] += 1
                            want.late = asyncio.get_running_loop().create_future()
                            self._answer(want, _HEDGE)
                    deadline = max(_DEADLINE_S, _DEADLINE_TIMES * after)
                    done, _ = await asyncio.wait((ask,), timeout=deadline - after)
                    if not done:
                        ask.cancel()
                        await asyncio.gather(ask, return_exceptions=True)
                        self._failed(peer, f"did not answer within {deadline:.1f} s")
                got = ask.result() if done else None
            except BaseException:
                ask.cancel()
                raise
        finally:
            for k, want in enumerate(batch):
                one = got[k] if got is not None else None
                if want.late is not None:
                    _settle(want.late, one)
                else:
                    self._answer(want, one)
            peer.inflight -= len(batch)
            if peer.pending and not peer.queued:
                peer.queued = True
                asyncio.get_running_loop().call_soon(self._dispatch, peer)

    async def _ask(self, peer: _Peer, batch: list[_Want]) -> list[bytes | None] | None:
        """The peer's answer for each read of ``batch``, checked (None: it has none for that one); None
        if the whole answer is not to be used (timed and noted either way)."""
        target = PATH + "?" + "&".join(w.query for w in batch)
        headers, sig = self._signer.sign("GET", target)
        headers["Host"] = peer.host
        t = time.perf_counter()
        try:
            resp = await self._get_pool().get(
                peer.origin, target, headers, _TIMEOUT_S, max_body=sum(w.size for w in batch), as_buffer=True
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # unreachable, reset, timed out, or not HTTP: the bucket's turn
            self._failed(peer, f"unreachable ({type(exc).__name__}: {exc})")
            return None
        seconds = time.perf_counter() - t
        if resp.status == 503:  # busy: these reads go to the bucket, the peer stays in use
            return [None] * len(batch)
        if resp.status != 200:
            self._failed(peer, f"answered {resp.status}: {resp.body[:200]!r}")
            return None
        table = resp.headers.get("X-Blobdata-Table") or ""
        want = answer_signature(self.table.secret, sig, 200, table)
        out, cold = None, False
        signed = (resp.headers.get("X-Blobdata-Signature") or "").encode("latin-1")
        if hmac.compare_digest(signed, want.encode()):
            body = resp.buffer if resp.buffer is not None else resp.body
            out, cold = _split(table, body, [w.size for w in batch])
        if out is None:
            _stats.rec()[_stats.PEER_WRONG] += 1
            self._failed(peer, "sent a wrong answer (signature, table, length or checksum)")
            return None
        peer.timed(seconds, cold)
        if peer is not self._peers[self.me]:
            got = [len(data) for data in out if data is not None]
            if got:
                _stats.note_peer(seconds, sum(got), len(got))
        return out

    @staticmethod
    def _failed(peer: _Peer, why: str) -> None:
        _log.debug(
            "blobdata: peer %s %s; its objects come from the bucket for %.0f s", peer.host, why, peer.backoff
        )
        peer.failed(time.monotonic())

    async def aclose(self) -> None:
        """Close this process's connections to the peers (a request in flight is given up: its reads
        go to the bucket)."""
        tasks = [*self._batches, *self._rests]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()


def _settle(fut: asyncio.Future[Any], value: bytes | None) -> None:
    if not fut.done():
        fut.set_result(value)


def _cancel_unless_done(task: asyncio.Task[None], fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():  # the reader left: its bucket read too
        task.cancel()


async def _race(
    late: asyncio.Future[bytes | None], bucket: Bucket
) -> tuple[bytes | None, asyncio.Future[tuple[bytes, str]] | None]:
    """A slow peer's ``late`` answer raced against ``bucket()``: the peer's bytes if they come first
    (or the bucket fails), else None and the bucket's read."""
    hedge = asyncio.ensure_future(bucket())
    try:
        await asyncio.wait((late, hedge), return_when=asyncio.FIRST_COMPLETED)
        if not late.done() and hedge.exception() is not None:
            await late  # the bucket failed: the peer may still answer
        data = late.result() if late.done() else None
        if data is not None:
            hedge.cancel()
            await asyncio.gather(hedge, return_exceptions=True)
            return data, None
        return None, hedge
    except BaseException:
        hedge.cancel()
        raise


def _split(
    table: str, body: bytes | bytearray | memoryview, sizes: list[int]
) -> tuple[list[bytes | None] | None, bool]:
    """Each object's bytes from an answer's ``body`` as its ``table`` says (None for ``-``: the bucket
    refused it), checked against the ``sizes`` asked and its checksum; and whether any was read from
    the bucket first. ``(None, False)`` for an answer that is wrong in any way."""
    entries = table.split(" ")
    if len(entries) != len(sizes):
        return None, False
    out: list[bytes | None] = []
    view = memoryview(body)
    pos, cold = 0, False
    for entry, size in zip(entries, sizes, strict=True):
        if entry == "-":
            out.append(None)
            continue
        n, dot, crc = entry[1:].partition(".")
        if entry[:1] not in ("c", "b") or not dot or n != str(size) or pos + size > len(body):
            return None, False
        data = bytes(view[pos : pos + size])
        if crc_text(data) != crc:
            return None, False
        pos += size
        cold |= entry[0] == "b"
        out.append(data)
    if pos != len(body):
        return None, False
    return out, cold

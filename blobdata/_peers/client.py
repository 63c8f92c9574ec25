"""The asking side: a sample this node's cache misses is read from its home node, and from the bucket
whenever the peer cannot give exactly the object's bytes in time.

One :class:`PeerClient` per process (made with the process's read state, so a forked worker has its
own: its own connections, client id and sequence numbers). Per peer it keeps at most ``per_peer``
requests in flight and latency estimates (RFC 6298's smoothed mean and deviation) of its answers from
its cache and of those it read from the bucket first; a read, once sent, waits for the peer until
``mean + 4 deviations`` of the kind the peer mostly gives lately (at least :data:`HEDGE_MIN_S`, at most
:data:`HEDGE_MAX_S`), then also asks the bucket and takes whichever answers first (a hedged request,
Dean and Barroso's "The Tail at Scale"), within a budget of :data:`HEDGE_SHARE` of the reads; past the
budget it waits for the peer up to a deadline, then gives it up for a while. What the peer sends is
checked as a cache entry is, and more: the answer's signature under the job's secret (bound to this
very request), the identity asked for, the length listed, the CRC32C. A peer that cannot be reached,
refuses, answers wrong or not in time is left alone for a while (1 s, doubling up to 30 s while it
keeps failing), and its objects come from the bucket meanwhile: a peer never costs a wrong byte or a
failed read, only bucket reads.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import quote

from .._metrics import stats as _stats
from .._stores import H1Pool
from .auth import Signer, answer_signature
from .config import PeerTable
from .homes import Homes
from .rendezvous import service_of
from .service import PATH, crc_text

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
_TIMEOUT_S = 30.0  # a peer's answer, connect to last byte, at most


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
    reads the object from the bucket first (cold), and how often it did the latter lately."""

    __slots__ = ("backoff", "cold", "cold_share", "down_until", "host", "origin", "sem", "warm")

    def __init__(self, address: str) -> None:
        self.origin = "http://" + address
        self.host = address
        self.sem: asyncio.Semaphore | None = None
        self.warm, self.cold = _Latency(), _Latency()
        self.cold_share = 1.0  # until it answers, what it holds is unknown: a cold start
        self.down_until = 0.0
        self.backoff = _DOWN_S

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


Bucket = Callable[[], Awaitable[tuple[bytes, str]]]


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
            if service is not None:  # this process runs the node's service: no request to itself
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
        slow). A request waits here for one of the peer's ``per_peer`` slots; the hedge's clock starts
        once it has one (the wait is this process's own queue, not the peer's slowness)."""
        if peer.sem is None:
            peer.sem = asyncio.Semaphore(self.table.per_peer)
        async with peer.sem:
            if peer.down_until > time.monotonic():  # it failed while this one waited
                return None, None
            ask = asyncio.ensure_future(self._ask(peer, url, size, identity))
            hedge: asyncio.Future[tuple[bytes, str]] | None = None
            try:
                after = peer.hedge_after()
                done, _ = await asyncio.wait((ask,), timeout=after)
                if done:
                    self._tokens = min(_HEDGE_BURST, self._tokens + HEDGE_SHARE)
                    return ask.result(), None
                if self._tokens < 1.0:  # no hedge left to spend: the peer has until its deadline
                    done, _ = await asyncio.wait(
                        (ask,), timeout=max(_DEADLINE_S, _DEADLINE_TIMES * after) - after
                    )
                    if done:
                        return ask.result(), None
                    ask.cancel()
                    await asyncio.gather(ask, return_exceptions=True)
                    self._failed(
                        peer, f"did not answer within {max(_DEADLINE_S, _DEADLINE_TIMES * after):.1f} s"
                    )
                    return None, None
                self._tokens -= 1.0
                _stats.rec()[_stats.PEER_HEDGED] += 1
                hedge = asyncio.ensure_future(bucket())
                await asyncio.wait((ask, hedge), return_when=asyncio.FIRST_COMPLETED)
                if not ask.done() and hedge.exception() is not None:
                    await ask  # the bucket failed: the peer may still answer
                if ask.done():
                    got = ask.result()
                    if got is not None:
                        hedge.cancel()
                        await asyncio.gather(hedge, return_exceptions=True)
                        return got, None
                    return None, hedge
                ask.cancel()
                await asyncio.gather(ask, return_exceptions=True)
                return None, hedge
            except BaseException:
                for task in (ask, hedge):
                    if task is not None:
                        task.cancel()
                raise

    async def _ask(self, peer: _Peer, url: str, size: int, identity: str) -> bytes | None:
        """The peer's answer, checked; None if it has none for us (timed and noted either way)."""
        ident = quote(identity, safe="")
        target = f"{PATH}?u={quote(url, safe='')}&e={ident}&n={size}"
        headers, sig = self._signer.sign("GET", target)
        headers["Host"] = peer.host
        t = time.perf_counter()
        try:
            resp = await self._get_pool().get(peer.origin, target, headers, _TIMEOUT_S, max_body=size)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # unreachable, reset, timed out, or not HTTP: the bucket's turn
            self._failed(peer, f"unreachable ({type(exc).__name__}: {exc})")
            return None
        seconds = time.perf_counter() - t
        if resp.status == 503:  # busy: this read goes to the bucket, the peer stays in use
            return None
        h = resp.headers
        body = resp.body
        crc = h.get("X-Blobdata-Crc") or ""
        want = answer_signature(self.table.secret, sig, resp.status, ident, len(body), crc)
        if resp.status != 200:
            self._failed(peer, f"answered {resp.status}: {resp.body[:200]!r}")
            return None
        if (
            h.get("X-Blobdata-Identity") != ident
            or len(body) != size
            or not hmac.compare_digest((h.get("X-Blobdata-Signature") or "").encode("latin-1"), want.encode())
            or crc_text(body) != crc
        ):
            _stats.rec()[_stats.PEER_WRONG] += 1
            self._failed(peer, f"sent {url} wrong (identity, length, signature or checksum)")
            return None
        peer.timed(seconds, h.get("X-Blobdata-From") == "bucket")
        if peer is not self._peers[self.me]:
            _stats.note_peer(seconds, len(body))
        return body

    @staticmethod
    def _failed(peer: _Peer, why: str) -> None:
        _log.debug(
            "blobdata: peer %s %s; its objects come from the bucket for %.0f s", peer.host, why, peer.backoff
        )
        peer.failed(time.monotonic())

    async def aclose(self) -> None:
        """Close this process's connections to the peers."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()

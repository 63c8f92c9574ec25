"""The asking side: a sample this node's cache misses is read from its home node, and from the bucket
whenever the peer cannot give exactly the object's bytes in time.

One :class:`PeerClient` per process (made with the process's read state, so a forked worker has its
own: its own connections, client id and sequence numbers). Per peer it keeps at most ``per_peer``
requests in flight and a latency estimate (RFC 6298's smoothed mean and deviation); a read waits for
the peer until ``mean + 4 deviations`` (at least :data:`HEDGE_MIN_S`, at most :data:`HEDGE_MAX_S`), then
also asks the bucket and takes whichever answers first (a hedged request, Dean and Barroso's "The Tail
at Scale"). What the peer sends is checked as a cache entry is, and more: the answer's signature under
the job's secret (bound to this very request), the identity asked for, the length listed, the CRC32C.
A peer that cannot be reached, refuses, or answers wrong is left alone for a while (1 s, doubling up to
30 s while it keeps failing), and its objects come from the bucket meanwhile: a peer never costs a
wrong byte or a failed read, only bucket reads.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Awaitable, Callable
from urllib.parse import quote

from .._metrics import stats as _stats
from .._stores import H1Pool
from .auth import Signer, answer_signature
from .config import PeerTable
from .homes import Homes
from .service import PATH, crc_text

__all__ = ["HEDGE_MAX_S", "HEDGE_MIN_S", "PeerClient"]

HEDGE_MIN_S = 0.02  # a peer answering from its cache takes ~1 ms; the bucket tens of ms
HEDGE_FIRST_S = 0.25  # before any answer of that peer was timed
HEDGE_MAX_S = 2.0
_DOWN_S, _DOWN_MAX_S = 1.0, 30.0
_TIMEOUT_S = 30.0  # a peer's answer, connect to last byte, at most


class _Peer:
    """One peer as this process sees it."""

    __slots__ = ("backoff", "down_until", "host", "origin", "rttvar", "sem", "srtt")

    def __init__(self, address: str) -> None:
        self.origin = "http://" + address
        self.host = address
        self.sem: asyncio.Semaphore | None = None
        self.srtt = 0.0  # 0: nothing timed yet
        self.rttvar = 0.0
        self.down_until = 0.0
        self.backoff = _DOWN_S

    def hedge_after(self) -> float:
        if not self.srtt:
            return HEDGE_FIRST_S
        return min(HEDGE_MAX_S, max(HEDGE_MIN_S, self.srtt + 4.0 * self.rttvar))

    def timed(self, seconds: float) -> None:
        if not self.srtt:
            self.srtt, self.rttvar = seconds, seconds / 2.0
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - seconds)
            self.srtt = 0.875 * self.srtt + 0.125 * seconds
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
        ``bucket()``; and whether the peer's were taken."""
        peer = self._peers[home]
        v = _stats.rec()
        if peer.down_until > time.monotonic():
            v[_stats.PEER_FALLBACK] += 1
            return (await bucket())[0], False
        ask = asyncio.ensure_future(self._ask(peer, url, size, identity))
        done, _ = await asyncio.wait((ask,), timeout=peer.hedge_after())
        if done:
            data = ask.result()
            if data is not None:
                return data, True
            v[_stats.PEER_FALLBACK] += 1
            return (await bucket())[0], False
        v[_stats.PEER_HEDGED] += 1
        hedge = asyncio.ensure_future(bucket())
        try:
            await asyncio.wait((ask, hedge), return_when=asyncio.FIRST_COMPLETED)
            if ask.done() and ask.result() is not None:
                return ask.result(), True  # type: ignore[return-value]
            if not hedge.done() or hedge.exception() is not None:
                await asyncio.wait((ask, hedge), return_when=asyncio.ALL_COMPLETED)
                if ask.result() is not None:
                    return ask.result(), True  # type: ignore[return-value]
            v[_stats.PEER_FALLBACK] += 1
            return hedge.result()[0], False
        finally:
            for task in (ask, hedge):
                if not task.done():
                    task.cancel()
            await asyncio.gather(ask, hedge, return_exceptions=True)

    async def _ask(self, peer: _Peer, url: str, size: int, identity: str) -> bytes | None:
        """The peer's answer, checked; None if it has none for us (timed and noted either way)."""
        ident = quote(identity, safe="")
        target = f"{PATH}?u={quote(url, safe='')}&e={ident}&n={size}"
        headers, sig = self._signer.sign("GET", target)
        headers["Host"] = peer.host
        if peer.sem is None:
            peer.sem = asyncio.Semaphore(self.table.per_peer)
        t = time.perf_counter()
        v = _stats.rec()
        async with peer.sem:
            try:
                resp = await self._get_pool().get(peer.origin, target, headers, _TIMEOUT_S, max_body=size)
            except asyncio.CancelledError:
                raise
            except Exception:  # unreachable, reset, timed out, or not HTTP: the bucket's turn
                peer.failed(time.monotonic())
                return None
        seconds = time.perf_counter() - t
        if resp.status == 503:  # busy: this read goes to the bucket, the peer stays in use
            return None
        h = resp.headers
        body = resp.body
        crc = h.get("X-Blobdata-Crc") or ""
        want = answer_signature(self.table.secret, sig, resp.status, ident, len(body), crc)
        if (
            resp.status != 200
            or h.get("X-Blobdata-Identity") != ident
            or len(body) != size
            or not hmac.compare_digest((h.get("X-Blobdata-Signature") or "").encode("latin-1"), want.encode())
            or crc_text(body) != crc
        ):
            if resp.status == 200:
                v[_stats.PEER_WRONG] += 1
            peer.failed(time.monotonic())
            return None
        peer.timed(seconds)
        _stats.note_peer(seconds, len(body))
        return body

    async def aclose(self) -> None:
        """Close this process's connections to the peers."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()

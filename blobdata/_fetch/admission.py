"""Admission: when an engine's next request to a store may go, under the node's throttle controller.

Each engine has a :class:`Gate` per store (in each process, on its loop): it bounds the requests in
flight (``FetchOptions.concurrency``) and, while the node does not know the store yet, a slow start's
window (4 per process, one more per answer). While the store has never throttled (the usual case) a
request passes at the cost of two float reads from the node's table; once it has, requests wait for
tokens of the node-wide rate (:mod:`blobdata._fetch.throttle`), retries of throttled requests ahead of new
ones, and the store's ``Retry-After`` pauses them all. A request waits only while the store makes
progress: when no request of the node was accepted for ``patience`` seconds
(``FetchOptions.throttle_wait``), its wait ends with :class:`PatienceSpent`, which
:func:`blobdata._retry.with_retries` turns into :class:`~blobdata.Throttled` naming the URL.

Readers passed to an engine (``FetchEngine(reader=...)``) have no endpoint that other processes
could name, so their engine keeps a controller of its own (:func:`private_gate`).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import math
import time
from typing import NamedTuple

from .. import _process
from .._errors import PatienceSpent
from .._metrics import stats as _stats
from .._stores import store_info
from .throttle import OPEN_WINDOW, START_WINDOW, SYNC_S, Limit, Table, key_id, node_table

__all__ = ["Gate", "PatienceSpent", "gate_for", "private_gate", "store_key"]


def store_key(protocol: str, endpoint: str, bucket: str, prefix: str) -> str:
    """What names one throttle controller: the store's endpoint (an Azure account) and bucket
    (container) and, for S3, which limits request rates per prefix, the folder's first path segment
    (``prefix``, "" for a whole bucket). Azure limits an account as a whole: its bucket is left out.
    Which of these a store limits by is its descriptor's (:func:`blobdata._stores.store_info`)."""
    store = store_info(protocol)
    bucket = bucket if store.throttle_bucket else ""
    return f"{protocol}\0{endpoint}\0{bucket}\0{prefix if store.throttle_prefix else ''}"


class _Waiter(NamedTuple):
    fut: asyncio.Future[None]
    began: float  # when its read began (time.monotonic())
    patience: float  # seconds without an accepted request before its wait ends


class Gate:
    """Admission of one engine's requests to one store, in one process, on one event loop.

    A request waits here until it may go: fewer than ``ceiling`` of the engine's requests are in
    flight (``FetchOptions.concurrency``), the slow start's window has room, and, once the store has
    throttled, the node's rate gives it a token. Retries of throttled requests go first. What is
    admitted is in flight at once: nothing waits between admission and the request.
    """

    def __init__(self, limit: Limit, ceiling: int) -> None:
        self.limit = limit
        self.ceiling = ceiling
        # Waiting requests: (their future, when their read began, their patience in seconds).
        self._retries: collections.deque[_Waiter] = collections.deque()
        self._fresh: collections.deque[_Waiter] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None  # the next try to admit waiting requests
        self._patience: asyncio.TimerHandle | None = None  # the next look for waits whose patience ran out
        self._flush: asyncio.TimerHandle | None = None
        self.inflight = 0  # admitted and not yet finished
        self.window = float(START_WINDOW)  # slow start, until the node's store is started up

    def _room(self) -> float:
        """How many more requests may be admitted now (the ceiling, and the slow start's window)."""
        room = float(self.ceiling - self.inflight)
        if self.window != math.inf:
            if self.limit.started_up():
                self.window = math.inf
            else:
                room = min(room, self.window - self.inflight)
        return room

    def _counted(self, pending: bool) -> None:
        """Counts wait to be written to the node's table: write them soon, even if nothing follows."""
        if pending and self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(SYNC_S, self._write)

    def _write(self) -> None:
        self._flush = None
        self.limit.sync(time.monotonic())

    async def admit(self, *, retry: bool, patience: float, since: float | None = None) -> float:
        """Wait until a request may go; it is in flight from then on (call :meth:`finished` when it
        ends, or :meth:`forgo` if it does not go after all). Returns the time it goes.

        ``retry``: a retry goes ahead of new requests. Raises :class:`PatienceSpent` once the node's
        requests to the store went ``patience`` seconds without one accepted, counted from ``since``
        (when the read began; default: now).
        """
        now = time.monotonic()
        if not self._retries and not self._fresh and self._room() >= 1 and self.limit.open(now):
            return self._go(now)
        began = now if since is None else since
        if self.patience_left(began, patience) <= 0.0:
            raise self.spent(patience)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._retries if retry else self._fresh).append(_Waiter(fut, began, patience))
        self._admit_waiting()
        if not fut.done() and self._patience is None:
            self._arm_patience(patience)
        try:
            await fut  # admitted, or PatienceSpent set by _expire
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.forgo()  # admitted just as it was cancelled
            fut.cancel()
            raise
        return time.monotonic()

    def _arm_patience(self, delay: float) -> None:
        # One timer per gate, not one per waiting request: a wait with a timeout of its own costs a
        # timer and callbacks per request, and with a full ceiling every request waits.
        self._patience = asyncio.get_running_loop().call_later(max(delay, 0.01), self._expire)

    def _expire(self) -> None:
        """End the waits whose patience ran out (:class:`PatienceSpent`); look again when the next may."""
        self._patience = None
        soonest = math.inf
        for queue in (self._retries, self._fresh):
            for w in queue:
                if w.fut.done():
                    continue
                left = self.patience_left(w.began, w.patience)
                if left <= 0.0:
                    w.fut.set_exception(self.spent(w.patience))
                else:
                    soonest = min(soonest, left)
        if soonest != math.inf:
            self._arm_patience(soonest)

    def _go(self, now: float) -> float:
        self.inflight += 1
        self.limit.inflight += 1
        self._counted(self.limit.sent(now))
        _stats.note_inflight(1, now)
        return now

    def forgo(self) -> None:
        """An admitted request does not go after all."""
        self.finished(time.monotonic(), "none")

    def patience_left(self, began: float, patience: float) -> float:
        """Seconds until ``patience`` runs out for a read that began at ``began``: counted from then,
        or from the last request of this node the store accepted, whichever is later."""
        return max(began, self.limit.last_ok()) + patience - time.monotonic()

    @staticmethod
    def spent(patience: float) -> PatienceSpent:
        return PatienceSpent(f"throttled: the store accepted no request of this node for {patience:g}s")

    def _next(self) -> asyncio.Future[None] | None:
        for queue in (self._retries, self._fresh):
            while queue:
                fut = queue.popleft().fut
                if not fut.done():
                    return fut
        return None

    def _waiting(self) -> int:
        for queue in (self._retries, self._fresh):
            while queue and queue[0].fut.done():
                queue.popleft()
        return len(self._retries) + len(self._fresh)

    def _admit_waiting(self) -> None:
        """Admit waiting requests, in order, as far as the ceiling, the window and the node's rate
        allow now; if some must wait for a token (or a pause), try again when it is due."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        limit = self.limit
        while n := self._waiting():
            room = self._room()
            if room < 1:
                return  # the ceiling or the slow start's window is full: the next answer tries again
            want = int(min(n, room))
            now = time.monotonic()
            granted, wait = (want, 0.0) if limit.open(now) else limit.take(want, now)
            for _ in range(granted):
                fut = self._next()
                if fut is None:
                    break
                self._go(now)
                fut.set_result(None)
            if granted < want:
                # Never later than 50 ms: the rate may rise (or a pause end) meanwhile.
                delay = min(max(wait, 0.0005), 0.05)
                self._timer = asyncio.get_running_loop().call_later(delay, self._admit_waiting)
                return

    def finished(self, sent_at: float, outcome: str, pause_s: float = 0.0) -> None:
        """The request admitted at ``sent_at`` ended: ``"ok"`` (the store answered it: data or a final
        refusal), ``"throttle"`` (pausing the node ``pause_s`` seconds) or ``"none"`` (no answer, or a
        server error)."""
        now = time.monotonic()
        limit = self.limit
        self.inflight -= 1
        limit.inflight -= 1
        _stats.note_inflight(-1, now)
        if outcome == "ok" and self.window != math.inf:
            self.window += 1.0  # one more per answer: the window doubles every round trip
            if self.window >= OPEN_WINDOW:
                limit.end_start()
        if outcome == "ok":
            self._counted(limit.accepted(now))
        elif outcome == "throttle":
            _stats.note_throttled()
            limit.throttled(sent_at, pause_s, now)
        _stats.note_rate_limit(limit.rate_now)
        if self._retries or self._fresh:
            self._admit_waiting()


# Per process: one Limit per store.
_limits: _process.PerProcess[dict[str, Limit]] = _process.PerProcess(dict)


def _leave() -> None:
    """At a clean exit, give up this process's entries in the node's table (a process that dies
    without this, a DataLoader worker leaving by ``os._exit`` included, is swept by the others)."""
    limits = _limits.peek()
    for limit in (limits or {}).values():
        with contextlib.suppress(OSError, ValueError):
            limit.leave()


atexit.register(_leave)


def gate_for(store: str, ceiling: int) -> Gate:
    """A gate to ``store`` (a :func:`store_key`) for ``ceiling`` requests in flight, on the node's
    controller of that store (this process's handle on it is made once)."""
    limits = _limits.get()
    limit = limits.get(store)
    if limit is None:
        limit = limits[store] = Limit(node_table(), key_id(store))
    return Gate(limit, ceiling)


def private_gate(ceiling: int) -> Gate:
    """A gate with a controller of its own (for a reader no other process can name)."""
    return Gate(Limit(Table(None), 1.0), ceiling)

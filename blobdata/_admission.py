"""Admission: when one process's next request to a store may go, under the node's throttle controller.

Each (process, event loop, store) has a :class:`Gate`. While the store has never throttled (the
usual case) a request passes at the cost of two float reads from the node's table; once it has, the
requests wait in the gate for tokens of the node-wide rate (:mod:`blobdata._throttle`), retries of
throttled requests ahead of new ones, and the store's ``Retry-After`` pauses them all. A request
waits only while the store makes progress: when no request of the node was accepted for
``patience`` seconds (``FetchOptions.throttle_wait``), its wait ends with :class:`PatienceSpent`, which
:func:`blobdata._retry.with_retries` turns into :class:`~blobdata.Throttled` naming the URL.

Readers passed to an engine (``FetchEngine(reader=...)``) have no endpoint that other processes
could name, so their engine keeps a controller of its own (:func:`private_gate`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
import weakref

from . import _process, _stats
from ._errors import TransientError
from ._throttle import OPEN_WINDOW, START_WINDOW, SYNC_S, Limit, Table, key_id, node_table

__all__ = ["Gate", "PatienceSpent", "gate_for", "private_gate", "store_key"]


class PatienceSpent(TransientError):
    """A request waited for admission while the store accepted nothing for the whole patience."""

    def __init__(self, message: str) -> None:
        super().__init__("throttle", message)


def store_key(protocol: str, endpoint: str, bucket: str, key: str) -> str:
    """What names one throttle controller: the store's endpoint and bucket and, for S3 (which limits
    request rates per prefix), the object key's first path segment."""
    prefix = key.split("/", 1)[0] if protocol == "s3" and "/" in key else ""
    return f"{protocol}\0{endpoint}\0{bucket}\0{prefix}"


class Gate:
    """Admission of one process's requests to one store, on one event loop."""

    def __init__(self, limit: Limit) -> None:
        self.limit = limit
        self._retries: collections.deque[asyncio.Future[None]] = collections.deque()
        self._fresh: collections.deque[asyncio.Future[None]] = collections.deque()
        self._pump: asyncio.Task[None] | None = None
        self._flush: asyncio.TimerHandle | None = None
        self._wake = asyncio.Event()
        self.admitted = 0  # requests admitted and not yet finished
        self.window = float(START_WINDOW)  # slow start, until the node's store is started up

    def _room(self) -> float:
        """How many more requests may be admitted now by the slow start's window."""
        if self.window == math.inf or self.limit.started_up():
            self.window = math.inf
            return math.inf
        return self.window - self.admitted

    def _counted(self, pending: bool) -> None:
        """Counts wait to be written to the node's table: write them soon, even if nothing follows."""
        if pending and self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(SYNC_S, self._write)

    def _write(self) -> None:
        self._flush = None
        self.limit.sync(time.monotonic())

    async def admit(self, *, retry: bool, patience: float) -> None:
        """Wait until a request may go (then call :meth:`started` as it goes).

        ``retry``: a retry goes ahead of new requests. Raises :class:`PatienceSpent` once the node's
        requests to the store went ``patience`` seconds without one accepted, counted from when this
        one began to wait.
        """
        now = time.monotonic()
        limit = self.limit
        if not self._retries and not self._fresh and limit.open(now) and self._room() >= 1:
            self.admitted += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._retries if retry else self._fresh).append(fut)
        if self._pump is None:
            self._pump = asyncio.ensure_future(self._run())
        began = now
        try:
            while True:
                left = self.patience_left(began, patience)
                if left <= 0.0 and not fut.done():
                    fut.cancel()
                    raise self.spent(patience)
                await asyncio.wait((fut,), timeout=max(left, 0.0))
                if fut.done():
                    return
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.forgo()
            fut.cancel()  # a token it was just given is lost: the rate only errs low
            raise

    def patience_left(self, began: float, patience: float) -> float:
        """Seconds until ``patience`` runs out for a read that began at ``began``: counted from then,
        or from the last request of this node the store accepted, whichever is later."""
        return max(began, self.limit.last_ok()) + patience - time.monotonic()

    @staticmethod
    def spent(patience: float) -> PatienceSpent:
        return PatienceSpent(f"throttled: the store accepted no request of this node for {patience:g}s")

    def forgo(self) -> None:
        """An admitted request will not go after all (cancelled before :meth:`started`)."""
        self.admitted -= 1
        self._wake.set()

    def started(self) -> float:
        """An admitted request goes to the store now; returns the time (``time.monotonic()``)."""
        now = time.monotonic()
        self.limit.inflight += 1
        self._counted(self.limit.sent(now))
        _stats.note_inflight(1, now)
        return now

    def _next(self) -> asyncio.Future[None] | None:
        for queue in (self._retries, self._fresh):
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    return fut
        return None

    def _waiting(self) -> int:
        for queue in (self._retries, self._fresh):
            while queue and queue[0].done():
                queue.popleft()
        return len(self._retries) + len(self._fresh)

    async def _run(self) -> None:
        """Hand out tokens to the waiting requests, in order, as the node's rate allows."""
        limit = self.limit
        try:
            while n := self._waiting():
                self._wake.clear()
                room = self._room()
                if room < 1:  # the slow start's window is full: wait for an answer
                    await self._wait(0.05)
                    continue
                want = int(min(n, room))
                now = time.monotonic()
                granted, wait = (want, 0.0) if limit.open(now) else limit.take(want, now)
                for _ in range(granted):
                    fut = self._next()
                    if fut is None:
                        break
                    self.admitted += 1
                    fut.set_result(None)
                if granted < want:
                    # Never longer than 50 ms: the rate may rise (or a pause end) meanwhile.
                    await self._wait(min(max(wait, 0.0005), 0.05))
        finally:
            self._pump = None

    async def _wait(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def finished(self, sent_at: float, outcome: str, pause_s: float = 0.0) -> None:
        """The request :meth:`started` at ``sent_at`` ended: ``"ok"`` (the store answered it: data or
        a final refusal), ``"throttle"`` (pausing the node ``pause_s`` seconds) or ``"none"`` (no
        answer, or a server error)."""
        now = time.monotonic()
        limit = self.limit
        limit.inflight -= 1
        self.admitted -= 1
        _stats.note_inflight(-1, now)
        if self.window != math.inf:
            if outcome == "ok":
                self.window += 1.0  # one more per answer: the window doubles every round trip
                if self.window >= OPEN_WINDOW:
                    limit.end_start()
            self._wake.set()
        if outcome == "ok":
            self._counted(limit.accepted(now))
        elif outcome == "throttle":
            _stats.note_throttled()
            limit.throttled(sent_at, pause_s, now)
        _stats.note_rate_limit(limit.rate_now)

    def snapshot(self) -> dict[str, float]:
        """The store's controller now (:meth:`blobdata._throttle.Limit.snapshot`)."""
        return self.limit.snapshot(time.monotonic())


# Per process: one Limit per store, one Gate per (loop, store).
_limits: _process.PerProcess[dict[str, Limit]] = _process.PerProcess(dict)
_gates: _process.PerProcess[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Gate]]] = (
    _process.PerProcess(weakref.WeakKeyDictionary)
)


def gate_for(store: str) -> Gate:
    """This process's gate to ``store`` (a :func:`store_key`) on the running loop, node-wide limit."""
    loop = asyncio.get_running_loop()
    per_loop = _gates.get().setdefault(loop, {})
    gate = per_loop.get(store)
    if gate is None:
        limits = _limits.get()
        limit = limits.get(store)
        if limit is None:
            limit = limits[store] = Limit(node_table(), key_id(store))
        gate = per_loop[store] = Gate(limit)
    return gate


def private_gate() -> Gate:
    """A gate with a controller of its own (for a reader no other process can name)."""
    return Gate(Limit(Table(None), 1.0))

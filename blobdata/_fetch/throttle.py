"""The node-wide throttle controller: one request rate per store, shared by every process of the node.

A store throttles a client as a whole (S3 about 5,500 GET/s per prefix, GCS and Azure per bucket or
account), so what a node may send is decided once for the node: the DataLoader workers, their
look-ahead, ``blobdata warm`` and other jobs of the same user all draw from one budget per store.

**What the controller does.** A store the node does not know yet starts with a slow start (each
process's gate, :mod:`blobdata._fetch.admission`: ``START_WINDOW`` requests in flight, one more per answer,
until ``OPEN_WINDOW``); then nothing is limited until the store throttles. A throttled answer to a
request sent after the last decrease (and ``HOLD_S`` past it) sets the store's *limit* to the rate it
accepted just before (node-wide, over the last few tenths of a second; at the first throttling, with
few answers counted yet, the rate sent), never above the rate allowed until then, and the allowed
rate drops to ``BETA`` (3/4) of that: a multiplicative decrease. Throttled answers to requests sent
earlier are the same congestion seen late and decrease nothing. Then the allowed rate grows linearly
back to the limit in ``(1 - BETA) / GAIN`` seconds and on beyond it, doubling every ``DOUBLING_S``,
but never above twice what the store accepted in the last second (an idle node keeps its limit
instead of inflating it); after ``RECOVER_S`` without a decrease the store is unlimited again.
Requests take tokens from the store's bucket (a burst of ``BURST_S`` seconds of the allowed rate),
and a ``Retry-After`` pauses the whole node's requests to that store (capped by the caller). Retries
are jittered by :func:`blobdata._retry.with_retries`.

**Where it lives.** One file per user, ``/dev/shm/blobdata-<uid>/throttle-v1.bin`` (the node's directory of
:mod:`blobdata._node`: 0700,
file 0600; the temporary directory where there is no ``/dev/shm``), mapped into each process and
changed under an ``fcntl`` lock: a table of stores (keyed by a hash of the protocol, endpoint, bucket
and, for S3, the folder's first path segment: S3 limits per prefix) and a table of owners (pid, start
time, store, heartbeat, requests in flight). Entries of processes that are gone are swept: an owner
holds a lock on its entry's byte of ``throttle-v1.bin.owners`` for as long as it owns it, so one of
another pid namespace is not taken for dead (:class:`blobdata._node.owners.SlotLocks`; pid and start
time where that file cannot be used), and a store no live process uses is forgotten after
``IDLE_S``. A process that cannot use the file (a read-only ``/dev/shm``, a file not its user's)
keeps the same state privately. All times are ``time.monotonic()``, one clock for every process.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import mmap
import os
import stat
import threading
import time
from collections.abc import Iterator
from typing import Protocol, cast

from .. import _process
from .._node import owners as _owners
from .._node import shm

__all__ = ["Limit", "Table", "key_id", "node_table"]

BETA = 0.75  # multiplicative decrease of the allowed rate on throttling
GAIN = 0.4  # additive increase per second, as a share of the limit: back to it in 0.625 s
DOUBLING_S = 0.5  # beyond the limit, the allowed rate doubles this often while nothing is throttled
RECOVER_S = 30.0  # no decrease for this long: unlimited again
HOLD_S = 0.1  # throttling of requests sent this soon after a decrease is the same congestion ...
HOLD_REQUESTS = 4  # ... or within this many requests' time at the new rate
MIN_RATE = 1.0  # requests/s: the allowed rate never goes below (a read still ends in bounded time)
BURST_S = 0.05  # the bucket holds this many seconds of the allowed rate
START_WINDOW = 4  # slow start: requests in flight per process to a store the node does not know yet ...
OPEN_WINDOW = 64  # ... +1 per accepted answer, until this many went without throttling
IDLE_S = 60.0  # a store no live process uses is forgotten this long after its last request
SYNC_S = 0.01  # counts are written to the node's table at most this often per process
SWEEP_S = 1.0  # dead owners are looked for at most this often per process
BEAT_S = 2.0  # an owner that wrote nothing for this long is checked for liveness

_MAGIC = 6.02214076e23 + 24.0
_VERSION = 1.0
STORES, OWNERS = 64, 256
_RING, _RING_S = 10, 0.1  # counts per tenth of a second over the last second
_MIN_SPAN_S = 0.05
_RECENT_S, _RECENT_N = 0.3, 20.0
# A store's slots.
(K_ID, K_LIMIT, K_TDEC, K_EPOCH, K_TOKENS, K_TTOK, K_PAUSE, K_LAST_OK, K_ACTIVE, K_SINCE, K_THROTTLED,
 K_OK, K_OPEN) = range(13)  # fmt: skip
K_OK_RING, K_SENT_RING, K_STAMPS = 13, 13 + _RING, 13 + 2 * _RING
K_FIELDS = 13 + 3 * _RING
# An owner's slots.
O_PID, O_START, O_KEY, O_BEAT, O_INFLIGHT = range(5)
O_FIELDS = 6
_HEAD = 4
SIZE = _HEAD + STORES * K_FIELDS + OWNERS * O_FIELDS
_OWNERS0 = _HEAD + STORES * K_FIELDS


class Slots(Protocol):
    def __getitem__(self, i: int, /) -> float: ...
    def __setitem__(self, i: int, value: float, /) -> None: ...


def key_id(text: str) -> float:
    """A store's identity in the table: 52 bits of a hash of ``text`` (exact as a float64), never 0."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
    return float((h >> 12) or 1)


class Table:
    """The mapped table and its lock (``fcntl`` on the file, and a thread lock); private without a file."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self._tlock = threading.Lock()
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self.locks: _owners.SlotLocks | None = None  # owners' liveness by lock (None: by pid)
        if path is None:
            self.v = cast(Slots, memoryview(bytearray(SIZE * 8)).cast("d"))
            self._init()
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise PermissionError(f"{path} is not a file of this user's only")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size != SIZE * 8:
                    os.ftruncate(fd, 0)  # another layout, or a file cut short: start afresh
                    os.ftruncate(fd, SIZE * 8)
                self._mm = mmap.mmap(fd, SIZE * 8)
                self.v = cast(Slots, memoryview(self._mm).cast("d"))
                if self.v[0] != _MAGIC or self.v[1] != _VERSION or self.v[2] != SIZE:
                    self._init()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        with contextlib.suppress(OSError):
            self.locks = _owners.SlotLocks(path + ".owners")

    def owner_gone(self, o: int, pid: int, since: float) -> bool:
        """Whether the owner in entry ``o`` has exited: by its lock, else by pid and start time."""
        if self.locks is not None:
            return self.locks.gone((o - _OWNERS0) // O_FIELDS)
        return not _owners.alive(pid, since)

    def _init(self) -> None:
        v = self.v
        for i in range(SIZE):
            v[i] = 0.0
        v[0], v[1], v[2] = _MAGIC, _VERSION, float(SIZE)

    @contextlib.contextmanager
    def locked(self) -> Iterator[Slots]:
        with self._tlock:
            if self._fd < 0:
                yield self.v
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self.v
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def shared(self) -> bool:
        return self._fd >= 0

    def sweep(self, v: Slots, now: float, *, thorough: bool = False) -> None:
        """Clear the owners that are gone and the stores no live owner used for ``IDLE_S`` (locked).
        Owners that wrote lately are taken to be alive unless ``thorough``."""
        used: set[int] = set()
        for o in range(_OWNERS0, _OWNERS0 + OWNERS * O_FIELDS, O_FIELDS):
            pid = int(v[o + O_PID])
            if not pid:
                continue
            stale = thorough or now - v[o + O_BEAT] > BEAT_S
            if pid != _process.pid() and stale and self.owner_gone(o, pid, v[o + O_START]):
                for f in range(O_FIELDS):
                    v[o + f] = 0.0
                continue
            used.add(int(v[o + O_KEY]))
        for k in range(STORES):
            b = _HEAD + k * K_FIELDS
            if v[b + K_ID] and k + 1 not in used and now - v[b + K_ACTIVE] > IDLE_S:
                for f in range(K_FIELDS):
                    v[b + f] = 0.0


def _open_node_table() -> Table:
    directory = shm.user_dir()
    if directory is not None:
        with contextlib.suppress(OSError):
            return Table(os.path.join(directory, "throttle-v1.bin"))
    return Table(None)  # nothing shared, nothing lost: this process keeps its own


_node: _process.PerProcess[Table] = _process.PerProcess(_open_node_table)


def node_table() -> Table:
    """This process's handle on the node's table (opened anew in each process)."""
    return _node.get()


def _accepted(v: Slots, b: int, now: float, ring: int, *, recent: bool = False) -> float:
    return _counted(v, b, now, ring, recent=recent)[0]


def _counted(v: Slots, b: int, now: float, ring: int, *, recent: bool = False) -> tuple[float, float]:
    """Requests per second counted in ``ring`` over the last second, or since the store's requests
    began after a pause (at least ``_MIN_SPAN_S``), and how many that was. ``recent``: over the
    shortest stretch back from now that holds ``_RECENT_N`` of them and spans ``_RECENT_S`` (a rate
    that is climbing is not averaged with where it was a second ago)."""
    bn = math.floor(now / _RING_S)
    begun = now - v[b + K_SINCE]
    n, span = 0.0, now - bn * _RING_S  # the current tenth, partly gone
    for age in range(_RING):
        i = (bn - age) % _RING
        if v[b + K_STAMPS + i] == bn - age:
            n += v[b + ring + i]
        if age:
            span += _RING_S
        if recent and span >= _RECENT_S and n >= _RECENT_N:
            break
    # A rate from the first milliseconds of a burst is an overestimate, which the next decrease
    # corrects; an underestimate would take seconds to grow out of.
    return n / max(min(span, begun), _MIN_SPAN_S), n


def allowed(v: Slots, b: int, now: float) -> float:
    """The requests per second the node may send to store slot ``b`` now (``inf``: no limit)."""
    limit = v[b + K_LIMIT]
    if limit <= 0.0:
        return math.inf
    t = now - v[b + K_TDEC]
    back = (1.0 - BETA) / GAIN
    rate = limit * (BETA + GAIN * t) if t < back else limit * 2.0 ** min((t - back) / DOUBLING_S, 60.0)
    return max(MIN_RATE, min(rate, max(limit, 2.0 * _accepted(v, b, now, K_OK_RING))))


class Limit:
    """One process's handle on one store's controller: admission tokens, what the store answered.

    Methods other than :meth:`open`, :meth:`paused_until` and :meth:`last_ok` take the table's lock.
    """

    def __init__(self, table: Table, ident: float) -> None:
        self.table = table
        self.ident = ident
        self.base = -1  # this store's first slot in the table
        self.owner = -1  # this process's owner entry, if the table had room
        self.inflight = 0  # this process's requests in flight to the store (kept by the caller)
        self.rate_now = 0.0  # the allowed rate at the last sync (requests/s; 0: no limit)
        self._ok = 0  # answers not yet counted in the table
        self._sent = 0
        self._synced = 0.0
        self._swept = 0.0
        with table.locked() as v:
            now = time.monotonic()
            table.sweep(v, now, thorough=True)  # a process joins once per store: look at every owner
            self._join(v, now)

    def _join(self, v: Slots, now: float) -> None:
        """Find (or claim) this store's slot and an owner entry (locked)."""
        free = -1
        for k in range(STORES):
            b = _HEAD + k * K_FIELDS
            if v[b + K_ID] == self.ident:
                self.base = b
                break
            if free < 0 and not v[b + K_ID]:
                free = b
        else:
            if free < 0:
                self.table.sweep(v, now)
                free = next((_HEAD + k * K_FIELDS for k in range(STORES) if not v[_HEAD + k * K_FIELDS]), -1)
            if free < 0:  # every slot in use: the store idle the longest is forgotten
                free = min((_HEAD + k * K_FIELDS for k in range(STORES)), key=lambda b: v[b + K_ACTIVE])
            for f in range(K_FIELDS):
                v[free + f] = 0.0
            self.base = free
            v[free + K_ID], v[free + K_SINCE], v[free + K_ACTIVE] = self.ident, now, now
        key = float((self.base - _HEAD) // K_FIELDS + 1)
        pid = _process.pid()
        entries = range(_OWNERS0, _OWNERS0 + OWNERS * O_FIELDS, O_FIELDS)
        mine = [o for o in entries if int(v[o + O_PID]) == pid and v[o + O_KEY] == key]
        free_owner = mine or [o for o in entries if not v[o + O_PID]]
        locks = self.table.locks
        if locks is not None:  # an entry whose lock a live process still holds is not free
            free_owner = [o for o in free_owner[:8] if locks.claim((o - _OWNERS0) // O_FIELDS)][:1]
        self.owner = free_owner[0] if free_owner else -1  # no room: the store works, unowned
        if self.owner >= 0:
            o = self.owner
            v[o + O_PID], v[o + O_START], v[o + O_KEY], v[o + O_BEAT] = pid, _owners.started(pid), key, now

    def _mine(self, v: Slots, now: float) -> int:
        """This store's slot, claimed again if it was swept while this process was away (locked)."""
        if v[self.base + K_ID] != self.ident or (
            self.owner >= 0 and int(v[self.owner + O_PID]) != _process.pid()
        ):
            self._join(v, now)
        return self.base

    # -- read without the lock (a float read from the mapping; a stale value is corrected next time)
    def open(self, now: float) -> bool:
        """No limit and no pause: a request may go now without a token."""
        v, b = self.table.v, self.base
        return v[b + K_LIMIT] <= 0.0 and v[b + K_PAUSE] <= now and v[b + K_ID] == self.ident

    def started_up(self) -> bool:
        """Whether this store is past its slow start on this node (no in-flight window applies)."""
        return self.table.v[self.base + K_OPEN] > 0.0

    def end_start(self) -> None:
        """The slow start reached ``OPEN_WINDOW`` without throttling: the store is open to the node."""
        with self.table.locked() as v:
            v[self._mine(v, time.monotonic()) + K_OPEN] = 1.0

    def paused_until(self) -> float:
        return self.table.v[self.base + K_PAUSE]

    def last_ok(self) -> float:
        """When the store last accepted a request of this node (``time.monotonic()``; 0.0: never)."""
        return self.table.v[self.base + K_LAST_OK]

    # -- under the lock
    def _flush(self, v: Slots, b: int, now: float) -> None:
        bn = math.floor(now / _RING_S)
        i = bn % _RING
        if v[b + K_STAMPS + i] != bn:
            v[b + K_STAMPS + i], v[b + K_OK_RING + i], v[b + K_SENT_RING + i] = bn, 0.0, 0.0
        v[b + K_OK_RING + i] += self._ok
        v[b + K_SENT_RING + i] += self._sent
        v[b + K_OK] += self._ok
        if self._ok:
            v[b + K_LAST_OK] = now
        if now - v[b + K_ACTIVE] > _RING_S * _RING:
            v[b + K_SINCE] = now  # requests begin again after a pause: rates count from now
        v[b + K_ACTIVE] = now
        self._ok = self._sent = 0
        if self.owner >= 0:
            v[self.owner + O_BEAT], v[self.owner + O_INFLIGHT] = now, self.inflight
        self._synced = now
        if now - self._swept > SWEEP_S:
            self._swept = now
            self.table.sweep(v, now)
            b = self._mine(v, now)
        limit = v[b + K_LIMIT]
        if limit > 0.0 and now - v[b + K_TDEC] > RECOVER_S:
            v[b + K_LIMIT] = 0.0  # no throttling for long: the store takes what is sent, unlimited again
        rate = allowed(v, b, now)
        self.rate_now = 0.0 if rate == math.inf else rate

    def sent(self, now: float) -> bool:
        """A request goes to the store now. Whether counts wait to be written (call :meth:`sync`
        within ``SYNC_S``)."""
        self._sent += 1
        if now - self._synced > SYNC_S:
            self.sync(now)
        return bool(self._sent or self._ok)

    def accepted(self, now: float) -> bool:
        """The store answered a request (with data, or any answer but throttling). As :meth:`sent`."""
        self._ok += 1
        if now - self._synced > SYNC_S:
            self.sync(now)
        return bool(self._sent or self._ok)

    def sync(self, now: float) -> None:
        """Write this process's counts and in-flight requests to the table."""
        with self.table.locked() as v:
            self._flush(v, self._mine(v, now), now)

    def take(self, n: int, now: float) -> tuple[int, float]:
        """Up to ``n`` tokens now: how many were granted, and in how many seconds the next one comes."""
        with self.table.locked() as v:
            b = self._mine(v, now)
            self._flush(v, b, now)
            pause = v[b + K_PAUSE]
            if pause > now:
                return 0, pause - now
            rate = allowed(v, b, now)
            if rate == math.inf:
                return n, 0.0
            tokens = min(max(1.0, rate * BURST_S), v[b + K_TOKENS] + max(0.0, now - v[b + K_TTOK]) * rate)
            granted = min(n, int(tokens))
            tokens -= granted
            v[b + K_TOKENS], v[b + K_TTOK] = tokens, now
            return granted, 0.0 if granted == n else (1.0 - tokens) / rate

    def throttled(self, sent_at: float, pause_s: float, now: float) -> bool:
        """The store throttled a request sent at ``sent_at``; pause the node's requests ``pause_s``
        seconds (its Retry-After, capped by the caller). Whether the allowed rate went down."""
        with self.table.locked() as v:
            b = self._mine(v, now)
            self._flush(v, b, now)
            v[b + K_THROTTLED] += 1
            v[b + K_OPEN] = 1.0  # no slow start from now on: the rate is the controller's
            if pause_s > 0.0:
                v[b + K_PAUSE] = max(v[b + K_PAUSE], now + pause_s)
            limit = v[b + K_LIMIT]
            if limit > 0.0 and sent_at < v[b + K_TDEC] + max(HOLD_S, HOLD_REQUESTS / allowed(v, b, now)):
                return False  # sent before the last decrease, or just after: the same congestion
            base, seen = _counted(v, b, now, K_OK_RING, recent=True)
            if limit <= 0.0 and seen < _RECENT_N:
                # The first throttling, too few answers counted yet (the node's first burst, or
                # processes that have not written theirs): what was sent, an overestimate the next
                # decrease corrects, rather than an underestimate that takes seconds to grow out of.
                base = max(base, _accepted(v, b, now, K_SENT_RING, recent=True))
            v[b + K_LIMIT] = max(MIN_RATE, min(allowed(v, b, now), base or MIN_RATE))
            v[b + K_TDEC] = now
            v[b + K_EPOCH] += 1
            v[b + K_TOKENS], v[b + K_TTOK] = 0.0, now
            self.rate_now = allowed(v, b, now)
            return True

    def leave(self) -> None:
        """Give up this process's owner entry (the store's state stays for the others)."""
        with self.table.locked() as v:
            if self.owner >= 0 and int(v[self.owner + O_PID]) == _process.pid():
                for f in range(O_FIELDS):
                    v[self.owner + f] = 0.0
                if self.table.locks is not None:
                    self.table.locks.release((self.owner - _OWNERS0) // O_FIELDS)
            self.owner = -1

    def snapshot(self, now: float) -> dict[str, float]:
        """The store's controller now: ``rate_limit`` (requests/s allowed; 0: none), ``limit``,
        ``accepted_per_s``, ``throttled`` (answers, node-wide, since the store was first seen),
        ``owners`` (live processes using it) and ``inflight`` (their requests in flight)."""
        with self.table.locked() as v:
            b = self._mine(v, now)
            self._flush(v, b, now)
            key = float((b - _HEAD) // K_FIELDS + 1)
            owners = [o for o in range(_OWNERS0, _OWNERS0 + OWNERS * O_FIELDS, O_FIELDS)
                      if v[o + O_PID] and v[o + O_KEY] == key]  # fmt: skip
            rate = allowed(v, b, now)
            return {
                "rate_limit": 0.0 if rate == math.inf else rate,
                "limit": v[b + K_LIMIT],
                "accepted_per_s": _accepted(v, b, now, K_OK_RING),
                "throttled": v[b + K_THROTTLED],
                "owners": float(len(owners)),
                "inflight": sum(v[o + O_INFLIGHT] for o in owners),
            }

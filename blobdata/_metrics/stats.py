"""Live statistics of the input pipeline, summed over a loader's processes: is data loading the bottleneck?

Each process that serves samples (a DataLoader worker, or the training process with ``num_workers=0``)
counts into one fixed-size record of float64 slots: samples served and where their bytes came from,
bytes, GETs with a log-bucket latency histogram, retries by cause, and the seconds spent waiting for
bytes, reading the cache, decoding, transforming and collating. Once the process works for a loader
(:func:`attach`), its record is a file in the loader's plan-channel directory (``/dev/shm``, mode 0700)
mapped into memory, so an update is a plain store into shared memory: no publishing step, no lag, and
nothing lost when a worker exits. The training process sums every record of the directory on
``loader.stats()``: fork, spawn and forkserver workers, persistent or not, and ``num_workers=0`` alike.
A record is raw native float64 with a magic number and its size first; a file that does not match is
ignored (nothing read back is ever unpickled).

The sums become a :class:`~blobdata.LoaderStats` in :mod:`.report`. Updates cost a few hundred
nanoseconds per sample (``benchmarks/bench_stats.py`` measures them against
the per-sample work). Each slot has one writer thread per process: the loop thread counts fetches and
cache reads, the worker's thread counts decode, transform and collate.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import numpy as np

from .. import _process

__all__ = [
    "Slots", "TimedCollate", "Records", "attach", "for_next_epoch", "next_epoch", "note_inflight",
    "note_peer", "note_rate_limit", "note_throttled", "rec",
]  # fmt: skip

log = logging.getLogger("blobdata")

# -- the record's layout ---------------------------------------------------------------------------
_MAGIC = 6.02214e23 + 14.0  # slot 0: marks a blobdata stats record
(
    SERVED, FROM_CACHE, FROM_BUCKET, STAGED, ERRORS, BATCHES, BYTES_BUCKET, BYTES_CACHE, GETS, GET_S,
    R_THROTTLE, R_SERVER, R_TIMEOUT, R_CONNECTION, R_SHORT_READ, R_OTHER,
    FETCH_WAIT_S, CACHE_S, DECODE_S, TRANSFORM_S, COLLATE_S, CACHE_STORED, CACHE_DROPPED,
    DEVICE_DECODED, DEVICE_REFUSED, WORKER_DECODED, THROTTLED, INFLIGHT, INFLIGHT_S, RATE_LIMIT,
    BUILT_AHEAD,
) = range(2, 33)  # fmt: skip
#: Gauges (a value now, not a count): a record of an exited process adds 0; the rate limit is a maximum.
_GAUGES = (INFLIGHT, RATE_LIMIT)
_RETRY_SLOT = {
    "throttle": R_THROTTLE, "server": R_SERVER, "timeout": R_TIMEOUT, "connection": R_CONNECTION,
    "short_read": R_SHORT_READ,
}  # fmt: skip
_HIST0 = 33
#: GET latency histogram: 4 buckets per octave from 10 us; the last bucket holds everything above ~170 s.
_BUCKETS = 96
_BASE_S = 1e-5
#: What the thread that serves batches counts itself, once per batch (reads made without the loop: cache
#: hits looked up per batch, local files): slots of their own, so that each slot keeps one writer thread,
#: folded into the loop thread's counterparts when records are summed (:data:`_FOLDED`).
(B_FROM_CACHE, B_BYTES_CACHE, B_CACHE_S, B_FROM_BUCKET, B_BYTES_BUCKET, B_CACHE_DROPPED) = range(
    _HIST0 + _BUCKETS, _HIST0 + _BUCKETS + 6
)
#: Objects read for the next epoch before it began (its first batches: staged across the epoch's end,
#: built ahead, handed over to new workers), from the cache and from the bucket: counted apart, so that
#: an epoch's hit rate and reads are its own (:func:`for_next_epoch`).
(N_FROM_CACHE, N_FROM_BUCKET) = range(_HIST0 + _BUCKETS + 6, _HIST0 + _BUCKETS + 8)
#: Peers (:mod:`blobdata._peers`), on the loop thread. Asking: objects read from another node's cache
#: (for this epoch, for the next), their bytes and seconds, reads that went to the bucket instead (the
#: peer down, busy, refusing or wrong), bucket reads started because a peer was slow (hedged), answers
#: refused as wrong. Serving (this process runs its node's service): answers given, their bytes, objects
#: read from the bucket for them, requests refused.
(
    FROM_PEER, N_FROM_PEER, BYTES_PEER, PEER_S, PEER_FALLBACK, PEER_HEDGED, PEER_WRONG,
    PEER_SERVED, PEER_SERVED_BYTES, PEER_SERVED_FETCHED, PEER_REFUSED,
) = range(_HIST0 + _BUCKETS + 8, _HIST0 + _BUCKETS + 19)  # fmt: skip
#: Peer answer latency histogram: 2 buckets per octave from 100 us (the last: above ~6.5 s).
_PHIST0, _PBUCKETS, _PBASE_S = _HIST0 + _BUCKETS + 19, 32, 1e-4
_FOLDED = (
    (B_FROM_CACHE, FROM_CACHE), (B_BYTES_CACHE, BYTES_CACHE), (B_CACHE_S, CACHE_S),
    (B_FROM_BUCKET, FROM_BUCKET), (B_BYTES_BUCKET, BYTES_BUCKET), (B_CACHE_DROPPED, CACHE_DROPPED),
)  # fmt: skip
SIZE = _PHIST0 + _PBUCKETS  # slots (8 bytes each); slot 1 holds SIZE, a layout check

#: Set while reads for the next epoch are started (tasks made in this context inherit it).
_next_epoch: contextvars.ContextVar[bool] = contextvars.ContextVar("blobdata_next_epoch", default=False)


@contextlib.contextmanager
def for_next_epoch() -> Iterator[None]:
    """Reads started inside are the next epoch's (counted in ``read_for_next_epoch``, not this epoch's)."""
    token = _next_epoch.set(True)
    try:
        yield
    finally:
        _next_epoch.reset(token)


def next_epoch() -> bool:
    """Whether the read running now is for the next epoch (:func:`for_next_epoch`)."""
    return _next_epoch.get()


class Slots(Protocol):
    """A record's float64 slots (a ``memoryview`` cast to ``"d"``)."""

    def __getitem__(self, i: int, /) -> float: ...
    def __setitem__(self, i: int, value: float, /) -> None: ...


def _fresh() -> Slots:
    v = cast(Slots, memoryview(bytearray(SIZE * 8)).cast("d"))
    v[0], v[1] = _MAGIC, float(SIZE)
    return v


class _Record:
    """This process's record: private until :func:`attach` maps it into a loader's directory."""

    def __init__(self) -> None:
        self.v = _fresh()
        self.directory: str | None = None  # the view keeps its mapping alive; unmapped once unused


_rec = _Record()


#: This process's requests in flight, and when that number last changed (``time.monotonic()``).
_inflight = [0.0, 0.0]


def _forget_in_child() -> None:
    # A forked child starts from zero and never writes into its parent's record.
    global _rec
    _process.orphan(_rec)
    _rec = _Record()
    _inflight[:] = [0.0, 0.0]


_process.at_fork(after_in_child=_forget_in_child)


def rec() -> Slots:
    """This process's counters (index with the slot constants; ``v[SERVED] += n``)."""
    return _rec.v


def attach(directory: str) -> None:
    """Count this process's work from now on in a new record file in ``directory`` (a loader's plan
    channel). Counts made before stay where they were: a loader's stats are its own processes' work."""
    r = _rec
    if r.directory == directory:
        return
    path = os.path.join(directory, f"stats-{_process.pid()}-{uuid.uuid4().hex[:8]}.bin")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, SIZE * 8)
            mm = mmap.mmap(fd, SIZE * 8)
        finally:
            os.close(fd)
    except OSError as exc:  # a directory gone or full: keep counting privately
        log.debug("blobdata: stats record in %s unavailable: %s", directory, exc)
        return
    v = cast(Slots, memoryview(mm).cast("d"))
    v[0], v[1] = _MAGIC, float(SIZE)
    v[INFLIGHT], v[RATE_LIMIT] = _inflight[0], r.v[RATE_LIMIT]
    r.v, r.directory = v, directory


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


class Records:
    """The records in one loader's directory, summed on demand (in the process that made the loader).

    A record of a process that has exited is folded into a running sum and its file removed, so that
    non-persistent workers (new processes each epoch) do not pile up files over a long run.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._retired = np.zeros(SIZE, dtype=np.float64)

    def total(self) -> np.ndarray:
        """The sum of every valid record, those of exited processes included."""
        total: np.ndarray = self._retired.copy()
        try:
            names = os.listdir(self.directory)
        except OSError:
            return total
        for name in names:
            parts = name.split("-")
            if not (name.endswith(".bin") and len(parts) == 3 and parts[0] == "stats" and parts[1].isdigit()):
                continue
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as fh:
                    data = fh.read(SIZE * 8 + 1)
            except OSError:
                continue
            if len(data) != SIZE * 8:
                continue
            arr = np.frombuffer(data, dtype=np.float64)
            if arr[0] != _MAGIC or arr[1] != SIZE:
                continue
            pid = int(parts[1])
            dead = pid != _process.pid() and not _alive(pid)
            if dead:
                arr = arr.copy()
                arr[list(_GAUGES)] = 0.0  # nothing in flight, no limit seen: it is gone
            rate_limit = max(total[RATE_LIMIT], arr[RATE_LIMIT])
            total[2:] += arr[2:]
            total[RATE_LIMIT] = rate_limit
            if dead:  # it writes no more: fold it in
                try:
                    os.unlink(path)
                except OSError:
                    continue
                self._retired[2:] += arr[2:]
        return total


# -- hooks called on the data path -------------------------------------------------------------------
def note_get(seconds: float, nbytes: int) -> None:
    """One GET answered in ``seconds`` with ``nbytes`` of body (called on the loop thread)."""
    v = _rec.v
    v[GETS] += 1
    v[GET_S] += seconds
    v[BYTES_BUCKET] += nbytes
    b = int(math.log2(seconds / _BASE_S) * 4) if seconds > _BASE_S else 0
    v[_HIST0 + min(b, _BUCKETS - 1)] += 1


def note_peer(seconds: float, nbytes: int) -> None:
    """A peer answered a read in ``seconds`` with ``nbytes`` accepted (called on the loop thread)."""
    v = _rec.v
    v[PEER_S] += seconds
    v[BYTES_PEER] += nbytes
    b = int(math.log2(seconds / _PBASE_S) * 2) if seconds > _PBASE_S else 0
    v[_PHIST0 + min(b, _PBUCKETS - 1)] += 1


def note_retry(kind: str) -> None:
    """A transient failure of ``kind`` that will be retried (called on the loop thread)."""
    _rec.v[_RETRY_SLOT.get(kind, R_OTHER)] += 1


def note_throttled() -> None:
    """The store answered a request with throttling (429, 503 SlowDown / ServerBusy)."""
    _rec.v[THROTTLED] += 1


def note_inflight(delta: int, now: float) -> None:
    """``delta`` requests started (+) or ended (-) at ``now`` (``time.monotonic()``; loop thread)."""
    v, state = _rec.v, _inflight
    if state[0]:
        v[INFLIGHT_S] += state[0] * (now - state[1])
    state[0] += delta
    state[1] = now
    v[INFLIGHT] = state[0]


def note_rate_limit(rate: float) -> None:
    """The request rate (per second) the node's throttle controller allows now; 0: no limit."""
    _rec.v[RATE_LIMIT] = rate


class TimedCollate:
    """Wraps the loader's ``collate_fn`` to count its seconds (in the worker that collates)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn: Callable[[Any], Any] = fn.fn if isinstance(fn, TimedCollate) else fn

    def __call__(self, batch: Any) -> Any:
        t = time.perf_counter()
        out = self.fn(batch)
        _rec.v[COLLATE_S] += time.perf_counter() - t
        return out


# -- the snapshot ------------------------------------------------------------------------------------

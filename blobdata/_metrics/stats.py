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

Updates cost a few hundred nanoseconds per sample (``benchmarks/bench_stats.py`` measures them against
the per-sample work). Each slot has one writer thread per process: the loop thread counts fetches and
cache reads, the worker's thread counts decode, transform and collate.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import mmap
import os
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np

from .. import _process

__all__ = [
    "LoaderStats", "Slots", "TimedCollate", "Records", "attach", "note_inflight", "note_rate_limit",
    "note_throttled", "rec", "stages", "throttle_bound", "verdict",
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
_FOLDED = (
    (B_FROM_CACHE, FROM_CACHE), (B_BYTES_CACHE, BYTES_CACHE), (B_CACHE_S, CACHE_S),
    (B_FROM_BUCKET, FROM_BUCKET), (B_BYTES_BUCKET, BYTES_BUCKET), (B_CACHE_DROPPED, CACHE_DROPPED),
)  # fmt: skip
SIZE = _HIST0 + _BUCKETS + 6  # slots (8 bytes each); slot 1 holds SIZE, a layout check


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
def _quantile(hist: np.ndarray, q: float) -> float:
    n = float(hist.sum())
    if n <= 0:
        return 0.0
    b = int(np.searchsorted(np.cumsum(hist), q * n))
    return _BASE_S * 2 ** ((min(b, _BUCKETS - 1) + 0.5) / 4)  # the bucket's geometric middle


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """What a :class:`~blobdata.BlobLoader` did, summed over the training process and its workers.

    Counts are totals since the loader was made; ``*_per_sample`` are seconds per served sample, spent
    in a worker; ``loop_wait_s`` is the time the training loop spent in ``next()`` waiting for batches
    (worker start-up included), out of ``elapsed_s`` spent iterating. ``samples_from_cache +
    samples_from_bucket`` is the samples whose bytes were read (equal to ``samples`` after whole epochs
    with no bad sample); ``samples_staged`` of them had been fetched ahead. ``batches_built_ahead`` is
    the batches a persistent worker had made while idle at an epoch's end (its first of the next
    epoch, see :mod:`blobdata._dataset.ahead`). ``hit_rate`` is the cache's
    share of those reads. ``cache_writes`` is the objects the loader's processes put in the cache;
    ``cache_writes_dropped`` those they fetched but did not cache because the cache's background
    writer had ``max_bytes`` queued already (the disk or the index was slower than the fetches; such
    objects are fetched from the bucket again next epoch). GET latencies (seconds) come from a
    histogram with 19% wide buckets. On the device path (``device=``), ``device_decoded`` is the
    samples the device's decoder decoded, ``device_refused`` the JPEGs it was given but returned
    nothing for (decoded with Pillow in the training process instead: slow; a warning says so past a
    threshold), and ``worker_decoded`` the samples the workers decoded on the CPU because the GPU
    decoders do not take them (PNG, CMYK, 12-bit or arithmetic-coded JPEGs). ``throttled`` is the
    requests the store answered with throttling
    (``throttled_share`` of those answered); ``concurrency`` the requests in flight now, and
    ``concurrency_mean`` on average while iterating; ``rate_limit`` the requests/s the node's throttle
    controller allows the store now (0: no limit; see :mod:`blobdata._fetch.throttle`).
    :meth:`as_dict` gives the flat ``{name: number}`` that TensorBoard, Lightning or Prometheus take.
    """

    samples: int = 0
    samples_from_cache: int = 0
    samples_from_bucket: int = 0
    samples_staged: int = 0
    errors_skipped: int = 0
    batches: int = 0
    batches_built_ahead: int = 0
    bytes_from_bucket: int = 0
    bytes_from_cache: int = 0
    hit_rate: float = 0.0
    gets: int = 0
    get_mean_s: float = 0.0
    get_p50_s: float = 0.0
    get_p99_s: float = 0.0
    retries: int = 0
    retries_throttle: int = 0
    retries_server: int = 0
    retries_timeout: int = 0
    retries_connection: int = 0
    retries_short_read: int = 0
    throttled: int = 0
    throttled_share: float = 0.0
    concurrency: float = 0.0
    concurrency_mean: float = 0.0
    rate_limit: float = 0.0
    cache_writes: int = 0
    cache_writes_dropped: int = 0
    device_decoded: int = 0
    device_refused: int = 0
    worker_decoded: int = 0
    fetch_wait_s_per_sample: float = 0.0
    cache_s_per_sample: float = 0.0
    decode_s_per_sample: float = 0.0
    transform_s_per_sample: float = 0.0
    collate_s_per_sample: float = 0.0
    loop_wait_s: float = 0.0
    loop_batches: int = 0
    elapsed_s: float = 0.0
    wait_fraction: float = 0.0
    samples_per_s: float = 0.0
    bucket_bytes_per_s: float = 0.0

    @classmethod
    def from_totals(
        cls,
        t: np.ndarray,
        *,
        loop_wait_s: float,
        loop_batches: int,
        elapsed_s: float,
        now: np.ndarray | None = None,
    ) -> LoaderStats:
        """Build a snapshot from a record sum (:meth:`Records.total`, or a difference of two; then
        ``now`` is the latest sum, whose gauges are the current ones)."""
        gauges = t if now is None else now
        t = t.copy()
        for batch_slot, slot in _FOLDED:
            t[slot] += t[batch_slot]
        answered = t[GETS] + t[THROTTLED]
        served = int(t[SERVED])
        reads = t[FROM_CACHE] + t[FROM_BUCKET]
        per = 1.0 / served if served else 0.0
        retries = [int(t[i]) for i in (R_THROTTLE, R_SERVER, R_TIMEOUT, R_CONNECTION, R_SHORT_READ, R_OTHER)]
        hist = t[_HIST0 : _HIST0 + _BUCKETS]
        return cls(
            samples=served,
            samples_from_cache=int(t[FROM_CACHE]),
            samples_from_bucket=int(t[FROM_BUCKET]),
            samples_staged=int(t[STAGED]),
            errors_skipped=int(t[ERRORS]),
            batches=int(t[BATCHES]),
            batches_built_ahead=int(t[BUILT_AHEAD]),
            bytes_from_bucket=int(t[BYTES_BUCKET]),
            bytes_from_cache=int(t[BYTES_CACHE]),
            hit_rate=float(t[FROM_CACHE] / reads) if reads else 0.0,
            gets=int(t[GETS]),
            get_mean_s=float(t[GET_S] / t[GETS]) if t[GETS] else 0.0,
            get_p50_s=_quantile(hist, 0.5),
            get_p99_s=_quantile(hist, 0.99),
            retries=sum(retries),
            retries_throttle=retries[0],
            retries_server=retries[1],
            retries_timeout=retries[2],
            retries_connection=retries[3],
            retries_short_read=retries[4],
            throttled=int(t[THROTTLED]),
            throttled_share=float(t[THROTTLED] / answered) if answered else 0.0,
            concurrency=float(gauges[INFLIGHT]),
            concurrency_mean=float(t[INFLIGHT_S]) / elapsed_s if elapsed_s > 0 else 0.0,
            rate_limit=float(gauges[RATE_LIMIT]),
            cache_writes=int(t[CACHE_STORED]),
            cache_writes_dropped=int(t[CACHE_DROPPED]),
            device_decoded=int(t[DEVICE_DECODED]),
            device_refused=int(t[DEVICE_REFUSED]),
            worker_decoded=int(t[WORKER_DECODED]),
            fetch_wait_s_per_sample=float(t[FETCH_WAIT_S]) * per,
            cache_s_per_sample=float(t[CACHE_S]) * per,
            decode_s_per_sample=float(t[DECODE_S]) * per,
            transform_s_per_sample=float(t[TRANSFORM_S]) * per,
            collate_s_per_sample=float(t[COLLATE_S]) * per,
            loop_wait_s=loop_wait_s,
            loop_batches=loop_batches,
            elapsed_s=elapsed_s,
            wait_fraction=loop_wait_s / elapsed_s if elapsed_s > 0 else 0.0,
            samples_per_s=served / elapsed_s if elapsed_s > 0 else 0.0,
            bucket_bytes_per_s=float(t[BYTES_BUCKET]) / elapsed_s if elapsed_s > 0 else 0.0,
        )

    def as_dict(self) -> dict[str, float]:
        """Every field as ``{name: number}`` (flat; for ``SummaryWriter.add_scalar``, ``log_dict``...)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _dropped(self) -> str:
        if not self.cache_writes_dropped:
            return ""
        return (
            f", {self.cache_writes_dropped} objects not cached (the cache writer fell behind the "
            "fetches; they are fetched again next epoch)"
        )

    def _throttling(self) -> str:
        if not self.throttled and not self.rate_limit:
            return ""
        limit = f", the node sends at most {self.rate_limit:.0f} GET/s" if self.rate_limit else ""
        return f", {self.throttled} throttled ({self.throttled_share:.0%} of GETs){limit}"

    def _ahead(self) -> str:
        """Why more objects were read than samples served: the look-ahead and the prefetch queue."""
        reads = self.samples_from_cache + self.samples_from_bucket
        parts = []
        if reads > self.samples:
            parts.append(f"{reads} objects read, {reads - self.samples} of them ahead for batches to come")
        if self.batches > self.loop_batches > 0:
            parts.append(f"{self.batches - self.loop_batches} batches made and waiting for the loop")
        return f"; look-ahead: {', '.join(parts)}" if parts else ""

    def summary(self) -> str:
        """One line: samples served (to the training loop's batches) and images/s, hit rate, bucket
        MB/s, GET latency, requests in flight, throttling, retries, skips, how long the loop waited
        and the verdict (what limits it), then what the look-ahead read ahead of the loop: early in an
        epoch more objects are read than samples served, the next batches arriving early."""
        kind, why = verdict(self)
        return (
            f"{self.samples} samples served in {self.elapsed_s:.1f}s ({self.samples_per_s:.0f} img/s), "
            f"hit rate {self.hit_rate:.0%}, bucket {self.bucket_bytes_per_s / 1e6:.1f} MB/s, "
            f"GET p50 {self.get_p50_s * 1e3:.0f} ms p99 {self.get_p99_s * 1e3:.0f} ms, "
            f"{self.concurrency_mean:.1f} in flight on average ({self.concurrency:.0f} now)"
            f"{self._throttling()}, "
            f"{self.retries} retries, {self.errors_skipped} skipped{self._dropped()}; the loop waited "
            f"{self.loop_wait_s:.1f}s ({self.wait_fraction:.0%}): {kind}: {why}{self._ahead()}"
        )


def stages(s: LoaderStats) -> dict[str, float]:
    """Seconds per sample in each worker stage; ``fetch`` is the wait for bytes not hidden by the
    look-ahead (cache reads included)."""
    return {
        "fetch": s.fetch_wait_s_per_sample,
        "decode": s.decode_s_per_sample,
        "transform": s.transform_s_per_sample,
        "collate": s.collate_s_per_sample,
    }


#: The loop waiting more than this share of its time for batches is input-bound.
INPUT_BOUND = 0.1


#: Throttled answers above this share of GETs (or a rate limit in force) mean the store sets the pace.
THROTTLED_SHARE = 0.01


def throttle_bound(s: LoaderStats) -> bool:
    """Whether the store's throttling bounds what the workers get: a limit in force, or throttled answers."""
    return s.rate_limit > 0 or s.throttled_share >= THROTTLED_SHARE


def verdict(s: LoaderStats) -> tuple[str, str]:
    """``("input-bound" | "compute-bound" | "store-throttled", why)`` from the loop's waits, the
    workers' stages and the store's throttling."""
    cost = stages(s)
    top = max(cost, key=lambda k: cost[k])
    per = sum(cost.values())
    if s.wait_fraction <= INPUT_BOUND:
        return "compute-bound", f"batches were ready {1 - s.wait_fraction:.0%} of the time"
    if top == "fetch" and throttle_bound(s):
        return "store-throttled", (
            f"the store throttled {s.throttled} requests ({s.throttled_share:.0%}); the node sent "
            f"{s.gets / s.elapsed_s if s.elapsed_s > 0 else 0.0:.0f} GET/s, what it accepts (ask for a "
            "higher limit, spread the keys over more prefixes, or warm a cache)"
        )
    share = cost[top] / per if per > 0 else 0.0
    where = (
        "waiting for the bucket (raise lookahead or concurrency, or warm a cache)"
        if top == "fetch"
        else f"{top} (add workers if cores are idle)"
    )
    return "input-bound", f"workers spend {share:.0%} of {per * 1e3:.2f} ms per sample in {where}"

"""A loader's statistics as read: :class:`LoaderStats` (a snapshot of the summed records, with the
training loop's clock), its one-line summary, and the verdict (what limits the loop)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from .stats import (
    _BASE_S,
    _BUCKETS,
    _FOLDED,
    _HIST0,
    _PBASE_S,
    _PBUCKETS,
    _PHIST0,
    BATCHES,
    BUILT_AHEAD,
    BYTES_BUCKET,
    BYTES_CACHE,
    BYTES_PEER,
    CACHE_DROPPED,
    CACHE_S,
    CACHE_STORED,
    COLLATE_S,
    DECODE_S,
    DEVICE_DECODED,
    DEVICE_REFUSED,
    ERRORS,
    FETCH_WAIT_S,
    FROM_BUCKET,
    FROM_CACHE,
    FROM_PEER,
    GET_S,
    GETS,
    INFLIGHT,
    INFLIGHT_S,
    N_FROM_BUCKET,
    N_FROM_CACHE,
    N_FROM_PEER,
    PEER_FALLBACK,
    PEER_HEDGED,
    PEER_REFUSED,
    PEER_S,
    PEER_SERVED,
    PEER_SERVED_BYTES,
    PEER_SERVED_FETCHED,
    PEER_WRONG,
    R_CONNECTION,
    R_OTHER,
    R_SERVER,
    R_SHORT_READ,
    R_THROTTLE,
    R_TIMEOUT,
    RATE_LIMIT,
    SERVED,
    STAGED,
    THROTTLED,
    TRANSFORM_S,
    WORKER_DECODED,
)  # fmt: skip

__all__ = [
    "INPUT_BOUND", "THROTTLED_SHARE", "LoaderStats", "limiting_source", "peers_bound", "stages",
    "throttle_bound", "verdict",
]  # fmt: skip


def _quantile(hist: np.ndarray, q: float, base: float = _BASE_S, per_octave: int = 4) -> float:
    n = float(hist.sum())
    if n <= 0:
        return 0.0
    b = int(np.searchsorted(np.cumsum(hist), q * n))
    return base * 2 ** ((min(b, len(hist) - 1) + 0.5) / per_octave)  # the bucket's geometric middle


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """What a :class:`~blobdata.BlobLoader` did, summed over the training process and its workers.

    Counts are totals since the loader was made; ``*_per_sample`` are seconds per served sample, spent
    in a worker; ``loop_wait_s`` is the time the training loop spent in ``next()`` waiting for batches
    (worker start-up included), out of ``elapsed_s`` spent iterating. ``samples`` is the samples of the
    batches the loop received (skipped ones left out); ``samples_made`` the workers' count, which also
    holds the batches made ahead and waiting for the loop (the DataLoader's prefetch).
    ``samples_from_cache + samples_from_peers + samples_from_bucket`` is the objects read for this
    epoch's samples (equal to ``samples`` after whole epochs with no bad sample); ``samples_staged`` of
    them had been fetched ahead, and ``read_for_next_epoch`` objects were read for the next epoch's
    first batches before it began (counted apart, so that an epoch's hit rate is its own).
    ``list_requests`` is the LIST requests the dataset's listing took (0: a remembered listing, or an
    index). ``batches_built_ahead`` is the batches a persistent worker had made while idle at an
    epoch's end (its first of the next epoch, see :mod:`blobdata._dataset.ahead`). ``hit_rate`` is the
    cache's share of those reads. ``cache_writes`` is the objects the loader's processes put in the cache;
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
    With peers (:class:`blobdata.Peers`), ``samples_from_peers`` objects came from another node's cache
    (``bytes_from_peers``; answer latency ``peer_mean_s``, ``peer_p50_s``, ``peer_p99_s``, from a histogram
    with 41% wide buckets), ``peer_fallbacks`` reads went to the bucket instead (the peer down, busy,
    refusing, or wrong: ``peer_wrong`` answers were refused for their bytes or signature), and
    ``peer_hedged`` bucket reads were started because a peer was slower than usual; a process that runs
    its node's service counts what it answered (``peers_served``, ``peers_served_bytes``), the objects
    it read from the bucket for them (``peers_served_fetched``) and the requests it refused
    (``peers_refused``).
    :meth:`as_dict` gives the flat ``{name: number}`` that TensorBoard, Lightning or Prometheus take.

    A :class:`~blobdata.Mixture`'s loader has ``sources``: each source's own figures (a
    ``LoaderStats`` by name: ``samples`` the samples its workers made, bytes, hit rate, GETs and their
    latency, throttling, ``fetch_wait_s_per_sample`` the time batches waited for its samples, decode and
    transform times); :meth:`summary` names the source that limits the loop, and :meth:`as_dict` has
    them as ``"<source>/<field>"``.
    """

    samples: int = 0
    samples_made: int = 0
    read_for_next_epoch: int = 0
    list_requests: int = 0
    samples_from_cache: int = 0
    samples_from_bucket: int = 0
    samples_from_peers: int = 0
    samples_staged: int = 0
    errors_skipped: int = 0
    batches: int = 0
    batches_built_ahead: int = 0
    bytes_from_bucket: int = 0
    bytes_from_cache: int = 0
    bytes_from_peers: int = 0
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
    peer_mean_s: float = 0.0
    peer_p50_s: float = 0.0
    peer_p99_s: float = 0.0
    peer_fallbacks: int = 0
    peer_hedged: int = 0
    peer_wrong: int = 0
    peers_served: int = 0
    peers_served_bytes: int = 0
    peers_served_fetched: int = 0
    peers_refused: int = 0
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
    sources: Mapping[str, LoaderStats] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_totals(
        cls,
        t: np.ndarray,
        *,
        loop_wait_s: float,
        loop_batches: int,
        elapsed_s: float,
        now: np.ndarray | None = None,
        loop_samples: int | None = None,
        list_requests: int = 0,
        sources: Mapping[str, LoaderStats] | None = None,
    ) -> LoaderStats:
        """Build a snapshot from a record sum (:meth:`Records.total`, or a difference of two; then
        ``now`` is the latest sum, whose gauges are the current ones). ``loop_samples``: the samples
        of the batches the loop received (as planned), when known; else the workers' count serves.
        ``list_requests``: the LIST requests the dataset's listing took; ``sources``: a mixture's."""
        gauges = t if now is None else now
        t = t.copy()
        for batch_slot, slot in _FOLDED:
            t[slot] += t[batch_slot]
        answered = t[GETS] + t[THROTTLED]
        made = int(t[SERVED])
        # The loop's own count: samples made ahead (the DataLoader's prefetch) are not yet served.
        served = made if loop_samples is None else max(0, min(made, loop_samples - int(t[ERRORS])))
        reads = t[FROM_CACHE] + t[FROM_BUCKET] + t[FROM_PEER]
        per = 1.0 / served if served else 0.0
        retries = [int(t[i]) for i in (R_THROTTLE, R_SERVER, R_TIMEOUT, R_CONNECTION, R_SHORT_READ, R_OTHER)]
        hist = t[_HIST0 : _HIST0 + _BUCKETS]
        peer_hist = t[_PHIST0 : _PHIST0 + _PBUCKETS]
        answered_by_peers = float(peer_hist.sum())
        return cls(
            samples=served,
            samples_made=made,
            read_for_next_epoch=int(t[N_FROM_CACHE] + t[N_FROM_BUCKET] + t[N_FROM_PEER]),
            list_requests=list_requests,
            samples_from_cache=int(t[FROM_CACHE]),
            samples_from_bucket=int(t[FROM_BUCKET]),
            samples_from_peers=int(t[FROM_PEER]),
            samples_staged=int(t[STAGED]),
            errors_skipped=int(t[ERRORS]),
            batches=int(t[BATCHES]),
            batches_built_ahead=int(t[BUILT_AHEAD]),
            bytes_from_bucket=int(t[BYTES_BUCKET]),
            bytes_from_cache=int(t[BYTES_CACHE]),
            bytes_from_peers=int(t[BYTES_PEER]),
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
            peer_mean_s=float(t[PEER_S]) / answered_by_peers if answered_by_peers else 0.0,
            peer_p50_s=_quantile(peer_hist, 0.5, _PBASE_S, 2),
            peer_p99_s=_quantile(peer_hist, 0.99, _PBASE_S, 2),
            peer_fallbacks=int(t[PEER_FALLBACK]),
            peer_hedged=int(t[PEER_HEDGED]),
            peer_wrong=int(t[PEER_WRONG]),
            peers_served=int(t[PEER_SERVED]),
            peers_served_bytes=int(t[PEER_SERVED_BYTES]),
            peers_served_fetched=int(t[PEER_SERVED_FETCHED]),
            peers_refused=int(t[PEER_REFUSED]),
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
            sources=dict(sources or {}),
        )

    def as_dict(self) -> dict[str, float]:
        """Every field as ``{name: number}`` (flat; for ``SummaryWriter.add_scalar``, ``log_dict``...); a
        mixture's sources' as ``"<source>/<field>"``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}
        for name, part in self.sources.items():
            out.update({f"{name}/{k}": v for k, v in part.as_dict().items()})
        return out

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
        reads = self.samples_from_cache + self.samples_from_bucket + self.samples_from_peers
        parts = []
        if reads > self.samples:
            parts.append(f"{reads} objects read, {reads - self.samples} of them ahead for batches to come")
        if self.read_for_next_epoch:
            parts.append(f"{self.read_for_next_epoch} read for the next epoch's first batches")
        if self.batches > self.loop_batches > 0:
            parts.append(f"{self.batches - self.loop_batches} batches made and waiting for the loop")
        return f"; look-ahead: {', '.join(parts)}" if parts else ""

    def _sources(self) -> str:
        """Where bytes came from, and how fast from the bucket; nothing said of what was not measured."""
        reads = self.samples_from_cache + self.samples_from_bucket + self.samples_from_peers
        parts = [f"hit rate {self.hit_rate:.0%}"] if reads else []
        parts += self._peers()
        if self.bytes_from_bucket:
            parts.append(f"bucket {_rate(self.bucket_bytes_per_s)}")
        elif reads:
            parts.append("nothing from the bucket")
        if self.gets:
            parts.append(f"GET p50 {_ms(self.get_p50_s)} p99 {_ms(self.get_p99_s)}")
        elif self.samples_from_bucket:
            parts.append("no GET (local files)")
        else:
            parts.append("no GET")
        lists = self.list_requests
        parts.append(f"{lists} LIST request{'s' if lists != 1 else ''} to list the dataset")
        return ", ".join(parts)

    def _peers(self) -> list[str]:
        """What the node's peers gave and took, when peers are on."""
        parts = []
        if self.samples_from_peers or self.peer_fallbacks:
            parts.append(
                f"{self.samples_from_peers} from peers (p50 {_ms(self.peer_p50_s)} p99 {_ms(self.peer_p99_s)}"
                + (f", {self.peer_fallbacks} went to the bucket instead" if self.peer_fallbacks else "")
                + (f", {self.peer_wrong} wrong answers refused" if self.peer_wrong else "")
                + ")"
            )
        if self.peers_served or self.peers_refused:
            fetched = (
                f", {self.peers_served_fetched} read from the bucket for them"
                if self.peers_served_fetched
                else ""
            )
            refused = f", {self.peers_refused} requests refused" if self.peers_refused else ""
            parts.append(f"served {self.peers_served} to peers{fetched}{refused}")
        return parts

    def summary(self) -> str:
        """One line: samples served (to the training loop's batches) and images/s, hit rate, bucket
        rate, GET latency, the LIST requests the listing took, requests in flight, throttling, retries,
        skips, how long the loop waited and the verdict (what limits it), then what the look-ahead read
        ahead of the loop: early in an epoch more objects are read than samples served, the next
        batches arriving early. Figures nothing measured (no GET, no byte from the bucket) are left out."""
        kind, why = verdict(self)
        inflight = (
            f", {self.concurrency_mean:.1f} in flight on average ({self.concurrency:.0f} now)"
            if self.gets or self.concurrency
            else ""
        )
        return (
            f"{self.samples} samples served in {self.elapsed_s:.1f}s ({self.samples_per_s:.0f} img/s), "
            f"{self._sources()}{inflight}{self._throttling()}, "
            f"{self.retries} retries, {self.errors_skipped} skipped{self._dropped()}; the loop waited "
            f"{self.loop_wait_s:.1f}s ({self.wait_fraction:.0%}): {kind}: {why}{self._ahead()}"
            f"{self._per_source()}"
        )

    def _per_source(self) -> str:
        """A mixture's sources, each in a few figures, and the one that limits the loop."""
        if not self.sources:
            return ""
        made = sum(p.samples for p in self.sources.values()) or 1
        parts = []
        for name, p in self.sources.items():
            reads = p.samples_from_cache + p.samples_from_bucket
            figures = [f"{p.samples} samples ({p.samples / made:.0%})"]
            if reads:
                figures.append(f"hit rate {p.hit_rate:.0%}")
            if p.gets:
                figures.append(f"GET p50 {_ms(p.get_p50_s)}")
            if p.throttled:
                figures.append(f"{p.throttled} throttled")
            parts.append(f"{name}: {', '.join(figures)}")
        limit = limiting_source(self)
        said = f"; {limit[1]}" if limit is not None else ""
        return f"; sources: {'; '.join(parts)}{said}"


def _rate(bytes_per_s: float) -> str:
    """A byte rate in the unit that shows it (``12 kB/s``, ``3.4 MB/s``, ``1.2 GB/s``)."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


def _ms(seconds: float) -> str:
    """A latency: milliseconds, with a decimal below 10 ms (``0.4 ms``, ``63 ms``)."""
    ms = seconds * 1e3
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


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


def peers_bound(s: LoaderStats) -> bool:
    """Whether the wait for bytes is mostly a wait for peers: their answers took more time in all than
    the bucket's GETs, or a tenth of the reads meant for them went to the bucket."""
    peer_time = s.peer_mean_s * s.samples_from_peers
    asked = s.samples_from_peers + s.peer_fallbacks
    return asked > 0 and (peer_time >= s.get_mean_s * s.gets or s.peer_fallbacks >= 0.1 * asked)


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
    if top == "fetch" and peers_bound(s):
        where = (
            f"waiting for peer nodes (answers p50 {_ms(s.peer_p50_s)} p99 {_ms(s.peer_p99_s)}, "
            f"{s.peer_fallbacks} reads went to the bucket instead: raise lookahead, or look at the peers' "
            "load)"
        )
    elif top == "fetch":
        where = "waiting for the bucket (raise lookahead or concurrency, or warm a cache)"
    else:
        where = f"{top} (add workers if cores are idle)"
    return "input-bound", f"workers spend {share:.0%} of {per * 1e3:.2f} ms per sample in {where}"


def limiting_source(s: LoaderStats) -> tuple[str, str] | None:
    """A mixture's source that limits the loop, and why, in words: input-bound, the one its batches
    waited for longest; compute-bound, the one that takes the most worker time; None without sources."""
    if not s.sources:
        return None
    kind, _ = verdict(s)
    parts = s.sources.items()
    if kind == "compute-bound":
        cost = {n: (p.decode_s_per_sample + p.transform_s_per_sample) * p.samples for n, p in parts}
        name = max(cost, key=lambda n: cost[n])
        return name, f"source {name!r} takes the most worker time ({cost[name]:.1f}s to decode and transform)"
    waits = {n: p.fetch_wait_s_per_sample * p.samples for n, p in parts}
    name = max(waits, key=lambda n: waits[n])
    p = s.sources[name]
    how = [f"GET p50 {_ms(p.get_p50_s)}"] if p.gets else []
    if throttle_bound(p):
        limit = f", at most {p.rate_limit:.0f} GET/s" if p.rate_limit else ""
        how.append(f"{p.throttled} throttled{limit}")
    detail = f"; {', '.join(how)}" if how else ""
    return name, f"the loop is limited by source {name!r} (batches waited {waits[name]:.1f}s for it{detail})"

"""What ``loader.stats()`` says of peers: reads from other nodes' caches, their bytes and latency, reads
that went to the bucket instead, what this node served; the summary says when peers set the pace, and
says nothing of peers when they are off."""

from __future__ import annotations

import re

import numpy as np

from blobdata import LoaderStats
from blobdata._metrics import stats as _stats


def _totals(**slots: float) -> np.ndarray:
    t = np.zeros(_stats.SIZE)
    for name, value in slots.items():
        t[getattr(_stats, name)] = value
    return t


def _peer_answers(t: np.ndarray, seconds: float, n: int) -> None:
    """``n`` peer answers of ``seconds`` and 1000 bytes each, counted into ``t`` by the data path's own
    :func:`blobdata._metrics.stats.note_peer`."""
    saved = _stats._rec.v
    _stats._rec.v = memoryview(t)  # type: ignore[assignment]  # float64 slots, as a record's
    try:
        for _ in range(n):
            _stats.note_peer(seconds, 1000)
    finally:
        _stats._rec.v = saved


def test_a_request_of_several_reads_counts_as_that_many_answers() -> None:
    """The client notes a request's answer once for all its reads: the same counts, latency sum and
    histogram as each read noted alone."""
    alone, together = _totals(), _totals()
    saved = _stats._rec.v
    try:
        for seconds in (0.0004, 0.002, 0.08, 3.0):
            _stats._rec.v = memoryview(alone)  # type: ignore[assignment]
            for _ in range(16):
                _stats.note_peer(seconds, 1000)
            _stats._rec.v = memoryview(together)  # type: ignore[assignment]
            _stats.note_peer(seconds, 16_000, 16)
    finally:
        _stats._rec.v = saved
    assert np.allclose(alone, together) and together[_stats.BYTES_PEER] == 64_000


def test_peer_reads_are_counted_apart_and_summarised() -> None:
    t = _totals(SERVED=1000, BATCHES=10, FROM_CACHE=250, FROM_PEER=740, FROM_BUCKET=10, PEER_FALLBACK=10,
                PEER_HEDGED=4, PEER_WRONG=1, PEER_SERVED=700, PEER_SERVED_BYTES=7e5, PEER_SERVED_FETCHED=3,
                PEER_REFUSED=2, GETS=10, GET_S=0.5, FETCH_WAIT_S=0.1, DECODE_S=2.0)  # fmt: skip
    _peer_answers(t, 0.002, 700)
    _peer_answers(t, 0.080, 40)
    s = LoaderStats.from_totals(t, loop_wait_s=0.1, loop_batches=10, elapsed_s=10.0)
    assert s.samples_from_peers == 740 and s.bytes_from_peers == 740_000
    assert s.hit_rate == 0.25  # the cache's share of every read, peers' included
    assert 0.0015 < s.peer_p50_s < 0.003 and 0.06 < s.peer_p99_s < 0.12
    assert abs(s.peer_mean_s - (700 * 0.002 + 40 * 0.08) / 740) < 1e-9
    assert (s.peer_fallbacks, s.peer_hedged, s.peer_wrong) == (10, 4, 1)
    assert (s.peers_served, s.peers_served_bytes, s.peers_served_fetched, s.peers_refused) == (
        700,
        700_000,
        3,
        2,
    )
    line = s.summary()
    assert re.search(r"740 from peers \(p50 [12]\.\d ms p99 \d+ ms, 10 went to the bucket instead", line)
    assert "1 wrong answers refused" in line
    assert "served 700 to peers, 3 read from the bucket for them, 2 requests refused" in line
    assert "compute-bound" in line
    assert s.as_dict()["samples_from_peers"] == 740


def test_the_summary_says_when_peers_set_the_pace() -> None:
    t = _totals(SERVED=1000, BATCHES=10, FROM_CACHE=250, FROM_PEER=700, FROM_BUCKET=50, PEER_FALLBACK=50,
                GETS=50, GET_S=2.5, FETCH_WAIT_S=9.0, DECODE_S=1.0)  # fmt: skip
    _peer_answers(t, 0.2, 700)
    s = LoaderStats.from_totals(t, loop_wait_s=8.0, loop_batches=10, elapsed_s=10.0)
    assert "input-bound" in s.summary() and "waiting for peer nodes (answers p50" in s.summary()
    assert "50 reads went to the bucket instead" in s.summary()
    # The same wait with the bucket the slower part: the bucket is named, not the peers.
    t2 = _totals(SERVED=1000, BATCHES=10, FROM_CACHE=250, FROM_PEER=700, FROM_BUCKET=50, GETS=50,
                 GET_S=200.0, FETCH_WAIT_S=9.0, DECODE_S=1.0)  # fmt: skip
    _peer_answers(t2, 0.002, 700)
    assert (
        "waiting for the bucket"
        in LoaderStats.from_totals(t2, loop_wait_s=8.0, loop_batches=10, elapsed_s=10.0).summary()
    )


def test_without_peers_the_summary_says_nothing_of_them() -> None:
    t = _totals(SERVED=100, BATCHES=1, FROM_CACHE=50, FROM_BUCKET=50, GETS=50, GET_S=1.0, DECODE_S=0.1)
    s = LoaderStats.from_totals(t, loop_wait_s=0.0, loop_batches=1, elapsed_s=1.0)
    assert "peer" not in s.summary() and s.samples_from_peers == 0 and s.hit_rate == 0.5

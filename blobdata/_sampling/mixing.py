"""A mixture's epoch as an exact plan, in plain numpy: which source each position of the epoch reads,
which of its samples, and which rank reads it (the arithmetic of :class:`~blobdata.MixtureSampler`).

* **Counts.** An epoch of ``N`` samples reads ``c_s`` of source ``s``: the largest-remainder rounding of
  ``w_s / sum(w) * N`` (each source gets the floor of its quota, and the sources with the largest
  remainders one more; ties to the earlier source). Not a random draw: the counts are exact.
* **Draws.** Inside source ``s`` (``n_s`` samples), the epoch reads ``c_s`` draws without replacement
  that cycle one keyed permutation of its samples (fixed by the seed, the epoch and the source's
  name): draw ``t`` is the permutation at ``t mod n_s``, so every sample is read ``floor(c_s / n_s)``
  or ``ceil(c_s / n_s)`` times, and a source read less than its size gives a fresh random subset each
  epoch (MosaicML streaming's choice).
* **Interleave.** Source ``s``'s ``k``-th draw sits at key ``(k + u_s) / c_s``, with a phase ``u_s``
  in ``[0, 1)`` keyed by the seed, the epoch and the source; the epoch is every draw sorted by key
  (stride scheduling). Any run of ``m`` consecutive positions then holds ``m * c_s / N`` draws of
  source ``s`` to within less than the number of sources: a batch's composition follows the weights.
* **Ranks.** ``W`` ranks read the epoch in blocks: rank ``r`` reads positions ``[r*L, (r+1)*L)``
  (``L = ceil(N / W)``, the order padded by repeating its start as ``DistributedSampler`` pads, or
  cut to ``floor(N / W)`` each with ``drop_last``). A block of an even order is even, so every rank's
  batches follow the weights too (dealing round-robin would give rank 0 of 2 only one source of a 1:1
  mix). At any step the ranks together have read the first ``p`` positions of every block.
* **Phases.** A resumed epoch: what each earlier run read (``(W, p)``: ``W`` ranks read ``p`` samples
  each) is left out, and the rest, in order (each block's unread tail, block after block, then a
  ``drop_last`` cut), is dealt to this run's ranks in blocks again: at the same ``W`` exactly the
  uninterrupted run's blocks; at another, each remaining sample once. A phase with other weights plans
  its rest afresh (:func:`remaining`): the same length, counts and interleave by the new weights, each
  source first reading what it had planned and not read, then going on along its draws.

Everything is a function of (seed, epoch, weights, the sources' names and sizes, the phases): the same
on every rank and for any number of workers. The hashes are splitmix64's (:mod:`.keyed`), not numpy's
generators, so a plan does not depend on numpy's version.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from .._errors import ConfigError
from .keyed import permute, round_keys

__all__ = ["Pool", "checked_weights", "deal", "largest_remainder", "remaining", "source_key", "weighted"]

# Salts (shares.py uses 1-4, elastic.py 5): a source's draws, and its phase in the interleave.
_DRAWS, _PHASE = 6, 7

#: A source's samples in a plan: an int ``n`` (samples ``0..n-1``) or an array of them (a node's share).
Pool = int | np.ndarray


def checked_weights(names: Sequence[str], weights: Any) -> tuple[float, ...]:
    """``weights`` (a mapping of every name in ``names`` to a non-negative finite number, not all 0) in
    the order of ``names``; a :class:`ConfigError` naming the source otherwise."""
    if not isinstance(weights, Mapping):
        raise ConfigError(f"weights must map each source's name to a number, got {type(weights).__name__}")
    known = ", ".join(repr(n) for n in names)
    for name in weights:
        if name not in names:
            raise ConfigError(
                f"weights name {name!r}, which is not a source (the sources are {known}): give a weight "
                "to each source by its name"
            )
    out = []
    for name in names:
        if name not in weights:
            raise ConfigError(
                f"source {name!r} has no weight: give every source a weight (0 leaves it out of the mix)"
            )
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise ConfigError(f"the weight of source {name!r} must be a number, got {w!r}")
        if not math.isfinite(float(w)) or float(w) < 0:
            raise ConfigError(
                f"the weight of source {name!r} is {float(w)!r}: weights are finite numbers >= 0 "
                "(0 leaves the source out)"
            )
        out.append(float(w))
    if not any(out):
        raise ConfigError(f"every weight is 0 (sources {known}): give at least one source a positive weight")
    return tuple(out)


def source_key(name: str) -> int:
    """A source's key in the plan's hashes: its name's (stable across processes and runs)."""
    return int.from_bytes(
        hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little"
    )


def largest_remainder(weights: Sequence[float], total: int) -> np.ndarray:
    """``total`` split in proportion to ``weights`` (int64, summing to ``total``): floors of the
    quotas, then one more to the largest remainders (ties to the earlier source). In exact arithmetic
    (each float is a fraction), so that ties are ties on every machine."""
    w = [Fraction(float(x)) for x in weights]
    whole = sum(w)
    quotas = [x * total / whole for x in w]
    counts = [math.floor(q) for q in quotas]
    order = sorted((s for s in range(len(w)) if w[s] > 0), key=lambda s: (counts[s] - quotas[s], s))
    for s in order[: total - sum(counts)]:
        counts[s] += 1
    return np.asarray(counts, dtype=np.int64)


def _phases(seed: int, epoch: int, phase: int, keys: Sequence[int]) -> np.ndarray:
    return np.array(
        [float(round_keys(_PHASE, seed, epoch, phase, k)[0]) / 2.0**64 for k in keys], dtype=np.float64
    )


def _interleave(counts: np.ndarray, phases: np.ndarray) -> np.ndarray:
    """The source of each position (int64) when ``counts[s]`` draws of each are spread evenly."""
    parts = [(np.arange(c, dtype=np.float64) + phases[s]) / c for s, c in enumerate(counts.tolist()) if c]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    keys = np.concatenate(parts)
    sources = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return sources[np.argsort(keys, kind="stable")]


class Draws:
    """Each source's draws of one epoch (global indices), taken in order: draw ``t`` of source ``s`` is
    ``offsets[s] + pool[perm(t mod n)]``; :attr:`taken` counts what a plan took of each."""

    def __init__(
        self, pools: Sequence[Pool], offsets: Sequence[int], keys: Sequence[int], *, seed: int, epoch: int,
        shuffle: bool,
    ) -> None:  # fmt: skip
        self.pools, self.offsets, self.keys = pools, offsets, keys
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.taken = [0] * len(pools)

    def take(self, s: int, count: int) -> np.ndarray:
        pool = self.pools[s]
        n = int(pool) if isinstance(pool, (int, np.integer)) else len(pool)
        pos = np.arange(self.taken[s], self.taken[s] + count, dtype=np.int64) % n
        self.taken[s] += count
        drawn = (
            permute(pos, n, round_keys(_DRAWS, self.seed, self.epoch, self.keys[s])) if self.shuffle else pos
        )
        got = drawn if isinstance(pool, (int, np.integer)) else np.asarray(pool)[drawn]
        return self.offsets[s] + got


def weighted(
    total: int, weights: Sequence[float], draws: Draws, *, phase: int = 0, left: Sequence[np.ndarray] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """A plan of ``total`` positions by ``weights``: (global indices, the source of each). Source ``s``
    reads first ``left[s]`` (what an earlier plan had for it and was not read), then its next draws."""
    counts = largest_remainder(weights, total)
    sources = _interleave(counts, _phases(draws.seed, draws.epoch, phase, draws.keys))
    out = np.empty(total, dtype=np.int64)
    for s, c in enumerate(counts.tolist()):
        if not c:
            continue
        old = left[s][:c] if s < len(left) else np.zeros(0, dtype=np.int64)
        new = draws.take(s, c - len(old)) if c > len(old) else np.zeros(0, dtype=np.int64)
        out[sources == s] = np.concatenate([old, new])
    return out, sources


def deal(n: int, world: int, per_rank: int) -> np.ndarray:
    """Which of ``n`` positions each of ``world`` ranks reads, ``per_rank`` each, in blocks: shape
    ``(world, per_rank)``; more than ``n`` in all repeats the start (padding), fewer leaves the end."""
    return np.arange(world * per_rank, dtype=np.int64).reshape(world, per_rank) % max(n, 1)


def remaining(
    order: np.ndarray, sources: np.ndarray, world: int, per_rank: int, read: int
) -> tuple[np.ndarray, np.ndarray]:
    """What is left of ``order`` (with each position's source) once ``world`` ranks dealt ``per_rank``
    each read ``read`` each: every block's unread tail, block after block, then what the deal left out."""
    blocks = deal(len(order), world, per_rank)
    keep = np.concatenate(
        [blocks[:, min(read, per_rank) :].reshape(-1), np.arange(world * per_rank, len(order))]
    )
    return order[keep], sources[keep]


def per_rank_of(n: int, world: int, drop_last: bool) -> int:
    """Samples per rank when ``world`` ranks read ``n``: ``DistributedSampler``'s count."""
    return n // world if drop_last else math.ceil(n / world)

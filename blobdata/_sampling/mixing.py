"""A mixture's epoch as an exact plan, in plain numpy: which source each position of the epoch reads,
and which of its samples (the arithmetic of :class:`~blobdata.MixtureSampler`).

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
  source ``s`` to within one or two: a batch's composition follows the weights.
* **Segments.** A resumed epoch whose weights changed (:class:`Segment`): the positions already read
  keep their sources and draws; from the resume's position ``m`` on, the ``N - m`` positions left are
  planned as above with the new weights, each source's draws going on from where it stopped. The
  epoch's length is unchanged.

Everything is a function of (seed, epoch, weights, the sources' names and sizes, the segments): the
same on every rank and for any number of workers. The hashes are splitmix64's (:mod:`.keyed`), not
numpy's generators, so a plan does not depend on numpy's version.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._errors import ConfigError
from .keyed import permute, round_keys

__all__ = ["Segment", "checked_weights", "epoch_plan", "largest_remainder", "source_key", "stream"]

# Salts (shares.py uses 1-4, elastic.py 5): a source's draws, and its phase in the interleave.
_DRAWS, _PHASE = 6, 7


class Segment(NamedTuple):
    """From position ``start`` of an epoch (0 for its beginning), the weights the rest follows."""

    start: int
    weights: tuple[float, ...]


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
    quotas, then one more to the largest remainders (ties to the earlier source)."""
    w = np.asarray(weights, dtype=np.float64)
    quotas = w / w.sum() * total
    counts: np.ndarray = np.minimum(np.floor(quotas).astype(np.int64), total)  # rounding cannot give more than the whole
    left = int(total - counts.sum())
    if left > 0:
        rem = quotas - counts
        rem[w <= 0] = -1.0  # a source of weight 0 gets nothing
        order = np.argsort(-rem, kind="stable")
        counts[order[:left]] += 1
    return counts


def _phases(seed: int, epoch: int, segment: int, keys: Sequence[int]) -> np.ndarray:
    return np.array(
        [float(round_keys(_PHASE, seed, epoch, segment, k)[0]) / 2.0**64 for k in keys], dtype=np.float64
    )


def _interleave(counts: np.ndarray, phases: np.ndarray) -> np.ndarray:
    """The source of each position (int64) when ``counts[s]`` draws of each are spread evenly."""
    parts = [(np.arange(c, dtype=np.float64) + phases[s]) / c for s, c in enumerate(counts.tolist()) if c]
    if not parts:
        return np.zeros(0, dtype=np.int64)
    keys = np.concatenate(parts)
    sources = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return sources[np.argsort(keys, kind="stable")]


def stream(
    total: int,
    pools: Sequence[np.ndarray | int],
    offsets: Sequence[int],
    keys: Sequence[int],
    segments: Sequence[Segment],
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> np.ndarray:
    """An epoch of ``total`` positions over the sources' ``pools`` (each an int ``n``: samples
    ``0..n-1``; or an array of the samples a node holds), as global indices (``offsets[s]`` + the
    source's own index), following ``segments`` (the first starts at 0)."""
    sources = np.zeros(total, dtype=np.int64)
    for j, seg in enumerate(segments):
        end = segments[j + 1].start if j + 1 < len(segments) else total
        begin = min(seg.start, total)
        end = max(begin, min(end, total))
        counts = largest_remainder(seg.weights, total - begin)
        sources[begin:end] = _interleave(counts, _phases(seed, epoch, j, keys))[: end - begin]
    out = np.empty(total, dtype=np.int64)
    for s, pool in enumerate(pools):
        where = np.flatnonzero(sources == s)
        if not len(where):
            continue
        n = int(pool) if isinstance(pool, (int, np.integer)) else len(pool)
        pos = np.arange(len(where), dtype=np.int64) % n
        drawn = permute(pos, n, round_keys(_DRAWS, seed, epoch, keys[s])) if shuffle else pos
        out[where] = offsets[s] + (drawn if isinstance(pool, (int, np.integer)) else np.asarray(pool)[drawn])
    return out


def epoch_plan(
    total: int, sizes: Sequence[int], keys: Sequence[int], segments: Sequence[Segment], *, seed: int,
    epoch: int, shuffle: bool = True,
) -> np.ndarray:  # fmt: skip
    """The whole epoch over whole sources of ``sizes`` (global indices)."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return stream(total, list(sizes), offsets, keys, segments, seed=seed, epoch=epoch, shuffle=shuffle)

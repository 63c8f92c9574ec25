"""Which samples each node reads, as plain numpy (no torch): the arithmetic of
:class:`~blobdata.PartitionedSampler`, also used by ``blobdata warm --nnodes`` and the benchmarks.

* The samples are put in one random order fixed by ``seed`` alone (a keyed hash of each index,
  sorted). Canonical share ``k`` of ``K`` is the slice ``[k*n//K, (k+1)*n//K)`` of it, a random mix
  of the whole dataset (a listing is sorted by class, so index ranges would not be). Node ``j`` of
  ``N`` holds the slice ``[j*n//N, (j+1)*n//N)``: with ``K`` a multiple of ``N``, exactly canonical
  shares ``j*K/N .. (j+1)*K/N - 1``; with ``N`` a multiple of ``K``, a fixed part of one. Sizes
  differ by at most one sample, and a node's share is the same every epoch.
* Every epoch has one global order (the samples sorted by a hash keyed by ``seed`` and the epoch);
  a node reads its share in that order (:func:`epoch_orders`) and its ranks deal it round-robin
  (:func:`rank_stream`). Each node's order is made ``P * ceil(n / W)`` long by repeating its start
  (``DistributedSampler``'s padding, from the node's own share: a padded sample is a cache hit), or
  ``P * (n // W)`` with ``drop_last``.
* ``mix``: each epoch, ``round(mix * size)`` samples of each share (chosen afresh) are pooled,
  shuffled and dealt back, as many to each node as it gave.
* A resumed epoch (``consumed``): the same layout continues its order; another layout replays the
  earlier ones to find what was read, each new node takes what is left of its own share, nodes with
  more than their part give the excess to the others, and the tail is padded as above.

Vectorised: one sort of ``n`` keys per seed (cached), one sort of the node's share per epoch
(``mix``: one sort of ``n`` keys per epoch). The hash is splitmix64's finaliser, not numpy's
generators, so a share does not depend on numpy's version (a cache warmed by one serves another).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from .._errors import ConfigError

__all__ = ["Layout", "canonical_nodes", "epoch_orders", "fixed_order", "node_share", "rank_stream"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1
# Salts, so that the share, the epoch order and the mix draw independent keys.
_SHARE, _ORDER, _MOVE, _POOL = 1, 2, 3, 4


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (a bijection: distinct inputs, distinct keys)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def _base(*salt: int) -> np.uint64:
    h = 0
    for s in salt:
        h = int(_mix64(np.array([(h ^ (int(s) & _MASK64)) * 0x9E3779B97F4A7C15 & _MASK64], np.uint64))[0])
    return np.uint64(h)  # type: ignore[no-any-return]


def _keys(items: np.ndarray, *salt: int) -> np.ndarray:
    """A random-looking, distinct uint64 key per sample index, fixed by ``salt``."""
    with np.errstate(over="ignore"):
        return _mix64(items.astype(np.uint64) * _GOLDEN + _base(*salt))


def _by_key(items: np.ndarray, *salt: int) -> np.ndarray:
    """``items`` ordered by their keys (a uniform random order of the set, whatever its input order)."""
    return items[np.argsort(_keys(items, *salt), kind="stable")]


@functools.lru_cache(maxsize=4)
def fixed_order(n: int, seed: int) -> np.ndarray:
    """The samples ``0..n-1`` in the random order that shares are slices of (fixed by ``seed``)."""
    order = _by_key(np.arange(n, dtype=np.int64), seed, _SHARE)
    order.setflags(write=False)
    return order


def node_share(n: int, *, seed: int, nnodes: int, node: int) -> np.ndarray:
    """The samples node ``node`` of ``nnodes`` holds every epoch (without ``mix``), in index order."""
    return np.sort(fixed_order(n, seed)[node * n // nnodes : (node + 1) * n // nnodes])


def canonical_nodes(k: int | None, nnodes: int) -> int:
    """``num_canonical_nodes`` (``k``, default ``nnodes``), checked: a multiple or a divisor of ``nnodes``,
    so that a node holds whole canonical shares or a fixed part of one."""
    k = nnodes if k is None else int(k)
    if k < 1 or (k % nnodes and nnodes % k):
        raise ConfigError(
            f"num_canonical_nodes={k} must be a multiple or a divisor of the number of nodes ({nnodes}); "
            f"choose one that every node count you run on divides (e.g. {math.lcm(max(k, 1), nnodes)})"
        )
    return k


class Layout:
    """How a job's ranks sit on nodes: ``nnodes`` nodes of ``nproc`` ranks (torchrun numbers rank
    ``node * nproc + local``)."""

    def __init__(self, nnodes: int, nproc: int) -> None:
        self.nnodes, self.nproc = nnodes, nproc

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self.nnodes, self.nproc) == (other.nnodes, other.nproc)

    def __hash__(self) -> int:
        return hash((self.nnodes, self.nproc))

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc


def _epoch_sets(
    n: int, seed: int, epoch: int, nnodes: int, mix: float, nodes: Sequence[int]
) -> list[np.ndarray]:
    """The samples each node in ``nodes`` reads in ``epoch``: its share, with ``mix`` exchanged."""
    order = fixed_order(n, seed)
    bounds = [j * n // nnodes for j in range(nnodes + 1)]
    if mix <= 0:
        return [order[bounds[j] : bounds[j + 1]] for j in nodes]
    # Movers: in each share, the round(mix * size) samples with the smallest keys of this epoch.
    node_of = np.repeat(np.arange(nnodes, dtype=np.uint64), np.diff(bounds))
    keys = _keys(order, seed, epoch, _MOVE) >> np.uint64(20)  # 44 bits of key under the node's id
    ranked = order[np.argsort((node_of << np.uint64(44)) | keys, kind="stable")]
    counts = [round(mix * (bounds[j + 1] - bounds[j])) for j in range(nnodes)]
    movers = [ranked[bounds[j] : bounds[j] + counts[j]] for j in range(nnodes)]
    pool = _by_key(np.concatenate(movers), seed, epoch, _POOL)
    given = np.concatenate([[0], np.cumsum(counts)])
    return [
        np.concatenate([ranked[bounds[j] + counts[j] : bounds[j + 1]], pool[given[j] : given[j + 1]]])
        for j in nodes
    ]


def _ordered(items: np.ndarray, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    return _by_key(items, seed, epoch, _ORDER) if shuffle else np.sort(items)


def _fit(orders: list[np.ndarray], total: int, layout: Layout, drop_last: bool) -> list[np.ndarray]:
    """Each node's order made ``nproc * L`` long (``L`` per rank: ``total`` samples over the layout's
    ranks, as ``DistributedSampler`` counts): a node with more than that gives its tail to nodes with
    less, then each pads by repeating its start. ``orders`` may be some nodes' only when no node has
    less than its part (nothing consumed: a share holds at least ``nproc * L``, or ``drop_last``)."""
    world, nproc = layout.world, layout.nproc
    per_rank = total // world if drop_last else -(-total // world)
    want = nproc * per_rank
    spill = np.concatenate([o[want:] for o in orders] + [np.zeros(0, np.int64)])
    out = []
    for o in orders:
        o = o[:want]
        if len(o) < want and len(spill):
            take, spill = spill[: want - len(o)], spill[want - len(o) :]
            o = np.concatenate([o, take])
        if len(o) < want:  # pad by repeating the start (of all there is, if this node has nothing)
            pad = o if len(o) else np.concatenate(orders)
            o = np.resize(pad if len(pad) else np.zeros(1, np.int64), want)  # fewer samples than nodes: 0
        out.append(o.astype(np.int64, copy=False))
    return out


def epoch_orders(
    n: int,
    *,
    seed: int,
    epoch: int,
    layout: Layout,
    shuffle: bool = True,
    mix: float = 0.0,
    drop_last: bool = False,
    consumed: Sequence[tuple[Layout, int]] = (),
    nodes: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """Each node's order for ``epoch`` (``nproc * L`` samples; its ranks deal it round-robin).

    ``consumed`` lists the earlier parts of this epoch: ``(layout, samples per rank)`` each, oldest
    first. ``nodes`` limits the work to those nodes when nothing was consumed (one rank needs one)."""
    layouts = [lay for lay, _ in consumed] + [layout]
    first = layouts[0]
    wanted = list(range(first.nnodes)) if consumed or nodes is None else list(nodes)
    sets = _epoch_sets(n, seed, epoch, first.nnodes, mix, wanted)
    orders = _fit([_ordered(s, seed, epoch, shuffle) for s in sets], n, first, drop_last)
    if not consumed:
        return orders
    taken = np.zeros(n, dtype=bool)
    for (lay, per_rank), nxt in zip(consumed, layouts[1:], strict=True):
        cut = lay.nproc * max(0, min(per_rank, len(orders[0]) // lay.nproc))
        for o in orders:
            taken[o[:cut]] = True
        orders = [o[cut:] for o in orders]
        if nxt == lay:
            continue  # the same layout goes on with the same order
        left = [s[~taken[s]] for s in _epoch_sets(n, seed, epoch, nxt.nnodes, mix, range(nxt.nnodes))]
        orders = _fit([_ordered(s, seed, epoch, shuffle) for s in left], int((~taken).sum()), nxt, drop_last)
    return orders if nodes is None else [orders[j] for j in nodes]


def rank_stream(order: np.ndarray, nproc: int, local_rank: int) -> np.ndarray:
    """The samples local rank ``local_rank`` of ``nproc`` reads from its node's order."""
    return order[local_rank::nproc]

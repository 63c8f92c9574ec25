"""Which samples each node reads, as plain numpy (no torch): the arithmetic of
:class:`~blobdata.PartitionedSampler`, also used by ``blobdata warm --nnodes`` and the benchmarks.

* The samples are put in one random order fixed by ``seed`` alone: a keyed permutation ``pi`` of
  ``0..n-1`` (:mod:`blobdata._sampling.keyed`, a Feistel network evaluated at any positions). Canonical
  share ``k`` of ``K`` is ``pi`` at positions ``[k*n//K, (k+1)*n//K)``, a random mix of the whole
  dataset (a listing is sorted by class, so index ranges would not be). Node ``j`` of ``N`` holds
  positions ``[j*n//N, (j+1)*n//N)``: with ``K`` a multiple of ``N``, exactly canonical shares
  ``j*K/N .. (j+1)*K/N - 1``; with ``N`` a multiple of ``K``, a fixed part of one. Sizes differ by at
  most one sample, and a node's share is the same every epoch.
* Every epoch, node ``j`` reads its share in the order of a second keyed permutation (of its share's
  positions, keyed by ``seed``, the epoch and ``j``; :func:`epoch_orders`) and its ranks deal it
  round-robin (:func:`rank_stream`). Each node's order is made ``P * ceil(n / W)`` long by repeating
  its start (``DistributedSampler``'s padding, from the node's own share: a padded sample is a cache
  hit), or ``P * (n // W)`` with ``drop_last``.
* ``mix``: each epoch, ``round(mix * size)`` samples of each share (chosen afresh by a keyed
  permutation of the share) are pooled, permuted and dealt back, as many to each node as it gave.
* A resumed epoch (``consumed``): the same layout continues its order; another layout replays the
  earlier ones to find what was read, each new node takes what is left of its own share, nodes with
  more than their part give the excess to the others, and the tail is padded as above.

Cost: a rank's epoch (:func:`rank_indices`) evaluates the permutations at that rank's positions only,
O(its share) time and memory whatever ``n`` (``shuffle=False`` sorts its node's share; a resume at
another layout replays every node: O(n), once). The hashes are splitmix64's finaliser, not numpy's
generators, so a share does not depend on numpy's version (a cache warmed by one serves another).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import ConfigError
from .keyed import _mix64, permute, round_keys

__all__ = [
    "Layout",
    "canonical_nodes",
    "epoch_orders",
    "fixed_order",
    "node_share",
    "rank_indices",
    "rank_stream",
    "this_nodes_share",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MASK64 = (1 << 64) - 1
# Salts, so that the share, the epoch order and the mix draw independent permutations.
_SHARE, _ORDER, _MOVE, _POOL = 1, 2, 3, 4


def _base(*salt: int) -> np.uint64:
    h = 0
    for s in salt:
        h = int(_mix64(np.array([(h ^ (int(s) & _MASK64)) * 0x9E3779B97F4A7C15 & _MASK64], np.uint64))[0])
    return np.uint64(h)  # type: ignore[no-any-return]


def _by_key(items: np.ndarray, *salt: int) -> np.ndarray:
    """``items`` ordered by a keyed hash of each (a uniform random order of the set, whatever its input
    order): the order of what is left of a share after a resume at another layout."""
    with np.errstate(over="ignore"):
        keys = _mix64(items.astype(np.uint64) * _GOLDEN + _base(*salt))
    return items[np.argsort(keys, kind="stable")]


def _share_keys(seed: int) -> np.ndarray:
    return round_keys(seed, _SHARE)


@functools.lru_cache(maxsize=4)
def fixed_order(n: int, seed: int) -> np.ndarray:
    """The samples ``0..n-1`` in the random order that shares are slices of (fixed by ``seed``): the
    whole permutation, O(n); the samplers evaluate it at their own positions instead."""
    order = permute(np.arange(n, dtype=np.int64), n, _share_keys(seed))
    order.setflags(write=False)
    return order


def node_share(n: int, *, seed: int, nnodes: int, node: int) -> np.ndarray:
    """The samples node ``node`` of ``nnodes`` holds every epoch (without ``mix``), in index order."""
    lo, hi = node * n // nnodes, (node + 1) * n // nnodes
    return np.sort(permute(np.arange(lo, hi, dtype=np.int64), n, _share_keys(seed)))


def this_nodes_share(manifest: Any, options: Mapping[str, Any]) -> Any:
    """This node's share of ``manifest`` (a :class:`~blobdata._listing.ShareManifest`): the samples a
    ``PartitionedSampler`` of ``options["seed"]`` (default 0) gives this node of the job, cut from the
    manifest's file (or copied from memory): ``FolderDataset(node_share=...)``."""
    from .._listing import cut_share, dist_info, share_in_memory

    unknown = set(options) - {"seed"}
    if unknown:
        raise ConfigError(f"node_share takes True or {{'seed': s}}, not the settings {sorted(unknown)}")
    seed = int(options.get("seed", 0))
    info = dist_info()
    spec = {"seed": seed, "nnodes": info.nnodes, "node": info.node_rank}
    rows = node_share(len(manifest), seed=seed, nnodes=info.nnodes, node=info.node_rank)
    if manifest._path is not None:  # mapped from a file this node checked: cut, never mapped whole
        return cut_share(manifest._path, rows, spec, verified=lambda: True)
    return share_in_memory(manifest, rows, spec)


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


class _Epoch:
    """One epoch's sets at ``nnodes`` nodes, evaluated at any indices: node ``j``'s set is ``size(j)``
    samples (its share, with ``mix`` exchanged), and :meth:`order` is the order its ranks deal."""

    def __init__(self, n: int, seed: int, epoch: int, nnodes: int, mix: float) -> None:
        self.n, self.seed, self.epoch, self.nnodes = n, seed, epoch, nnodes
        self.bounds = np.array([j * n // nnodes for j in range(nnodes + 1)], dtype=np.int64)
        sizes = np.diff(self.bounds)
        self.movers = np.array([round(mix * int(s)) for s in sizes] if mix > 0 else [0] * nnodes, np.int64)
        self.given = np.concatenate([[0], np.cumsum(self.movers)]).astype(np.int64)
        self.share_keys = _share_keys(seed)

    def size(self, j: int) -> int:
        return int(self.bounds[j + 1] - self.bounds[j])

    def _moved(self, j: int, idx: np.ndarray) -> np.ndarray:
        """Share ``j``'s samples at ``idx`` of this epoch's permutation of it (its movers first)."""
        size = self.size(j)
        if self.movers[j]:
            idx = permute(idx, size, round_keys(self.seed, self.epoch, _MOVE, j))
        return permute(self.bounds[j] + idx, self.n, self.share_keys)

    def at(self, j: int, idx: np.ndarray) -> np.ndarray:
        """Node ``j``'s set at indices ``idx``: its stayers, then what the pool deals it."""
        stay = self.size(j) - int(self.movers[j])
        out = np.empty(len(idx), dtype=np.int64)
        own = idx < stay
        out[own] = self._moved(j, idx[own] + int(self.movers[j]))
        if not own.all():
            pool = permute(self.given[j] + idx[~own] - stay, int(self.given[-1]),
                           round_keys(self.seed, self.epoch, _POOL))  # fmt: skip
            src = np.searchsorted(self.given, pool, side="right") - 1
            got = np.empty(len(pool), dtype=np.int64)
            for k in np.unique(src).tolist():
                mine = src == k
                got[mine] = self._moved(k, pool[mine] - self.given[k])
            out[~own] = got
        return out

    def whole(self, j: int) -> np.ndarray:
        return self.at(j, np.arange(self.size(j), dtype=np.int64))

    def order(self, j: int, positions: np.ndarray, shuffle: bool) -> np.ndarray:
        """Node ``j``'s epoch order at ``positions`` (any ``>= 0``): its set in a keyed random order
        (index order without ``shuffle``), repeated from its start past its end (the padding)."""
        size = self.size(j)
        if size == 0:  # fewer samples than nodes: this node pads with sample 0
            return np.zeros(len(positions), dtype=np.int64)
        idx = np.asarray(positions, dtype=np.int64) % size
        if not shuffle:
            return np.sort(self.whole(j))[idx]
        return self.at(j, permute(idx, size, round_keys(self.seed, self.epoch, _ORDER, j)))


def _per_rank(total: int, layout: Layout, drop_last: bool) -> int:
    return total // layout.world if drop_last else -(-total // layout.world)


def _ordered(items: np.ndarray, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    return _by_key(items, seed, epoch, _ORDER) if shuffle else np.sort(items)


def _fit(orders: list[np.ndarray], total: int, layout: Layout, drop_last: bool) -> list[np.ndarray]:
    """Each node's order made ``nproc * L`` long (``L`` per rank: ``total`` samples over the layout's
    ranks, as ``DistributedSampler`` counts): a node with more than that gives its tail to nodes with
    less, then each pads by repeating its start."""
    want = layout.nproc * _per_rank(total, layout, drop_last)
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


def _same_layout_cut(consumed: Sequence[tuple[Layout, int]], layout: Layout, length: int) -> int | None:
    """Positions of each node's order already read when every part of ``consumed`` ran at ``layout``
    (the order goes on where it stopped); None when some part ran at another layout."""
    cut = 0
    for lay, per_rank in consumed:
        if lay != layout:
            return None
        cut += lay.nproc * max(0, min(per_rank, (length - cut) // lay.nproc))
    return cut


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
    first. ``nodes`` limits the work to those nodes (all of them are replayed when ``consumed`` holds
    another layout)."""
    first = consumed[0][0] if consumed else layout
    want = first.nproc * _per_rank(n, first, drop_last)
    wanted = list(range(layout.nnodes)) if nodes is None else list(nodes)
    cut = _same_layout_cut(consumed, layout, want)
    if cut is not None:  # no other layout: each node's order from where it stopped, node by node
        ep = _Epoch(n, seed, epoch, layout.nnodes, mix)
        return [ep.order(j, np.arange(cut, want, dtype=np.int64), shuffle) for j in wanted]
    ep = _Epoch(n, seed, epoch, first.nnodes, mix)
    orders = [ep.order(j, np.arange(want, dtype=np.int64), shuffle) for j in range(first.nnodes)]
    taken = np.zeros(n, dtype=bool)
    layouts = [lay for lay, _ in consumed] + [layout]
    for (lay, per_rank), nxt in zip(consumed, layouts[1:], strict=True):
        cut = lay.nproc * max(0, min(per_rank, len(orders[0]) // lay.nproc))
        for o in orders:
            taken[o[:cut]] = True
        orders = [o[cut:] for o in orders]
        if nxt == lay:
            continue  # the same layout goes on with the same order
        ep = _Epoch(n, seed, epoch, nxt.nnodes, mix)
        left = [s[~taken[s]] for s in (ep.whole(j) for j in range(nxt.nnodes))]
        orders = _fit([_ordered(s, seed, epoch, shuffle) for s in left], int((~taken).sum()), nxt, drop_last)
    return [orders[j] for j in wanted]


def rank_indices(
    n: int,
    *,
    seed: int,
    epoch: int,
    layout: Layout,
    node: int,
    local_rank: int,
    shuffle: bool = True,
    mix: float = 0.0,
    drop_last: bool = False,
    consumed: Sequence[tuple[Layout, int]] = (),
) -> np.ndarray:
    """What rank ``local_rank`` of node ``node`` reads in ``epoch``: ``rank_stream`` of its node's
    :func:`epoch_orders`, computed at that rank's positions only (O(its share)) unless ``consumed``
    holds another layout."""
    first = consumed[0][0] if consumed else layout
    want = first.nproc * _per_rank(n, first, drop_last)
    cut = _same_layout_cut(consumed, layout, want)
    if cut is None:
        (order,) = epoch_orders(n, seed=seed, epoch=epoch, layout=layout, shuffle=shuffle, mix=mix,
                                drop_last=drop_last, consumed=consumed, nodes=[node])  # fmt: skip
        return rank_stream(order, layout.nproc, local_rank)
    positions = np.arange(cut + local_rank, want, layout.nproc, dtype=np.int64)
    return _Epoch(n, seed, epoch, layout.nnodes, mix).order(node, positions, shuffle)


def rank_stream(order: np.ndarray, nproc: int, local_rank: int) -> np.ndarray:
    """The samples local rank ``local_rank`` of ``nproc`` reads from its node's order."""
    return order[local_rank::nproc]

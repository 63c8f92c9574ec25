"""``DistributedSampler``'s order, resumable at another world size.

Elastic resume (:class:`ElasticDistributedSampler`): an epoch's order is one global permutation
(seeded by ``seed + epoch``, the same on every rank: ``DistributedSampler``'s), dealt to the ranks
round-robin: rank ``r`` of ``W`` reads positions ``r, r + W, r + 2W, ...``. When all ranks step in
lockstep, after ``b`` batches of ``B`` samples the ranks together have read exactly the first
``b * B * W`` positions, whatever ``W`` is. The state records that global position; a run that comes
back with ``M`` ranks deals the rest of the permutation round-robin to its ``M`` ranks, so each
remaining sample is seen once (the tail is padded or cut to a multiple of ``M`` as
``DistributedSampler`` does). This is MosaicML streaming's idea (the sample order is fixed by the
job's canonical layout, not by the number of ranks it runs on) and LitData's elastic resume (the
consumed prefix is counted globally), applied to a plain permutation of a bucket folder's listing.

A plain ``DistributedSampler`` deals the same permutation the same way, so an epoch interrupted under
one is resumed at another world size through :func:`equivalent`: the elastic sampler of the same
dataset, seed, ``shuffle`` and ``drop_last``, from the interrupted epoch's global position.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data.distributed import DistributedSampler

from .._errors import ConfigError
from .._listing import dist_info
from .keyed import permute, round_keys

__all__ = ["ElasticDistributedSampler", "equivalent", "node_share"]

_ELASTIC = 5  # the salt of the keyed global order (shares.py uses 1-4)


class ElasticDistributedSampler(DistributedSampler[int]):
    """``DistributedSampler``'s order, resumable at another world size (see the module docstring).

    With ``start == 0`` it yields exactly what ``DistributedSampler`` with the same arguments yields.
    ``num_replicas`` and ``rank`` default to the job's (process group or torchrun's variables).
    ``start`` is the number of positions of the epoch's global order already consumed; a loader's
    ``load_state_dict`` sets it, and ``set_epoch`` to another epoch resets it to 0.

    ``permutation``: ``"torch"`` (default) is ``DistributedSampler``'s ``torch.randperm`` of the whole
    dataset on every rank (8 bytes a sample, e.g. 800 MB per rank at 100 M samples); ``"keyed"`` is a
    keyed permutation (:mod:`blobdata._sampling.keyed`, fixed by ``seed`` and the epoch) evaluated at
    this rank's positions only: O(its share) time and memory, another order than ``DistributedSampler``'s
    (a loader state saved with one does not resume with the other).
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        permutation: str = "torch",
    ) -> None:
        if permutation not in ("torch", "keyed"):
            raise ConfigError(
                f'ElasticDistributedSampler: permutation must be "torch" or "keyed", got {permutation!r}'
            )
        info = dist_info() if num_replicas is None or rank is None else None
        super().__init__(
            dataset,
            num_replicas=num_replicas if num_replicas is not None else info.world_size,  # type: ignore[union-attr]
            rank=rank if rank is not None else info.rank,  # type: ignore[union-attr]
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.permutation = permutation
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0
        super().set_epoch(epoch)

    def _at(self, positions: np.ndarray) -> np.ndarray:
        """The epoch's global order at ``positions`` (int64)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return positions
        if self.permutation == "keyed":
            return permute(positions, n, round_keys(self.seed, self.epoch, _ELASTIC))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        perm = torch.randperm(n, generator=g)
        return perm[torch.from_numpy(positions)].numpy()

    def global_order(self) -> list[int]:
        """The epoch's global order (unpadded), the same on every rank (O(n): for inspection)."""
        order: list[int] = self._at(np.arange(len(self.dataset), dtype=np.int64)).tolist()  # type: ignore[arg-type]
        return order

    def _per_rank(self, remaining: int) -> int:
        w = self.num_replicas
        return remaining // w if self.drop_last else math.ceil(remaining / w)

    def __len__(self) -> int:
        return self._per_rank(max(0, len(self.dataset) - self.start))  # type: ignore[arg-type]

    def indices(self) -> np.ndarray:
        """This rank's samples for the current epoch, in the order ``__iter__`` yields them (int64): the
        rest of the global order from ``start``, dealt round-robin, its tail padded by repeating its
        start (as ``DistributedSampler`` does) or cut (``drop_last``)."""
        rest = max(0, len(self.dataset) - self.start)  # type: ignore[arg-type]
        total = self._per_rank(rest) * self.num_replicas
        mine = np.arange(self.rank, total, self.num_replicas, dtype=np.int64)
        return self._at(self.start + mine % max(rest, 1))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def node_share(
    n: int, *, nnodes: int, node_rank: int, nproc_per_node: int, seed: int, epoch: int
) -> list[int]:
    """The samples the ranks of node ``node_rank`` read in ``epoch`` under an
    :class:`ElasticDistributedSampler` (or ``DistributedSampler``) with ``seed``, over ``n`` samples;
    torchrun numbers a node's ranks ``node_rank * nproc_per_node + local_rank``."""
    world = nnodes * nproc_per_node
    out: list[int] = []
    for rank in range(node_rank * nproc_per_node, (node_rank + 1) * nproc_per_node):
        sampler = ElasticDistributedSampler(_Sized(n), num_replicas=world, rank=rank, seed=seed)
        sampler.set_epoch(epoch)
        out.extend(sampler)
    return out


def equivalent(sampler: DistributedSampler[Any], *, start: int) -> ElasticDistributedSampler:
    """The :class:`ElasticDistributedSampler` that deals ``sampler``'s epoch (a plain
    ``DistributedSampler``: the same permutation, dealt the same way) from global position ``start``
    to ``sampler``'s ranks: what serves the rest of an epoch interrupted at another world size."""
    out = ElasticDistributedSampler(
        sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=sampler.shuffle,
        seed=sampler.seed, drop_last=sampler.drop_last,
    )  # fmt: skip
    out.set_epoch(sampler.epoch)
    out.start = start
    return out

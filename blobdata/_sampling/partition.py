"""Many nodes whose caches add up: :class:`PartitionedSampler` keeps each node on one fixed share of
the dataset, every epoch.

Under ``DistributedSampler`` each epoch deals a fresh global permutation to the ranks, so over the
epochs every node reads almost the whole dataset and its cache helps only as far as it holds all of
it: with 16 nodes and a cache of 1/8 of the dataset each, about 7/8 of every epoch comes from the
bucket again, on every node. Here a node reads the same share every epoch (MosaicML streaming's
canonical nodes, CoorDL's partitioned caching, applied to a folder of single objects), so the
node caches add up: together they need to hold the dataset once. Which samples go where is plain
numpy arithmetic in :mod:`blobdata._sampling.shares`.

Resume (the loader's ``state_dict``): the state records, for the interrupted epoch, how many samples
each rank read at which layout (nodes, ranks per node). With the same layout the order goes on
exactly; at another layout every remaining sample is read once, each node reading what is left of
its own new share (see :mod:`blobdata._sampling.shares`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from .._config import env
from .._errors import ConfigError
from .._listing import dist_info
from .shares import Layout, canonical_nodes, node_share, rank_indices

__all__ = ["PartitionedSampler"]


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"PartitionedSampler: {name} must be an integer, got {value!r}")
    return int(value)


class PartitionedSampler(DistributedSampler[int]):
    """``DistributedSampler`` for nodes with their own caches: each node reads the same share of the
    dataset every epoch, shuffled afresh within the node (see :mod:`blobdata._sampling.shares`).

    Takes ``DistributedSampler``'s arguments (``num_replicas`` and ``rank`` default to the job's;
    ``seed`` fixes the shares and, with the epoch, each epoch's order) plus:

    nproc_per_node:       ranks per node (default torchrun's ``LOCAL_WORLD_SIZE``, else every rank
                          on one node); torchrun numbers rank ``node * nproc_per_node + local``.
    num_canonical_nodes:  the shares the dataset is split into (default: the number of nodes). A
                          node takes ``K/N`` of them, or a fixed part of one when there are more
                          nodes than shares; so it must be a multiple or a divisor of the number of
                          nodes. Pick one that every node count you may run on divides (e.g. 8 for
                          1, 2, 4, 8 nodes): then a change of node count gives each node unions (or
                          parts) of earlier shares, which its cache partly holds already.
    mix:                  fraction of each node's share exchanged with the other nodes each epoch
                          (default 0). It mixes more globally, at a cost: each node then reads
                          about ``mix`` of every epoch from outside the share its cache holds (from
                          the bucket).

    Call ``set_epoch(e)`` each epoch, as with ``DistributedSampler``. Every epoch covers the dataset
    once, padded (or cut, ``drop_last``) as ``DistributedSampler`` does, and every rank reads
    ``len(sampler)`` samples. A loader's ``state_dict()`` resumes mid-epoch exactly, also at another
    world size.
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
        nproc_per_node: int | None = None,
        num_canonical_nodes: int | None = None,
        mix: float = 0.0,
    ) -> None:
        info = dist_info() if num_replicas is None or rank is None else None
        world = _int("num_replicas", num_replicas if num_replicas is not None else info.world_size)  # type: ignore[union-attr]
        me = _int("rank", rank if rank is not None else info.rank)  # type: ignore[union-attr]
        if world < 1 or not 0 <= me < world:
            raise ConfigError(
                f"PartitionedSampler: rank {me} is not in 0..{world - 1} (num_replicas={world})"
            )
        if nproc_per_node is None:
            nproc_per_node = dist_info().local_world_size if env("LOCAL_WORLD_SIZE") is not None else world
        per_node = _int("nproc_per_node", nproc_per_node)
        if per_node < 1 or world % per_node:
            raise ConfigError(
                f"PartitionedSampler: {world} ranks cannot sit on nodes of nproc_per_node={per_node} "
                "ranks each (it must divide num_replicas)"
            )
        nnodes = world // per_node
        try:
            given = None if num_canonical_nodes is None else _int("num_canonical_nodes", num_canonical_nodes)
            k = canonical_nodes(given, nnodes)
        except ConfigError as exc:
            raise ConfigError(f"PartitionedSampler: {exc}") from None
        if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix <= 1.0:
            raise ConfigError(f"PartitionedSampler: mix must be a fraction in [0, 1], got {mix!r}")
        kept = getattr(dataset, "node_share", None)  # FolderDataset(node_share=...): one node's samples
        want = {"seed": seed, "nnodes": nnodes, "node": me // per_node}
        if isinstance(kept, dict) and (mix or any(kept.get(k) != v for k, v in want.items())):
            raise ConfigError(
                f"PartitionedSampler: the dataset keeps only the share of node {kept.get('node')} of "
                f"{kept.get('nnodes')} for seed {kept.get('seed')} (node_share=), and this sampler reads "
                f"node {want['node']} of {nnodes} for seed {seed} with mix={mix}: make them alike (mix=0), "
                "or make the dataset without node_share"
            )
        super().__init__(
            dataset, num_replicas=world, rank=me, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.nproc_per_node = per_node
        self.nnodes = nnodes
        self.node_rank, self.local_rank = divmod(me, per_node)
        self.num_canonical_nodes = k
        self.mix = float(mix)
        #: The parts of the current epoch read before this run: (layout, samples per rank), oldest first.
        self.consumed: list[tuple[Layout, int]] = []
        #: Made by ``dataloader(sampler="partitioned")``: that loader begins each epoch at the next
        #: epoch unless ``set_epoch`` was called since the last one began.
        self.owned_by_loader = False
        self._set_epoch_calls = 0
        self._memo: tuple[tuple[Any, ...], np.ndarray] | None = None

    @property
    def layout(self) -> Layout:
        """This job's nodes and ranks per node."""
        return Layout(self.nnodes, self.nproc_per_node)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.consumed = []
        self._set_epoch_calls += 1
        super().set_epoch(epoch)

    def share(self) -> np.ndarray:
        """The samples this node holds every epoch (without ``mix``), in index order: what ``blobdata
        warm --nnodes`` fetches and what its cache should keep."""
        n = len(self.dataset)  # type: ignore[arg-type]
        return node_share(n, seed=self.seed, nnodes=self.nnodes, node=self.node_rank)

    def indices(self) -> np.ndarray:
        """This rank's samples for the current epoch, in the order ``__iter__`` yields them (int64)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        key = (n, self.seed, self.epoch, self.shuffle, self.drop_last, self.mix, self.layout,
               tuple((lay.nnodes, lay.nproc, c) for lay, c in self.consumed))  # fmt: skip
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        stream = rank_indices(
            n, seed=self.seed, epoch=self.epoch, layout=self.layout, node=self.node_rank,
            local_rank=self.local_rank, shuffle=self.shuffle, mix=self.mix, drop_last=self.drop_last,
            consumed=self.consumed,
        )  # fmt: skip
        self._memo = (key, stream)
        return stream

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return len(self.indices()) if self.consumed else int(self.num_samples)

    # -- the loader's state (blobdata._sampling.resume) -----------------------------------------------------
    def loader_state(self) -> dict[str, Any]:
        """What replays the current epoch from its start (JSON-friendly): the seed, the epoch, the
        order's settings, and what was read at which layout before this run."""
        return {
            "kind": "partitioned", "seed": self.seed, "epoch": self.epoch,
            "samples": len(self.dataset), "shuffle": self.shuffle, "drop_last": self.drop_last,  # type: ignore[arg-type]
            "mix": self.mix, "num_canonical_nodes": self.num_canonical_nodes,
            "consumed": [[lay.nnodes, lay.nproc, c] for lay, c in self.consumed],
        }  # fmt: skip

    def state_after(self, start: dict[str, Any], per_rank: int) -> dict[str, Any]:
        """``start`` (:meth:`loader_state` at the epoch's start) after every rank read ``per_rank``
        more samples at this sampler's layout."""
        per_rank = max(0, min(int(per_rank), len(self)))
        return {**start, "consumed": [*start["consumed"], [self.nnodes, self.nproc_per_node, per_rank]]}

    def load_loader_state(self, state: dict[str, Any], *, complete: bool) -> None:
        """Make the next iteration resume ``state``'s epoch (the one after it when ``complete``)."""
        try:
            saved = {k: state[k] for k in ("seed", "samples", "shuffle", "drop_last", "mix")}
            epoch = int(state["epoch"])
            consumed = [(Layout(int(a), int(b)), int(c)) for a, b, c in state["consumed"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"blobdata loader state: a bad PartitionedSampler state ({exc!r})") from None
        here = {"seed": self.seed, "samples": len(self.dataset), "shuffle": self.shuffle,  # type: ignore[arg-type]
                "drop_last": self.drop_last, "mix": self.mix}  # fmt: skip
        for key, value in here.items():
            if saved[key] != value:
                raise ConfigError(
                    f"the loader state was saved with a PartitionedSampler of {key}={saved[key]!r}, this "
                    f"one has {key}={value!r}: its order would differ, so it cannot resume there"
                )
        for lay, c in consumed:
            if lay.nnodes < 1 or lay.nproc < 1 or c < 0:
                raise ConfigError(f"blobdata loader state: a bad consumed part {[lay.nnodes, lay.nproc, c]}")
        self.set_epoch(epoch)
        self.consumed = [] if complete else consumed

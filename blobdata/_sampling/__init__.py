"""Which samples each rank reads: node shares that make caches add up, epoch orders, and the
loader's resumable position.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``keyed``          a keyed permutation of ``0..n-1`` evaluated at any positions (Feistel network)
``shares``         which samples each node reads, in plain numpy (no torch)
``partition``      :class:`PartitionedSampler`: each node reads one fixed share every epoch
``resume``         the loader's position (``state_dict``), elastic resume at another world size
=================  ==========================================================================

The samplers need torch: they are imported on first use, so the command line's ``warm`` and
``cache trim`` (which use ``shares`` alone) start without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .keyed import permute, round_keys
from .shares import (
    Layout,
    canonical_nodes,
    epoch_orders,
    fixed_order,
    node_share,
    rank_indices,
    rank_stream,
)

if TYPE_CHECKING:
    from .partition import PartitionedSampler
    from .resume import ElasticDistributedSampler, Progress, own_generator
    from .resume import node_share as epoch_share

__all__ = [
    "ElasticDistributedSampler",
    "Layout",
    "PartitionedSampler",
    "Progress",
    "canonical_nodes",
    "epoch_orders",
    "epoch_share",
    "fixed_order",
    "node_share",
    "own_generator",
    "permute",
    "rank_indices",
    "rank_stream",
    "round_keys",
]


def __getattr__(name: str) -> object:
    if name == "PartitionedSampler":
        from .partition import PartitionedSampler

        return PartitionedSampler
    if name in ("ElasticDistributedSampler", "Progress", "epoch_share", "own_generator"):
        from . import resume

        return getattr(resume, "node_share" if name == "epoch_share" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

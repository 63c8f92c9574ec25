"""Which samples each rank reads: node shares that make caches add up, epoch orders, and the
loader's resumable position.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``keyed``          a keyed permutation of ``0..n-1`` evaluated at any positions (Feistel network)
``shares``         which samples each node reads, in plain numpy (no torch)
``partition``      :class:`PartitionedSampler`: each node reads one fixed share every epoch
``elastic``        :class:`ElasticDistributedSampler`: ``DistributedSampler``'s order, resumable anywhere
``mixing``         a mixture's epoch as an exact plan: counts, draws, an even interleave (numpy)
``mixsampler``     :class:`MixtureSampler`: a mixture's plan dealt to ranks (or nodes), resumable
``resume``         the loader's position (``state_dict``), resumed at another batch or world size
``peek``           the next epoch's batches before it begins (look-ahead across epochs)
``identity``       what makes a state this run's; a digest of the indices served (``compare_runs``)
``rng``            augmentation draws keyed by (loader seed, epoch, sample URL); ``sample_rng()``
=================  ==========================================================================

The samplers need torch: they are imported on first use, so the command line's ``warm`` and
``cache trim`` (which use ``shares`` alone) start without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .identity import ServedDigest, compare_runs, listing_digest, run_identity
from .keyed import permute, round_keys
from .mixing import checked_weights, largest_remainder, source_key
from .rng import SampleDraws, enter_batch, epoch_seed, loader_seed, sample_key, sample_rng, uniforms
from .rng import current as current_sample
from .rng import enter as enter_sample
from .rng import leave as leave_sample
from .shares import (
    Layout,
    canonical_nodes,
    epoch_orders,
    fixed_order,
    node_share,
    rank_indices,
    rank_stream,
    this_nodes_share,
)

if TYPE_CHECKING:
    from .elastic import ElasticDistributedSampler
    from .elastic import node_share as epoch_share
    from .mixsampler import MixtureSampler
    from .partition import PartitionedSampler
    from .peek import NextEpoch
    from .resume import Progress, own_generator

__all__ = [
    "ElasticDistributedSampler",
    "Layout",
    "MixtureSampler",
    "NextEpoch",
    "PartitionedSampler",
    "Progress",
    "SampleDraws",
    "ServedDigest",
    "canonical_nodes",
    "checked_weights",
    "compare_runs",
    "current_sample",
    "enter_batch",
    "enter_sample",
    "epoch_orders",
    "epoch_seed",
    "epoch_share",
    "fixed_order",
    "largest_remainder",
    "leave_sample",
    "listing_digest",
    "loader_seed",
    "node_share",
    "own_generator",
    "permute",
    "rank_indices",
    "rank_stream",
    "round_keys",
    "run_identity",
    "sample_key",
    "sample_rng",
    "source_key",
    "this_nodes_share",
    "uniforms",
]


def __getattr__(name: str) -> object:
    if name == "NextEpoch":
        from .peek import NextEpoch

        return NextEpoch
    if name == "PartitionedSampler":
        from .partition import PartitionedSampler

        return PartitionedSampler
    if name == "MixtureSampler":
        from .mixsampler import MixtureSampler

        return MixtureSampler
    if name in ("ElasticDistributedSampler", "epoch_share"):
        from . import elastic

        return getattr(elastic, "node_share" if name == "epoch_share" else name)
    if name in ("Progress", "own_generator"):
        from . import resume

        return getattr(resume, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

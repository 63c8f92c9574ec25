"""How a node asks a store for bytes: the engine, admission at the rate the store accepts, the node's
throttle controller, and the look-ahead that fetches before a worker asks.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``engine``         :class:`FetchEngine`: URLs in, bytes out, bounded concurrency, pinned ranges
``admission``      one process's gate to a store: slow start, the node's tokens, retries first
``throttle``       the node-wide controller: one request rate per store (AIMD) in ``/dev/shm``
``plans``          each epoch's batches (and the next's, where known) published to the workers
``lookahead``      the planning batch sampler; bytes fetched before they are asked
``packed``         an epoch's batches as numpy arrays; the next epoch's, predicted in a thread
``ranged``         one object as a seekable file read in ranges (a large table, never held whole)
=================  ==========================================================================

The one retry budget (:mod:`blobdata._retry`) is plumbing at the top: stores and listings use it too.
"""

from __future__ import annotations

from . import throttle
from .admission import Gate, gate_for, private_gate, store_key
from .engine import FetchEngine, endpoint_of
from .lookahead import IN_FLIGHT, HandOver, LookAhead, PlanningBatchSampler
from .packed import PackedBatches, Predicted
from .plans import PlanChannel, sweep_dead_channels
from .ranged import RangedFile
from .throttle import Limit, Table, key_id, node_table

__all__ = [
    "IN_FLIGHT",
    "FetchEngine",
    "Gate",
    "HandOver",
    "Limit",
    "LookAhead",
    "PackedBatches",
    "PlanChannel",
    "PlanningBatchSampler",
    "Predicted",
    "RangedFile",
    "Table",
    "endpoint_of",
    "gate_for",
    "key_id",
    "node_table",
    "private_gate",
    "store_key",
    "sweep_dead_channels",
    "throttle",
]

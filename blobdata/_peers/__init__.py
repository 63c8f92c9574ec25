"""Node caches that serve each other: a sample this node's cache misses is read from the cache of the
node that is its home, instead of from the bucket (CoorDL's partitioned caching, VLDB 2021, under a
global shuffle).

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``config``         :class:`Peers` (the settings), ``BLOBDATA_PEERS``, the :class:`PeerTable`
``homes``          each object's home node: rendezvous hashing over the job's node names
``rendezvous``     the nodes meet through the job's ``torch.distributed`` store; the node's service starts
``auth``           requests signed under the job's secret (HMAC), replays refused; answers signed
``server``         the service's HTTP/1.1 server: GET only, bounded heads, one request at a time
``service``        what the service answers: its home objects, from the cache or read once from the bucket
``daemon``         the service in a process of its own (``python -m blobdata._peers``), told what to serve
``client``         the asking side: deadlines from observed latency, hedged bucket reads, answers checked
=================  ==========================================================================

See docs/peers.md for the design, the security model and the figures.
"""

from __future__ import annotations

from .auth import Refused, Signer, Verifier, job_id
from .client import PeerClient
from .config import PEERS_LOOKAHEAD, SERVICE_READERS, Peers, PeerTable, peers_setting
from .daemon import EngineSpec, ServiceProcess
from .homes import Homes
from .rendezvous import join, serve, service_of
from .service import PATH, Service

__all__ = [
    "PATH",
    "EngineSpec",
    "ServiceProcess",
    "PEERS_LOOKAHEAD",
    "SERVICE_READERS",
    "Homes",
    "PeerClient",
    "PeerTable",
    "Peers",
    "Refused",
    "Service",
    "Signer",
    "Verifier",
    "job_id",
    "join",
    "peers_setting",
    "serve",
    "service_of",
]

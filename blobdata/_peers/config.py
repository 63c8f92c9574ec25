"""How a job's nodes serve each other their caches: the :class:`Peers` settings (keyword-only, checked
when made), ``BLOBDATA_PEERS``, and the :class:`PeerTable` a rendezvous gives every process of the job.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._config import env, parse_duration
from .._errors import ConfigError

__all__ = ["PEERS_LOOKAHEAD", "SERVICE_READERS", "PeerTable", "Peers", "peers_setting"]

#: The look-ahead of a dataset with peers, unless one is given (``FetchOptions(lookahead=...)``): the
#: default 1,024 samples cover the bucket's tens of milliseconds, and a peer answers in one or a few.
#: With 1,024, each process asked for most of its epoch at the epoch's first batch, and that burst of
#: reads (the CPU of every node at once) was what the first batches waited for.
PEERS_LOOKAHEAD = 256

#: The node's service reads from the bucket, for the objects its cache lacks, with the concurrency of
#: this many of the node's processes (``Peers(service_concurrency=)`` unless given): in a job's first
#: epoch it reads the node's share of every node's samples, as much as a whole node reads without
#: peers. With one process's 64 it was the job's limit there: a node that reads 1,000 samples a second
#: from a bucket 60 ms away has 60 reads in flight, and its service as many for the others.
SERVICE_READERS = 8

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Peers:
    """Node caches that serve each other: a sample that this node's cache misses is read from the
    cache of its home node (each object has one, a function of its key and the job's nodes) instead
    of the bucket. See docs/peers.md. Every setting has a default that fits torchrun:

    store:          the ``torch.distributed.Store`` the nodes meet through (default: the initialised
                    process group's store, else a client of torchrun's at ``MASTER_ADDR:MASTER_PORT``).
    nnodes:         the job's nodes (default: ``WORLD_SIZE / LOCAL_WORLD_SIZE``).
    node_rank:      this node's rank (default: ``GROUP_RANK``, as torchrun numbers nodes).
    host:           the address this node's service listens on and the others reach it at (default:
                    the local address that routes to ``MASTER_ADDR``; ``BLOBDATA_PEERS_HOST``).
    port:           its port (default 0: a free one).
    advertise:      ``host:port`` the others reach the service at, where that is not where it listens
                    (a NAT, a port mapping, a proxy); default: ``host`` and the port it listens on.
    node_name:      the name homes are computed from (default: ``host``): it must stay the same for a
                    node across restarts of the job, so that a node's cache keeps serving.
    serves:         whether this process starts the node's service (default: the node's local rank 0).
    service_process: whether the service runs in a process of its own (default True: its work never
                    takes the training process's GIL, which its batches wait for), or on the serving
                    process's own loop (False: where a process cannot be started, or storage options
                    cannot be sent to one).
    job:            what tells this job's meeting from another's in the store (default: torchrun's run
                    id and restart count).
    per_peer:       objects a process has in flight to one peer at most (default 16); the reads it
                    starts together go to a peer as one request, of up to this many objects. A node's
                    service takes 1,024 objects in flight from each asking node (64 processes at the
                    default): beyond that, the rest are told busy and read the bucket.
    timeout:        how long the nodes wait for each other at the rendezvous (default 600 s).
    service_concurrency: requests the node's service has in flight to the bucket at most, for the
                    objects its cache lacks (a job's first epoch): it reads the node's share of every
                    node's samples, as many as all the node's processes read without peers (default:
                    :data:`SERVICE_READERS` times the dataset's ``FetchOptions(concurrency=)``, 512 at
                    its default; the node's throttle state slows it where the store asks). With
                    ``service_process=False`` the serving process's own engine reads them.
    """

    store: Any = None
    nnodes: int | None = None
    node_rank: int | None = None
    host: str | None = None
    port: int = 0
    advertise: str | None = None
    node_name: str | None = None
    serves: bool | None = None
    job: str | None = None
    per_peer: int = 16
    timeout: float = 600.0
    service_process: bool = True
    service_concurrency: int | None = None

    def __init__(
        self,
        *,
        store: Any = None,
        nnodes: int | None = None,
        node_rank: int | None = None,
        host: str | None = None,
        port: int = 0,
        advertise: str | None = None,
        node_name: str | None = None,
        serves: bool | None = None,
        job: str | None = None,
        per_peer: int = 16,
        timeout: float | str = 600.0,
        service_process: bool = True,
        service_concurrency: int | None = None,
    ) -> None:
        for name, value, low in (
            ("nnodes", nnodes, 1),
            ("node_rank", node_rank, 0),
            ("per_peer", per_peer, 1),
            ("service_concurrency", service_concurrency, 1),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"Peers({name}=) must be an integer of at least {low}, got {value!r}")
        if serves is not None and not isinstance(serves, bool):
            raise ConfigError(f"Peers(serves=) must be True, False or None, got {serves!r}")
        if not isinstance(service_process, bool):
            raise ConfigError(f"Peers(service_process=) must be True or False, got {service_process!r}")
        if nnodes is not None and node_rank is not None and node_rank >= nnodes:
            raise ConfigError(f"Peers(node_rank={node_rank}) must be below nnodes={nnodes}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ConfigError(f"Peers(port=) must be a port number (0: a free one), got {port!r}")
        host = host if host is not None else env("BLOBDATA_PEERS_HOST")
        for name, text in (("host", host), ("advertise", advertise), ("node_name", node_name), ("job", job)):
            if text is not None and (not isinstance(text, str) or not text or not text.isprintable()):
                raise ConfigError(f"Peers({name}=) must be a non-empty printable string, got {text!r}")
        values = {
            "store": store, "nnodes": nnodes, "node_rank": node_rank, "host": host, "port": port,
            "advertise": advertise, "node_name": node_name, "serves": serves, "job": job,
            "per_peer": per_peer, "service_process": service_process,
            "service_concurrency": service_concurrency,
            "timeout": parse_duration(timeout, name="Peers(timeout=)"),
        }  # fmt: skip
        for name, value in values.items():
            object.__setattr__(self, name, value)


def peers_setting(peers: bool | Peers | None) -> Peers | None:
    """A dataset's ``peers=``: a :class:`Peers`, True (the defaults), False (off), or None: what
    ``BLOBDATA_PEERS`` says (``1``/``true``/``on``; unset or ``0``: off)."""
    if isinstance(peers, Peers):
        return peers
    if peers is True:
        return Peers()
    if peers is False:
        return None
    if peers is not None:
        raise ConfigError(f"peers= takes True, False or a blobdata.Peers, got {type(peers).__name__}")
    raw = env("BLOBDATA_PEERS")
    if raw is None or raw.lower() in _OFF:
        return None
    if raw.lower() in _ON:
        return Peers()
    raise ConfigError(f"BLOBDATA_PEERS must be 1 or 0 (on or off), got {raw!r}")


@dataclasses.dataclass(frozen=True)
class PeerTable:
    """What every process of the job knows of the peers after the rendezvous: the job's secret, each
    node's name and service address (``host:port``; this node's as its own processes reach it) in node
    order, and which node this process is on.
    Plain data: it travels to DataLoader workers with the dataset. The secret is never shown."""

    secret: bytes = dataclasses.field(repr=False)
    names: tuple[str, ...]
    addresses: tuple[str, ...]
    me: int
    per_peer: int = 16

    def __post_init__(self) -> None:
        if len(self.names) != len(self.addresses) or not 0 <= self.me < len(self.names):
            raise ConfigError(f"a peer table of {len(self.names)} nodes cannot have node {self.me}")

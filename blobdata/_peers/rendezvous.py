"""How the job's nodes meet: through the job's own ``torch.distributed`` store, as torchrun's ranks do.

:func:`join` runs once per job in each process that makes a dataset with peers (later datasets of the
same job, a mixture's sources among them, reuse what it found). Under a key of the job's own
(``blobdata/peers/v1/<job>/``: torchrun's run id and restart count, so a restarted job never reads an
earlier round's keys), node 0's serving process puts 32 random bytes, the job's secret; every process
reads them. The serving process of each node (its local rank 0 by default) starts the node's service
(:class:`~.service.Service`, on this process's background loop, listening on the node's address) and
puts its name and address under ``node/<rank>``; every process waits for all ``nnodes`` of them, so
that every process of the job has the same :class:`~.config.PeerTable`.

The store is the job's trust root: anyone who can read it can read the secret, as anyone who can reach
it can already join or disrupt the job's collectives (torch's own model: run it on the job's private
network). What is read from it is checked all the same (bounded, JSON of the expected shape, distinct
names). The service also leaves a note of itself in the node's directory (``peers-<pid>-*/service.json``,
:mod:`blobdata._node`), owned by its process's lock, swept once it is gone.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import json
import re
import secrets
import socket
from typing import Any

from .. import _process
from .._cache import BlobCache
from .._config import env
from .._errors import ConfigError
from .._listing import dist_info
from .._loop import run
from .config import Peers, PeerTable
from .daemon import EngineSpec, ServiceProcess, start
from .homes import Homes
from .service import Fetch, Service, address_of, leave_note

__all__ = ["join", "serve", "service_of"]

_MAX_VALUE = 4096  # bytes of one value read from the store
_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})")

#: This process's meetings (job key -> table) and services (job id -> service); a forked child has none.
_joined: _process.PerProcess[dict[tuple[str, int], PeerTable]] = _process.PerProcess(dict)
_services: _process.PerProcess[dict[bytes, Service | ServiceProcess]] = _process.PerProcess(dict)


def _job_key(config: Peers) -> str:
    if config.job is not None:
        return config.job
    names = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    return "|".join(env(n) or "" for n in names)


def _local_host() -> str:
    """The address of this node that the others reach it at: the one that routes to ``MASTER_ADDR``."""
    master = env("MASTER_ADDR")
    if master is None or master == "localhost" or master.startswith("127."):
        return "127.0.0.1"
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # UDP: no packet is sent, the kernel only picks a route
                return str(s.getsockname()[0])
        except OSError:
            continue
    return socket.gethostbyname(socket.gethostname())


def _default_store(timeout: float) -> Any:
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    addr, port = env("MASTER_ADDR"), env("MASTER_PORT")
    if addr is None or port is None or not port.isdigit():
        raise ConfigError(
            "peers need the job's store to meet through: run under torchrun, initialise the process "
            "group first, or pass peers=blobdata.Peers(store=...)"
        )
    return TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))


def _get(store: Any, key: str, timeout: float, what: str) -> bytes:
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
        value = store.get(key)
    except Exception as exc:  # DistStoreError: a timeout, or the store went away
        raise ConfigError(
            f"peers: {what} did not come within {timeout:.0f} s ({exc}); is every node running?"
        ) from exc
    data = bytes(value)
    if len(data) > _MAX_VALUE:
        raise ConfigError(f"peers: {what} in the job's store is {len(data)} bytes, more than expected")
    return data


def join(config: Peers) -> PeerTable | None:
    """This process's place among the job's peers (None for a job of one node); see the module docstring."""
    info = dist_info()
    nnodes = config.nnodes if config.nnodes is not None else info.nnodes
    node = config.node_rank if config.node_rank is not None else info.node_rank
    if nnodes == 1:
        return None
    if not 0 <= node < nnodes:
        raise ConfigError(f"peers: node rank {node} is not in 0..{nnodes - 1}")
    key = (_job_key(config), id(config.store))
    known = _joined.get().get(key)
    if known is not None:
        return known
    store = config.store if config.store is not None else _default_store(config.timeout)
    prefix = f"blobdata/peers/v1/{hashlib.sha256(key[0].encode('utf-8', 'surrogatepass')).hexdigest()[:16]}/"
    serves = config.serves if config.serves is not None else info.local_rank == 0
    if serves and node == 0:
        store.set(prefix + "secret", secrets.token_bytes(32).hex())
    raw = _get(store, prefix + "secret", config.timeout, "node 0's secret")
    try:
        secret = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != 32:
        raise ConfigError("peers: the job's secret in the store is not 32 bytes of hex")
    host = config.host or _local_host()
    name = config.node_name or host
    if serves:
        service = _start(secret, host, config.port, own_process=config.service_process)
        # "local": where the node's own processes reach it (where it listens: a NAT may not loop back)
        entry = {"name": name, "address": config.advertise or service.address, "local": service.address}
        store.set(prefix + f"node/{node}", json.dumps(entry))
    names, addresses, local = [], [], ""
    for k in range(nnodes):
        text = _get(store, prefix + f"node/{k}", config.timeout, f"node {k}'s address")
        try:
            got = json.loads(text)
            n, a, here = got["name"], got["address"], got["local"]
        except (ValueError, KeyError, TypeError):
            n = a = here = None
        if not (
            isinstance(n, str)
            and n.isprintable()
            and all(isinstance(x, str) and _ADDRESS.fullmatch(x) for x in (a, here))
        ):
            raise ConfigError(f"peers: node {k}'s entry in the job's store is not a name and host:port")
        names.append(n)
        addresses.append(a)
        local = here if k == node else local
    if len(set(names)) != nnodes:
        raise ConfigError(
            f"peers: the nodes' names are not distinct ({names}); give each node its own "
            "Peers(node_name=...) or host"
        )
    addresses[node] = local
    table = PeerTable(secret, tuple(names), tuple(addresses), node, config.per_peer)
    if serves:
        if isinstance(service, Service):
            service.homes, service.me = Homes(table.names), node
        else:
            service.set_homes(table.names, node)
    _joined.get()[key] = table
    return table


def _start(secret: bytes, host: str, port: int, *, own_process: bool) -> Service | ServiceProcess:
    """This node's service for the job of ``secret``: in a process of its own
    (:mod:`.daemon`), or on this process's loop."""
    services = _services.get()
    service = services.get(secret)
    if service is not None:
        return service
    if own_process:
        handle = services[secret] = start(secret, host, port)
        return handle
    service = Service(secret)

    async def listen() -> int:
        return await service.server.start(host, port)

    try:
        bound = run(listen(), 30.0)
    except OSError as exc:
        raise ConfigError(
            f"peers: cannot listen on {address_of(host, port)} ({exc}); give Peers(host=, port=) an "
            "address of this node that the others can reach"
        ) from exc
    service.address = address_of(host, bound)
    services[secret] = service
    leave_note(service)
    return service


@atexit.register
def _end_services() -> None:
    """The service processes this process started, told to end and waited for (a forked child has
    none: it neither owns nor waits for its parent's)."""
    for service in (_services.peek() or {}).values():
        if isinstance(service, ServiceProcess):
            service.close(2.0)


def service_of(table: PeerTable) -> Service | ServiceProcess | None:
    """This process's service for ``table``'s job, if it runs one (on its loop: a :class:`Service`) or
    started one (a :class:`ServiceProcess`)."""
    return _services.get().get(table.secret)


def serve(
    table: PeerTable, root: str, cache: BlobCache, owner: Any, fetch: Fetch, engine: EngineSpec
) -> None:
    """Serve the objects below ``root`` (``owner``, a dataset of the job) from ``cache``, if this
    process runs or started its node's service: read when the cache misses them by ``fetch(owner,
    url, size, identity)`` on this process's loop, or, in the service's own process, by a fetch engine
    made there from ``engine``."""
    service = service_of(table)
    if isinstance(service, Service):
        service.add_source(root, cache, owner, fetch)
    elif service is not None:
        service.add_source(root, cache, engine, owner)

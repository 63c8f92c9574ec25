"""A dataset among the job's peers (:mod:`blobdata._peers`): joining them when it is made, a miss of
this node's cache read from its home node (``_fetch_object`` asks), and the reads its node's service
makes for the others.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from .._cache import BlobCache
from .._errors import ConfigError
from .._metrics import stats as _stats
from .._peers import (
    SERVICE_READERS,
    EngineSpec,
    PeerClient,
    Peers,
    PeerTable,
    join,
    peers_setting,
    serve,
)
from .._url import printable
from .reads import Objects, ProcessState

__all__ = ["away", "join_peers", "not_kept", "note_homes", "read_from_home", "serve_peer", "start_from_homes"]

_log = logging.getLogger("blobdata")


def join_peers(ds: Any, peers: bool | Peers | None, cache: BlobCache | None) -> PeerTable | None:
    """``ds``'s place among the job's peers (None: peers off, a job of one node, or a local folder, whose
    files each node reads itself), its objects served to them if this process runs its node's service.
    A collective call, as the listing is."""
    setting = peers_setting(peers)
    if setting is None:
        return None
    if cache is None:
        raise ConfigError(
            f"peers need a cache for {printable(ds._url)}: a node serves the others from it; pass "
            "cache=DIR (each node's own, sized to its share of the dataset and some slack)"
        )
    if ds._local_root is not None:  # its files are read directly, in the thread serving the batch
        _log.info("blobdata: peers are off for %s: a local folder is read directly", printable(ds._url))
        return None
    table = join(setting)
    if table is not None:
        options = ds.fetch_options
        readers = setting.service_concurrency or SERVICE_READERS * options.concurrency
        engine = EngineSpec(options.replace(concurrency=readers), ds._protocol, ds._storage_options)
        serve(table, ds._url, cache, ds, serve_peer, engine)
    return table


async def read_from_home(proc: ProcessState, peers: PeerClient, url: str, size: int, identity: str) -> bytes:
    """A miss of this node's cache, read from the cache of its home node (this node's own through its
    service, which reads each object from the bucket once per job); from the bucket where the home does
    not answer in time or answers wrong. Not kept in this node's cache: its home keeps it."""
    bucket = functools.partial(proc.engine.fetch, url, size=size, identity=identity)
    home = proc.homes.pop(url, None)
    data, from_peer = await peers.read(
        peers.home_of(url) if home is None else home, url, size, identity, bucket
    )
    v = _stats.rec()
    if from_peer:
        v[_stats.N_FROM_PEER if _stats.next_epoch() else _stats.FROM_PEER] += 1
    else:
        v[_stats.N_FROM_BUCKET if _stats.next_epoch() else _stats.FROM_BUCKET] += 1
    return data


def start_from_homes(ds: Any, proc: ProcessState, indices: list[int]) -> list[asyncio.Future[Any]]:
    """The look-ahead's reads of ``indices`` (samples of one object each, which this node's cache
    misses) from their homes, started as one batch: each joins the next request to its home without a
    task of its own (:meth:`~blobdata._peers.PeerClient.start`), from what the look-ahead noted when
    it found it missing (:func:`note_homes`: the object and its home, not looked up again); where a
    read cannot start so, a task reads it as :func:`read_from_home` does. Each future gets the
    object's bytes."""
    peers, noted = proc.peers, proc.noted
    assert peers is not None
    notes = [noted.pop(i, None) for i in indices]
    lost = [i for i, note in zip(indices, notes, strict=True) if note is None]
    if lost:  # not noted (the notes started again meanwhile): from the listing, each home scored alone
        objects = ds._objects(lost)
        found = iter(zip(objects.urls, objects.sizes, objects.ids, strict=True))
    fetch = proc.engine.fetch
    out: list[asyncio.Future[Any]] = []
    for i, note in zip(indices, notes, strict=True):
        if note is None:
            url, size, identity = next(found)
            home = peers.home_of(url) if identity and size >= 0 else -1
        else:
            url, size, identity, home = note
        fut = None
        if home >= 0:
            bucket = functools.partial(fetch, url, size=size, identity=identity)
            fut = peers.start(home, url, size, identity, bucket)
            if fut is None:  # read in a task: its read_from_home takes the home scored here
                proc.homes[url] = home
        out.append(fut if fut is not None else asyncio.ensure_future(ds._load(i, checked=True)))
    return out


def note_homes(proc: ProcessState, objects: Objects, found: list[bool], limit: int) -> None:
    """The homes of ``objects`` the look-ahead found missing from the cache (``found``) and will read
    from their homes (their identity and size known: :func:`read_from_home`), scored as one batch
    (:meth:`~blobdata._peers.Homes.homes_of`) for their reads to take (one object scored alone costs
    1.2 us and 0.4 us per node, 10 us from 24 nodes). Where the look-ahead starts its reads from the
    notes (``proc.starts_noted``: samples of one object each), they are noted whole, by sample
    (``proc.noted``, for :func:`start_from_homes`); else each object's home by URL (``proc.homes``,
    for :func:`read_from_home`: a mixture's sources, BlobDataset, and the reads start_from_homes
    hands to a task). Past ``limit`` entries (reads given up, or answered by the cache after all)
    either notes start again."""
    peers = proc.peers
    if peers is None:
        return
    ids, sizes = objects.ids, objects.sizes
    known = [k for k, f in enumerate(found) if not f and ids[k] and sizes[k] >= 0]
    if not known:
        return
    urls = [objects.urls[k] for k in known]
    homes = peers.homes.homes_of(urls).tolist()
    if len(proc.homes) > limit:
        proc.homes.clear()
    if proc.starts_noted and objects.offsets is None:
        noted, rows = proc.noted, objects.rows
        if len(noted) > limit:
            noted.clear()
        for k, url, home in zip(known, urls, homes, strict=True):
            noted[rows[k]] = (url, sizes[k], ids[k], home)
        return
    proc.homes.update(zip(urls, homes, strict=True))


def not_kept(ds: Any, indices: list[int]) -> list[int]:
    """Of ``indices``, those whose bytes ``ds``'s node cache does not keep once fetched (all without one;
    with peers, those read from other nodes): what is handed over to the next epoch's new workers."""
    if ds.cache is None:
        return indices
    peers = ds._process().peers
    return away(peers, indices, ds._objects(indices)) if peers is not None else []


def away(peers: PeerClient, indices: list[int], objects: Objects) -> list[int]:
    """Of the samples ``indices`` (reading ``objects``), those with an object read from another node
    (its home is elsewhere, and its identity and size are known: else it is read from the bucket and
    kept here). Their bytes are not kept in this node's cache, so the next epoch's workers would wait
    for a peer at their first batches: the training process fetches them for them."""
    homes = peers.homes.homes_of(objects.urls).tolist()
    known = zip(homes, objects.ids, objects.sizes, strict=True)
    far = [h != peers.me and bool(e) and n >= 0 for h, e, n in known]
    bounds = objects.offsets if objects.offsets is not None else range(len(indices) + 1)
    return [i for k, i in enumerate(indices) if any(far[bounds[k] : bounds[k + 1]])]


async def serve_peer(ds: Any, url: str, size: int | None, identity: str) -> bytes:
    """An object of ``ds`` that this node is home for and its cache misses, asked by a peer (or one of
    this node's processes): read from the bucket through ``ds``'s engine (the node's throttle state,
    the one retry budget), pinned to ``identity``. The service puts it in the cache."""
    data, _ = await ds._process().engine.fetch(url, size=size, identity=identity)
    return bytes(data)

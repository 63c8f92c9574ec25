"""A dataset among the job's peers (:mod:`blobdata._peers`): joining them when it is made, and the reads
its node's service makes for them. The asking side is in the read path (``_fetch_object`` in base).
"""

from __future__ import annotations

from typing import Any

from .._cache import BlobCache
from .._errors import ConfigError
from .._peers import Peers, PeerTable, join, peers_setting, serve
from .._url import printable

__all__ = ["join_peers", "serve_peer"]


def join_peers(ds: Any, peers: bool | Peers | None, cache: BlobCache | None) -> PeerTable | None:
    """``ds``'s place among the job's peers (None: peers off, or a job of one node), its objects served
    to them if this process runs its node's service. A collective call, as the listing is."""
    setting = peers_setting(peers)
    if setting is None:
        return None
    if cache is None:
        raise ConfigError(
            f"peers need a cache for {printable(ds._url)}: a node serves the others from it; pass "
            "cache=DIR (each node's own, sized to its share of the dataset and some slack)"
        )
    table = join(setting)
    if table is not None:
        serve(table, ds._url, cache, ds, serve_peer)
    return table


async def serve_peer(ds: Any, url: str, size: int | None, identity: str) -> bytes:
    """An object of ``ds`` that this node is home for and its cache misses, asked by a peer (or one of
    this node's processes): read from the bucket through ``ds``'s engine (the node's throttle state,
    the one retry budget), pinned to ``identity``. The service puts it in the cache."""
    data, _ = await ds._process().engine.fetch(url, size=size, identity=identity)
    return bytes(data)

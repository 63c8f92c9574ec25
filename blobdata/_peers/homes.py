"""Which node is an object's home: rendezvous (highest random weight) hashing over the job's nodes.

Every node of the job scores every object: ``score(key, node) = mix64(h(key) ^ h(node))``, with ``h``
the first 8 bytes of BLAKE2b and ``mix64`` splitmix64's finaliser; the object's home is the node with
the highest score. It is a pure function of the key and the set of node names (by default the
nodes' addresses): every process of the job computes the same home without asking anyone. When a
node leaves, only the objects it was home for move (each to the node that scored second for it: the
survivors' caches stay valid), and a node that joins takes about ``1/N`` of the objects from every
other node, so a resize from ``N`` to ``N - 1`` nodes moves ``1/N`` of the homes, as consistent hashing
promises (Thaler and Ravishankar, 1998). Node *names*, not ranks: an elastic restart may number the
nodes that stay differently, and their caches stay where they are.

Cost: one hash of the key and ``N`` integer mixes per object (:meth:`Homes.home_of`, about 1 us for 8
nodes), or numpy over a batch (:meth:`Homes.homes_of`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["Homes", "key_hash"]

_MASK64 = (1 << 64) - 1
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def key_hash(text: str) -> int:
    """64 bits of BLAKE2b of ``text`` (UTF-8, lone surrogates kept as they are)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: int) -> int:
    x ^= x >> 30
    x = (x * _M1) & _MASK64
    x ^= x >> 27
    x = (x * _M2) & _MASK64
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(_M1)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(_M2)
        out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


class Homes:
    """The homes of objects among ``nodes`` (their names, in the job's order: node ``k`` is the
    ``k``-th). Names must be distinct."""

    def __init__(self, nodes: Sequence[str]) -> None:
        if not nodes:
            raise ValueError("a job has at least one node")
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node names must be distinct, got {list(nodes)!r}")
        self.nodes = tuple(nodes)
        self._salts = [key_hash("node\0" + n) for n in self.nodes]
        self._salt_array = np.array(self._salts, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.nodes)

    def home_of(self, url: str) -> int:
        """The index (in :attr:`nodes`) of ``url``'s home."""
        salts = self._salts
        if len(salts) == 1:
            return 0
        h = key_hash(url)
        best, home = -1, 0
        for k, salt in enumerate(salts):
            score = _mix(h ^ salt)
            if score > best:
                best, home = score, k
        return home

    def homes_of(self, urls: Sequence[str]) -> np.ndarray:
        """:meth:`home_of` of each of ``urls`` (int64), in numpy over the batch."""
        if len(self._salts) == 1:
            return np.zeros(len(urls), dtype=np.int64)
        keys = np.fromiter((key_hash(u) for u in urls), dtype=np.uint64, count=len(urls))
        scores = _mix_array(keys[:, None] ^ self._salt_array[None, :])
        homes: np.ndarray = np.argmax(scores, axis=1).astype(np.int64)
        return homes

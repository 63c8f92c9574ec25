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

Cost: one hash of the key and ``N`` integer mixes per object. :meth:`Homes.home_of` mixes in Python up
to :data:`NUMPY_FROM` nodes (on the 2-core build machine 1.2 us and 0.4 us per node: 2.8 us for 4
nodes, 8 us for 16) and in numpy from there (10 us whatever the number of nodes, where a Python loop
would take 28 us for 64 nodes and 55 us for 128, on each side of every peer read).
:meth:`Homes.homes_of` scores a batch in numpy (14 us, and 1.5 us per object), or one object at a
time where that costs less (a few objects among few nodes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["NUMPY_FROM", "Homes", "key_hash"]

#: From this many nodes, one object's home is scored in numpy: its fixed cost (about 10 us) is then less
#: than the Python loop's, which grows by about 0.4 us per node.
NUMPY_FROM = 24
#: A batch is scored in numpy from this many (objects x nodes, the nodes counted up to NUMPY_FROM).
_BATCH_FROM = 40

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
        if len(salts) >= NUMPY_FROM:  # the first of equal scores, as below
            return int(np.argmax(_mix_array(self._salt_array ^ np.uint64(h))))
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
        if len(urls) * min(len(self._salts), NUMPY_FROM) < _BATCH_FROM:  # numpy's fixed cost is not worth it
            return np.array([self.home_of(u) for u in urls], dtype=np.int64)
        keys = np.fromiter((key_hash(u) for u in urls), dtype=np.uint64, count=len(urls))
        scores = _mix_array(keys[:, None] ^ self._salt_array[None, :])
        homes: np.ndarray = np.argmax(scores, axis=1).astype(np.int64)
        return homes

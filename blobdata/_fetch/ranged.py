"""One object as a read-only, seekable binary file, read in ranges as it is consumed: what reads a
large table from a bucket (an S3 Inventory report, a Parquet index) holds one range of it at a time,
not the whole object.

Each range is one request through a :class:`~blobdata._fetch.FetchEngine` (its retry budget, its
error map), made on blobdata's background loop; every range after the first is pinned to the identity
(ETag, generation) the first response carried, so an object replaced while it is read raises
:class:`~blobdata.ObjectChanged`, never bytes of two versions. A store that answers a range with the
whole object is read whole, once (as the engine does for parts).
"""

from __future__ import annotations

import io
from typing import Any

from .. import _loop
from .._errors import RangeIgnored
from .engine import FetchEngine

__all__ = ["RangedFile"]

#: Bytes asked per request (the engine's default part size).
CHUNK = 8 * 1024 * 1024


class RangedFile(io.RawIOBase):
    """``url`` read through ``engine`` in ranges of ``chunk`` bytes (see the module). Synchronous: call
    it from any thread but the background loop's."""

    def __init__(self, engine: FetchEngine, url: str, *, chunk: int = CHUNK) -> None:
        super().__init__()
        self._engine, self._url, self._chunk = engine, url, chunk
        self._pos = 0
        self._size: int | None = None
        self._identity: str | None = None
        self._buf, self._at = b"", 0  # the range held, and where it starts

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._total() + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def _total(self) -> int:
        if self._size is None:
            self._load(0)
        assert self._size is not None
        return self._size

    def _load(self, start: int) -> None:
        """Hold the range that starts at ``start``."""
        try:
            res = _loop.run(
                self._engine.fetch_range(self._url, start, start + self._chunk, identity=self._identity)
            )
            body, identity, total = res.body, res.identity, res.total
        except RangeIgnored:  # the store sends the whole object for a range: read it once, whole
            body, identity = _loop.run(self._engine.fetch(self._url, identity=self._identity))
            total, start = len(body), 0
        if self._identity is None:
            self._identity = identity or None
        if total is None:  # the store did not say: a short range is the object's end
            total = start + len(body) if len(body) < self._chunk else None
        if total is not None:
            self._size = total
        self._buf, self._at = body, start

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._size is not None and self._pos >= self._size:
            return 0
        if not self._at <= self._pos < self._at + len(self._buf):
            self._load(self._pos)
            if not self._at <= self._pos < self._at + len(self._buf):
                return 0  # past the end
        offset = self._pos - self._at
        n = min(len(view), len(self._buf) - offset)
        view[:n] = self._buf[offset : offset + n]
        self._pos += n
        return n

"""A scripted in-memory :class:`~blobdata._stores.base.Reader`, for engine tests that need no socket.

    reader = FakeReader({"b/k.bin": data})
    reader.fail("b/k.bin", 2, "throttle", retry_after=0.5)   # two TransientErrors, then bytes
    engine = FetchEngine(options, "s3", {}, reader=reader)

Objects live in ``objects`` keyed ``"bucket/key"`` (``replace`` swaps one for a new version, with a
new identity); a read of a missing key raises NotFound naming its URL; a pinned read of another
identity raises ObjectChanged (with ``verify_identity=False`` it answers with the identity it was
asked for, as memory:// does). ``delay_s`` makes every read take that long (``asyncio.sleep``).
Every call is recorded in ``calls`` with the loop time it started, and ``max_in_flight`` is the most
reads that were ever running at once.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from blobdata._errors import NotFound, ObjectChanged, TransientError
from blobdata._stores.base import ReadResult

__all__ = ["Call", "FakeReader"]


@dataclass(frozen=True)
class Call:
    """One read as the engine made it; ``at`` is the event loop's clock when it started (seconds)."""

    bucket: str
    key: str
    start: int | None
    end: int | None
    expect_identity: str | None
    timeout: float
    at: float


class FakeReader:
    """Serves ``objects`` ({"bucket/key": bytes}) with the failures scripted by :meth:`fail`."""

    def __init__(
        self,
        objects: Mapping[str, bytes] | None = None,
        *,
        delay_s: float = 0.0,
        verify_identity: bool = True,
    ) -> None:
        self.objects: dict[str, bytes] = dict(objects or {})
        self.verify_identity = verify_identity
        self.versions: collections.Counter[str] = collections.Counter()
        self.delay_s = delay_s
        self.calls: list[Call] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed = False
        self._script: dict[str, collections.deque[Callable[[str], BaseException]]] = {}
        #: Called with (bucket/key, call number) after each read's delay, before it is answered.
        self.on_read: Callable[[str, int], None] | None = None

    def identity(self, path: str) -> str:
        """The identity a read of ``path`` ("bucket/key") reports now."""
        return f"v{self.versions[path]}-{len(self.objects[path])}"

    def replace(self, path: str, data: bytes) -> None:
        """Put a new version of ``path``: new bytes, new identity."""
        self.objects[path] = data
        self.versions[path] += 1

    def fail(self, path: str, times: int, kind: str = "server", *, retry_after: float | None = None) -> None:
        """The next ``times`` reads of ``path`` raise ``TransientError(kind)`` (with ``retry_after``)."""
        message = f"scripted {kind} failure"
        for _ in range(times):
            self._script.setdefault(path, collections.deque()).append(
                lambda url: TransientError(kind, f"{url}: {message}", retry_after=retry_after)
            )

    def fail_with(self, path: str, times: int, error: Callable[[str], BaseException]) -> None:
        """The next ``times`` reads of ``path`` raise ``error(url)`` (any exception)."""
        for _ in range(times):
            self._script.setdefault(path, collections.deque()).append(error)

    def reads(self, path: str) -> list[Call]:
        """The calls made for ``path`` ("bucket/key"), in order."""
        bucket, _, key = path.partition("/")
        return [c for c in self.calls if (c.bucket, c.key) == (bucket, key)]

    async def read(
        self,
        bucket: str,
        key: str,
        *,
        start: int | None,
        end: int | None,
        expect_identity: str | None,
        timeout: float,
        size: int | None = None,
    ) -> ReadResult:
        loop = asyncio.get_running_loop()
        self.calls.append(Call(bucket, key, start, end, expect_identity, timeout, loop.time()))
        number = len(self.calls)
        path, url = f"{bucket}/{key}", f"s3://{bucket}/{key}"
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.on_read is not None:
                self.on_read(path, number)
            script = self._script.get(path)
            if script:
                raise script.popleft()(url)
            if path not in self.objects:
                raise NotFound(f"{url}: no such object (fake reader)", url)
            identity = self.identity(path)
            if not self.verify_identity:
                identity = expect_identity or identity
            elif expect_identity is not None and expect_identity != identity:
                raise ObjectChanged(f"{url}: identity {identity}, listed {expect_identity}", url)
            data = self.objects[path]
            body = data[start or 0 : len(data) if end is None else end]
            return ReadResult(body, identity, len(data))
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        self.closed = True

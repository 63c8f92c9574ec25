"""Listing one S3 (or GCS) prefix in parallel: its key space cut into ranges listed at once, the result the
very list a page-by-page listing gives. GCS's objects.list serves the same way, ``startOffset`` standing
for ``start-after`` (:class:`~blobdata._stores.gcs.GCSLister`).

ListObjectsV2 pages follow one another (each continuation token comes with the page before), so a
prefix of 200,000 keys is 200 round trips in a row. ``start-after`` starts a listing anywhere in the
key space. The first two pages are read one after the other (a prefix that ends within them, such as
an ImageNet class folder, costs no request more); then the rest of the prefix is cut at split
strings and each range ``(after, upto]`` is listed from ``start-after=after``, page by page, until its
first key past ``upto``. The first request of a range is the probe: its first key says where the
keys are.

Split strings: the keys after the prefix read as numbers (:class:`_Space`: at each position, digits
from the characters the first pages hold there, widened to their class), and each range spans a
width meant to hold 0.9 page of keys (so that one request lists it and sees the key past its end):
the first pages' width to begin with, doubled after a range that held less than half a page, cut by a
fifth after one that held a page or more. A range that finds
its first key far beyond its end (a gap in the key space) makes the next range reach past that key,
so a gap costs one request, not one per split. Ranges in flight start at 2 per prefix and double each
time as many have come back (a round), up to ``FetchOptions.concurrency`` (the extra ranges of every
prefix of a listing share that many slots): a prefix of a few dozen pages sends few ranges past its
end. A range that finds nothing after its start ends the listing.

Identical to page by page, or page by page: S3 orders keys by their UTF-8 bytes (code points, as
Python compares strings) and ``start-after`` follows that order. The ranges are checked to have
done so: each range's keys increase and lie in ``(after, upto]``, and the key that stopped one range
is the first key the next one found (the first key after the boundary, either way). A store that
orders otherwise (SeaweedFS orders by path segment) or ignores ``start-after`` fails a check, and the
prefix is listed again page by page. Every request is still checked as every page is (ordering,
tokens, page size, empty pages; ``S3LeanLister._pages``) under the listing's one deadline.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol
from urllib.parse import quote

from ..base import Columns, Growing
from .xml import ListPage, list_query, parse_list_page

if TYPE_CHECKING:
    from ..h1 import Response
    from .reader import S3Reader


class _Lister(Protocol):
    """What this module uses of :class:`~blobdata._stores.s3.S3LeanLister`."""

    url: Any

    def _pages(
        self, prefix: str, delimiter: str | None, start_after: str | None = None
    ) -> AsyncIterator[ListPage]: ...


__all__ = [
    "Board", "LocalBoard", "Part", "RangeInfo", "consistent", "list_page_after", "list_part", "list_prefix",
    "relist",
]  # fmt: skip

logger = logging.getLogger(__name__)

_FIRST_RANGES = 2
_BLOCK = 4  # ranges a process claims at once on a shared board
_SEQUENTIAL_PAGES = 2  # pages read one after the other before any range


async def list_page_after(
    reader: S3Reader, bucket: str, prefix: str, start_after: str, *, timeout: float, max_keys: int
) -> ListPage:
    """One ListObjectsV2 page of the keys of ``bucket`` under ``prefix`` after ``start_after``; no
    retries (:meth:`S3Reader.list_page` with ``start-after``, which sorts last in the signed query)."""
    from ..._errors import TransientError
    from .reader import LIST_BODY_CAP

    url = f"s3://{bucket}/{prefix}"
    safe = start_after.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    query = list_query(prefix, delimiter=None, continuation=None, max_keys=max_keys)
    query += "&start-after=" + quote(safe, safe="")

    def on_success(resp: Response) -> ListPage:
        body = resp.body
        if resp.content_length is not None and len(body) != resp.content_length:
            raise TransientError("short_read", f"{url}: got {len(body)} of {resp.content_length} bytes")
        return parse_list_page(body, url)

    return await reader._send(bucket, None, query, {}, timeout, url, on_success, max_body=LIST_BODY_CAP)


_CLASSES = ("0123456789", "abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_PRINTABLE = "".join(chr(c) for c in range(0x21, 0x7F))


class _Space:
    """Key suffixes as numbers in a mixed radix: the digits of position ``i`` are the characters the
    first page holds there, each widened to its class (a digit to 0-9, a letter to its case's 26), so
    that numbered and hashed names count as they are made (``img_0999`` + 1 is ``img_1000``)."""

    def __init__(self, suffixes: list[str]) -> None:
        self.fixed = min(len(s) for s in suffixes)  # positions every key has: no "ended" digit there
        self.alphabets: list[str] = []
        for i in range(max(len(s) for s in suffixes) + 4):
            seen = {s[i] for s in suffixes if i < len(s)}
            chars = set(seen) if seen else set(_PRINTABLE)
            for cls in _CLASSES:
                if seen & set(cls):
                    chars |= set(cls)
            self.alphabets.append("".join(sorted(chars)))

    def _radix(self, i: int) -> int:
        return len(self.alphabets[i]) + (i >= self.fixed)

    def value(self, s: str) -> int:
        v = 0
        for i, alphabet in enumerate(self.alphabets):
            # Where the character sits in the alphabet (one outside it counts as its neighbour below:
            # the order is kept, not strictly); past ``fixed``, 0 is "the string has ended".
            d = bisect.bisect_right(alphabet, s[i]) if i < len(s) else 0
            d = max(d - 1, 0) if i < self.fixed else d
            v = v * self._radix(i) + d
        return v

    def string(self, v: int) -> str | None:
        """A string of about value ``v`` (None: past every string of this length)."""
        digits = [0] * len(self.alphabets)
        for i in reversed(range(len(self.alphabets))):
            v, digits[i] = divmod(v, self._radix(i))
        if v:
            return None
        while len(digits) > self.fixed and digits[-1] == 0:
            digits.pop()  # the string ends
        chars = (self.alphabets[i][d if i < self.fixed else max(d, 1) - 1] for i, d in enumerate(digits))
        return "".join("\ue000" if "\ud800" <= c <= "\udfff" else c for c in chars)


@dataclasses.dataclass
class _Range:
    after: str | None  # keys after this one (None: the first page's listing, continued)
    upto: str | None  # up to and including this one (None: to the end)
    found: Growing = dataclasses.field(default_factory=Growing)  # its keys, ``cut`` bytes shorter
    count: int = 0
    first_seen: str | None = None  # the first key its requests returned, before any cut
    stop: str | None = None  # the first key past ``upto`` (None: the listing ended)
    sound: bool = True  # its keys increased and lay in (after, upto]
    done: bool = False


class RangeInfo(NamedTuple):
    """What a range found, without its keys: enough to check that ranges make one listing."""

    after: str | None
    upto: str | None
    first_seen: str | None
    stop: str | None
    sound: bool
    listed: int  # keys


def _first_unordered(objects: Columns, last: bytes | None) -> int:
    """The first key not above the one before it (``last`` before the first), by bytes; ``len``: none."""
    for i in range(len(objects)):
        key = objects.key_bytes(i)
        if last is not None and key <= last:
            return i
        last = key
    return len(objects)


def _bisect_above(objects: Columns, bound: bytes, hi: int) -> int:
    """The first of the (increasing) keys ``[0, hi)`` above ``bound``; ``hi`` when none is."""
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if objects.key_bytes(mid) > bound:
            hi = mid
        else:
            lo = mid + 1
    return lo


async def _run(r: _Range, pages: AsyncIterator[ListPage], cut: int = 0) -> _Range:
    last = r.after.encode("utf-8", "surrogatepass") if r.after is not None else None
    upto = r.upto.encode("utf-8", "surrogatepass") if r.upto is not None else None
    try:
        async for page in pages:
            objects = page.objects
            n = len(objects)
            if not n:
                continue
            if r.first_seen is None:
                r.first_seen = objects.key(0)
            if page.ordered and (last is None or objects.key_bytes(0) > last):
                ordered = n  # the listing checked the rest
            else:
                ordered = _first_unordered(objects, last)
            keep = _bisect_above(objects, upto, ordered) if upto is not None else ordered
            r.found.add(objects.head(keep).cut(cut))
            r.count += keep
            if keep < n:
                if keep < ordered or (upto is not None and objects.key_bytes(keep) > upto):
                    r.stop = objects.key(keep)
                else:
                    r.sound = False
                return r
            last = objects.key_bytes(n - 1)
        return r
    finally:
        r.done = True
        await pages.aclose()  # type: ignore[attr-defined]


def consistent(ranges: Sequence[RangeInfo]) -> bool:
    """Whether the ranges, in order, are one listing (see the module docstring)."""
    for i in range(len(ranges) - 1):
        r, nxt = ranges[i], ranges[i + 1]
        if not r.sound:
            return False
        if r.stop is None:  # the listing ended here: nothing may lie after
            return all(not later.listed and later.sound for later in ranges[i + 1 :])
        if r.stop != nxt.first_seen:
            return False
    return ranges[-1].sound and ranges[-1].stop is None


class Board(Protocol):
    """Where the processes listing one prefix meet: ``torch.distributed``'s ``Store`` (set, get, which
    waits for the key, compare_set), or :class:`LocalBoard` in one process. Its keys: ``state``
    (``small``: the lead listed it all; ``big``: ranges), ``sample`` and ``width`` (the lead's first
    pages, which fix the split strings), ``frontier`` (the first key no range claimed yet, and who
    claimed last) and ``reach`` (a key past a gap)."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...


class LocalBoard:
    """A :class:`Board` of one process."""

    remote = False

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self._data[key] = value

    def get(self, key: str) -> bytes:
        return self._data[key]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        if self._data.get(key, b"") == expected:
            self._data[key] = desired
        return self._data[key]


_END = b"\xff"  # no key is this (keys are UTF-8): the frontier once the listing has ended


async def _ask(board: Board, op: str, *args: Any) -> Any:
    """A board operation; a shared store's off the event loop (it waits on the network)."""
    call = getattr(board, op)
    if getattr(board, "remote", True):
        return await asyncio.to_thread(call, *args)
    return call(*args)


def _enc(key: str | None) -> bytes:
    return _END if key is None else key.encode("utf-8", "surrogatepass")


def _dec(value: bytes) -> str | None:
    return None if value == _END else value.decode("utf-8", "surrogatepass")


@dataclasses.dataclass
class Part:
    """What one process listed of a prefix: its ranges (in key order) and their keys, one after the
    other in ``objects`` (``cut`` bytes shorter). ``lead``: it read the first pages."""

    ranges: list[RangeInfo]
    objects: Columns
    lead: bool = False


async def list_prefix(
    lister: _Lister, prefix: str, limit: int, slots: asyncio.Semaphore, page_keys: int = 1000, *, cut: int = 0
) -> Columns:
    """Every key under ``prefix``, in the store's order, with ranges listed at once: up to ``limit`` for
    this prefix, each extra range holding one of the lister's ``slots`` while it lists. Keys come
    without their first ``cut`` bytes (the lister's root)."""
    part = await list_part(lister, prefix, limit, slots, page_keys, cut=cut, board=LocalBoard(), lead=True)
    if consistent(part.ranges):
        return part.objects
    return await relist(lister, prefix, cut)


async def relist(lister: _Lister, prefix: str, cut: int) -> Columns:
    """``prefix`` page by page: where the ranges did not make one listing (see the module docstring)."""
    logger.info("listing %s://%s/%s: the store's start-after (GCS: startOffset) does not follow the key "
                "order; listed page by page instead", getattr(lister, "store", "s3"), lister.url.bucket,
                prefix)  # fmt: skip
    out = Growing()
    async for page in lister._pages(prefix, None):
        out.add(page.objects.cut(cut))
    return out.done()


async def list_part(
    lister: _Lister, prefix: str, limit: int, slots: asyncio.Semaphore, page_keys: int = 1000, *, cut: int,
    board: Board, lead: bool, nonce: str = "",
) -> Part:  # fmt: skip
    """This process's part of ``prefix``, listed with the others that share ``board``: the ``lead``
    reads the first pages and, for a prefix longer than that, publishes the split strings; then every
    process claims ranges from the board's frontier until the listing ends. ``nonce`` tells this
    process's claims from the others'."""
    head = _Range(None, None)
    pages: AsyncIterator[ListPage] | None = None
    if lead:
        pages = lister._pages(prefix, None)
        keys: list[str] = []
        read = 0
        async for page in pages:  # the first pages one after the other: most prefixes end within them
            head.found.add(page.objects.cut(cut))
            head.count += len(page.objects)
            keys += page.keys
            read += 1
            if page.next_token is not None and read >= _SEQUENTIAL_PAGES and limit >= 2 and len(keys) >= 2:
                break
        else:
            await _ask(board, "set", "state", b"small")
            info = RangeInfo(None, None, keys[0] if keys else None, None, True, head.count)
            return Part([info], head.found.done(), lead=True)
        start = len(prefix)
        space = _Space([k[start:] for k in keys])
        span = max(1, space.value(keys[-1][start:]) - space.value(keys[0][start:]))
        width = max(1, span * page_keys * 9 // (10 * (len(keys) - 1)))  # 0.9 page: one request a range
        head.first_seen = keys[0]
    else:
        if await _ask(board, "get", "state") == b"small":
            return Part([], Columns.empty())
        keys = json.loads(await _ask(board, "get", "sample"))
        width = int(await _ask(board, "get", "width"))
        start = len(prefix)
        space = _Space([k[start:] for k in keys])

    def after(key: str, span: int) -> str | None:
        s = space.string(space.value(key[start:]) + span)
        if s is None:
            return None
        nxt = prefix + s
        return nxt if nxt > key else key + "!"

    if lead:
        head.upto = after(keys[-1], width)
        await _ask(board, "set", "frontier", _enc(head.upto) + b"\xff")
        await _ask(board, "set", "sample", json.dumps(keys).encode())
        await _ask(board, "set", "width", str(width).encode())
        await _ask(board, "set", "state", b"big")
    del keys
    claims = 0
    lock = asyncio.Lock()  # one claim of this process at a time: they would only race each other
    claimed: list[tuple[str, str | None]] = []  # claimed in a block, not yet listed
    block = 1 if isinstance(board, LocalBoard) else _BLOCK

    async def claim() -> _Range | None:
        """The next range of the key space, claimed on the board (a shared one: ``_BLOCK`` ranges in a
        row at once, fewer round trips to the store); None once it has ended."""
        nonlocal claims
        async with lock:
            while not claimed:
                now = await _ask(board, "get", "frontier")
                frontier = _dec(now.rsplit(b"\xff", 1)[0])
                if frontier is None:
                    return None
                reach = _dec(await _ask(board, "compare_set", "reach", b"", b""))
                bounds: list[tuple[str, str | None]] = []
                start: str | None = frontier
                while start is not None and len(bounds) < block:
                    upto = after(max(start, reach) if reach and not bounds else start, width)
                    bounds.append((start, upto))
                    start = upto
                claims += 1
                mine = _enc(start) + b"\xff" + f"{nonce}.{claims}".encode()
                if await _ask(board, "compare_set", "frontier", now, mine) == mine:
                    claimed.extend(bounds)
            after_key, upto_key = claimed.pop(0)
            return _Range(after_key, upto_key)

    ranges = [head] if lead else []

    async def next_range() -> _Range | None:
        """A range claimed once a slot is free (so that a process claims no more than it lists at once),
        and listed; None once the listing has ended."""
        async with slots:
            r = await claim()
            if r is None:
                return None
            ranges.append(r)  # claims only move forward: this process's ranges stay in key order
            return await _run(r, lister._pages(prefix, None, start_after=r.after), cut)

    running: set[asyncio.Future[_Range | None]] = set()
    if pages is not None:
        running.add(asyncio.ensure_future(_run(head, pages, cut)))  # the first page's listing goes on
    joined, ready = Growing(), 0  # my ranges done in order so far, in one set of arrays
    in_flight, ended, window = _FIRST_RANGES, False, 0
    try:
        while True:
            while not ended and len(running) < in_flight:
                running.add(asyncio.ensure_future(next_range()))
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                running.discard(task)
                r = task.result()  # a failed request fails the listing
                if r is None:
                    ended = True
                    continue
                if r.stop is None:
                    ended = True
                    await _ask(board, "set", "frontier", _END + b"\xff" + nonce.encode())
                elif not r.count and r.upto is not None and r.stop > r.upto:
                    await _raise_reach(board, r.stop)  # a gap: the next range reaches past the key found
                if r.after is not None:  # aim at a page a range: wider after a thin one, narrower after
                    if r.count < page_keys // 2:
                        width *= 2
                    elif r.count >= page_keys:
                        width = max(1, width * 4 // 5)
                window += 1
                if window >= in_flight:  # a whole window came back: twice as many (slow start, per round)
                    in_flight, window = min(limit, in_flight * 2), 0
            while ready < len(ranges) and ranges[ready].done:  # joined as soon as the ranges before are
                joined.add(ranges[ready].found.done())
                ready += 1
    except BaseException:
        for task in running:
            task.cancel()
        raise
    infos = [RangeInfo(r.after, r.upto, r.first_seen, r.stop, r.sound, r.count) for r in ranges]
    return Part(infos, joined.done(), lead=lead)


async def _raise_reach(board: Board, key: str) -> None:
    """``reach`` moved up to ``key`` unless another process moved it further."""
    while True:
        now = await _ask(board, "compare_set", "reach", b"", b"")
        if now and _dec(now) is not None and (_dec(now) or "") >= key:
            return
        if await _ask(board, "compare_set", "reach", now, _enc(key)) == _enc(key):
            return

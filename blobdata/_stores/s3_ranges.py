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
so a gap costs one request, not one per split. Ranges in flight start at 2 per prefix and double as
ranges come back, up to ``FetchOptions.concurrency`` (the extra ranges of every prefix of a listing
share that many slots); a range that finds nothing after its start ends the listing.

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
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol
from urllib.parse import quote

from .h1 import Response
from .s3 import LIST_BODY_CAP, S3Reader
from .s3xml import ListPage, list_query, parse_list_page


class _Lister(Protocol):
    """What this module uses of :class:`~blobdata._stores.s3_listing.S3LeanLister`."""

    url: Any

    def _pages(
        self, prefix: str, delimiter: str | None, start_after: str | None = None
    ) -> AsyncIterator[ListPage]: ...


__all__ = ["list_prefix", "list_page_after"]

logger = logging.getLogger(__name__)

Found = tuple[str, int, str]  # (full key, size, etag)
_FIRST_RANGES = 2
_SEQUENTIAL_PAGES = 2  # pages read one after the other before any range


async def list_page_after(
    reader: S3Reader, bucket: str, prefix: str, start_after: str, *, timeout: float, max_keys: int
) -> ListPage:
    """One ListObjectsV2 page of the keys of ``bucket`` under ``prefix`` after ``start_after``; no
    retries (:meth:`S3Reader.list_page` with ``start-after``, which sorts last in the signed query)."""
    from .._errors import TransientError

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
    found: list[Found] = dataclasses.field(default_factory=list)
    first_seen: str | None = None  # the first key its requests returned, before any cut
    stop: str | None = None  # the first key past ``upto`` (None: the listing ended)
    sound: bool = True  # its keys increased and lay in (after, upto]


async def _run(r: _Range, pages: AsyncIterator[ListPage]) -> _Range:
    last = r.after
    try:
        async for page in pages:
            for key, size, etag in zip(page.keys, page.sizes, page.etags, strict=True):
                if r.first_seen is None:
                    r.first_seen = key
                if r.upto is not None and key > r.upto:
                    r.stop = key
                    return r
                if last is not None and key <= last:
                    r.sound = False
                    return r
                r.found.append((key, size, etag))
                last = key
        return r
    finally:
        await pages.aclose()  # type: ignore[attr-defined]


def _consistent(ranges: list[_Range]) -> bool:
    """Whether the ranges, in order, are one listing (see the module docstring)."""
    for i in range(len(ranges) - 1):
        r, nxt = ranges[i], ranges[i + 1]
        if not r.sound:
            return False
        if r.stop is None:  # the listing ended here: nothing may lie after
            return all(not later.found and later.sound for later in ranges[i + 1 :])
        if r.stop != nxt.first_seen:
            return False
    return ranges[-1].sound and ranges[-1].stop is None


async def _bounded(slots: asyncio.Semaphore, lister: _Lister, prefix: str, r: _Range) -> _Range:
    async with slots:
        return await _run(r, lister._pages(prefix, None, start_after=r.after))


async def list_prefix(
    lister: _Lister, prefix: str, limit: int, slots: asyncio.Semaphore, page_keys: int = 1000
) -> list[Found]:
    """Every key under ``prefix``, in the store's order, with ranges listed at once: up to ``limit`` for
    this prefix, each extra range holding one of the lister's ``slots`` while it lists."""
    pages = lister._pages(prefix, None)
    found: list[Found] = []
    read = 0
    async for page in pages:  # the first pages one after the other: most prefixes end within them
        found.extend(zip(page.keys, page.sizes, page.etags, strict=True))
        read += 1
        if page.next_token is not None and read >= _SEQUENTIAL_PAGES and limit >= 2 and len(found) >= 2:
            break
    else:
        return found
    cut = len(prefix)
    keys = [f[0] for f in found]
    space = _Space([k[cut:] for k in keys])
    span = max(1, space.value(keys[-1][cut:]) - space.value(keys[0][cut:]))
    width = max(1, span * page_keys * 9 // (10 * (len(keys) - 1)))  # 0.9 page: one request a range

    def after(key: str, span: int) -> str | None:
        s = space.string(space.value(key[cut:]) + span)
        if s is None:
            return None
        nxt = prefix + s
        return nxt if nxt > key else key + "!"

    frontier = after(keys[-1], width)
    head = _Range(None, frontier, first_seen=keys[0])
    head.found = found
    ranges = [head]
    running: dict[asyncio.Task[_Range], _Range] = {
        asyncio.ensure_future(_run(head, pages)): head  # the first page's listing goes on
    }
    in_flight, ended, reach = _FIRST_RANGES, False, frontier
    try:
        while True:
            while not ended and frontier is not None and len(running) < in_flight:
                upto = after(max(frontier, reach) if reach is not None else frontier, width)
                r = _Range(frontier, upto)
                ranges.append(r)
                running[asyncio.ensure_future(_bounded(slots, lister, prefix, r))] = r
                frontier = upto
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                r = running.pop(task)
                task.result()  # a failed request fails the listing
                if r.stop is None:
                    ended = True
                elif not r.found and frontier is not None and r.stop > frontier:
                    reach = r.stop  # a gap: the next range reaches past the key found
                if (
                    r.after is not None
                ):  # aim at a page a range: wider after a thin one, narrower after a thick one
                    if len(r.found) < page_keys // 2:
                        width *= 2
                    elif len(r.found) >= page_keys:
                        width = max(1, width * 4 // 5)
                in_flight = min(limit, in_flight * 2)
    except BaseException:
        for task in running:
            task.cancel()
        raise
    if _consistent(ranges):
        return [f for r in ranges for f in r.found]
    logger.info("listing %s://%s/%s: the store's start-after (GCS: startOffset) does not follow the key "
                "order; listed page by page instead", getattr(lister, "store", "s3"), lister.url.bucket,
                prefix)  # fmt: skip
    out: list[Found] = []
    async for page in lister._pages(prefix, None):
        out.extend(zip(page.keys, page.sizes, page.etags, strict=True))
    return out

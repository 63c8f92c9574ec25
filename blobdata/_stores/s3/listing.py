"""Listing S3: ListObjectsV2 through blobdata's own signed requests (the lean path), or through s3fs
for the options only s3fs understands. Also S3's identity rule for an fsspec info dict.

The lean path costs ~0.03 s of client CPU per 1,000-key page where botocore spends ~0.14 s. Each
page is retried under the one budget (:func:`blobdata._retry.with_retries`) and a final failure is
stated by the one error map, as s3fs's errors are.

A listing the store drives must end: every continuation token of a listing is remembered (one sent
again is an error), keys and common prefixes must increase from entry to entry and page to page, a
page may hold no more entries than asked for (but for a last page where ``whole_ok``), 1,000 pages
in a row without an entry is an error, and the whole listing has a deadline
(``FetchOptions.listing_timeout``). Keys and prefixes outside the requested prefix are dropped, and
named in one warning when the listing ends.

A prefix of more than one page is listed in key ranges at once (:mod:`.ranges`): the same keys in
the same order as page by page, each range's pages checked as above. :class:`PagedLister` holds these
checks for any store whose pages carry a continuation token (GCS's lister is one too).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import numpy as np

from ..._config import FetchOptions
from ..._errors import BlobdataError, FetchError, FetchTimeout, TransientError
from ..._retry import final_error, with_retries
from ..._url import BlobURL, printable
from ..base import Columns, count_list
from ..fsspec import bounded
from .ranges import Board, Part, list_page_after, list_part, list_prefix
from .reader import STORE, S3Reader
from .xml import ListPage

__all__ = ["PagedLister", "S3LeanLister", "S3fsLister", "identity", "lean_s3"]

logger = logging.getLogger(__name__)

_PAGE_KEYS = 1000  # entries asked per page (the store's maximum)
_MAX_EMPTY_PAGES = 1000  # truncated pages in a row without an entry (S3 may skip deleted entries)
_MAX_TOKEN = 8192  # characters of one continuation token
_NAMED = 5  # keys named in the warning about keys outside the prefix


def identity(info: Mapping[str, Any]) -> str:
    """S3's identity of a listed object: the ETag without quotes, ``etag@version`` when versioned."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    version = info.get("VersionId") or info.get("version_id")
    return f"{etag}@{version}" if version and version != "null" else etag


class S3fsLister:
    """list_objects_v2 pages through s3fs, bypassing its dircache, for the options only s3fs reads.
    Each operation is bounded by the dataset's timeout and attempt budget."""

    def __init__(self, url: BlobURL, fs: Any, options: FetchOptions) -> None:
        self.url = url
        self.fs = fs
        self.options = options

    def _prefix(self) -> str:
        return self.url.prefix + "/" if self.url.prefix else ""

    def _iter(self, prefix: str, delimiter: str) -> Any:
        count_list()  # one listing through s3fs (its pages are its own)
        return self.fs._iterdir(self.url.bucket, prefix=prefix, delimiter=delimiter)

    async def folders(self) -> tuple[list[str], bool]:
        return await bounded(self._folders, url=str(self.url), options=self.options, store="s3")

    async def _folders(self) -> tuple[list[str], bool]:
        base = self._prefix()
        cut = len(self.url.bucket) + 1 + len(base)
        names: list[str] = []
        anything = False
        async for info in self._iter(base, "/"):
            anything = True
            if info["type"] == "directory":
                names.append(info["Key"][cut:])  # "bucket/prefix/cls" (s3fs dropped the "/")
        return names, anything

    async def below(self, folder: str) -> Columns:
        return await bounded(
            lambda: self._below(folder), url=f"{self.url}/{folder}", options=self.options, store="s3"
        )

    async def _below(self, folder: str) -> Columns:
        cut = len(self.url.bucket) + 1 + len(self._prefix())
        out: list[tuple[str, int, str]] = []
        async for info in self._iter(self._prefix() + folder + "/", ""):
            out.append((info["Key"][cut:], int(info["size"]), identity(info)))
        return Columns.from_entries(out)

    async def aclose(self) -> None:
        """Nothing to do: the s3fs client is shared through :func:`blobdata._stores.fsspec.get_fs`."""


class _Order:
    """Checks that names come in a strictly increasing order: S3's (by UTF-8 bytes, which is by
    code point) or the one some S3-compatible stores list in (by path segment, SeaweedFS's: "x/y"
    before "x y"), whichever the listing keeps to. Either way no name comes twice, so it moves on."""

    __slots__ = ("by_path", "by_text", "last")

    def __init__(self) -> None:
        self.by_text = self.by_path = True
        self.last: str | None = None

    def follow(self, names: list[str]) -> tuple[str, str] | None:
        """Take the next ``names``; (name, the one before it) at the first that breaks both orders."""
        last = self.last
        last_parts = last.split("/") if last is not None else []
        for name in names:
            parts = name.split("/")
            if last is not None:
                if self.by_text and name <= last:
                    self.by_text = False
                if self.by_path and parts <= last_parts:
                    self.by_path = False
                if not (self.by_text or self.by_path):
                    return name, last
            last, last_parts = name, parts
        self.last = last
        return None

    def follow_keys(self, objects: Columns, prefix: bytes) -> tuple[tuple[str, str] | None, Any]:
        """:meth:`follow` for a page of keys as columns, and which keys start with ``prefix`` (a bool
        array): both from one grid of the keys' bytes, a key a row."""
        n = len(objects)
        if not n:
            return None, np.ones(0, dtype=bool)
        last = self.last.encode("utf-8", "surrogatepass") if self.last is not None else None
        if bool((objects.keys == 0).any()) or (last is not None and b"\0" in last):
            keys = objects.key_list()  # a NUL byte would read as the grid's padding
            wanted = prefix.decode("utf-8", "surrogatepass")
            return self.follow(keys), np.array([k.startswith(wanted) for k in keys], dtype=bool)
        grid = objects.grid()
        width = len(prefix)
        if grid.shape[1] >= width:
            inside = (grid[:, :width] == np.frombuffer(prefix, np.uint8)).all(axis=1)
        else:
            inside = np.zeros(n, dtype=bool)
        a, b = grid[:-1], grid[1:]
        differ = a != b
        col = differ.argmax(axis=1)
        at = np.arange(len(col))
        c1, c2, moved = a[at, col], b[at, col], differ[at, col]
        text = moved & (c1 < c2)
        # By path segment: '/' ends a segment, so it sorts before any other byte.
        path = moved & (c2 != 0) & ((c1 == 0) | (c1 == 47) | ((c2 != 47) & (c1 < c2)))
        if last is not None:  # the page before's last key, then this page's first
            first = objects.key_bytes(0)
            text = np.append(first > last, text)
            path = np.append(first.split(b"/") > last.split(b"/"), path)
        fails = []
        for alive, ok in ((self.by_text, text), (self.by_path, path)):
            bad = np.flatnonzero(~ok)
            fails.append(-1 if not alive else int(bad[0]) if len(bad) else None)
        if fails[0] is not None and fails[1] is not None:  # both orders broken, at the later of the two
            i = max(fails[0], fails[1]) + (last is None)
            before = objects.key(i - 1) if i > 0 else self.last
            return (objects.key(i), before or ""), inside
        self.by_text = self.by_text and fails[0] is None
        self.by_path = self.by_path and fails[1] is None
        self.last = objects.key(n - 1)
        return None, inside


class PagedLister:
    """The checks of a listing the store drives, page by page (see the module docstring), for any store
    whose listing pages carry a continuation token: S3's ListObjectsV2 (:class:`S3LeanLister`) and
    GCS's objects.list (:class:`~blobdata._stores.gcs.GCSLister`). A subclass sends one page
    (:meth:`_request`); ``store`` is its scheme and ``hint`` its credential hint, for the messages.

    One lister is one listing: its deadline (``options.listing_timeout``) starts at its first
    request and covers every page of every prefix it lists.
    """

    store = "s3"
    hint = ""
    #: Whether a last page (no continuation token) may hold more entries than asked: the whole prefix in
    #: one answer, as GCS emulators that ignore ``maxResults`` send it.
    whole_ok = False

    def __init__(self, url: BlobURL, options: FetchOptions) -> None:
        self.url = url
        self.options = options
        self.base = url.prefix + "/" if url.prefix else ""
        self._deadline: float | None = None
        self._slots: asyncio.Semaphore | None = None  # for the extra ranges of every prefix together
        self._outside: list[str] = []  # the first keys outside the requested prefix
        self._outside_count = 0

    async def _request(
        self, prefix: str, delimiter: str | None, token: str | None, start_after: str | None, timeout: float
    ) -> ListPage:
        """One page (after ``start_after`` when given and ``token`` is None); no retries."""
        raise NotImplementedError

    def _fail(self, what: str) -> FetchError:
        root = str(self.url)
        return FetchError(f"listing of {root} failed: {what}; retry later, or check what answers for "
                          "the endpoint (a proxy or gateway)", url=root)  # fmt: skip

    async def _page(
        self,
        prefix: str,
        delimiter: str | None,
        token: str | None,
        pages: int,
        start_after: str | None = None,
    ) -> ListPage:
        """One page under the retry budget and the listing's deadline (``start_after``: the first page of
        a range, :mod:`.ranges`)."""
        bucket, opts, root = self.url.bucket, self.options, str(self.url)
        loop = asyncio.get_running_loop()
        if self._deadline is None:
            self._deadline = loop.time() + opts.listing_timeout
        left = self._deadline - loop.time()
        timeout = min(opts.timeout, max(left, 0.001))
        call = functools.partial(self._request, prefix, delimiter, token, start_after, timeout)
        count_list()
        try:
            if left <= 0:
                raise TimeoutError
            pages_call = with_retries(call, url=f"{self.store}://{bucket}/{prefix}", options=opts)
            return await asyncio.wait_for(pages_call, left)
        except BlobdataError as exc:
            # Restated for the dataset's root, as a listing error, from the store's status and code
            # (or the transport error) chained behind the last TransientError.
            origin = exc.__cause__
            if isinstance(origin, TransientError) and origin.__cause__ is not None:
                origin = origin.__cause__
            err = final_error(
                origin or exc, root, hint=self.hint, what="listing", timeout=opts.timeout,
                attempts=opts.attempts,
            )  # fmt: skip
            if err is exc:
                raise
            raise err from exc
        except TimeoutError:  # the listing's deadline (a page's own is with_retries' FetchTimeout)
            raise FetchTimeout(
                f"listing of {root} did not end within listing_timeout={opts.listing_timeout:g}s "
                f"({pages} pages of {self.store}://{bucket}/{prefix} so far); raise "
                "FetchOptions(listing_timeout=) for a folder that large, or check the store: a listing "
                "that never ends is its fault",
                url=root,
            ) from None

    async def _pages(
        self, prefix: str, delimiter: str | None, start_after: str | None = None
    ) -> AsyncIterator[ListPage]:
        """The pages of one listing of ``prefix`` (after ``start_after``), each checked; entries outside
        it dropped."""
        token: str | None = None
        tokens: set[str] = set()
        keys, prefixes = _Order(), _Order()
        wanted = prefix.encode("utf-8", "surrogatepass")
        pages = empty = 0
        while True:
            page = await self._page(prefix, delimiter, token, pages, start_after)
            pages += 1
            objects, common = page.objects, page.common_prefixes
            count = len(objects) + len(common)
            if count > _PAGE_KEYS and (page.next_token is not None or not self.whole_ok):
                raise self._fail(f"the store sent {count} entries in a page of at most {_PAGE_KEYS}")
            bad, inside = keys.follow_keys(objects, wanted)
            bad = bad or prefixes.follow(common)
            if bad is not None:
                raise self._fail(f"the store sent {bad[0]!r} after {bad[1]!r}: a listing that moves "
                                 "forward never sends a name twice or goes back")  # fmt: skip
            empty = 0 if count else empty + 1
            if empty > _MAX_EMPTY_PAGES:
                raise self._fail(f"the store sent {empty} pages in a row with no key")
            if not bool(inside.all()) or any(not p.startswith(prefix) for p in common):
                page = self._inside(page, prefix, inside)
            yield page._replace(ordered=keys.by_text)
            if page.next_token is None:
                return
            if page.next_token in tokens or page.next_token == token or len(page.next_token) > _MAX_TOKEN:
                raise self._fail("the store sent a continuation token it had sent before (a listing that "
                                 "would go round in circles)")  # fmt: skip
            if token is not None:
                tokens.add(token)
            token = page.next_token

    def _inside(self, page: ListPage, prefix: str, inside: Any) -> ListPage:
        """``page`` without the keys and prefixes outside ``prefix`` (remembered for the warning)."""
        bucket_url = f"{self.store}://{self.url.bucket}/"
        out = np.flatnonzero(~inside)
        outside = [page.objects.key(int(i)) for i in out[:_NAMED]]
        outside += [p for p in page.common_prefixes if not p.startswith(prefix)]
        self._outside_count += len(out) + sum(not p.startswith(prefix) for p in page.common_prefixes)
        for name in outside:
            if len(self._outside) < _NAMED and bucket_url + name not in self._outside:
                self._outside.append(bucket_url + name)
        return ListPage(page.objects.take(inside), [p for p in page.common_prefixes if p.startswith(prefix)],
                        page.next_token)  # fmt: skip

    def _warn_outside(self) -> None:
        if self._outside_count:
            logger.warning(
                "listing of %s: dropped %d key(s) outside the requested prefix (%s%s); the store or a proxy "
                "answered for another prefix", self.url, self._outside_count,
                printable(", ".join(self._outside)),
                ", ..." if self._outside_count > len(self._outside) else "",
            )  # fmt: skip
            self._outside, self._outside_count = [], 0

    async def folders(self) -> tuple[list[str], bool]:
        cut = len(self.base)
        names: list[str] = []
        anything = False
        self.root_files: list[str] = []  # objects directly at the root, named when there is no class
        async for page in self._pages(self.base, "/"):
            anything = anything or bool(len(page.objects) or page.common_prefixes)
            names.extend(p[cut:-1] for p in page.common_prefixes)  # "prefix/cls/" -> "cls"
            self.root_files.extend(k[cut:] for k in page.keys if k[cut:])
        return names, anything

    async def below(self, folder: str) -> Columns:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.options.concurrency)
        return await list_prefix(self, self.base + folder + "/", self.options.concurrency, self._slots,
                                 _PAGE_KEYS, cut=len(self.base.encode("utf-8", "surrogatepass")))  # fmt: skip

    async def below_part(self, folder: str, board: Board, *, lead: bool, nonce: str) -> Part:
        """This process's part of :meth:`below`, listed with the others on ``board`` (a split listing:
        :mod:`blobdata._listing.job.split`)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.options.concurrency)
        cut = len(self.base.encode("utf-8", "surrogatepass"))
        return await list_part(self, self.base + folder + "/", self.options.concurrency, self._slots,
                               _PAGE_KEYS, cut=cut, board=board, lead=lead, nonce=nonce)  # fmt: skip


class S3LeanLister(PagedLister):
    """ListObjectsV2 pages through blobdata's own signed requests, parsed with ``xml.etree``."""

    hint = STORE.credential_hint

    def __init__(self, url: BlobURL, storage_options: Mapping[str, Any], options: FetchOptions) -> None:
        super().__init__(url, options)
        self.reader = S3Reader(storage_options, concurrency=options.concurrency)

    async def _request(
        self, prefix: str, delimiter: str | None, token: str | None, start_after: str | None, timeout: float
    ) -> ListPage:
        if start_after is not None and token is None:
            return await list_page_after(self.reader, self.url.bucket, prefix, start_after, timeout=timeout,
                                         max_keys=_PAGE_KEYS)  # fmt: skip
        return await self.reader.list_page(self.url.bucket, prefix, delimiter=delimiter, continuation=token,
                                           timeout=timeout, max_keys=_PAGE_KEYS)  # fmt: skip

    async def aclose(self) -> None:
        self._warn_outside()
        await self.reader.close()


# storage_options the lean S3 path reads as s3fs does (see S3Reader), or that change nothing in what
# a listing returns. Anything else (a botocore session, use_ssl, s3_additional_kwargs, addressing
# or signature settings, versions, requester pays) keeps the listing on s3fs.
_LEAN_S3_OPTIONS = frozenset({
    "key", "secret", "token", "anon", "profile", "endpoint_url", "client_kwargs", "config_kwargs",
    "version_aware", "requester_pays", "s3_additional_kwargs", "cache_regions", "use_listings_cache",
    "listings_expiry_time", "max_dirs", "default_block_size", "default_fill_cache", "default_cache_type",
    "skip_instance_cache",
})  # fmt: skip
_LEAN_CLIENT_KWARGS = frozenset({
    "endpoint_url", "region_name", "verify", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token",
})  # fmt: skip
_LEAN_CONFIG_KWARGS = frozenset(
    {"max_pool_connections", "connect_timeout", "read_timeout", "retries", "proxies"}
)


def lean_s3(storage_options: Mapping[str, Any]) -> bool:
    """Whether the lean S3 listing path serves these (resolved) storage options exactly as s3fs would.

    ``version_aware`` (ListObjectVersions), ``requester_pays`` and any option it does not know keep
    the listing on s3fs.
    """
    opts = storage_options
    if opts.get("version_aware") or opts.get("requester_pays") or opts.get("s3_additional_kwargs"):
        return False
    client_kwargs = opts.get("client_kwargs") or {}
    config_kwargs = opts.get("config_kwargs") or {}
    return (
        opts.keys() <= _LEAN_S3_OPTIONS
        and isinstance(client_kwargs, Mapping)
        and client_kwargs.keys() <= _LEAN_CLIENT_KWARGS
        and isinstance(config_kwargs, Mapping)
        and config_kwargs.keys() <= _LEAN_CONFIG_KWARGS
    )

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

A prefix of more than one page is listed in key ranges at once (:mod:`.s3_ranges`): the same keys in
the same order as page by page, each range's pages checked as above. :class:`PagedLister` holds these
checks for any store whose pages carry a continuation token (GCS's lister is one too).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from .._config import FetchOptions
from .._errors import BlobdataError, FetchError, FetchTimeout, TransientError
from .._retry import final_error, with_retries
from .._url import BlobURL, printable
from .base import Entry, count_list
from .fsspec import bounded
from .s3 import STORE, S3Reader
from .s3_ranges import list_page_after, list_prefix
from .s3xml import ListPage

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

    async def below(self, folder: str) -> list[Entry]:
        return await bounded(
            lambda: self._below(folder), url=f"{self.url}/{folder}", options=self.options, store="s3"
        )

    async def _below(self, folder: str) -> list[Entry]:
        cut = len(self.url.bucket) + 1 + len(self._prefix())
        out: list[Entry] = []
        async for info in self._iter(self._prefix() + folder + "/", ""):
            out.append((info["Key"][cut:], int(info["size"]), identity(info)))
        return out

    async def aclose(self) -> None:
        """Nothing to do: the s3fs client is shared through :func:`blobdata._stores.fsspec.get_fs`."""


class _Order:
    """Checks that names come in a strictly increasing order: S3's (by UTF-8 bytes, which is by
    code point) or the one some S3-compatible stores list in (by path segment, SeaweedFS's: "x/y"
    before "x y"), whichever the listing keeps to. Either way no name comes twice, so it moves on."""

    __slots__ = ("by_path", "by_text", "last", "last_parts")

    def __init__(self) -> None:
        self.by_text = self.by_path = True
        self.last: str | None = None
        self.last_parts: list[str] = []

    def follow(self, names: list[str]) -> tuple[str, str] | None:
        """Take the next ``names``; (name, the one before it) at the first that breaks both orders."""
        last, last_parts = self.last, self.last_parts
        for name in names:
            parts = name.split("/") if self.by_path else last_parts
            if last is not None:
                if self.by_text and name <= last:
                    self.by_text = False
                if self.by_path and parts <= last_parts:
                    self.by_path = False
                if not (self.by_text or self.by_path):
                    return name, last
            last, last_parts = name, parts
        self.last, self.last_parts = last, last_parts
        return None


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
        a range, :mod:`.s3_ranges`)."""
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
        orders = [_Order(), _Order()]  # of the keys, of the common prefixes
        pages = empty = 0
        while True:
            page = await self._page(prefix, delimiter, token, pages, start_after)
            pages += 1
            keys, prefixes = page.keys, page.common_prefixes
            if len(keys) + len(prefixes) > _PAGE_KEYS and (page.next_token is not None or not self.whole_ok):
                raise self._fail(f"the store sent {len(keys) + len(prefixes)} entries in a page of at most "
                                 f"{_PAGE_KEYS}")  # fmt: skip
            for order, names in zip(orders, (keys, prefixes), strict=True):
                bad = order.follow(names)
                if bad is not None:
                    raise self._fail(f"the store sent {bad[0]!r} after {bad[1]!r}: a listing that moves "
                                     "forward never sends a name twice or goes back")  # fmt: skip
            empty = 0 if keys or prefixes else empty + 1
            if empty > _MAX_EMPTY_PAGES:
                raise self._fail(f"the store sent {empty} pages in a row with no key")
            if any(not k.startswith(prefix) for k in keys) or any(not p.startswith(prefix) for p in prefixes):
                page = self._inside(page, prefix)
            yield page
            if page.next_token is None:
                return
            if page.next_token in tokens or page.next_token == token or len(page.next_token) > _MAX_TOKEN:
                raise self._fail("the store sent a continuation token it had sent before (a listing that "
                                 "would go round in circles)")  # fmt: skip
            if token is not None:
                tokens.add(token)
            token = page.next_token

    def _inside(self, page: ListPage, prefix: str) -> ListPage:
        """``page`` without the keys and prefixes outside ``prefix`` (remembered for the warning)."""
        bucket_url = f"{self.store}://{self.url.bucket}/"
        keep = [i for i, k in enumerate(page.keys) if k.startswith(prefix)]
        outside = [k for k in page.keys if not k.startswith(prefix)]
        outside += [p for p in page.common_prefixes if not p.startswith(prefix)]
        self._outside_count += len(outside)
        for name in outside:
            if len(self._outside) < _NAMED and bucket_url + name not in self._outside:
                self._outside.append(bucket_url + name)
        return ListPage(
            [page.keys[i] for i in keep],
            [page.sizes[i] for i in keep],
            [page.etags[i] for i in keep],
            [p for p in page.common_prefixes if p.startswith(prefix)],
            page.next_token,
        )

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
            anything = anything or bool(page.keys or page.common_prefixes)
            names.extend(p[cut:-1] for p in page.common_prefixes)  # "prefix/cls/" -> "cls"
            self.root_files.extend(k[cut:] for k in page.keys if k[cut:])
        return names, anything

    async def below(self, folder: str) -> list[Entry]:
        cut = len(self.base)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.options.concurrency)
        found = await list_prefix(
            self, self.base + folder + "/", self.options.concurrency, self._slots, _PAGE_KEYS
        )
        return [(k[cut:], size, etag) for k, size, etag in found]


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

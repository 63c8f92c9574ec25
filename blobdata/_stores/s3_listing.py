"""Listing S3: ListObjectsV2 through blobdata's own signed requests (the lean path), or through s3fs
for the options only s3fs understands. Also S3's identity rule for an fsspec info dict.

The lean path costs ~0.03 s of client CPU per 1,000-key page where botocore spends ~0.14 s. Each
page is retried under the one budget (:func:`blobdata._retry.with_retries`) and a final failure is
stated by the one error map, as s3fs's errors are.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Mapping
from typing import Any

from .._config import FetchOptions
from .._errors import BlobdataError, FetchError, TransientError
from .._retry import final_error, with_retries
from .._url import BlobURL
from .base import Entry
from .fsspec import bounded
from .s3 import S3Reader
from .s3xml import ListPage

__all__ = ["S3LeanLister", "S3fsLister", "identity", "lean_s3"]


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


class S3LeanLister:
    """ListObjectsV2 pages through blobdata's own signed requests, parsed with ``xml.etree``."""

    def __init__(self, url: BlobURL, storage_options: Mapping[str, Any], options: FetchOptions) -> None:
        self.url = url
        self.reader = S3Reader(storage_options, concurrency=options.concurrency)
        self.options = options
        self.base = url.prefix + "/" if url.prefix else ""

    async def _pages(self, prefix: str, delimiter: str | None) -> AsyncIterator[ListPage]:
        bucket, opts, root = self.url.bucket, self.options, str(self.url)
        token: str | None = None
        while True:
            call = functools.partial(
                self.reader.list_page,
                bucket,
                prefix,
                delimiter=delimiter,
                continuation=token,
                timeout=opts.timeout,
            )
            try:
                page = await with_retries(call, url=f"s3://{bucket}/{prefix}", options=opts)
            except BlobdataError as exc:
                # Restated for the dataset's root, as a listing error, from the store's status and code
                # (or the transport error) chained behind the last TransientError.
                origin = exc.__cause__
                if isinstance(origin, TransientError) and origin.__cause__ is not None:
                    origin = origin.__cause__
                err = final_error(
                    origin or exc, root, store="s3", what="listing", timeout=opts.timeout,
                    attempts=opts.retries,
                )  # fmt: skip
                if err is exc:
                    raise
                raise err from exc
            yield page
            if page.next_token is None:
                return
            if page.next_token == token:
                raise FetchError(f"listing of {root} failed: the store sent the same continuation token "
                                 "twice; retry later", url=root)  # fmt: skip
            token = page.next_token

    async def folders(self) -> tuple[list[str], bool]:
        cut = len(self.base)
        names: list[str] = []
        anything = False
        async for page in self._pages(self.base, "/"):
            anything = anything or bool(page.keys or page.common_prefixes)
            names.extend(p[cut:-1] for p in page.common_prefixes)  # "prefix/cls/" -> "cls"
        return names, anything

    async def below(self, folder: str) -> list[Entry]:
        cut = len(self.base)
        out: list[Entry] = []
        async for page in self._pages(self.base + folder + "/", None):
            out.extend(zip([k[cut:] for k in page.keys], page.sizes, page.etags, strict=True))
        return out

    async def aclose(self) -> None:
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
_LEAN_CONFIG_KWARGS = frozenset({"max_pool_connections", "connect_timeout", "read_timeout", "retries"})


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

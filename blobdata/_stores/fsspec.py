"""Stores reached through fsspec: the per-process filesystem clients, and the reader and lister for
``memory://`` and any protocol without a lean path (gcsfs and adlfs listings, s3fs for the options
only it understands).

fsspec's async filesystems are bound to an event loop and refuse to run after fork, so blobdata
never shares one across processes: :func:`get_fs` keys its clients by process and builds them on
this process's background loop (:mod:`blobdata._loop`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import fsspec

from .. import _process
from .._config import FetchOptions
from .._errors import AccessDenied, ConfigError, translate
from .._loop import get_loop
from .._retry import with_retries
from .._url import BlobURL, printable
from .base import Columns, ReadResult, count_list, listed_size
from .options import options_token

__all__ = ["AsyncFsLister", "FsspecReader", "MemoryLister", "bounded", "get_fs", "memory_identity"]

T = TypeVar("T")
logger = logging.getLogger(__name__)
_lock = threading.Lock()
_cache: dict[tuple[int, str, str], Any] = {}


def _fsspec_protocol(protocol: str) -> str:
    return {"gs": "gcs", "az": "abfs"}.get(protocol, protocol)


def get_fs(protocol: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem for ``protocol`` in this process (async where the backend is async).

    ``storage_options`` must already be resolved (:func:`resolve_storage_options`).
    """
    opts = dict(storage_options or {})
    key = (_process.pid(), protocol, options_token(protocol, opts))
    fs = _cache.get(key)
    if fs is not None:
        return fs
    with _lock:
        fs = _cache.get(key)
        if fs is not None:
            return fs
        for stale in [k for k in _cache if k[0] != key[0]]:
            del _cache[stale]  # inherited from a parent process: unusable here
        cls = fsspec.get_filesystem_class(_fsspec_protocol(protocol))
        kwargs: dict[str, Any] = dict(opts)
        if getattr(cls, "async_impl", False):
            # Bound to blobdata's loop; blobdata only awaits the ``_``-prefixed coroutines, on that
            # loop. ``asynchronous=False`` on purpose: fsspec drops ``loop`` when asynchronous=True, and
            # the backends' weakref finalizers then have no loop to close their sessions on at exit.
            kwargs.update(asynchronous=False, loop=get_loop())
        if protocol == "s3":
            # s3fs/aiobotocore default to 10 pooled connections; listing runs many prefixes at once.
            config_kwargs = dict(kwargs.get("config_kwargs") or {})
            config_kwargs.setdefault("max_pool_connections", 64)
            kwargs["config_kwargs"] = config_kwargs
        if protocol == "gs":
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        kwargs["skip_instance_cache"] = True
        try:
            fs = cls(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"invalid storage_options for {protocol}://: {exc}") from None
        except Exception as exc:
            # Credential resolution failed (a bad token, an unreachable token service, ...). The
            # backend's text is dropped: gcsfs and adlfs put tokens and connection strings in theirs.
            raise AccessDenied(
                f"could not set up {protocol}:// access from storage_options and the environment "
                f"({type(exc).__name__}): check the credentials (token, key, connection string)"
            ) from None
        _cache[key] = fs
        return fs


def memory_identity(info: Mapping[str, Any]) -> str:
    """``memory://``'s identity: creation time and size."""
    created = info.get("created")
    if isinstance(created, datetime.datetime):
        created = created.timestamp()
    return f"{created!r}-{int(info.get('size') or 0)}"


def _hint(protocol: str) -> str:
    from . import credential_hint  # the package's dispatch imports this module first

    return credential_hint(protocol)


async def bounded(call: Callable[[], Awaitable[T]], *, url: str, options: FetchOptions, store: str) -> T:
    """``call()`` (one listing operation of a client library) under the dataset's timeout and attempt
    budget: each attempt gets ``options.timeout`` seconds, failures go through the one error map."""

    async def once() -> T:
        try:
            return await asyncio.wait_for(call(), options.timeout)
        except Exception as exc:
            err = translate(exc, url, hint=_hint(store), what="listing", timeout=options.timeout)
            raise err from exc

    return await with_retries(once, url=url, options=options)


class FsspecReader:
    """Reads ``memory://`` (and any other fsspec protocol without a lean reader).

    The identity is not checked (the expected one is echoed back): S3, GCS, Azure and local files
    have their own pinned readers.
    """

    def __init__(self, protocol: str, storage_options: Mapping[str, Any]) -> None:
        self.protocol = protocol
        self._options = dict(storage_options)

    def __repr__(self) -> str:
        return f"FsspecReader({self.protocol!r})"

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
        fs = get_fs(self.protocol, self._options)
        path = f"{bucket}/{key}" if bucket else key
        url = f"{self.protocol}://{path}"
        try:
            if getattr(fs, "async_impl", False):
                body = await asyncio.wait_for(fs._cat_file(path, start=start, end=end), timeout)
            elif self.protocol == "memory":
                body = fs.cat_file(path, start=start, end=end)
            else:
                body = await asyncio.wait_for(asyncio.to_thread(fs.cat_file, path, start, end), timeout)
        except Exception as exc:
            raise translate(exc, url, timeout=timeout) from exc
        return ReadResult(bytes(body), expect_identity or "", None)

    async def close(self) -> None:
        """Nothing to do: the filesystem client is shared through :func:`get_fs`."""


class AsyncFsLister:
    """Any async fsspec backend (gcsfs, adlfs, s3fs's fallback): its own listing calls, dircache
    invalidated first, each call bounded by the dataset's timeout and attempt budget."""

    def __init__(
        self,
        url: BlobURL,
        fs: Any,
        *,
        identity: Callable[[Mapping[str, Any]], str],
        options: FetchOptions,
        store: str,
    ) -> None:
        self.url = url
        self.fs = fs
        self.identity = identity
        self.options = options
        self.store = store
        self.base = url.fs_path

    def _rel(self, name: str) -> str:
        return name[len(self.base) + 1 :] if self.base else name

    async def folders(self) -> tuple[list[str], bool]:
        self.fs.invalidate_cache(self.base)
        count_list()
        try:
            entries = await bounded(
                lambda: self.fs._ls(self.base, detail=True), url=str(self.url), options=self.options,
                store=self.store,
            )  # fmt: skip
        except FileNotFoundError:  # NotFound is one too
            return [], False
        names = [self._rel(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory"]
        # Objects directly at the root, named when there is no class folder.
        self.root_files = [self._rel(e["name"]) for e in entries if e.get("type") != "directory"]
        return names, bool(entries)

    async def below(self, folder: str) -> Columns:
        path = f"{self.base}/{folder}"
        self.fs.invalidate_cache(path)
        count_list()
        found = await bounded(
            lambda: self.fs._find(path, detail=True, withdirs=False), url=f"{self.url}/{folder}",
            options=self.options, store=self.store,
        )  # fmt: skip
        inside = {n: i for n, i in found.items() if n.startswith(path + "/")}
        if len(inside) < len(found):
            outside = [f"{self.url.protocol}://{n}" for n in found if n not in inside]
            logger.warning("listing of %s: dropped %d key(s) outside the requested prefix: %s; the store or "
                           "a proxy answered for another prefix", self.url, len(outside),
                           printable(", ".join(outside[:5])))  # fmt: skip
        scheme = self.url.protocol
        return Columns.from_entries(
            (self._rel(n), listed_size(i.get("size") or 0, f"{scheme}://{n}"), self.identity(i))
            for n, i in inside.items()
        )

    async def aclose(self) -> None:
        """Nothing to do: the client is shared through :func:`get_fs`."""


class MemoryLister:
    """fsspec's in-process store (tests): listed directly, synchronously."""

    def __init__(self, url: BlobURL, fs: Any) -> None:
        self.url = url
        self.fs = fs

    async def folders(self) -> tuple[list[str], bool]:
        if not self.fs.exists(self.url.fs_path):
            return [], False
        entries = self.fs.ls(self.url.fs_path, detail=True)
        cut = len(self.url.fs_path.rstrip("/")) + 1
        return [e["name"][cut:] for e in entries if e["type"] == "directory"], bool(entries)

    async def below(self, folder: str) -> Columns:
        base = self.url.fs_path.rstrip("/")
        found = self.fs.find(f"{base}/{folder}", detail=True, withdirs=False)
        return Columns.from_entries((n[len(base) + 1 :], int(i["size"]), memory_identity(i))
                                    for n, i in found.items())  # fmt: skip

    async def aclose(self) -> None:
        """Nothing to do: the client is shared through :func:`get_fs`."""

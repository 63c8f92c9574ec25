"""Local files (paths and ``file://``): read directly, listed as torchvision lists them.

A local file's identity is ``"{mtime_ns}-{size}"``; a read checks it before and after, so a file
rewritten after listing (or during the read) is :class:`~blobdata._errors.ObjectChanged`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from .._errors import AccessDenied, BlobdataError, FetchError, NotFound, ObjectChanged
from .._url import BlobURL
from .base import Columns, Entry, ReadResult

__all__ = ["LocalLister", "LocalReader", "identity"]


def identity(info: Mapping[str, Any]) -> str:
    """A local file's identity from an fsspec info dict (stat again: its float mtime lost precision)."""
    mtime_ns = info.get("mtime_ns")
    if mtime_ns is None:
        mtime_ns = os.stat(info["name"]).st_mtime_ns
    return f"{int(mtime_ns)}-{int(info.get('size') or 0)}"


class LocalReader:
    """Reads local files in a thread, checking their listed identity before and after the read."""

    def __repr__(self) -> str:
        return "LocalReader()"

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
        return await asyncio.wait_for(
            asyncio.to_thread(_read_local, key, start, end, expect_identity, f"file://{key}"), timeout
        )

    async def close(self) -> None:
        """Nothing to close."""


def _local_identity(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns}-{st.st_size}"


def _read_local(path: str, start: int | None, end: int | None, expect: str | None, url: str) -> ReadResult:
    """Read a local file (or a range of it), checking its identity before and after the read."""
    try:
        with open(path, "rb") as fh:
            before = os.fstat(fh.fileno())
            if expect and _local_identity(before) != expect:
                raise ObjectChanged(
                    f"{url}: changed since it was listed (identity {_local_identity(before)}, listed "
                    f"{expect}); rebuild the listing with refresh=True",
                    url,
                )
            fh.seek(start or 0)
            body = fh.read() if end is None else fh.read(max(0, end - (start or 0)))
            after = os.fstat(fh.fileno())
    except BlobdataError:
        raise
    except FileNotFoundError:
        raise NotFound(
            f"{url}: no such file; the listing may be stale, rebuild it with refresh=True", url
        ) from None
    except PermissionError:
        raise AccessDenied(f"{url}: permission denied", url) from None
    except OSError as exc:
        raise FetchError(f"{url}: cannot read ({exc.strerror or type(exc).__name__})", url) from exc
    if _local_identity(after) != _local_identity(before):
        raise ObjectChanged(f"{url}: modified while it was read; rebuild the listing with refresh=True", url)
    return ReadResult(body, _local_identity(before), before.st_size)


class LocalLister:
    """os.scandir / os.walk(followlinks=True) exactly as torchvision does, in threads."""

    def __init__(self, url: BlobURL) -> None:
        self.url = url

    async def folders(self) -> tuple[list[str], bool]:
        def scan() -> tuple[list[str], bool]:
            with os.scandir(self.url.prefix) as it:
                entries = list(it)
            return [e.name for e in entries if e.is_dir()], bool(entries)

        try:
            return await asyncio.to_thread(scan)
        except (FileNotFoundError, NotADirectoryError):
            return [], False

    async def below(self, folder: str) -> Columns:
        root = self.url.prefix

        def walk() -> Columns:
            out: list[Entry] = []
            cut = len(root.rstrip("/")) + 1
            for dirpath, _dirs, fnames in os.walk(os.path.join(root, folder), followlinks=True):
                for fname in fnames:
                    path = os.path.join(dirpath, fname)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue  # dangling symlink or vanished file: torchvision would fail later
                    out.append((path[cut:], st.st_size, f"{st.st_mtime_ns}-{st.st_size}"))
            return Columns.from_entries(out)

        return await asyncio.to_thread(walk)

    async def aclose(self) -> None:
        """Nothing to close."""

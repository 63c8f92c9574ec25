"""URLs: which store, which bucket, which key; and the guard that keeps keys from becoming paths.

``s3://b/p``, ``gs://b/p`` (``gcs://``), ``az://container/p`` (``abfs://``, ``abfss://``), local paths,
``file://`` and ``memory://`` are accepted. Keys are kept exactly as the store has them (unicode,
spaces, ``+``); :func:`safe_relpath` is the one check a key must pass before it names a local file.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from collections.abc import Sequence
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt

from ._errors import ConfigError

__all__ = ["CLOUD_PROTOCOLS", "BlobURL", "parse_url", "safe_relpath"]

_ALIASES = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gs",
    "gcs": "gs",
    "az": "az",
    "abfs": "az",
    "abfss": "az",
    "file": "file",
    "local": "file",
    "memory": "memory",
}
CLOUD_PROTOCOLS = frozenset({"s3", "gs", "az"})


@dataclasses.dataclass(frozen=True)
class BlobURL:
    """A parsed location. ``prefix`` has no leading or trailing ``/``; for ``file`` it is absolute."""

    protocol: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        if self.protocol == "file":
            return "file://" + self.prefix
        if self.protocol == "memory":
            return "memory://" + self.prefix
        return f"{self.protocol}://{self.bucket}/{self.prefix}".rstrip("/")

    @property
    def fs_path(self) -> str:
        """The path as the fsspec filesystem of this protocol expects it."""
        if self.protocol in ("file", "memory"):
            return self.prefix
        return f"{self.bucket}/{self.prefix}".rstrip("/")

    def child(self, relkey: str) -> BlobURL:
        """The location ``relkey`` below this one (``relkey`` is used verbatim, never normalised)."""
        if not relkey:
            return self
        if self.protocol in ("file", "memory"):
            return BlobURL(self.protocol, "", self.prefix.rstrip("/") + "/" + relkey)
        return BlobURL(self.protocol, self.bucket, f"{self.prefix}/{relkey}" if self.prefix else relkey)


def parse_url(url: str | os.PathLike[str]) -> BlobURL:
    """Parse a dataset or object URL; raise :class:`ConfigError` naming the URL when it is not usable."""
    text = os.fspath(url)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"expected a URL such as s3://bucket/prefix or a local path, got {url!r}")
    scheme, sep, rest = text.partition("://")
    if not sep:
        typo = _one_slash(text)
        if typo is not None:
            raise ConfigError(f"{text!r} is not a URL: did you mean {typo!r}? (a store URL has two slashes "
                              "after its scheme; a path without one is a local path)", url=text)  # fmt: skip
        # A plain local path (Windows drive letters are not special-cased here).
        return BlobURL("file", "", os.path.abspath(os.path.expanduser(text)).rstrip("/") or "/")
    protocol = _ALIASES.get(scheme.lower())
    if protocol is None:
        supported = "s3://, gs://, gcs://, az://, abfs://, file://, memory:// or a local path"
        raise ConfigError(f"unsupported URL scheme {scheme!r} in {text!r}: use {supported}", url=text)
    if protocol == "file":
        path = rest if rest.startswith("/") else "/" + rest
        return BlobURL("file", "", os.path.abspath(path).rstrip("/") or "/")
    if protocol == "memory":
        return BlobURL("memory", "", "/" + rest.strip("/"))
    bucket, _, prefix = rest.partition("/")
    if protocol == "az" and "@" in bucket:
        # abfs://container@account.dfs.core.windows.net/path
        bucket = bucket.split("@", 1)[0]
    if not bucket or any(c in bucket for c in "?#\\ "):
        raise ConfigError(f"no valid bucket name in {text!r}: expected {scheme}://bucket/prefix", url=text)
    if urlsplit(text).query:
        raise ConfigError(f"query strings are not supported in {text!r}", url=text)
    return BlobURL(protocol, bucket, prefix.strip("/"))


def _one_slash(text: str) -> str | None:
    """``s3:/bucket/x`` or ``s3:bucket/x`` (a store's scheme without its ``//``): the URL meant."""
    scheme, colon, rest = text.partition(":")
    if not colon or _ALIASES.get(scheme.lower()) not in CLOUD_PROTOCOLS or not rest.strip("/"):
        return None
    return f"{scheme}://{rest.lstrip('/')}"


def safe_relpath(key: str, *, url: str | None = None) -> str:
    """Return ``key`` if it is safe to append to a local directory, else raise ConfigError.

    Refuses absolute keys, ``..`` and ``.`` segments, empty segments (``//``), NUL and backslashes,
    so that no object key can name a file outside the directory it is placed in.
    """
    where = url or key
    if not key or key.startswith("/") or "\x00" in key or "\\" in key:
        raise ConfigError(f"object key {key!r} cannot be used as a local path ({where})", url=url)
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ConfigError(
            f"object key {key!r} has an empty, '.' or '..' segment and cannot name a local path ({where})",
            url=url,
        )
    assert posixpath.normpath(key) == key
    return key


_INNER = (b"//", b"/./", b"/../", b"\x00", b"\\")  # a bad segment inside a key (or across two bad ones)
_DOT, _SLASH = ord("."), ord("/")


def check_relkeys(
    keys: bytes | npt.NDArray[np.uint8], offsets: Sequence[int] | npt.NDArray[np.int64], *, root: str
) -> None:
    """Raise ConfigError for the first key that :func:`safe_relpath` refuses, of the keys of a manifest
    of ``root`` used as local paths (key ``i`` is ``keys[offsets[i]:offsets[i + 1]]``, UTF-8).

    Vectorised: one search of the bytes for a bad inner segment, and a look at both ends of each key
    (a match across two keys needs the first to end badly); keys are decoded only to name a bad one."""
    buf = np.frombuffer(keys, np.uint8) if isinstance(keys, (bytes, bytearray)) else np.asarray(keys)
    offs = np.asarray(offsets, dtype=np.int64)
    if len(offs) < 2:
        return
    starts, ends = offs[:-1], offs[1:]
    lengths = ends - starts
    bad = bool((lengths <= 0).any()) or any(p in buf[offs[0] : offs[-1]].tobytes() for p in _INNER)
    if not bad:
        last = len(buf) - 1

        def at(pos: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
            return buf[np.clip(pos, 0, last)]

        s0, s1, s2 = at(starts), at(starts + 1), at(starts + 2)
        e1, e2, e3 = at(ends - 1), at(ends - 2), at(ends - 3)
        # "/x", ".", "./x", "..", "../x" at the start; "x/", "x/.", "x/.." at the end
        lead = (s0 == _SLASH) | (
            (s0 == _DOT)
            & ((lengths == 1) | (s1 == _SLASH) | ((s1 == _DOT) & ((lengths == 2) | (s2 == _SLASH))))
        )
        trail = (
            (e1 == _SLASH)
            | ((e1 == _DOT) & (lengths >= 2) & (e2 == _SLASH))
            | ((e1 == _DOT) & (e2 == _DOT) & (lengths >= 3) & (e3 == _SLASH))
        )
        bad = bool(lead.any() or trail.any())
    if not bad:
        return
    for i in range(len(offs) - 1):
        key = bytes(buf[offs[i] : offs[i + 1]]).decode("utf-8", "surrogateescape")
        try:
            safe_relpath(key, url=f"{root}/{key}")
        except ConfigError as exc:
            raise ConfigError(
                f"{exc}: the manifest of the local folder {root} names a file outside it; build the "
                "manifest from the folder itself (blobdata ls ROOT --save-manifest PATH)",
                url=root,
            ) from None


def printable(text: object) -> str:
    """``text`` for a terminal or a log line: what is not printable (escape sequences, newlines, bidi
    controls) is written as its Python escape, so a name from a bucket can neither drive the terminal
    nor forge a line of output."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)

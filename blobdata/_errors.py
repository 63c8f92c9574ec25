"""The one exception hierarchy of blobdata.

Every error blobdata raises derives from :class:`BlobdataError`, and each subclass also derives
from the built-in exception a user would already catch, so ``except FileNotFoundError`` keeps
working around code that moved from local files to a bucket::

    BlobdataError(Exception)
    ├── ConfigError(ValueError)          bad argument, URL, size or environment value
    ├── NotFound(FileNotFoundError)      bucket, prefix or object does not exist
    │   └── EmptyDatasetError            no class folder or no valid file (as ImageFolder)
    ├── AccessDenied(PermissionError)    credentials missing or refused (HTTP 401/403)
    ├── FetchError(OSError)              an object could not be read after the retry budget
    │   ├── Throttled                    the store kept answering 429/503 SlowDown
    │   ├── FetchTimeout(TimeoutError)   the per-request deadline passed on every attempt
    │   └── ObjectChanged                the object's ETag/generation is not the one listed
    ├── DecodeError(ValueError)          bytes arrived but are not a valid sample
    ├── ManifestError(ValueError)        a stored listing is unreadable or for another URL
    └── CacheError(OSError)              the local cache cannot be used (never raised mid-training)

Errors cross DataLoader worker processes, so each one pickles with its message and ``url``.
Messages name the object URL, what was expected, and what to do; they never contain credentials.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AccessDenied",
    "BlobdataError",
    "CacheError",
    "ConfigError",
    "DecodeError",
    "EmptyDatasetError",
    "FetchError",
    "FetchTimeout",
    "ManifestError",
    "NotFound",
    "ObjectChanged",
    "Throttled",
]


class BlobdataError(Exception):
    """Base class of every blobdata error.

    ``url`` is the object or prefix URL the error is about (``None`` where none applies).
    """

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Positional (message, url) so that the multiple-inheritance subclasses (OSError's
        # constructor is picky) rebuild exactly across DataLoader worker processes.
        return (_rebuild, (type(self), self.message, self.url, dict(self.__dict__)))


def _rebuild(cls: type[BlobdataError], message: str, url: str | None, state: dict[str, Any]) -> BlobdataError:
    err = cls.__new__(cls)
    BlobdataError.__init__(err, message, url)
    err.__dict__.update(state)
    return err


class ConfigError(BlobdataError, ValueError):
    """An argument, URL, size string or environment variable is invalid."""


class NotFound(BlobdataError, FileNotFoundError):
    """The bucket, prefix or object does not exist (HTTP 404)."""


class EmptyDatasetError(NotFound):
    """The folder holds no class folder or no valid file (set ``allow_empty=True`` to accept)."""


class AccessDenied(BlobdataError, PermissionError):
    """The store refused the credentials, or none were found (HTTP 401/403)."""


class FetchError(BlobdataError, OSError):
    """An object could not be read within the retry budget."""


class Throttled(FetchError):
    """The store kept throttling (HTTP 429 or 503 SlowDown) until the retry budget ran out."""


class FetchTimeout(FetchError, TimeoutError):
    """Every attempt passed its per-request deadline."""


class ObjectChanged(FetchError):
    """The object's identity (ETag, generation, version) differs from the one listed.

    The listing is stale: rebuild it with ``refresh=True`` (or ``blobdata ls --refresh``).
    """


class DecodeError(BlobdataError, ValueError):
    """The bytes of an object are not a valid sample (corrupt image, decompression bomb, ...)."""


class ManifestError(BlobdataError, ValueError):
    """A stored listing (manifest) is unreadable, corrupt or belongs to another URL."""


class CacheError(BlobdataError, OSError):
    """The local cache directory cannot be opened or used."""

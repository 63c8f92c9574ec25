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
    ├── MissingMember(KeyError)          a BlobDataset sample has no member of that name (s["jpg"])
    ├── ManifestError(ValueError)        a stored listing is unreadable or for another URL
    └── CacheError(OSError)              the local cache cannot be used (never raised mid-training)

Errors cross DataLoader worker processes, so each one pickles with its message and ``url``; one
raised in a worker also carries its fields in a note (:func:`note_fields`) that the main process's
copy reads back, and leaves out of its message, because the DataLoader re-raises a worker's error as
``type(exc)(traceback_text)``.
Messages name the object URL, what was expected, and what to do; they never contain credentials.

The one error map: :func:`from_status` turns an HTTP status and a store's error code into the error
(or into a :class:`TransientError` for what may be retried), and :func:`translate` does the same for
a backend library's exception (botocore, gcsfs, the Azure SDK, aiohttp, OSError). Every store and the
listing call these two; nothing else decides what a status means.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
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
    "MissingMember",
    "NotFound",
    "ObjectChanged",
    "Throttled",
]


class BlobdataError(Exception):
    """Base class of every blobdata error.

    ``url`` is the object or prefix URL the error is about (``None`` where none applies).
    """

    def __init__(self, message: str, url: str | None = None) -> None:
        fields: dict[str, Any] = {}
        if url is None and _FIELDS_NOTE in message:  # rebuilt from a worker's text: the note is internal
            fields = _fields_from(message)
            message = "\n".join(ln for ln in message.split("\n") if not ln.strip().startswith(_FIELDS_NOTE))
        super().__init__(message)
        self.message = message
        self.url = url
        self.__dict__.update(fields)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # Positional (message, url) so that the multiple-inheritance subclasses (OSError's
        # constructor is picky) rebuild exactly across DataLoader worker processes.
        return (_rebuild, (type(self), self.message, self.url, dict(self.__dict__)))


_FIELDS_NOTE = "blobdata-error-fields: "


def note_fields(exc: BaseException) -> None:
    """Attach ``exc``'s fields (``url`` and other plain values) as a note, once.

    The DataLoader sends a worker's error to the main process as its formatted traceback (notes
    included) and rebuilds it there as ``type(exc)(text)``; :class:`BlobdataError` reads the note
    back, so ``exc.url`` survives fork, spawn and forkserver workers.
    """
    if not isinstance(exc, BlobdataError) or not hasattr(exc, "add_note"):
        return
    if any(n.startswith(_FIELDS_NOTE) for n in getattr(exc, "__notes__", ())):
        return
    plain = (str, int, float, bool)
    fields = {k: v for k, v in exc.__dict__.items() if k != "message" and isinstance(v, plain)}
    exc.add_note(_FIELDS_NOTE + json.dumps(fields, sort_keys=True))


def _fields_from(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(_FIELDS_NOTE):
            try:
                fields = json.loads(line[len(_FIELDS_NOTE) :])
            except ValueError:
                return {}
            return (
                {k: v for k, v in fields.items() if isinstance(k, str) and k != "message"}
                if isinstance(fields, dict)
                else {}
            )
    return {}


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


class MissingMember(BlobdataError, KeyError):
    """A :class:`~blobdata.BlobDataset` sample has no member (or field) of the name asked for, as in a
    transform's ``sample["jpg"]``; a ``KeyError``, so ``except KeyError`` still catches it."""


class ManifestError(BlobdataError, ValueError):
    """A stored listing (manifest) is unreadable, corrupt or belongs to another URL."""


class CacheError(BlobdataError, OSError):
    """The local cache directory cannot be opened or used."""


# -- the one error map ------------------------------------------------------------------------------


class TransientError(Exception):
    """A failure worth retrying (internal: never reaches the user, :func:`blobdata._retry.give_up`
    turns the last one into an error). ``kind`` is one of ``throttle``, ``server``, ``timeout``,
    ``connection``, ``short_read``; ``retry_after`` is the store's hint in seconds, if any."""

    def __init__(self, kind: str, message: str, *, retry_after: str | float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        try:
            self.retry_after = float(retry_after) if retry_after is not None else None
        except ValueError:
            self.retry_after = None  # an HTTP date: ignored, the backoff applies


class PatienceSpent(TransientError):
    """A request waited for admission while the store accepted nothing for the whole patience."""

    def __init__(self, message: str) -> None:
        super().__init__("throttle", message)


class RangeIgnored(Exception):
    """The store answered a ranged read with the whole object (HTTP 200 to a ``Range`` request;
    internal: the fetch engine then reads the object once, whole, instead of once per part)."""


#: What to check when a store refuses credentials and its caller named no hint of the store's
#: (each store's own hint is its descriptor's: :func:`blobdata._stores.credential_hint`).
_DEFAULT_HINT = "check the credentials in storage_options and the bucket policy"
_DENIED_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled",
    "InvalidToken", "AccountProblem", "AuthorizationFailure", "AuthenticationFailed", "Forbidden",
    "TokenRefreshRequired", "ExpiredTokenException",
})  # fmt: skip
_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "ServiceUnavailable", "ServerBusy",
})  # fmt: skip
_MISSING_BUCKET_CODES = frozenset({"NoSuchBucket", "ContainerNotFound", "CONTAINER_NOT_FOUND"})
_SERVER_CODES = frozenset({"RequestTimeout", "InternalError"})


def from_status(
    url: str,
    status: int,
    *,
    code: str = "",
    hint: str = "",
    what: str = "",
    retry_after: str | float | None = None,
    expected: str | None = None,
) -> BlobdataError | TransientError:
    """The error for one refused request: HTTP ``status`` and the store's error ``code`` (``""`` if none).

    ``hint`` is the store's advice on credentials (its descriptor's ``credential_hint``); ``what``
    (``"listing"``, ``"manifest"``; empty for an object read) starts the message; ``expected`` is the listed
    identity, for a 412. Throttling, 5xx and 408 are :class:`TransientError` (the caller retries; a
    throttled request is never "not found"); everything else is final.
    """
    label = f"HTTP {status}{' ' + code if code else ''}" if status else (code or "no status")
    head = f"{what} of {url}" if what else url
    if code in _THROTTLE_CODES or status in (429, 503):
        return TransientError("throttle", f"{head}: throttled ({label})", retry_after=retry_after)
    if code in _SERVER_CODES or status == 408 or status >= 500:
        return TransientError("server", f"{head}: server error ({label})")
    if code in _DENIED_CODES or status in (401, 403):
        return AccessDenied(f"{head}: access denied, the store refused the request ({label}); "
                            f"{hint or _DEFAULT_HINT}", url)  # fmt: skip
    if code in _MISSING_BUCKET_CODES:
        return NotFound(f"{head}: the bucket does not exist ({label}); check the bucket name, the URL and "
                        "the endpoint", url)  # fmt: skip
    if status == 404 or code in ("NoSuchKey", "BlobNotFound", "NotFound"):
        if what:
            return NotFound(f"{url} does not exist ({label}): check the bucket and prefix", url)
        return NotFound(f"{url}: no such object ({label}); the listing may be stale, rebuild it with "
                        "refresh=True", url)  # fmt: skip
    if status == 412:
        listed = f"identity {expected} listed, " if expected else ""
        return ObjectChanged(f"{url} changed since it was listed ({listed}{label} on a conditional read): "
                             "rebuild the listing with refresh=True", url)  # fmt: skip
    return FetchError(f"{head}: the store refused the request ({label})", url)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _status_of(exc: BaseException) -> tuple[str, int]:
    """(error code, HTTP status) of a botocore / gcsfs / Azure SDK / aiohttp error; ("", 0) if none."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        err = response.get("Error") or {}
        http = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return str(err.get("Code") or ""), int(http) if http else 0
    code = str(getattr(exc, "error_code", None) or "").rsplit(".", 1)[-1]  # StorageErrorCode.X -> X
    status: int = next(
        (v for a in ("status_code", "status", "code") if isinstance(v := getattr(exc, a, None), int)), 0
    )
    return code, status


_TIMEOUT_NAMES = frozenset({"ConnectTimeoutError", "ReadTimeoutError", "ServerTimeoutError", "FSTimeoutError",
                            "ServiceResponseTimeoutError"})  # fmt: skip
_CONNECTION_NAMES = frozenset({
    "EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError", "gaierror",
    "ConnectionError",
    "ServiceRequestError", "ServiceResponseError", "ClientConnectionError", "ClientOSError",
    "ServerDisconnectedError", "ClientPayloadError",
})  # fmt: skip
_TLS_REFUSED_NAMES = frozenset({"SSLCertVerificationError", "ClientConnectorCertificateError"})
_CREDENTIAL_NAMES = frozenset({"NoCredentialsError", "PartialCredentialsError", "ClientAuthenticationError"})


def translate(
    exc: BaseException,
    url: str,
    *,
    hint: str = "",
    what: str = "",
    timeout: float | None = None,
    expected: str | None = None,
) -> BlobdataError | TransientError:
    """The error for a backend library's exception (the one boundary; ``raise ... from exc``).

    Looks along the exception's cause chain for an HTTP status or a store error code (then as
    :func:`from_status`), else classifies by type: timeouts and connection failures are
    :class:`TransientError`, missing credentials :class:`AccessDenied`. The backend's own text is
    never copied into the message (an Azure or GCS error may hold a signed URL).
    """
    if isinstance(exc, (BlobdataError, TransientError)):
        return exc
    head = f"{what} of {url}" if what else url
    for e in _chain(exc):
        code, status = _status_of(e)
        if code or status:
            return from_status(url, status, code=code, hint=hint, what=what,
                               retry_after=_retry_after(e), expected=expected)  # fmt: skip
    names = {type(e).__name__ for e in _chain(exc)}
    refused = next((e for e in _chain(exc) if type(e).__name__ in _TLS_REFUSED_NAMES), None)
    if refused is not None:  # a certificate the client refused: final, no attempt can succeed
        cause = getattr(refused, "certificate_error", None) or refused
        reason = getattr(cause, "verify_message", None) or getattr(cause, "reason", None)
        reason = reason or type(cause).__name__
        return FetchError(f"{head}: TLS certificate verification failed ({reason}); name the CA bundle that "
                          "signed the server's certificate, or check the endpoint", url)  # fmt: skip
    if names & _CREDENTIAL_NAMES:
        return AccessDenied(
            f"{head}: no usable credentials; {hint or 'set them in storage_options or the environment'}", url
        )
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)) or names & _TIMEOUT_NAMES:
        within = f" within {timeout:g}s" if timeout is not None else ""
        return TransientError("timeout", f"{head}: no complete response{within}")
    if "IncompleteReadError" in names:
        return TransientError("short_read", f"{head}: connection closed mid-body")
    if names & _CONNECTION_NAMES or isinstance(exc, ConnectionError):
        return TransientError(
            "connection",
            f"{head}: connection failed ({type(exc).__name__}); check endpoint_url in storage_options (or "
            "AWS_ENDPOINT_URL_S3, STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING) and that the "
            "server is running",
        )
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{head}: permission denied", url)
    if isinstance(exc, FileNotFoundError):
        if what:
            return NotFound(f"{url} does not exist: check the bucket and prefix", url)
        return NotFound(f"{url}: no such object; the listing may be stale, rebuild it with refresh=True", url)
    return FetchError(f"{head}: failed ({type(exc).__name__})", url)


def _retry_after(exc: BaseException) -> str | None:
    headers = getattr(exc, "headers", None) or (getattr(exc, "response", None) or {})
    try:
        value = headers.get("Retry-After") if hasattr(headers, "get") else None
    except Exception:
        return None
    return str(value) if value is not None else None

"""The GCS read path: JSON-API media downloads pinned to the listed generation.

One aiohttp session per process; credentials come from gcsfs's own credential handling (``token``:
a service-account file, a credentials object, ``"anon"``, ``"google_default"``, ...), taken from the
per-process filesystem of :func:`blobdata._stores.fsspec.get_fs`, so the listing and every read of a process
share one resolution (one metadata-server round trip at most, never one per request or per worker
thread). Refreshing an expiring token runs in a thread, off the event loop.

Identity is the object's generation (what :func:`identity` lists). A read with an expected
generation sends ``generation=N``: the store serves exactly that
version, or 404 once it is gone (then :class:`ObjectChanged` if the object still exists, else
:class:`NotFound`); the ``x-goog-generation`` response header is checked as well.

Emulators: gcp-storage-emulator ignores ``generation=``, sends no ``x-goog-generation`` and checks
no credentials. When the header is missing the reader asks the object's metadata *after* the
download; generations only grow, so a metadata generation equal to the expected one proves the
bytes were that version (one extra request per read, on such stores only).

Responses are checked as the S3 reader checks them (:mod:`.s3`): 200 for a whole read, 206 with the
exact ``Content-Range`` for a ranged one (a 200 raises :class:`~blobdata._errors.RangeIgnored` before
its body is read), bodies bounded by the range or the listed size whatever the framing, only
``chunked`` transfer coding.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import numpy as np
import yarl

from .. import _process
from .._config import FetchOptions, env
from .._errors import (
    BlobdataError,
    FetchError,
    NotFound,
    ObjectChanged,
    RangeIgnored,
    TransientError,
    from_status,
)
from .._url import BlobURL
from .base import MAX_LISTED_SIZE, Columns, ReadResult, StoreInfo, join_bytes, listed_size
from .fsspec import get_fs
from .http import ProcessBound, check_content_range, grown, lean_session, read_capped
from .network import proxy_url, redact_url
from .s3 import ListPage
from .s3.listing import PagedLister

__all__ = ["GCSLister", "GCSReader", "identity"]

_DEFAULT_LOCATION = "https://storage.googleapis.com"
# Bytes of one objects.list answer: 1,000 entries take well under 1 MiB, but an emulator that ignores
# maxResults (gcp-storage-emulator) sends the whole prefix in one answer (about 0.5 KiB an object).
_LIST_BODY_CAP = 256 * 1024 * 1024
_UNSIZED_CAP = 1 << 30  # bytes of a whole read whose size was not listed
_REFRESH_MARGIN_S = 300.0  # refresh a token this long before it expires (gcsfs uses the same margin)


class GCSReader:
    """Generation-pinned GCS GETs over one aiohttp session per process.

    ``storage_options`` are gcsfs's: ``token``, ``project``, ``endpoint_url`` (or the environment's
    ``STORAGE_EMULATOR_HOST``), ``requester_pays`` (True or a project to bill). ``concurrency``
    (default 64) sizes the connection pool to match the fetch engine.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 64) -> None:
        self._options = STORE.resolved(storage_options)
        endpoint = self._options.get("endpoint_url")
        self._location = str(endpoint).rstrip("/") if endpoint else _DEFAULT_LOCATION
        payer = self._options.get("requester_pays")
        self._user_project = (
            payer if isinstance(payer, str) else (self._options.get("project") if payer else None)
        )
        self._concurrency = concurrency
        # HTTP(S)_PROXY / ALL_PROXY / NO_PROXY as for S3 (:mod:`.network`); None: direct.
        self._proxy = proxy_url(self._options, self._location)
        self._sessions = ProcessBound(self._new_session, aiohttp.ClientSession.close)
        self._auth: tuple[int, Any] | None = None  # (pid, gcsfs GoogleCredentials)
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def __repr__(self) -> str:
        return f"GCSReader(endpoint={redact_url(self._location)!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_auth=None, _timeouts={})
        return state

    # -- per-process state -------------------------------------------------------------------
    def _new_session(self) -> aiohttp.ClientSession:
        return lean_session(self._concurrency)

    async def close(self) -> None:
        """Close this process's session (safe to call more than once)."""
        await self._sessions.aclose()

    async def _headers(self) -> dict[str, str]:
        """Authorization for one request: gcsfs's credentials of this process, refreshed off the loop."""
        pid = _process.pid()
        if self._auth is None or self._auth[0] != pid:
            # Resolving may read files or ask the metadata server: in a thread, once per process.
            fs = await asyncio.to_thread(get_fs, "gs", self._options)
            self._auth = (pid, fs.credentials)
        gcreds = self._auth[1]
        creds = gcreds.credentials
        headers: dict[str, str] = {}
        if creds is None:
            return headers  # anonymous
        expiry = getattr(creds, "expiry", None)
        soon = expiry is not None and (
            expiry.replace(tzinfo=datetime.timezone.utc) - datetime.datetime.now(datetime.timezone.utc)
        ) < datetime.timedelta(seconds=_REFRESH_MARGIN_S)
        if not creds.valid or soon:
            await asyncio.to_thread(gcreds.maybe_refresh)
        creds.apply(headers)
        return headers

    def _object_url(self, bucket: str, key: str, *, media: bool, generation: str | None) -> yarl.URL:
        path = f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(key, safe='')}"
        query = ["alt=media"] if media else ["fields=generation"]
        if generation:
            query.append(f"generation={generation}")
        if self._user_project:
            query.append(f"userProject={quote(str(self._user_project), safe='')}")
        prefix = "/download" if media else ""
        return yarl.URL(f"{self._location}{prefix}{path}?{'&'.join(query)}", encoded=True)

    async def list_page(
        self,
        bucket: str,
        prefix: str,
        *,
        delimiter: str | None,
        token: str | None,
        start_offset: str | None = None,
        timeout: float,
        max_keys: int = 1000,
    ) -> ListPage:
        """One objects.list page of the objects of ``bucket`` under ``prefix``; no retries.

        ``delimiter`` groups names into ``common_prefixes``; ``token`` is the previous page's
        ``nextPageToken``; ``start_offset`` lists only names from it on (inclusive); ``max_keys`` caps
        the page. Identities are generations (:func:`identity`). Raises NotFound (no such bucket),
        AccessDenied, FetchError, or :class:`~blobdata._errors.TransientError` to retry.
        """
        url = f"gs://{bucket}/{prefix}"
        query = {"prefix": prefix, "maxResults": str(max_keys), "projection": "noAcl",
                 "fields": "nextPageToken,prefixes,items(name,size,generation,etag)"}  # fmt: skip
        if delimiter:
            query["delimiter"] = delimiter
        if token is not None:
            query["pageToken"] = token
        if start_offset is not None:
            query["startOffset"] = start_offset
        if self._user_project:
            query["userProject"] = str(self._user_project)
        target = yarl.URL(
            f"{self._location}/storage/v1/b/{quote(bucket, safe='')}/o?{urlencode(query, quote_via=quote)}",
            encoded=True,
        )
        session = self._sessions.get()
        headers = await self._headers()
        try:
            async with session.get(target, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
                                   allow_redirects=False, proxy=self._proxy) as resp:  # fmt: skip
                status = resp.status
                if status != 200:
                    await resp.content.read(8192)
                    raise from_status(url, status, hint=STORE.credential_hint, what="listing",
                                      retry_after=resp.headers.get("Retry-After"))  # fmt: skip
                body = await read_capped(resp, _LIST_BODY_CAP, url)
        except asyncio.TimeoutError as exc:
            raise TransientError("timeout", f"{url}: no complete response within {timeout:g}s") from exc
        except aiohttp.ClientPayloadError as exc:
            raise TransientError("short_read", f"{url}: connection closed mid-listing") from exc
        except aiohttp.ClientSSLError as exc:
            raise _tls_error(url, self._location, exc) from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise TransientError("connection", f"{url}: connection failed ({type(exc).__name__})") from exc
        return _parse_page(body, url, bucket)

    # -- the request -------------------------------------------------------------------------
    async def read(
        self,
        bucket: str,
        key: str,
        *,
        start: int | None = None,
        end: int | None = None,
        expect_identity: str | None = None,
        timeout: float = 30.0,
        size: int | None = None,
    ) -> ReadResult:
        """One GET of ``gs://bucket/key`` (bytes ``[start, end)`` when given), no retries.

        ``expect_identity`` is the listed generation; ``timeout`` (seconds) bounds each request;
        ``size`` (the listed size, bytes) bounds a whole read's body.
        """
        url = f"gs://{bucket}/{key}"
        # Only a generation (digits) can be pinned; anything else (an etag) is merely compared.
        generation = expect_identity if expect_identity and expect_identity.isdigit() else None
        session = self._sessions.get()
        headers = await self._headers()
        ranged = start is not None or end is not None
        first = start or 0
        if ranged:
            headers["Range"] = f"bytes={first}-{end - 1}" if end is not None else f"bytes={first}-"
        known = end if end is not None else size
        cap = known - first if known is not None else _UNSIZED_CAP
        client_timeout = self._timeouts.get(timeout)
        if client_timeout is None:
            client_timeout = self._timeouts[timeout] = aiohttp.ClientTimeout(total=timeout)
        target = self._object_url(bucket, key, media=True, generation=generation)
        body, got, content_range = b"", None, ""
        try:
            async with session.get(
                target, headers=headers, timeout=client_timeout, allow_redirects=False, proxy=self._proxy
            ) as resp:
                status = resp.status
                if status in (200, 206):
                    if ranged and status == 200:
                        raise RangeIgnored(f"{url}: the store answered a ranged GET with the whole object")
                    if status == 206 and not ranged:
                        raise TransientError("server", f"{url}: bad HTTP response (206 to a whole read)")
                    length = resp.content_length
                    if size is not None and not ranged and length is not None and length > cap:
                        # Larger than listed: a changed object, unless it carries the pinned generation.
                        same = generation is not None and resp.headers.get("x-goog-generation") == generation
                        raise grown(url, length, cap, same)
                    body = await read_capped(resp, max(cap, 0), url)
                    length = resp.content_length
                    if length is not None and len(body) != length:
                        raise TransientError("short_read", f"{url}: got {len(body)} of {length} bytes")
                    got = resp.headers.get("x-goog-generation")
                    content_range = resp.headers.get("Content-Range", "")
                else:
                    await resp.content.read(8192)
        except asyncio.TimeoutError as exc:
            raise TransientError("timeout", f"{url}: no complete response within {timeout:g}s") from exc
        except aiohttp.ClientPayloadError as exc:
            raise TransientError("short_read", f"{url}: connection closed mid-body") from exc
        except aiohttp.ClientSSLError as exc:  # a refused certificate or handshake: no retry helps
            raise _tls_error(url, self._location, exc) from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            via = " through the proxy from the environment" if self._proxy else ""
            what = f"connection failed ({type(exc).__name__}){via}"
            raise TransientError("connection", f"{url}: {what}") from exc
        if status not in (200, 206):
            if status == 404 and expect_identity:
                # The listed generation is gone: changed if the object itself is still there.
                current = await self._generation(session, bucket, key, headers, client_timeout, url)
                if current is not None:
                    raise _changed(url, expect_identity, current)
            raise _http_error(url, status, resp.headers.get("Retry-After"))
        if got is None:
            # The store does not echo the generation (emulators): ask for it after the read.
            got = await self._generation(session, bucket, key, headers, client_timeout, url)
            if got is None:
                raise NotFound(f"{url}: the object was deleted while it was read; rebuild the listing", url)
        if expect_identity and got and got != expect_identity:
            raise _changed(url, expect_identity, got)
        total: int | None = len(body)
        if status == 206:
            total = check_content_range(url, content_range, first, end, len(body))
        return ReadResult(body, got or expect_identity or "", total)

    async def _generation(
        self,
        session: aiohttp.ClientSession,
        bucket: str,
        key: str,
        headers: Mapping[str, str],
        timeout: aiohttp.ClientTimeout,
        url: str,
    ) -> str | None:
        """The live generation of the object, ``None`` if it does not exist."""
        meta_headers = {k: v for k, v in headers.items() if k.lower() != "range"}
        target = self._object_url(bucket, key, media=False, generation=None)
        try:
            async with session.get(target, headers=meta_headers, timeout=timeout, proxy=self._proxy) as resp:
                raw = await resp.content.read(65536)
                status = resp.status
        except asyncio.TimeoutError as exc:
            raise TransientError("timeout", f"{url}: metadata request timed out") from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise TransientError("connection", f"{url}: connection failed ({type(exc).__name__})") from exc
        if status == 404:
            return None
        if status != 200:
            raise _http_error(url, status, None)
        try:
            generation = json.loads(raw).get("generation")
        except (ValueError, AttributeError):
            raise TransientError("server", f"{url}: unreadable object metadata") from None
        return str(generation) if generation is not None else None


_SIZES = re.compile(r"(?:[0-9]{1,16}\n)*[0-9]{1,16}")


def _parse_page(body: bytes, url: str, bucket: str) -> ListPage:
    """One objects.list response as a :class:`ListPage` of columns (a retryable error when it is not
    one). The JSON is read by :func:`json.loads` (in C); its items live as long as the page does, and
    only their names, sizes and generations go on, in arrays."""
    try:
        doc = json.loads(body)
        items = doc.get("items") or []
        prefixes = [str(p) for p in doc.get("prefixes") or []]
        token = doc.get("nextPageToken")
        names = [str(i["name"]) for i in items]
        raw = [i.get("size") or 0 for i in items]
        ids = [str(g) if (g := i.get("generation")) is not None else str(i.get("etag") or "") for i in items]
    except (ValueError, AttributeError, KeyError, TypeError):
        raise TransientError("server", f"{url}: the store sent a listing that is not objects.list JSON") \
            from None
    sizes = None
    if all(type(v) is str for v in raw) and _SIZES.fullmatch("\n".join(map(str, raw)) if raw else "0"):
        sizes = np.fromiter(map(int, raw), dtype=np.int64, count=len(raw))
        if len(sizes) and int(sizes.max()) > MAX_LISTED_SIZE:
            sizes = None
    if sizes is None:  # numbers, or something that is not a size: the error names the object
        sizes = np.array([listed_size(v, f"gs://{bucket}/{n}") for v, n in zip(raw, names, strict=True)],
                         dtype=np.int64)  # fmt: skip
    kb, ko = join_bytes([n.encode("utf-8", "surrogatepass") for n in names])
    ib, io = join_bytes([i.encode("utf-8", "surrogatepass") for i in ids])
    return ListPage(Columns(kb, ko, sizes, ib, io), prefixes, str(token) if token else None)


def _tls_error(url: str, location: str, exc: aiohttp.ClientSSLError) -> FetchError:
    cause = getattr(exc, "certificate_error", None) or getattr(exc, "os_error", None) or exc
    reason = getattr(cause, "verify_message", None) or getattr(cause, "reason", None) or str(cause)
    return FetchError(f"{url}: TLS with {redact_url(location)} failed: {reason}", url)


def _changed(url: str, expected: str, current: str) -> ObjectChanged:
    return ObjectChanged(
        f"{url} changed since it was listed (generation {expected} listed, {current} now): rebuild the "
        "listing with refresh=True",
        url,
    )


def _http_error(url: str, status: int, retry_after: str | None) -> BlobdataError | TransientError:
    """One failed GCS response as the blobdata error (or a TransientError to retry): the one map."""
    return from_status(url, status, hint=STORE.credential_hint, retry_after=retry_after)


def identity(info: Mapping[str, Any]) -> str:
    """GCS's identity of a listed object: its generation (the etag where there is none)."""
    generation = info.get("generation")
    return str(generation) if generation is not None else str(info.get("etag") or "")


def _resolve(opts: dict[str, Any]) -> None:
    host = env("STORAGE_EMULATOR_HOST")
    if "endpoint_url" not in opts and host:
        opts["endpoint_url"] = host if "://" in host else "http://" + host
        opts.setdefault("token", "anon")


#: GCS's facts: an emulator named by STORAGE_EMULATOR_HOST; credentials are gcsfs's ``token``.
STORE = StoreInfo(
    "gs",
    credential_hint="check token= in storage_options (a service-account file, 'google_default', or "
    "'anon' for a public bucket) and the bucket's IAM policy",
    resolve=_resolve,
    listing_scope=lambda opts: f"gs:{opts.get('endpoint_url') or env('STORAGE_EMULATOR_HOST') or 'google'}",
)


class GCSLister(PagedLister):
    """objects.list pages on blobdata's own session (:class:`GCSReader`), checked as S3's are
    (:class:`~blobdata._stores.s3.PagedLister`); a prefix of more than two pages is listed in
    key ranges at once (:mod:`.s3.ranges`), each range from ``startOffset``.

    ``startOffset`` is inclusive: a range after key ``k`` starts at ``k + "\\x00"``, the first name
    after ``k``. ``endOffset`` is deliberately not sent: a range reads on to the first name past its end,
    which is what proves that two ranges meet (the next range must find that very name first); a
    server-side cut would hide it. A store that ignores ``startOffset`` (it sends names before the
    offset) fails that check and the prefix is listed again page by page.
    """

    store = "gs"
    hint = STORE.credential_hint
    whole_ok = True  # gcp-storage-emulator ignores maxResults: the whole prefix, one answer, no token

    def __init__(self, url: BlobURL, storage_options: Mapping[str, Any], options: FetchOptions) -> None:
        super().__init__(url, options)
        self.reader = GCSReader(storage_options, concurrency=options.concurrency)

    async def _request(
        self, prefix: str, delimiter: str | None, token: str | None, start_after: str | None, timeout: float
    ) -> ListPage:
        from .s3 import listing

        start = start_after + "\x00" if start_after is not None and token is None else None
        page = await self.reader.list_page(self.url.bucket, prefix, delimiter=delimiter, token=token,
                                           start_offset=start, timeout=timeout,
                                           max_keys=listing._PAGE_KEYS)  # fmt: skip
        objects = page.objects
        ends = objects.key_offsets[1:]
        placeholder = (ends > objects.key_offsets[:-1]) & (objects.keys[np.maximum(ends - 1, 0)] == 47) \
            if len(objects.keys) else np.zeros(len(objects), dtype=bool)  # fmt: skip
        if bool(placeholder.any()):  # folder placeholders ("a/"): not objects (as gcsfs lists)
            page = page._replace(objects=objects.take(~placeholder))
        return page

    async def aclose(self) -> None:
        self._warn_outside()
        await self.reader.close()

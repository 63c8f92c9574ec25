"""The lean S3 GET path: our own SigV4 signer and our own HTTP/1.1 client (:mod:`blobdata._stores.h1`).

Why not s3fs/aiobotocore for the hot path: they spend ~2 ms of client CPU per 100 KB object
(request serialisation, event hooks, response parsing); a signed GET through :class:`H1Pool`
spends about half of what the same GET costs through aiohttp. fsspec stays in charge of credentials
files and the other protocols.

Addressing: a custom endpoint (``endpoint_url`` or ``client_kwargs.endpoint_url``: MinIO, SeaweedFS,
R2, ...) is used path-style, ``{endpoint}/{bucket}/{key}``; real AWS is virtual-hosted,
``https://{bucket}.s3.{region}.amazonaws.com/{key}``, path-style for bucket names with dots.
Keys are sent exactly as stored: every byte except the unreserved characters is percent-encoded,
``/`` is kept, and the path is never normalised (``a/../b`` and ``a//b`` are distinct keys).

Identity: the ETag with its quotes stripped, ``etag@version-id`` when the store reports a version.

Every response is checked against its request: a read without a range must be a 200, a ranged one a
206 whose ``Content-Range`` is exactly the range asked (its end may stop short only at the object's
end; the total is the engine's to compare with the listing); a 200 to a ranged read raises
:class:`~blobdata._errors.RangeIgnored` at the head, so the engine reads the object once, whole;
no body may exceed what was asked (the range, the listed size, or :data:`~.h1.MAX_BODY` when
neither is known), refused from Content-Length before any buffer is made; a pinned read must carry
the pinned ETag. A TLS handshake that fails is final, its reason in the message. Proxies and the CA
bundle are read as botocore reads them (:mod:`.network`).

Listing: :meth:`S3Reader.list_page` is one signed ListObjectsV2 request parsed with ``xml.etree``
(~0.03 s of CPU per 1,000-key page, where botocore's parser spends ~0.14 s). It asks for
``encoding-type=url`` so keys with control characters survive XML, and decodes them as botocore
does; a server that ignores the parameter is read verbatim. Retries go through
:func:`blobdata._retry.with_retries`, the one retry budget. The lister is in :mod:`.listing`;
the signer in :mod:`.sigv4`; the ListObjectsV2 wire format in :mod:`.xml`.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import yarl

from ..._config import env
from ..._errors import (
    AccessDenied,
    ConfigError,
    FetchError,
    ObjectChanged,
    RangeIgnored,
    TransientError,
    from_status,
)
from ..base import ReadResult, StoreInfo, check_header_identity
from ..h1 import MAX_BODY, BadResponse, BodyTooLarge, H1Pool, IncompleteBody, ProxyError, Response
from ..h1 import RangeIgnored as _H1RangeIgnored
from ..http import ProcessBound, check_content_range, grown
from ..network import ca_bundle, proxy_settings, redact_url
from .sigv4 import Credentials, SigV4Signer, cached_chain, chain_key, quote_key, refresh_chain, resolve_chain
from .xml import ListPage, list_query, parse_list_page

__all__ = ["EXPIRED_CODES", "S3ErrorResponse", "S3Reader", "split_identity"]

T = TypeVar("T")

_CODE_RE = re.compile(rb"<Code>([^<]{1,80})</Code>")
#: The error codes of a request signed with expired temporary credentials (S3 sends ``ExpiredToken``,
#: and ``TokenRefreshRequired`` for a token that must be renewed; ``ExpiredTokenException`` is STS's).
EXPIRED_CODES = frozenset({"ExpiredToken", "TokenRefreshRequired", "ExpiredTokenException"})
_REGION_RE = re.compile(rb"<Region>([a-z0-9-]{1,40})</Region>")
#: The most bytes of one ListObjectsV2 page (1,000 entries of keys up to 1,024 bytes, URL-encoded).
LIST_BODY_CAP = 16 * 1024 * 1024
# ssl errors of a handshake cut by the network (worth a retry), not refused by either side.
_SSL_TRANSIENT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


def split_identity(identity: str) -> tuple[str, str | None]:
    """``"etag@version"`` or ``"etag"`` (quotes allowed) -> ``(etag, version or None)``."""
    etag, _, version = identity.partition("@")
    return etag.strip('"'), (version or None)



class S3ErrorResponse(Exception):
    """The HTTP status and S3 error code of a refused request, chained as the ``__cause__`` of the
    error raised for it, so a caller can restate it (``error_code``/``status_code`` are the names
    :func:`blobdata._errors.translate` reads). Never holds the response body."""

    def __init__(self, status_code: int, error_code: str | None) -> None:
        super().__init__(f"HTTP {status_code}{' ' + error_code if error_code else ''}")
        self.status_code = status_code
        self.error_code = error_code



class S3Reader:
    """Signed S3 GETs over one connection pool per process (created lazily inside the running loop).

    ``storage_options`` are s3fs's: ``key``/``secret``/``token``, ``anon``, ``profile``,
    ``endpoint_url`` (or ``client_kwargs.endpoint_url``), ``client_kwargs.region_name``,
    ``client_kwargs.verify``, ``config_kwargs.proxies``, ``requester_pays``; proxies and the CA
    bundle otherwise come from the environment and the AWS config as botocore reads them
    (:mod:`.network`). ``concurrency`` (default 64) sizes the connection pool to match the fetch
    engine.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 64) -> None:
        opts = STORE.resolved(storage_options)
        client_kwargs = dict(opts.get("client_kwargs") or {})
        endpoint = opts.get("endpoint_url") or client_kwargs.get("endpoint_url")
        self._endpoint = str(endpoint).rstrip("/") if endpoint else None
        self._origin = self._host = self._base_path = ""
        if self._endpoint is not None:
            try:
                parsed = yarl.URL(self._endpoint)
            except ValueError:
                parsed = yarl.URL()
            if parsed.scheme not in ("http", "https") or not parsed.raw_host:
                raise ConfigError(
                    f"endpoint_url must look like http://host:port, got {redact_url(self._endpoint)!r}"
                )
            host = f"[{parsed.raw_host}]" if ":" in parsed.raw_host else parsed.raw_host
            if parsed.explicit_port is not None and not parsed.is_default_port():
                host = f"{host}:{parsed.explicit_port}"
            # Parsed once: the per-request path only concatenates strings.
            self._origin, self._host = f"{parsed.scheme}://{host}", host
            self._base_path = parsed.raw_path.rstrip("/")
        self._region = (
            client_kwargs.get("region_name") or env("AWS_REGION") or env("AWS_DEFAULT_REGION") or "us-east-1"
        )
        self._bucket_region: dict[str, str] = {}
        self._anon = bool(opts.get("anon", False))
        key = opts.get("key") or client_kwargs.get("aws_access_key_id")
        secret = opts.get("secret") or client_kwargs.get("aws_secret_access_key")
        token = opts.get("token") or client_kwargs.get("aws_session_token")
        self._static = (
            Credentials(str(key), str(secret), str(token) if token else None) if key and secret else None
        )
        self._profile: str | None = opts.get("profile")
        # What selects the chain's credentials (the environment, the AWS files), read once here.
        self._chain = chain_key(self._profile) if self._static is None and not self._anon else ""
        self._extra_headers = {"x-amz-request-payer": "requester"} if opts.get("requester_pays") else {}
        # botocore's ``verify``: False (no certificate check) or a CA bundle path; default on.
        self._verify = ca_bundle(opts, self._profile) if self._uses_tls() else True
        self._proxies = proxy_settings(opts)
        self._concurrency = concurrency
        self._signer = SigV4Signer()
        self._pools = ProcessBound(self._new_pool, H1Pool.aclose)

    def __repr__(self) -> str:
        endpoint = redact_url(self._endpoint) if self._endpoint else "aws"
        return f"S3Reader(endpoint={endpoint!r}, region={self._region!r}, anon={self._anon})"

    def _uses_tls(self) -> bool:
        return self._endpoint is None or self._origin.startswith("https://")

    # -- per-process state -------------------------------------------------------------------
    def _new_pool(self) -> H1Pool:
        # Sends only the headers it is given: no Accept, Accept-Encoding or User-Agent (S3 needs none).
        return H1Pool(self._concurrency, verify=self._verify, proxies=self._proxies)

    async def close(self) -> None:
        """Close this process's connections (safe to call more than once)."""
        await self._pools.aclose()

    async def _refreshed(self, stale: Credentials) -> Credentials | None:
        """Credentials resolved afresh after the store refused ``stale`` as expired (off the loop: the
        chain may run a process or ask the instance metadata service); None if the chain has none."""
        creds = await asyncio.to_thread(refresh_chain, self._profile, self._chain, stale)
        if creds is None:
            return None
        frozen = creds.get_frozen_credentials()
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token)

    async def _credentials(self) -> Credentials | None:
        if self._anon:
            return None
        if self._static is not None:
            return self._static
        creds = cached_chain(self._profile, self._chain)
        if creds is None:
            # Off the loop: the chain may read files or wait on the instance metadata service.
            creds = await asyncio.to_thread(resolve_chain, self._profile, self._chain)
        if creds is None:
            return None
        frozen = creds.get_frozen_credentials()  # refreshable credentials rotate here
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token)

    # -- addressing --------------------------------------------------------------------------
    def _locate(self, bucket: str, key: str | None) -> tuple[str, str, str, str]:
        """-> (scheme://host, Host header, encoded path, region) for one object, or for the bucket
        itself when ``key`` is None (the path of a bucket-level request such as a listing)."""
        region = self._bucket_region.get(bucket, self._region)
        tail = "" if key is None else "/" + quote_key(key)
        if self._endpoint is not None:
            return self._origin, self._host, f"{self._base_path}/{bucket}{tail}", region
        if "." in bucket:
            host = f"s3.{region}.amazonaws.com"
            return f"https://{host}", host, f"/{bucket}{tail}", region
        host = f"{bucket}.s3.{region}.amazonaws.com"
        return f"https://{host}", host, tail or "/", region

    # -- the request -------------------------------------------------------------------------
    async def _send(
        self,
        bucket: str,
        key: str | None,
        query: str,
        extra_headers: Mapping[str, str],
        timeout: float,
        url: str,
        on_success: Callable[[Response], T],
        *,
        max_body: int,
        ranged: bool = False,
        too_large: Callable[[BodyTooLarge], Exception] | None = None,
    ) -> T:
        """One signed GET of ``key`` (the bucket itself when None) with the canonical ``query``; no retries.

        ``on_success`` reads a 200/206 response. Every other status becomes the error of
        :func:`_http_error` (chained to an :class:`S3ErrorResponse`), after at most one retry at the
        region the store named; transport failures become :class:`~blobdata._errors.TransientError`,
        except a refused TLS handshake or proxy, which are final. ``timeout`` (seconds) bounds the
        whole request, connect to last byte; ``max_body`` (bytes) bounds a 2xx body; ``ranged``:
        the headers ask for a range (a 200 raises :class:`~blobdata._errors.RangeIgnored`);
        ``too_large`` makes the error for a Content-Length over ``max_body`` (default: retryable).
        A request refused as signed with expired credentials (:data:`EXPIRED_CODES`) is signed again,
        once, with credentials resolved afresh (:func:`~.sigv4.refresh_chain`, for this process and the
        node); a second refusal is a final AccessDenied saying so.
        """
        pool = self._pools.get()
        # Static and anonymous credentials without a coroutine per request; the chain awaits.
        if self._anon:
            creds = None
        elif self._static is not None:
            creds = self._static
        else:
            creds = await self._credentials()
        moved = refreshed = False  # one retry at the bucket's own region; one with refreshed credentials
        while True:
            origin, host, path, region = self._locate(bucket, key)
            # Host first, as clients conventionally send it; the signer signs it either way.
            headers = {"Host": host, **self._extra_headers, **extra_headers}
            if creds is not None:
                self._signer.sign("GET", host, path, headers, creds, region, query=query)
            try:
                resp = await pool.get(
                    origin, f"{path}?{query}" if query else path, headers, timeout,
                    max_body=max_body, ranged=ranged,
                )  # fmt: skip
            # One boundary for transport failures; first the timeouts (TimeoutError is an OSError).
            except asyncio.TimeoutError as exc:
                raise TransientError("timeout", f"{url}: no complete response within {timeout:g}s") from exc
            except _H1RangeIgnored as exc:
                raise RangeIgnored(f"{url}: the store answered a ranged GET with the whole object") from exc
            except BodyTooLarge as exc:
                raise (too_large(exc) if too_large is not None else _bad(url, exc)) from exc
            except BadResponse as exc:
                raise _bad(url, exc) from exc
            except IncompleteBody as exc:
                raise TransientError("short_read", f"{url}: connection closed mid-body") from exc
            except ssl.SSLError as exc:
                raise _tls_error(url, origin, exc) from exc
            except ProxyError as exc:
                if exc.final:
                    raise FetchError(f"{url}: {exc}; check the proxy settings (HTTPS_PROXY, HTTP_PROXY, "
                                     "NO_PROXY or config_kwargs['proxies'])", url) from exc  # fmt: skip
                raise TransientError("connection", f"{url}: connection failed ({exc})") from exc
            except OSError as exc:  # ConnectionLost, refused, reset, DNS
                proxy = pool.proxy_for(origin)
                via = f" through the proxy {proxy.display}" if proxy is not None else ""
                raise TransientError(
                    "connection", f"{url}: connection failed ({type(exc).__name__}){via}"
                ) from exc
            status = resp.status
            if status == 200 or status == 206:
                return on_success(resp)
            err_body = resp.body[:8192]
            new_region = resp.headers.get("x-amz-bucket-region")
            if new_region is None and status == 400:
                m = _REGION_RE.search(err_body)
                new_region = m.group(1).decode() if m else None
            if status in (301, 400) and new_region and new_region != region and not moved:
                self._bucket_region[bucket] = new_region
                moved = True
                continue
            code = _error_code(err_body)
            if status in (400, 403) and code in EXPIRED_CODES and creds is not None:
                if self._static is not None:
                    raise AccessDenied(f"{url}: the store refused the session token given in storage_options "
                                       f"as expired (HTTP {status} {code}); pass fresh key/secret/token, or "
                                       "leave them out to use the AWS credential chain", url)  # fmt: skip
                if refreshed:
                    raise AccessDenied(
                        f"{url}: the store refused the request twice as signed with expired credentials "
                        f"(HTTP {status} {code}); they were resolved again once and the new ones were "
                        "refused too, so the credentials expired and could not be refreshed: check their "
                        "source (the instance role, `aws sso login`, the profile's credential_process)", url,
                    )  # fmt: skip
                refreshed = True
                creds = await self._refreshed(creds)
                if creds is None:
                    raise AccessDenied(f"{url}: the store refused the credentials as expired (HTTP {status} "
                                       f"{code}) and the credential chain found none when asked again; "
                                       f"{STORE.credential_hint}", url)  # fmt: skip
                continue
            raise _http_error(url, status, err_body, resp.headers.get("Retry-After")) from (
                S3ErrorResponse(status, _error_code(err_body) or None)
            )
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
        """One GET of ``s3://bucket/key`` (bytes ``[start, end)`` when given), no retries.

        Returns the body, the identity (the expected one when given, else the response's ETag) and
        the object's total size (from Content-Range or the body). ``size`` (bytes, the listed size)
        bounds a whole read's body; a range bounds its own. Raises NotFound, AccessDenied,
        ObjectChanged, FetchError, :class:`~blobdata._errors.RangeIgnored` (a ranged GET answered
        with the whole object), or :class:`~blobdata._errors.TransientError` for what the caller
        may retry. ``timeout`` (seconds) bounds the whole request, connect to last byte.
        """
        url = f"s3://{bucket}/{key}"
        expect_etag, expect_version = split_identity(expect_identity) if expect_identity else (None, None)
        headers: dict[str, str] = {}
        ranged = start is not None or end is not None
        if ranged:
            first = start or 0
            headers["Range"] = f"bytes={first}-{end - 1}" if end is not None else f"bytes={first}-"
            bound = end - first if end is not None else (size - first if size is not None else MAX_BODY)
        else:
            bound = size if size is not None else MAX_BODY
        if expect_etag:
            if not (expect_etag.isascii() and expect_etag.isprintable()):  # the common case costs two C calls
                check_header_identity(expect_etag, url)
            headers["If-Match"] = f'"{expect_etag}"'

        def on_success(resp: Response) -> ReadResult:
            return self._check(url, resp, start, end, expect_etag, expect_version, expect_identity)

        def too_large(exc: BodyTooLarge) -> Exception:
            # A whole read larger than listed: a changed object, unless it carries the pinned ETag.
            etag = (exc.headers.get("ETag") or "").strip('"')
            return grown(url, exc.length, bound, bool(expect_etag) and etag == expect_etag)

        return await self._send(
            bucket, key, "", headers, timeout, url, on_success, max_body=max(bound, 0), ranged=ranged,
            too_large=too_large if size is not None and not ranged else None,
        )  # fmt: skip

    async def list_page(
        self,
        bucket: str,
        prefix: str,
        *,
        delimiter: str | None,
        continuation: str | None,
        timeout: float,
        max_keys: int = 1000,
    ) -> ListPage:
        """One ListObjectsV2 page of the keys of ``bucket`` starting with ``prefix``; no retries.

        ``delimiter`` (``"/"``, or None for every key below ``prefix``) groups keys into
        ``common_prefixes``; ``continuation`` is the previous page's ``next_token`` (None for the
        first page); ``max_keys`` caps the keys and prefixes of the page (the store's maximum is
        1000). ``timeout`` (seconds) bounds the request, connect to last byte. Raises NotFound (no
        such bucket), AccessDenied, FetchError, or :class:`~blobdata._errors.TransientError` for
        what the caller may retry (:func:`with_retries`).
        """
        url = f"s3://{bucket}/{prefix}"
        query = list_query(prefix, delimiter=delimiter, continuation=continuation, max_keys=max_keys)

        def on_success(resp: Response) -> ListPage:
            body = resp.body
            length = resp.content_length
            if length is not None and len(body) != length:
                raise TransientError("short_read", f"{url}: got {len(body)} of {length} bytes of a listing")
            return parse_list_page(body, url)

        return await self._send(bucket, None, query, {}, timeout, url, on_success, max_body=LIST_BODY_CAP)

    @staticmethod
    def _check(
        url: str,
        resp: Response,
        start: int | None,
        end: int | None,
        expect_etag: str | None,
        expect_version: str | None,
        expect_identity: str | None,
    ) -> ReadResult:
        """A 200 (whole read) or 206 (ranged read; the parser refused the other pairings) checked
        against what was asked, as the ReadResult."""
        body = resp.body
        length = resp.content_length
        if length is not None and len(body) != length:
            raise TransientError("short_read", f"{url}: got {len(body)} of {length} bytes")
        h = resp.headers
        etag = (h.get("ETag") or "").strip('"')
        version = h.get("x-amz-version-id")
        if version == "null":
            version = None
        other_version = expect_version and version and version != expect_version
        if expect_etag and (etag != expect_etag or other_version):
            if not etag:
                raise ObjectChanged(
                    f"{url}: the store's answer carries no ETag, so it cannot be shown to be the listed "
                    f"version ({expect_identity}); a proxy between here and the store may drop ETags and "
                    "ignore If-Match. Nothing was returned, to never mix two versions",
                    url,
                )
            raise ObjectChanged(
                f"{url} changed since it was listed (expected identity {expect_identity}, the store has "
                f"{etag}{'@' + version if version else ''}): rebuild the listing with refresh=True",
                url,
            )
        total: int | None = len(body)
        if resp.status == 206:
            total = check_content_range(url, h.get("Content-Range"), start or 0, end, len(body))
        identity = expect_identity or (f"{etag}@{version}" if etag and version else etag)
        return ReadResult(body, identity, total)


def _error_code(body: bytes) -> str:
    """The S3 error code (``NoSuchBucket``, ``SlowDown``, ...) of an error response body, or ``""``."""
    m = _CODE_RE.search(body)
    return m.group(1).decode(errors="replace") if m else ""


def _bad(url: str, exc: BadResponse) -> TransientError:
    return TransientError("server", f"{url}: bad HTTP response ({exc})")


def _tls_error(url: str, origin: str, exc: ssl.SSLError) -> Exception:
    """A failed TLS handshake: final (with its reason) when a side refused it, else retried."""
    if isinstance(exc, _SSL_TRANSIENT):
        return TransientError("connection", f"{url}: the TLS handshake was cut ({type(exc).__name__})")
    reason = getattr(exc, "verify_message", None) or exc.reason or str(exc)
    hint = (
        "; if the server's certificate is signed by your own CA, name its bundle in AWS_CA_BUNDLE, "
        "ca_bundle in the AWS config or client_kwargs={'verify': '/path/ca.pem'}"
        if isinstance(exc, ssl.SSLCertVerificationError)
        else ""
    )
    return FetchError(f"{url}: TLS with {redact_url(origin)} failed: {reason}{hint}", url)


def _http_error(url: str, status: int, body: bytes, retry_after: str | None) -> Exception:
    """One failed S3 response as the blobdata error (or a TransientError to retry): the one map."""
    code = _error_code(body)
    return from_status(url, status, code=code, hint=STORE.credential_hint, retry_after=retry_after)


def _resolve(opts: dict[str, Any]) -> None:
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if "endpoint_url" not in opts and "endpoint_url" not in client_kwargs:
        endpoint = env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs


def _listing_scope(opts: Mapping[str, Any]) -> str:
    client_kwargs = opts.get("client_kwargs") or {}
    endpoint = opts.get("endpoint_url") or client_kwargs.get("endpoint_url") or "aws"
    return f"s3:{str(endpoint).rstrip('/')}:versions={bool(opts.get('version_aware'))}"


#: S3's facts: the endpoint from AWS_ENDPOINT_URL(_S3); request rates limited per prefix.
STORE = StoreInfo(
    "s3",
    credential_hint="check the credentials (key/secret, AWS_PROFILE, AWS_ACCESS_KEY_ID) and the bucket "
    "policy, or pass anon=True for a public bucket",
    resolve=_resolve,
    listing_scope=_listing_scope,
    throttle_prefix=True,
)

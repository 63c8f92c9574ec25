"""The lean S3 GET path: our own SigV4 signer and one aiohttp session per process.

Why not s3fs/aiobotocore for the hot path: they spend ~2 ms of client CPU per 100 KB object
(request serialisation, event hooks, response parsing); a signed aiohttp GET spends a fraction of
that. fsspec stays in charge of listing, credentials files and the other protocols.

Addressing: a custom endpoint (``endpoint_url`` or ``client_kwargs.endpoint_url``: MinIO, SeaweedFS,
R2, ...) is used path-style, ``{endpoint}/{bucket}/{key}``; real AWS is virtual-hosted,
``https://{bucket}.s3.{region}.amazonaws.com/{key}``, path-style for bucket names with dots.
Keys are sent exactly as stored: every byte except the unreserved characters is percent-encoded,
``/`` is kept, and the path is never normalised (``a/../b`` and ``a//b`` are distinct keys).

Identity: the ETag with its quotes stripped, ``etag@version-id`` when the store reports a version.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import ssl
import time
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import quote

import aiohttp
import yarl

from ._config import env
from ._errors import AccessDenied, ConfigError, FetchError, NotFound, ObjectChanged
from ._fetch import ReadResult, TransientError
from ._fs import resolve_storage_options

__all__ = ["EMPTY_SHA256", "UNSIGNED_PAYLOAD", "S3Reader", "SigV4Signer", "quote_key", "split_identity"]

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
_CODE_RE = re.compile(rb"<Code>([^<]{1,80})</Code>")
_REGION_RE = re.compile(rb"<Region>([a-z0-9-]{1,40})</Region>")
_RANGE_TOTAL_RE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


class Credentials(NamedTuple):
    """One set of static credentials. Deliberately no readable repr: it would print the secret."""

    access_key: str
    secret_key: str
    token: str | None

    def __repr__(self) -> str:
        return "Credentials(***)"


def quote_key(key: str) -> str:
    """Percent-encode an object key for the request path the way S3 canonicalises it.

    UTF-8 bytes, unreserved characters (``A-Za-z0-9-._~``) and ``/`` kept, everything else
    (space, ``+``, ``%``, unicode, ...) percent-encoded; no path normalisation.
    """
    return quote(key, safe="/~")


def split_identity(identity: str) -> tuple[str, str | None]:
    """``"etag@version"`` or ``"etag"`` (quotes allowed) -> ``(etag, version or None)``."""
    etag, _, version = identity.partition("@")
    return etag.strip('"'), (version or None)


class SigV4Signer:
    """AWS Signature Version 4 for S3 requests without a body (GET/HEAD).

    The derived signing key is cached per (secret, date, region); a request costs one SHA-256 of
    the canonical request and one HMAC. ``unsigned_payload`` sends ``UNSIGNED-PAYLOAD`` as the
    content hash instead of the SHA-256 of the empty body (both are valid for a GET).
    """

    def __init__(self, *, service: str = "s3", unsigned_payload: bool = False) -> None:
        self.service = service
        self.payload_hash = UNSIGNED_PAYLOAD if unsigned_payload else EMPTY_SHA256
        self._keys: dict[tuple[str, str, str], bytes] = {}

    def __repr__(self) -> str:
        return f"SigV4Signer(service={self.service!r})"

    def _signing_key(self, secret: str, date: str, region: str) -> bytes:
        cache_key = (secret, date, region)
        key = self._keys.get(cache_key)
        if key is None:
            if len(self._keys) > 16:
                self._keys.clear()  # old dates and rotated secrets
            k = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
            k = hmac.new(k, region.encode(), hashlib.sha256).digest()
            k = hmac.new(k, self.service.encode(), hashlib.sha256).digest()
            key = hmac.new(k, b"aws4_request", hashlib.sha256).digest()
            self._keys[cache_key] = key
        return key

    def sign(
        self,
        method: str,
        host: str,
        path: str,
        headers: dict[str, str],
        credentials: Credentials,
        region: str,
        *,
        query: str = "",
        amz_date: str | None = None,
    ) -> dict[str, str]:
        """Add ``x-amz-date``, ``x-amz-content-sha256``, the token and ``Authorization`` to ``headers``.

        ``path`` is the already-encoded request path (see :func:`quote_key`), ``query`` the canonical
        query string, ``host`` the Host header (port included when not the default). ``amz_date``
        (``YYYYMMDDTHHMMSSZ``, default now) exists for tests. Returns ``headers``.
        """
        if amz_date is None:
            amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        headers["x-amz-date"] = amz_date
        headers["x-amz-content-sha256"] = self.payload_hash
        if credentials.token:
            headers["x-amz-security-token"] = credentials.token
        canon = {k.lower(): " ".join(v.split()) for k, v in headers.items()}
        canon["host"] = host
        names = sorted(canon)
        signed = ";".join(names)
        canonical_request = "\n".join(
            (
                method,
                path,
                query,
                "".join(f"{n}:{canon[n]}\n" for n in names),
                signed,
                self.payload_hash,
            )
        )
        date = amz_date[:8]
        scope = f"{date}/{region}/{self.service}/aws4_request"
        string_to_sign = (
            f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical_request.encode()).hexdigest()}"
        )
        key = self._signing_key(credentials.secret_key, date, region)
        signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}"
        )
        return headers


# botocore's credential chain, resolved once per process (env, config files, SSO, IMDS, ...).
_chain: dict[tuple[int, str | None], Any] = {}
# Sessions inherited from a parent process: never closed or collected here, because closing them
# would act on the parent's event loop and warn about the parent's connections.
_orphans: list[Any] = []


def _resolve_chain(profile: str | None) -> Any:
    import botocore.session

    session = botocore.session.Session(profile=profile) if profile else botocore.session.get_session()
    return session.get_credentials()


class S3Reader:
    """Signed S3 GETs over one aiohttp session per process (created lazily inside the running loop).

    ``storage_options`` are s3fs's: ``key``/``secret``/``token``, ``anon``, ``profile``,
    ``endpoint_url`` (or ``client_kwargs.endpoint_url``), ``client_kwargs.region_name``,
    ``client_kwargs.verify``, ``requester_pays``. ``concurrency`` (default 64) sizes the
    connection pool to match the fetch engine.
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 64) -> None:
        opts = resolve_storage_options("s3", storage_options)
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
                raise ConfigError(f"endpoint_url must look like http://host:port, got {self._endpoint!r}")
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
        self._extra_headers = {"x-amz-request-payer": "requester"} if opts.get("requester_pays") else {}
        # botocore's ``verify``: False (no certificate check) or a CA bundle path; default on.
        self._verify: bool | str = client_kwargs.get("verify", True)
        self._concurrency = concurrency
        self._signer = SigV4Signer()
        self._session: aiohttp.ClientSession | None = None
        self._owner: tuple[int, asyncio.AbstractEventLoop] | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def __repr__(self) -> str:
        return f"S3Reader(endpoint={self._endpoint or 'aws'!r}, region={self._region!r}, anon={self._anon})"

    # -- per-process state -------------------------------------------------------------------
    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        owner = (os.getpid(), loop)
        if self._session is not None and self._owner == owner:
            return self._session
        if self._session is not None:
            _orphans.append(self._session)  # another process or loop: unusable and not ours to close
        connector = aiohttp.TCPConnector(
            limit=self._concurrency,
            limit_per_host=self._concurrency,
            use_dns_cache=True,
            ttl_dns_cache=300,
            ssl=ssl.create_default_context(cafile=self._verify)
            if isinstance(self._verify, str)
            else self._verify,
        )
        # Raw bytes as stored (no gzip decoding); no cookies; keep-alive pooled connections.
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("Accept-Encoding", "User-Agent"),
            read_bufsize=2**18,
        )
        # aiohttp silently resends an idempotent request once when a pooled connection fails; the
        # engine owns the one retry budget, so that stays off (aiohttp's own test client does the same).
        if hasattr(self._session, "_retry_connection"):
            self._session._retry_connection = False
        self._owner = owner
        return self._session

    async def close(self) -> None:
        """Close this process's session (safe to call more than once)."""
        session, owner = self._session, self._owner
        self._session = self._owner = None
        if session is None:
            return
        if owner is not None and owner[0] == os.getpid() and owner[1] is asyncio.get_running_loop():
            await session.close()
        else:
            _orphans.append(session)  # a parent's or another loop's: not ours to close

    async def _credentials(self) -> Credentials | None:
        if self._anon:
            return None
        if self._static is not None:
            return self._static
        cache_key = (os.getpid(), self._profile)
        if cache_key not in _chain:
            # Off the loop: the chain may read files or wait on the instance metadata service.
            _chain[cache_key] = await asyncio.to_thread(_resolve_chain, self._profile)
        creds = _chain[cache_key]
        if creds is None:
            return None
        frozen = creds.get_frozen_credentials()  # refreshable credentials rotate here
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token)

    # -- addressing --------------------------------------------------------------------------
    def _locate(self, bucket: str, key: str) -> tuple[str, str, str, str]:
        """-> (scheme://host, Host header, encoded path, region) for one object."""
        region = self._bucket_region.get(bucket, self._region)
        if self._endpoint is not None:
            return self._origin, self._host, f"{self._base_path}/{bucket}/{quote_key(key)}", region
        if "." in bucket:
            host = f"s3.{region}.amazonaws.com"
            return f"https://{host}", host, f"/{bucket}/{quote_key(key)}", region
        host = f"{bucket}.s3.{region}.amazonaws.com"
        return f"https://{host}", host, "/" + quote_key(key), region

    # -- the request -------------------------------------------------------------------------
    async def get(
        self,
        bucket: str,
        key: str,
        *,
        start: int | None = None,
        end: int | None = None,
        expect_identity: str | None = None,
        timeout: float = 30.0,
    ) -> tuple[bytes, str]:
        """One GET of ``s3://bucket/key`` (bytes ``[start, end)`` when given), no retries.

        Returns ``(body, identity)``. Raises NotFound, AccessDenied, ObjectChanged, FetchError, or
        :class:`~blobdata._fetch.TransientError` for what the caller may retry. ``timeout`` (seconds)
        bounds the whole request, connect to last byte.
        """
        result = await self.read(
            bucket, key, start=start, end=end, expect_identity=expect_identity, timeout=timeout
        )
        return result.body, result.identity or ""

    async def read(
        self,
        bucket: str,
        key: str,
        *,
        start: int | None = None,
        end: int | None = None,
        expect_identity: str | None = None,
        timeout: float = 30.0,
    ) -> ReadResult:
        """Like :meth:`get`, also returning the object's total size (from Content-Range or the body)."""
        url = f"s3://{bucket}/{key}"
        expect_etag, expect_version = split_identity(expect_identity) if expect_identity else (None, None)
        session = self._get_session()
        creds = await self._credentials()
        client_timeout = self._timeouts.get(timeout)
        if client_timeout is None:
            client_timeout = self._timeouts[timeout] = aiohttp.ClientTimeout(total=timeout)
        for attempt in (0, 1):  # the second pass only after learning the bucket's region
            origin, host, path, region = self._locate(bucket, key)
            headers: dict[str, str] = dict(self._extra_headers)
            if start is not None or end is not None:
                first = start or 0
                headers["Range"] = f"bytes={first}-{end - 1}" if end is not None else f"bytes={first}-"
            if expect_etag:
                headers["If-Match"] = f'"{expect_etag}"'
            if creds is not None:
                self._signer.sign("GET", host, path, headers, creds, region)
            headers["Host"] = host
            try:
                async with session.get(
                    yarl.URL(origin + path, encoded=True),
                    headers=headers,
                    timeout=client_timeout,
                    allow_redirects=False,
                ) as resp:
                    status = resp.status
                    if status == 200 or status == 206:
                        body = await resp.read()
                        return self._check(
                            url, resp, body, status, start, end, expect_etag, expect_version, expect_identity
                        )
                    err_body = await resp.content.read(8192)
                    new_region = resp.headers.get("x-amz-bucket-region")
                    if new_region is None and status == 400:
                        m = _REGION_RE.search(err_body)
                        new_region = m.group(1).decode() if m else None
                    if status in (301, 400) and new_region and new_region != region and attempt == 0:
                        self._bucket_region[bucket] = new_region
                        continue
                    raise _http_error(url, status, err_body, resp.headers.get("Retry-After"))
            # One boundary for transport failures; first the timeouts, which aiohttp also makes ClientErrors.
            except asyncio.TimeoutError as exc:
                raise TransientError("timeout", f"{url}: no complete response within {timeout:g}s") from exc
            except aiohttp.ClientResponseError as exc:
                raise TransientError("server", f"{url}: bad HTTP response ({exc.status})") from exc
            except aiohttp.ClientPayloadError as exc:
                raise TransientError("short_read", f"{url}: connection closed mid-body") from exc
            except (aiohttp.ClientError, ConnectionError) as exc:
                raise TransientError(
                    "connection", f"{url}: connection failed ({type(exc).__name__})"
                ) from exc
        raise FetchError(
            f"{url}: the store redirected to another region twice; set client_kwargs.region_name", url
        )

    @staticmethod
    def _check(
        url: str,
        resp: aiohttp.ClientResponse,
        body: bytes,
        status: int,
        start: int | None,
        end: int | None,
        expect_etag: str | None,
        expect_version: str | None,
        expect_identity: str | None,
    ) -> ReadResult:
        length = resp.content_length
        if length is not None and len(body) != length:
            raise TransientError("short_read", f"{url}: got {len(body)} of {length} bytes")
        h = resp.headers
        etag = (h.get("ETag") or "").strip('"')
        version = h.get("x-amz-version-id")
        if version == "null":
            version = None
        if (
            expect_etag
            and etag
            and (etag != expect_etag or (expect_version and version and version != expect_version))
        ):
            raise ObjectChanged(
                f"{url} changed since it was listed (expected identity {expect_identity}, the store has "
                f"{etag}{'@' + version if version else ''}): rebuild the listing with refresh=True",
                url,
            )
        total: int | None = len(body)
        if status == 206:
            m = _RANGE_TOTAL_RE.match(h.get("Content-Range", ""))
            total = int(m.group(3)) if m and m.group(3) != "*" else None
        elif start is not None or end is not None:
            body = body[start or 0 : end]  # the store ignored Range and sent everything
        if expect_identity and (etag == expect_etag or not etag):
            identity = expect_identity
        else:
            identity = f"{etag}@{version}" if etag and version else etag
        return ReadResult(body, identity, total)


def _http_error(url: str, status: int, body: bytes, retry_after: str | None) -> Exception:
    """Map one failed S3 response to the blobdata error (or a TransientError to retry)."""
    m = _CODE_RE.search(body)
    code = m.group(1).decode(errors="replace") if m else ""
    what = f"HTTP {status}{' ' + code if code else ''}"
    if status == 404:
        if code == "NoSuchBucket":
            return NotFound(f"{url}: the bucket does not exist ({what}); check the URL and endpoint", url)
        return NotFound(
            f"{url}: no such object ({what}); the listing may be stale, rebuild it with refresh=True", url
        )
    if status in (401, 403):
        return AccessDenied(
            f"{url}: access denied ({what}); check the credentials (key/secret, AWS_PROFILE, "
            "AWS_ACCESS_KEY_ID) and the bucket policy, or pass anon=True for a public bucket",
            url,
        )
    if status == 412:
        return ObjectChanged(
            f"{url} changed since it was listed ({what} on If-Match): rebuild the listing with refresh=True",
            url,
        )
    if status == 429 or status == 503 or code in ("SlowDown", "Throttling", "RequestLimitExceeded"):
        return TransientError("throttle", f"{url}: throttled ({what})", retry_after=retry_after)
    if status >= 500 or status == 408 or code in ("RequestTimeout", "InternalError"):
        return TransientError("server", f"{url}: server error ({what})")
    return FetchError(f"{url}: the store refused the request ({what})", url)

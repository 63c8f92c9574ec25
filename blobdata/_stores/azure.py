"""The Azure Blob read path: ``azure.storage.blob.aio`` downloads pinned to the listed ETag.

One ``BlobServiceClient`` per process (and event loop), built from the resolved storage options
(adlfs's names): ``connection_string``; or ``account_name`` (or ``account_host`` / ``account_url``)
with ``account_key``, ``sas_token``, ``credential`` or ``client_id``/``client_secret``/``tenant_id``;
``anon=False`` alone uses ``DefaultAzureCredential``; ``account_name`` alone is anonymous access to a
public container. The credential object lives as long as the client, so a token is fetched once per
process and refreshed by the SDK, never per request.

A read with an expected identity sends ``If-Match`` (``etag=``, ``MatchConditions.IfNotModified``):
a replaced blob fails with 412, reported as :class:`ObjectChanged`. The identity is the ETag without
quotes, as :func:`identity` lists it; a pinned read whose answer carries no ETag is refused. The
SDK's own retries are off (the engine owns the one retry budget) and its exception texts are never
echoed: they can hold the request URL, SAS signature included.

Every answer is checked at its head, before the SDK reads its body (a ``raw_response_hook``): Blob
Storage always states a Content-Length, so a 2xx without one (chunked, or until the server closes),
with a Content-Length above what was asked (the range or the listed size), with a transfer coding,
or with a ``Content-Range`` that is not the range asked, is refused and retried, never read.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

from .._config import env
from .._errors import ConfigError, NotFound, ObjectChanged, TransientError, translate
from .base import ReadResult, StoreInfo, check_header_identity
from .http import ProcessBound, check_content_range, grown, lean_session
from .network import proxy_url

__all__ = ["AzureReader", "identity"]

_RANGE_TOTAL_RE = re.compile(r"bytes\s+\d+-\d+/(\d+)")
_UNSIZED_CAP = 1 << 30  # bytes of a whole read whose size was not listed


def _head_check(url: str, first: int, end: int | None, cap: int, whole: bool, etag: str | None) -> Any:
    """A ``raw_response_hook`` that refuses a 2xx download whose head does not answer the request
    (see the module docstring), closing it unread. ``whole``: a whole read of a listed size, which a
    larger answer without the pinned ``etag`` shows to have changed."""

    def hook(pipeline_response: Any) -> None:
        resp = pipeline_response.http_response
        if not 200 <= resp.status_code < 300:
            return
        headers = resp.headers
        te, length = headers.get("Transfer-Encoding"), headers.get("Content-Length")
        problem = ""
        if te is not None:
            problem = f"Transfer-Encoding {te[:40]!r}: Blob Storage sends a Content-Length"
        elif length is None or not (length.isascii() and length.isdigit()):
            problem = f"Content-Length {length!r}"
        elif int(length) > cap:
            problem = f"Content-Length {length} is more than the {cap} bytes asked"
        elif resp.status_code == 206:
            try:
                check_content_range(url, headers.get("Content-Range"), first, end, int(length))
            except TransientError as exc:
                problem = str(exc).partition("(")[2].rstrip(")")
        if problem:
            internal = getattr(resp, "internal_response", None)
            if internal is not None and hasattr(internal, "close"):
                internal.close()
            if whole and length is not None and length.isdigit() and int(length) > cap:
                same = etag is not None and headers.get("ETag", "").strip('"') == etag
                raise grown(url, int(length), cap, same)
            raise TransientError("server", f"{url}: bad HTTP response ({problem})")

    return hook


async def _close_client(client: Any) -> None:
    await client.close()


def _service_client(opts: Mapping[str, Any], concurrency: int) -> Any:
    """A new aio ``BlobServiceClient`` for ``opts`` (call inside the running loop)."""
    from azure.core.pipeline.transport import AioHttpTransport
    from azure.storage.blob.aio import BlobServiceClient

    timeouts: dict[str, Any] = {
        "connection_timeout": 20,
        "read_timeout": 60,
        "connection_data_block_size": 2**18,
    }
    kwargs: dict[str, Any] = {
        "retry_total": 0,  # the engine retries; the SDK's own retries would stack with ours
        "max_single_get_size": 2**31,  # one GET per read: ranges are the engine's business
        # Our session: aiohttp's silent resend of a request whose pooled connection failed is off
        # (one retry budget, the engine's), and the pool is sized to the engine's concurrency.
        "transport": AioHttpTransport(
            session=lean_session(concurrency, skip_headers=()), session_owner=True, **timeouts
        ),
        **timeouts,
    }
    if opts.get("connection_string"):
        endpoint = _endpoint_of(str(opts["connection_string"]))
        proxy = proxy_url(opts, endpoint) if endpoint else None
        if proxy:
            kwargs["proxies"] = {"http": proxy, "https": proxy}
        return BlobServiceClient.from_connection_string(
            opts["connection_string"], credential=opts.get("credential"), **kwargs
        )
    account = opts.get("account_name")
    url = opts.get("account_url")
    if not url and opts.get("account_host"):
        url = f"https://{opts['account_host']}"
    if not url and account:
        url = f"https://{account}.blob.core.windows.net"
    if not url:
        raise ConfigError(
            "az:// needs storage_options with connection_string or account_name (or the environment's "
            "AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_ACCOUNT_NAME)"
        )
    proxy = proxy_url(opts, url)
    if proxy:
        kwargs["proxies"] = {"http": proxy, "https": proxy}
    credential: Any = opts.get("credential")
    if credential is None and opts.get("account_key"):
        credential = {"account_name": account, "account_key": opts["account_key"]}
    elif credential is None and opts.get("sas_token"):
        from azure.core.credentials import AzureSasCredential

        credential = AzureSasCredential(str(opts["sas_token"]).lstrip("?"))
    elif credential is None and opts.get("client_id") and opts.get("client_secret"):
        from azure.identity.aio import ClientSecretCredential

        credential = ClientSecretCredential(opts["tenant_id"], opts["client_id"], opts["client_secret"])
    elif credential is None and opts.get("anon") is False:
        from azure.identity.aio import DefaultAzureCredential

        credential = DefaultAzureCredential()
    return BlobServiceClient(url, credential=credential, **kwargs)


def _endpoint_of(connection_string: str) -> str | None:
    """The blob endpoint a connection string names (None: the SDK's default for its account)."""
    parts = dict(p.split("=", 1) for p in connection_string.split(";") if "=" in p)
    if parts.get("BlobEndpoint"):
        return parts["BlobEndpoint"]
    if parts.get("UseDevelopmentStorage") == "true":
        return "http://127.0.0.1:10000"
    account, suffix = parts.get("AccountName"), parts.get("EndpointSuffix", "core.windows.net")
    scheme = parts.get("DefaultEndpointsProtocol", "https")
    return f"{scheme}://{account}.blob.{suffix}" if account else None


class AzureReader:
    """ETag-pinned Azure Blob reads over one ``BlobServiceClient`` per process.

    ``storage_options`` are adlfs's (see the module docstring); ``concurrency`` (default 64) is the
    engine's bound on requests in flight (the SDK's aiohttp pool follows it).
    """

    def __init__(self, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 64) -> None:
        self._options = STORE.resolved(storage_options)
        self._concurrency = concurrency
        self._clients: ProcessBound[Any] = ProcessBound(self._new_client, _close_client)

    def __repr__(self) -> str:
        account = self._options.get("account_name") or ("connection string" if self._options else "?")
        return f"AzureReader(account={account!r})"

    def _new_client(self) -> Any:
        return _service_client(self._options, self._concurrency)

    async def close(self) -> None:
        """Close this process's client (safe to call more than once)."""
        await self._clients.aclose()

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
        """One download of ``az://container/key`` (bytes ``[start, end)`` when given), no retries.

        ``expect_identity`` is the listed ETag (quotes optional); ``timeout`` (seconds) bounds the
        whole request, first byte to last.
        """
        from azure.core import MatchConditions

        url = f"az://{bucket}/{key}"
        blob = self._clients.get().get_blob_client(bucket, key)
        kwargs: dict[str, Any] = {"max_concurrency": 1}
        first = start or 0
        if start is not None or end is not None:
            kwargs["offset"] = first
            if end is not None:
                kwargs["length"] = end - first
        known = end if end is not None else size
        pinned = expect_identity.strip('"') if expect_identity else None
        kwargs["raw_response_hook"] = _head_check(
            url, first, end, known - first if known is not None else _UNSIZED_CAP,
            whole=size is not None and start is None and end is None, etag=pinned,
        )  # fmt: skip
        if pinned:
            check_header_identity(pinned, url)
        if expect_identity:
            kwargs.update(
                etag=f'"{expect_identity.strip(chr(34))}"', match_condition=MatchConditions.IfNotModified
            )

        async def download() -> tuple[bytes, Any]:
            downloader = await blob.download_blob(**kwargs)
            return await downloader.readall(), downloader.properties

        try:
            body, props = await asyncio.wait_for(download(), timeout)
        except Exception as exc:
            err = translate(exc, url, hint=STORE.credential_hint, timeout=timeout, expected=expect_identity)
            if isinstance(err, ObjectChanged) and not await self._exists(blob, timeout):
                # Azure answers If-Match on a missing blob with 412 too: that is "not found".
                err = NotFound(f"{url}: no such blob (HTTP 404); rebuild the listing with refresh=True", url)
            raise err from None
        etag = str(props.etag or "").strip('"')
        if expect_identity and not etag:
            raise ObjectChanged(
                f"{url}: the store's answer carries no ETag, so it cannot be shown to be the listed "
                f"version ({expect_identity}); a proxy between here and the store may drop ETags and "
                "ignore If-Match. Nothing was returned, to never mix two versions",
                url,
            )
        if expect_identity and etag != expect_identity.strip('"'):
            raise ObjectChanged(
                f"{url} changed since it was listed (ETag {expect_identity} listed, {etag} now): rebuild "
                "the listing with refresh=True",
                url,
            )
        m = _RANGE_TOTAL_RE.match(str(getattr(props, "content_range", "") or ""))
        total = int(m.group(1)) if m else (len(body) if start is None and end is None else None)
        return ReadResult(body, etag or expect_identity or "", total)

    @staticmethod
    async def _exists(blob: Any, timeout: float) -> bool:
        """Whether the blob exists (True when that cannot be told: the caller's error stands)."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            await asyncio.wait_for(blob.get_blob_properties(), timeout)
        except ResourceNotFoundError:
            return False
        except Exception:
            return True
        return True


def identity(info: Mapping[str, Any]) -> str:
    """Azure's identity of a listed blob: its ETag without quotes."""
    return str(info.get("etag") or info.get("ETag") or "").strip('"')


# adlfs reads these itself; blobdata's own Azure reader must see the same credentials, so they are
# folded into the options here (storage_options win over the environment).
_AZURE_ENV = (
    ("account_key", "AZURE_STORAGE_ACCOUNT_KEY"),
    ("sas_token", "AZURE_STORAGE_SAS_TOKEN"),
    ("client_id", "AZURE_STORAGE_CLIENT_ID"),
    ("client_secret", "AZURE_STORAGE_CLIENT_SECRET"),
    ("tenant_id", "AZURE_STORAGE_TENANT_ID"),
)
_AZURE_CREDENTIALS = ("connection_string", "account_key", "sas_token", "credential", "client_id")


def _resolve(opts: dict[str, Any]) -> None:
    if not {"connection_string", "account_name", "account_url"} & opts.keys():
        conn = env("AZURE_STORAGE_CONNECTION_STRING")
        account = env("AZURE_STORAGE_ACCOUNT_NAME") or env("AZURE_STORAGE_ACCOUNT")
        if conn:
            opts["connection_string"] = conn
        elif account:
            opts["account_name"] = account
    if "connection_string" in opts:
        return
    for name, var in _AZURE_ENV:
        value = env(var)
        if name not in opts and value:
            opts[name] = value
    if "anon" not in opts and not any(opts.get(k) for k in _AZURE_CREDENTIALS):
        # An account name and no credential is anonymous access to a public container (adlfs would
        # try DefaultAzureCredential); anon=False or AZURE_STORAGE_ANON=false asks for that chain.
        flag = env("AZURE_STORAGE_ANON")
        opts["anon"] = flag.lower() not in ("false", "0", "f", "no") if flag else True


def _listing_scope(opts: Mapping[str, Any]) -> str:
    account = opts.get("account_url") or opts.get("account_host") or opts.get("account_name") or ""
    conn = str(opts.get("connection_string") or "")
    for part in conn.split(";"):
        name, _, value = part.partition("=")
        if name.strip() in ("BlobEndpoint", "AccountName") and value:
            account = account or value.strip()
        if part.strip() == "UseDevelopmentStorage=true":
            account = account or "devstoreaccount1"
    return f"az:{account}"


def _endpoint(opts: Mapping[str, Any]) -> str:
    """The account, and the blob endpoint too: an emulator's accounts all share one name."""
    parts = str(opts.get("connection_string") or "").split(";")
    scope = _listing_scope(opts)
    scope += "|" + "|".join(p.strip() for p in parts if p.strip().startswith("BlobEndpoint="))
    return scope + "|" + str(opts.get("account_url") or "")


#: Azure's facts: credentials from AZURE_STORAGE_*; an account's request rate is limited as a whole.
STORE = StoreInfo(
    "az",
    credential_hint="check the account key, SAS token or credential in storage_options (or "
    "AZURE_STORAGE_CONNECTION_STRING)",
    resolve=_resolve,
    listing_scope=_listing_scope,
    endpoint=_endpoint,
    throttle_bucket=False,
)

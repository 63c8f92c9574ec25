"""AWS Signature Version 4 for S3 GETs, and botocore's credential chain resolved once per process.

Per (credentials, date, region) the signing key, the credential scope and the start of the
``Authorization`` header are derived once, so a request costs one SHA-256 and one HMAC.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
import time
from typing import Any, NamedTuple
from urllib.parse import quote

from ... import _process
from .credentials import chain_key

__all__ = [
    "EMPTY_SHA256",
    "UNSIGNED_PAYLOAD",
    "Credentials",
    "SigV4Signer",
    "cached_chain",
    "chain_key",
    "quote_key",
    "refresh_chain",
    "resolve_chain",
]

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
# A key made only of characters that quote_key keeps is its own encoding (the common case).
_PLAIN_KEY_RE = re.compile(r"[A-Za-z0-9/._~-]*")


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
    # ``quote`` rebuilds its safe set on every call (~1.3 us); a plain key skips it.
    return key if _PLAIN_KEY_RE.fullmatch(key) else quote(key, safe="/~")


class SigV4Signer:
    """AWS Signature Version 4 for S3 requests without a body (GET/HEAD).

    Per (credentials, date, region) the derived signing key, the credential scope and the start of
    the ``Authorization`` header are computed once, so a request costs one SHA-256 of the canonical
    request and one HMAC. The ``x-amz-date`` stamp is formatted once per second.
    ``unsigned_payload`` sends ``UNSIGNED-PAYLOAD`` as the content hash instead of the SHA-256 of
    the empty body (both are valid for a GET).
    """

    def __init__(self, *, service: str = "s3", unsigned_payload: bool = False) -> None:
        self.service = service
        self.payload_hash = UNSIGNED_PAYLOAD if unsigned_payload else EMPTY_SHA256
        self._scopes: dict[tuple[str, str, str, str], _Scope] = {}
        # (unix second, its x-amz-date stamp): one tuple, swapped whole, so threads never see a torn pair.
        self._clock: tuple[int, str] = (-1, "")

    def __repr__(self) -> str:
        return f"SigV4Signer(service={self.service!r})"

    def _signing_key(self, secret: str, date: str, region: str) -> bytes:
        k = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
        k = hmac.new(k, region.encode(), hashlib.sha256).digest()
        k = hmac.new(k, self.service.encode(), hashlib.sha256).digest()
        return hmac.new(k, b"aws4_request", hashlib.sha256).digest()

    def _scope(self, credentials: Credentials, date: str, region: str) -> _Scope:
        cache_key = (credentials.access_key, credentials.secret_key, date, region)
        scope = self._scopes.get(cache_key)
        if scope is None:
            if len(self._scopes) > 16:
                self._scopes.clear()  # old dates and rotated secrets
            name = f"{date}/{region}/{self.service}/aws4_request"
            scope = self._scopes[cache_key] = _Scope(
                name,
                f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{name}, SignedHeaders=",
                self._signing_key(credentials.secret_key, date, region),
            )
        return scope

    def _now(self) -> str:
        now = int(time.time())
        clock = self._clock
        if clock[0] != now:
            clock = self._clock = (now, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)))
        return clock[1]

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
            amz_date = self._now()
        headers["x-amz-date"] = amz_date
        headers["x-amz-content-sha256"] = self.payload_hash
        if credentials.token:
            headers["x-amz-security-token"] = credentials.token
        canon = {k.lower(): v for k, v in headers.items()}
        canon["host"] = host
        names = sorted(canon)
        signed = ";".join(names)
        # SigV4 trims each value and collapses its inner runs of spaces.
        canonical_headers = "".join([f"{n}:{' '.join(canon[n].split())}\n" for n in names])
        canonical_request = f"{method}\n{path}\n{query}\n{canonical_headers}\n{signed}\n{self.payload_hash}"
        scope = self._scope(credentials, amz_date[:8], region)
        string_to_sign = (
            f"AWS4-HMAC-SHA256\n{amz_date}\n{scope.name}\n"
            f"{hashlib.sha256(canonical_request.encode()).hexdigest()}"
        )
        signature = hmac.new(scope.key, string_to_sign.encode(), hashlib.sha256).hexdigest()
        headers["Authorization"] = f"{scope.auth_prefix}{signed}, Signature={signature}"
        return headers


class _Scope(NamedTuple):
    """What one (credentials, date, region) signs with: the credential scope ``name``, the
    ``Authorization`` header up to its signed-header list, and the derived signing ``key``."""

    name: str
    auth_prefix: str
    key: bytes


# botocore's credential chain, resolved once per process (env, config files, SSO, IMDS, ...), per
# (pid, profile, chain key): the key holds everything else that selects the credentials (chain_key).
chains: dict[tuple[int, str | None, str], Any] = {}
_chain_lock = threading.Lock()


def _reset_chain_lock() -> None:
    # A fork while another thread resolves credentials would hand the child a held lock.
    global _chain_lock
    _chain_lock = threading.Lock()


_process.at_fork(after_in_child=_reset_chain_lock)


def cached_chain(profile: str | None, key: str) -> Any:
    """This process's resolved chain for ``profile`` and ``key`` (:func:`chain_key`), or None when not
    resolved yet (no I/O)."""
    return chains.get((_process.pid(), profile, key))


def resolve_chain(profile: str | None, key: str | None = None) -> Any:
    """botocore's chain for ``profile``, resolved at most once per process and chain ``key`` (default:
    :func:`chain_key` now; requests that start together wait here, in threads, for the first resolution
    instead of each asking IMDS/SSO) and, for refreshable credentials, once per node
    (:mod:`.credentials`)."""
    import botocore.session

    from .credentials import node_chain

    key = chain_key(profile) if key is None else key
    cache_key = (_process.pid(), profile, key)
    with _chain_lock:
        if cache_key not in chains:
            session = botocore.session.Session(profile=profile) if profile else botocore.session.get_session()
            # Once per node: the other processes read what the first resolved (credentials.py).
            chains[cache_key] = node_chain(key, session.get_credentials)
        return chains[cache_key]


def refresh_chain(profile: str | None, key: str, stale: Credentials) -> Any:
    """The chain for ``profile`` and ``key`` resolved afresh after a store refused ``stale`` as expired:
    this process's resolution, and the node's shared copy when it still holds ``stale``, are forgotten
    first. Threads (or processes of the node) that saw the same refusal together resolve once: one that
    finds the chain already holding other credentials takes them. Blocking (run it in a thread)."""
    from .credentials import forget

    cache_key = (_process.pid(), profile, key)
    with _chain_lock:
        current = chains.get(cache_key)
        if current is not None:
            frozen = current.get_frozen_credentials()
            if (frozen.access_key, frozen.secret_key, frozen.token) != tuple(stale):
                return current  # refreshed meanwhile
            del chains[cache_key]
        forget(key, stale)
    return resolve_chain(profile, key)

"""Network settings of the S3 client, read the way botocore reads them: proxies and the CA bundle.

Proxies (:func:`proxy_settings`):

- ``config_kwargs={"proxies": {"http": ..., "https": ...}}`` (botocore's ``Config(proxies=)``, what s3fs
  users pass) wins, and then the environment is not read at all, as in botocore.
- Otherwise ``HTTPS_PROXY`` for ``https://`` endpoints and ``HTTP_PROXY`` for ``http://`` ones
  (lower-case names first, as urllib reads them; ``HTTP_PROXY`` is ignored when ``REQUEST_METHOD``
  is set, urllib's CGI rule), then ``ALL_PROXY`` for either scheme (curl's and requests' fallback;
  botocore itself ignores it and would connect directly, which on a proxy-only network cannot work).
- ``NO_PROXY``: comma-separated host names, each matching itself and its sub-domains (a leading dot
  is ignored), optionally ``host:port``; ``*`` matches every host. urllib's rule, which botocore uses.
- A proxy URL without a scheme is ``http://`` (botocore's rule); ``user:password@`` in it is sent as
  ``Proxy-Authorization: Basic``. ``https://`` and ``socks`` proxies, ``proxies_config`` and
  ``client_kwargs["proxies"]`` are refused when the reader is made, with an error naming where the
  setting came from: blobdata never connects directly when a proxy was asked for.

CA bundle (:func:`ca_bundle`): ``client_kwargs["verify"]`` (False, or a path), else ``AWS_CA_BUNDLE``,
else ``ca_bundle`` of the profile in the AWS config file, else the system's CAs. A path that is not a
readable file is refused when the reader is made.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

from .._config import env
from .._errors import ConfigError

__all__ = ["Proxy", "ProxySettings", "ca_bundle", "proxy_settings", "proxy_url", "redact_url"]

_USERINFO_RE = re.compile(r"(?<=://)[^/@\s]*@")


def redact_url(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it replaced by ``***@``."""
    return _USERINFO_RE.sub("***@", text) if "@" in text else text


class Proxy(NamedTuple):
    """One HTTP proxy: where to connect, the ``Proxy-Authorization`` value (or None), how to name it
    in messages (its URL without credentials, and the setting it came from) and its full URL
    (credentials included: never printed, its repr leaves it out)."""

    host: str
    port: int
    authorization: str | None
    display: str
    url: str

    def __repr__(self) -> str:
        return f"Proxy({self.display})"


class ProxySettings(NamedTuple):
    """Proxies by endpoint scheme (``http``, ``https``) and the hosts that bypass them."""

    by_scheme: Mapping[str, Proxy]
    no_proxy: tuple[str, ...]

    def for_origin(self, scheme: str, host: str, port: int) -> Proxy | None:
        """The proxy to reach ``scheme://host:port`` through, or None to connect directly."""
        proxy = self.by_scheme.get(scheme)
        if proxy is None or _bypass(self.no_proxy, host, port):
            return None
        return proxy


def _bypass(no_proxy: tuple[str, ...], host: str, port: int) -> bool:
    if "*" in no_proxy:
        return True
    host = host.lower()
    hostport = f"{host}:{port}"
    for name in no_proxy:
        pattern = r"(.+\.)?" + re.escape(name) + "$"
        if re.match(pattern, host) or re.match(pattern, hostport):
            return True
    return False


def _parse_proxy(url: str, source: str) -> Proxy:
    raw = url.strip()
    if raw.startswith("//"):
        raw = "http:" + raw
    elif "://" not in raw:
        raw = "http://" + raw
    shown = redact_url(raw)
    where = f"{shown} (from {source})"
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{source}: {shown!r} is not a proxy URL such as http://proxy:3128") from None
    if parts.scheme != "http":
        raise ConfigError(
            f"{source}: the proxy {shown} is an {parts.scheme}:// proxy; blobdata's S3 client connects "
            "through http:// proxies only (https:// endpoints are tunnelled with CONNECT): use the "
            "proxy's http:// address, or unset it if the endpoint is reachable directly"
        )
    if not parts.hostname:
        raise ConfigError(f"{source}: {shown!r} is not a proxy URL such as http://proxy:3128")
    auth = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return Proxy(parts.hostname, port or 80, auth, where, raw)


_ENV_NAMES = {"http": ("http_proxy", "HTTP_PROXY"), "https": ("https_proxy", "HTTPS_PROXY")}


def _env_proxy(scheme: str) -> tuple[str, str] | None:
    """(value, variable name) of the proxy the environment sets for ``scheme``, or None."""
    lower, upper = _ENV_NAMES[scheme]
    names = [lower] if scheme == "http" and env("REQUEST_METHOD") else [lower, upper]
    for name in [*names, "all_proxy", "ALL_PROXY"]:
        value = env(name)
        if value:
            return value, name
    return None


def proxy_settings(storage_options: Mapping[str, Any]) -> ProxySettings:
    """The proxies of the S3 client for these (resolved) storage options; see the module docstring.
    Raises :class:`ConfigError` naming the setting for any form blobdata does not support."""
    client_kwargs = storage_options.get("client_kwargs") or {}
    config_kwargs = storage_options.get("config_kwargs") or {}
    if "proxies" in client_kwargs:
        raise ConfigError(
            "client_kwargs['proxies'] is not a botocore client argument (s3fs would fail with it too): "
            "pass config_kwargs={'proxies': {'https': 'http://proxy:3128'}}"
        )
    if config_kwargs.get("proxies_config"):
        raise ConfigError(
            "config_kwargs['proxies_config'] (proxy_ca_bundle, proxy_client_cert, "
            "proxy_use_forwarding_for_https) is not supported by blobdata's S3 client: it connects "
            "through http:// proxies only; remove it"
        )
    configured = config_kwargs.get("proxies")
    if configured is not None:
        if not isinstance(configured, Mapping) or not set(configured) <= {"http", "https"}:
            raise ConfigError(
                "config_kwargs['proxies'] must map 'http' and/or 'https' to a proxy URL, got "
                f"{redact_url(repr(configured))}"
            )
        by_scheme = {
            scheme: _parse_proxy(str(url), f"config_kwargs['proxies'][{scheme!r}]")
            for scheme, url in configured.items()
            if url
        }
        return ProxySettings(by_scheme, ())
    env_scheme: dict[str, Proxy] = {}
    for scheme in ("http", "https"):
        found = _env_proxy(scheme)
        if found is not None:
            env_scheme[scheme] = _parse_proxy(found[0], found[1])
    raw = env("no_proxy") or env("NO_PROXY") or ""
    no_proxy = tuple(n.strip().lstrip(".").lower() for n in raw.split(",") if n.strip().lstrip("."))
    return ProxySettings(env_scheme, no_proxy)


def proxy_url(storage_options: Mapping[str, Any], url: str) -> str | None:
    """The proxy URL (credentials included) for requests to ``url``, for aiohttp's ``proxy=``."""
    parts = urlsplit(url)
    scheme = parts.scheme or "https"
    proxy = proxy_settings(storage_options).for_origin(
        scheme, parts.hostname or "", parts.port or (443 if scheme == "https" else 80)
    )
    return proxy.url if proxy is not None else None


def ca_bundle(storage_options: Mapping[str, Any], profile: str | None) -> bool | str:
    """botocore's ``verify`` for these storage options: False, True (the system's CAs) or a CA
    bundle path, checked to be a readable file. See the module docstring for the order."""
    client_kwargs = storage_options.get("client_kwargs") or {}
    source = "client_kwargs['verify']"
    verify: Any = client_kwargs.get("verify")
    if verify is None:
        verify, source = env("AWS_CA_BUNDLE"), "AWS_CA_BUNDLE"
    if verify is None:
        verify, source = _config_file_ca_bundle(profile), "ca_bundle in the AWS config file"
    if verify is None or isinstance(verify, bool):
        return True if verify is None else verify
    path = os.path.expanduser(str(verify))
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ConfigError(f"{source} names the CA bundle {path!r}, which is not a readable file")
    return path


def _config_file_ca_bundle(profile: str | None) -> str | None:
    """``ca_bundle`` of the profile in the AWS config file (``AWS_CONFIG_FILE``, ``~/.aws/config``),
    read through botocore as boto3 reads it; None when there is no such file or setting."""
    config_file = env("AWS_CONFIG_FILE") or "~/.aws/config"
    if not os.path.isfile(os.path.expanduser(config_file)):
        return None  # no file: skip loading botocore's session (tens of milliseconds)
    import botocore.session

    session = botocore.session.Session(profile=profile) if profile else botocore.session.Session()
    try:
        value = session.get_scoped_config().get("ca_bundle")
    except Exception:  # an unknown profile: the credential chain reports it with its own error
        return None
    return str(value) if value else None

"""Storage options: the environment folded in once, a stable token for cache keys, a redacted copy.

Endpoints and credentials written the way each ecosystem writes them (``AWS_ENDPOINT_URL_S3``,
``STORAGE_EMULATOR_HOST``, ``AZURE_STORAGE_CONNECTION_STRING``, ...) are folded into the storage
options here, where ``storage_options`` are silent; nothing else reads those variables.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .._config import env
from .._errors import ConfigError
from .network import redact_url

__all__ = ["listing_scope", "options_token", "redact", "resolve_storage_options"]

_SECRET_WORDS = ("secret", "token", "password", "key", "credential", "sas", "connection_string", "signature")


def resolve_storage_options(protocol: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Storage options for ``protocol`` with the ecosystem's environment endpoints applied.

    Explicit options win over the environment.
    """
    opts = dict(storage_options or {})
    if protocol == "s3":
        client_kwargs = dict(opts.get("client_kwargs") or {})
        if "endpoint_url" not in opts and "endpoint_url" not in client_kwargs:
            endpoint = env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL")
            if endpoint:
                opts["endpoint_url"] = endpoint
        if client_kwargs:
            opts["client_kwargs"] = client_kwargs
    elif protocol == "gs":
        host = env("STORAGE_EMULATOR_HOST")
        if "endpoint_url" not in opts and host:
            opts["endpoint_url"] = host if "://" in host else "http://" + host
            opts.setdefault("token", "anon")
    elif protocol == "az":
        _resolve_azure(opts)
    return opts


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


def _resolve_azure(opts: dict[str, Any]) -> None:
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


def options_token(protocol: str, storage_options: Mapping[str, Any]) -> str:
    """A stable string identifying (protocol, options), for cache keys. Contains secrets: never log it."""
    try:
        return protocol + ":" + json.dumps(storage_options, sort_keys=True, default=repr)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"storage_options for {protocol}:// must be plain values: {exc}") from None


def redact(storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``storage_options`` safe to print: values of secret-looking keys are replaced, and
    the ``user:password@`` of URLs (an endpoint, a proxy) too."""
    out: dict[str, Any] = {}
    for k, v in storage_options.items():
        if isinstance(v, Mapping):
            out[k] = redact(v)
        elif any(word in k.lower() for word in _SECRET_WORDS) and k.lower() not in ("key_prefix",):
            out[k] = "***"
        elif isinstance(v, str):
            out[k] = redact_url(v)
        else:
            out[k] = v
    return out


def listing_scope(protocol: str, storage_options: Mapping[str, Any]) -> str:
    """What a bucket listing depends on besides the URL: the endpoint (or Azure account), never the
    credentials, so that one URL has one remembered listing however its credentials are given."""
    opts = storage_options
    if protocol == "s3":
        client_kwargs = opts.get("client_kwargs") or {}
        endpoint = opts.get("endpoint_url") or client_kwargs.get("endpoint_url") or "aws"
        return f"s3:{str(endpoint).rstrip('/')}:versions={bool(opts.get('version_aware'))}"
    if protocol == "gs":
        return f"gs:{opts.get('endpoint_url') or env('STORAGE_EMULATOR_HOST') or 'google'}"
    if protocol == "az":
        account = opts.get("account_url") or opts.get("account_host") or opts.get("account_name") or ""
        conn = str(opts.get("connection_string") or "")
        for part in conn.split(";"):
            name, _, value = part.partition("=")
            if name.strip() in ("BlobEndpoint", "AccountName") and value:
                account = account or value.strip()
            if part.strip() == "UseDevelopmentStorage=true":
                account = account or "devstoreaccount1"
        return f"az:{account}"
    return protocol

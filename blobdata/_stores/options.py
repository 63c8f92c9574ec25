"""Storage options: a stable token for cache keys, and a copy safe to print.

What each store folds in from the environment (``AWS_ENDPOINT_URL_S3``, ``STORAGE_EMULATOR_HOST``,
``AZURE_STORAGE_CONNECTION_STRING``, ...) is its descriptor's ``resolve`` (``STORE`` in its module),
reached through :func:`blobdata._stores.resolve_storage_options`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .._errors import ConfigError
from .network import redact_url

__all__ = ["options_token", "redact"]

_SECRET_WORDS = ("secret", "token", "password", "key", "credential", "sas", "connection_string", "signature")


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

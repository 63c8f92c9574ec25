"""The one error map against the backends' real exception classes.

``blobdata._errors.translate`` classifies a backend's exception by its class *name* (botocore, aiohttp,
fsspec, the Azure SDK, the standard library), so that no backend has to be imported to classify
another's error. A renamed class upstream would silently turn a retryable timeout into a final error:
these tests find every name the map matches on a real class of an installed backend, and translate
real instances.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any, ClassVar

import aiohttp
import botocore.exceptions
import pytest
from azure.core import exceptions as azure_exc
from fsspec import exceptions as fsspec_exc

from blobdata import AccessDenied, FetchError, NotFound, Throttled
from blobdata._errors import (
    _CONNECTION_NAMES,
    _CREDENTIAL_NAMES,
    _TIMEOUT_NAMES,
    _TLS_REFUSED_NAMES,
    TransientError,
    translate,
)
from blobdata._stores import credential_hint

_MODULES: list[Any] = [botocore.exceptions, aiohttp, azure_exc, fsspec_exc, socket, ssl, asyncio]
_BUILTINS = {"ConnectionRefusedError": ConnectionRefusedError, "ConnectionError": ConnectionError}


def _real_class(name: str) -> type[BaseException]:
    if name in _BUILTINS:
        return _BUILTINS[name]
    for module in _MODULES:
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            return cls
    raise AssertionError(f"no installed backend defines {name}: renamed upstream? update blobdata._errors")


@pytest.mark.parametrize(
    "name", sorted(_TIMEOUT_NAMES | _CONNECTION_NAMES | _TLS_REFUSED_NAMES | _CREDENTIAL_NAMES)
)
def test_every_name_the_map_matches_is_a_real_class(name: str) -> None:
    assert _real_class(name).__name__ == name


def _instance(cls: type[BaseException]) -> BaseException:
    """A real instance of a backend's class, made the way the backend makes it."""
    if issubclass(cls, botocore.exceptions.BotoCoreError):
        return cls(endpoint_url="http://127.0.0.1:1", error="refused", provider="env", cred_var="x")
    if issubclass(cls, aiohttp.ClientConnectorError):
        key = aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 1, False, True, None, None, None)
        if cls is aiohttp.ClientConnectorCertificateError:
            return cls(key, ssl.SSLCertVerificationError("self-signed"))
        return cls(key, OSError(111, "refused"))
    if cls is socket.gaierror:
        return cls(-2, "Name or service not known")
    return cls("failed")


@pytest.mark.parametrize("name", sorted(_TIMEOUT_NAMES))
def test_timeouts_are_retried(name: str) -> None:
    err = translate(_instance(_real_class(name)), "s3://b/k")
    assert isinstance(err, TransientError) and err.kind == "timeout", err


@pytest.mark.parametrize("name", sorted(_CONNECTION_NAMES - {"ConnectionError"}))
def test_connection_failures_are_retried(name: str) -> None:
    err = translate(_instance(_real_class(name)), "s3://b/k")
    assert isinstance(err, TransientError) and err.kind in ("connection", "short_read"), err


@pytest.mark.parametrize("name", sorted(_TLS_REFUSED_NAMES))
def test_a_refused_certificate_is_final_and_says_so(name: str) -> None:
    err = translate(_instance(_real_class(name)), "s3://b/k")
    assert isinstance(err, FetchError) and "TLS certificate" in str(err), err


@pytest.mark.parametrize("name", sorted(_CREDENTIAL_NAMES))
def test_missing_credentials_are_access_denied_with_the_stores_hint(name: str) -> None:
    err = translate(_instance(_real_class(name)), "s3://b/k", hint=credential_hint("s3"))
    assert isinstance(err, AccessDenied) and "AWS_ACCESS_KEY_ID" in str(err), err


def test_botocore_client_errors_by_code_and_status() -> None:
    def client_error(code: str, status: int) -> botocore.exceptions.ClientError:
        response: Any = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return botocore.exceptions.ClientError(response, "GetObject")

    throttled = translate(client_error("SlowDown", 503), "s3://b/k")
    assert isinstance(throttled, TransientError) and throttled.kind == "throttle"
    assert not isinstance(throttled, NotFound)  # a throttled request is never "not found"
    assert isinstance(translate(client_error("NoSuchKey", 404), "s3://b/k"), NotFound)
    denied = translate(client_error("AccessDenied", 403), "gs://b/k", hint=credential_hint("gs"))
    assert isinstance(denied, AccessDenied) and "token=" in str(denied)


def test_azure_http_errors_by_status() -> None:
    class _Response:
        status_code = 404
        reason = "Not Found"
        headers: ClassVar[dict[str, str]] = {}

        def text(self) -> str:
            return ""

    err = azure_exc.ResourceNotFoundError(message="gone", response=_Response())
    assert isinstance(translate(err, "az://c/k"), NotFound)
    _Response.status_code = 503
    busy = azure_exc.HttpResponseError(message="busy", response=_Response())
    assert isinstance(translate(busy, "az://c/k"), TransientError)


def test_throttled_is_a_fetch_error_a_user_can_catch() -> None:
    assert issubclass(Throttled, FetchError)

"""AWS credentials resolved once per node, not once per process: 8 ranks x 8 DataLoader workers that
each ask the instance metadata service (or SSO, or an assumed role) at start make 64 requests, and
the service throttles. The first process of the node to need them resolves botocore's chain, under
a lock, and leaves what it got in this user's node-private directory in memory
(``/dev/shm/blobdata-<uid>/``, mode 0700; the file 0600); the others read it while it is valid.

Only refreshable credentials (those with an expiry: IMDS, containers, SSO, assumed roles, a
``credential_process``) are shared; static keys from the environment or the config files are cheap
to read and are never written anywhere. Nothing is shared where there is no ``/dev/shm``: the
credentials never go to a disk. A process re-reads the file, or resolves afresh under the lock,
5 minutes before the expiry; credentials a store refused as expired before that are forgotten
(:func:`forget`, only if the file still holds them) and resolved afresh. The file is named after
the profile and the variables that choose where credentials come from, so two configurations never
share.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["forget", "node_chain"]

_MARGIN_S = 300.0  # refresh this long before the expiry, as botocore's advisory refresh does
_SOURCES = (
    "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_ACCESS_KEY_ID",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT", "AWS_EC2_METADATA_DISABLED",
)  # fmt: skip


class _Frozen(NamedTuple):
    access_key: str
    secret_key: str
    token: str | None


def _path(profile: str | None) -> str | None:
    from ..._node import memory_dir

    top = memory_dir()  # memory only: credentials never reach a disk
    if top is None:
        return None
    ident = json.dumps([profile, [os.environ.get(v) for v in _SOURCES]])
    return os.path.join(top, f"credentials-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json")


def _read(path: str) -> tuple[_Frozen, float] | None:
    """The shared credentials and their expiry, if the file is there, this user's and still valid."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as fh:
        st = os.fstat(fh.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        try:
            doc = json.load(fh)
            frozen = _Frozen(str(doc["access_key"]), str(doc["secret_key"]), doc.get("token"))
            expiry = float(doc["expiry"])
        except (ValueError, KeyError, TypeError):
            return None
    return (frozen, expiry) if expiry - _MARGIN_S > time.time() else None


def _write(path: str, frozen: Any, expiry: float) -> None:
    doc = {"access_key": frozen.access_key, "secret_key": frozen.secret_key, "token": frozen.token,
           "expiry": expiry}  # fmt: skip
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".credentials.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _expiry(creds: Any) -> float | None:
    """The expiry (epoch seconds) of botocore's refreshable credentials; None for static ones."""
    when = getattr(creds, "_expiry_time", None)
    return when.timestamp() if when is not None and hasattr(when, "timestamp") else None


class _Shared:
    """Credentials another process of the node resolved: botocore's ``get_frozen_credentials()``
    interface, read from the node's file and resolved afresh there near their expiry."""

    def __init__(self, path: str, frozen: _Frozen, expiry: float, resolve: Callable[[], Any]) -> None:
        self._path, self._frozen, self._expiry, self._resolve = path, frozen, expiry, resolve
        self._lock = threading.Lock()

    def get_frozen_credentials(self) -> _Frozen:
        if self._expiry - _MARGIN_S > time.time():
            return self._frozen
        with self._lock:
            got = _locked(self._path, self._resolve)
            if isinstance(got, _Shared):
                self._frozen, self._expiry = got._frozen, got._expiry
                return self._frozen
            return got.get_frozen_credentials() if got is not None else self._frozen


def _locked(path: str, resolve: Callable[[], Any]) -> Any:
    with open(path + ".lock", "a") as lock:
        os.chmod(lock.name, 0o600)
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # the others wait for the first resolution
        shared = _read(path)
        if shared is not None:
            return _Shared(path, shared[0], shared[1], resolve)
        creds = resolve()
        expiry = _expiry(creds) if creds is not None else None
        if expiry is not None:
            _write(path, creds.get_frozen_credentials(), expiry)
        return creds


def node_chain(profile: str | None, resolve: Callable[[], Any]) -> Any:
    """botocore's credentials for ``profile``: read from the node's file when another process shared
    them, else ``resolve()`` (botocore's chain), shared when refreshable (see the module docstring)."""
    path = _path(profile)
    if path is None:
        return resolve()
    shared = _read(path)
    if shared is not None:
        return _Shared(path, shared[0], shared[1], resolve)
    try:
        return _locked(path, resolve)
    except OSError:
        return resolve()  # nothing shared, nothing lost


def forget(profile: str | None, stale: Any) -> None:
    """Remove the node's shared credentials for ``profile`` if they are ``stale`` (refused by the store as
    expired before their stated expiry), so that the next resolution asks the chain again. Credentials
    another process already refreshed are kept."""
    path = _path(profile)
    if path is None:
        return
    try:
        with open(path + ".lock", "a") as lock:
            os.chmod(lock.name, 0o600)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            shared = _read(path)
            if shared is not None and tuple(shared[0]) == (stale.access_key, stale.secret_key, stale.token):
                os.unlink(path)
    except OSError:
        pass  # nothing shared: the next resolution asks the chain anyway

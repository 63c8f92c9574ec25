"""AWS credentials resolved once per node, not once per process: 8 ranks x 8 DataLoader workers that
each ask the instance metadata service (or SSO, or an assumed role) at start make 64 requests, and
the service throttles. The first process of the node to need them resolves botocore's chain, under
a lock, and leaves what it got in this user's node-private directory in memory
(``/dev/shm/blobdata-<uid>/``, mode 0700; the file 0600); the others read it while it is valid.

Only refreshable credentials that do not come from the environment (IMDS, containers, SSO, assumed
roles, web identity, a ``credential_process``) are shared; keys from the environment (even with
``AWS_CREDENTIAL_EXPIRATION``, which makes them refreshable to botocore) or static keys of the config
files are cheap to read and are never written anywhere. Nothing is shared where there is no
``/dev/shm``: the credentials never go to a disk. A process re-reads the file, or resolves afresh under
the lock, 5 minutes before the expiry; credentials a store refused as expired before that are forgotten
(:func:`forget`, only if the file still holds them) and resolved afresh.

The file is named after everything that selects what botocore's chain resolves (:func:`chain_key`): the
profile asked for, every ``AWS_*`` variable (``AWS_PROFILE``, ``AWS_DEFAULT_PROFILE``, the config and
credentials file paths, role, web identity, container and instance-metadata settings, region and
endpoints), the home directory (``~/.aws``, the SSO token cache) and the identity of the config and
credentials files; two configurations never share, and the file holds only this user's (0600, in a 0700
directory, read only when this user's own and not a link).
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

__all__ = ["chain_key", "forget", "node_chain"]

_MARGIN_S = 300.0  # refresh this long before the expiry, as botocore's advisory refresh does
_MAX_FILE = 64 * 1024  # a shared credentials file is a few hundred bytes
#: How botocore names credentials it read from the environment (never shared, even refreshable).
_FROM_ENV = frozenset({"env"})
#: The AWS files botocore reads, and where they are by default.
_FILES = (("AWS_CONFIG_FILE", "~/.aws/config"), ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"))


def chain_key(profile: str | None) -> str:
    """What selects the credentials botocore's chain resolves for ``profile`` (see the module), hashed.

    Read once per reader, not per request: it stats the two files."""
    environ = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    files: list[list[object]] = []
    for var, default in _FILES:
        path = os.path.expanduser(os.environ.get(var) or default)
        try:
            st = os.stat(path)
            files.append([path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns])
        except OSError:
            files.append([path])
    ident = json.dumps([profile, environ, os.path.expanduser("~"), files])
    return hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class _Frozen(NamedTuple):
    access_key: str
    secret_key: str
    token: str | None


def _path(key: str) -> str | None:
    from ..._node import memory_dir

    top = memory_dir()  # memory only: credentials never reach a disk
    if top is None:
        return None
    return os.path.join(top, f"credentials-{key[:24]}.json")


def _read(path: str) -> tuple[_Frozen, float] | None:
    """The shared credentials and their expiry, if the file is there, this user's own (a regular file,
    not a link, 0600: :func:`blobdata._node.read_own`) and still valid."""
    from ..._errors import ConfigError
    from ..._node import read_own

    try:
        raw = read_own(path, setting="BLOBDATA_NODE_DIR", limit=_MAX_FILE)
        if raw is None:
            return None
        doc = json.loads(raw)
        frozen = _Frozen(str(doc["access_key"]), str(doc["secret_key"]), doc.get("token"))
        expiry = float(doc["expiry"])
    except (OSError, ConfigError, ValueError, KeyError, TypeError):
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
        if expiry is not None and getattr(creds, "method", None) not in _FROM_ENV:
            _write(path, creds.get_frozen_credentials(), expiry)
        return creds


def node_chain(key: str, resolve: Callable[[], Any]) -> Any:
    """botocore's credentials for the chain ``key`` (:func:`chain_key`): read from the node's file when
    another process shared them, else ``resolve()`` (botocore's chain), shared when refreshable and not
    from the environment (see the module docstring)."""
    path = _path(key)
    if path is None:
        return resolve()
    shared = _read(path)
    if shared is not None:
        return _Shared(path, shared[0], shared[1], resolve)
    try:
        return _locked(path, resolve)
    except OSError:
        return resolve()  # nothing shared, nothing lost


def forget(key: str, stale: Any) -> None:
    """Remove the node's shared credentials for the chain ``key`` if they are ``stale`` (refused by the
    store as expired before their stated expiry), so that the next resolution asks the chain again.
    Credentials another process already refreshed are kept."""
    path = _path(key)
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

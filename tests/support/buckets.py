"""Fresh test buckets on any backend, one interface: ``name``, ``url()``, ``put``, ``put_many``, ``delete``.

Each backend only supplies how to create, write, delete and drop a bucket (:class:`_Backend`); the
test-facing :class:`TestBucket` is shared, so S3, Azurite and the GCS emulator behave alike in tests.
:func:`through_proxy` puts a :class:`~blobdata.testing.LatencyProxy` between blobdata and a bucket's
server, whichever store it is.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from blobdata.testing import LatencyProxy, LocalAzurite, LocalGCSEmulator, S3Endpoint, s3_client

__all__ = [
    "TestBucket",
    "az_bucket",
    "file_bucket",
    "gcs_bucket",
    "memory_bucket",
    "s3_bucket",
    "through_proxy",
    "unique_name",
]

_UPLOAD_THREADS = 16


def unique_name(prefix: str = "t") -> str:
    """A bucket name valid on S3, GCS and Azure (lowercase, digits, hyphens, 3-63 chars)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class _Backend:
    scheme = ""
    max_threads = _UPLOAD_THREADS  # uploads in flight that the server takes without dropping any

    def create(self, name: str) -> None:
        raise NotImplementedError

    def put(self, name: str, key: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, name: str, key: str) -> None:
        raise NotImplementedError

    def drop(self, name: str) -> None:
        raise NotImplementedError


class _S3(_Backend):
    scheme = "s3"

    _clients: ClassVar[dict[tuple[str, str], Any]] = {}  # one client per endpoint (thread-safe)

    def __init__(self, server: S3Endpoint) -> None:
        self.server = server
        key = (server.endpoint_url, server.access_key)
        if key not in self._clients:
            self._clients[key] = s3_client(server, max_pool_connections=_UPLOAD_THREADS)
        self.client = self._clients[key]

    def create(self, name: str) -> None:
        self.client.create_bucket(Bucket=name)

    def put(self, name: str, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=name, Key=key, Body=data)

    def delete(self, name: str, key: str) -> None:
        self.client.delete_object(Bucket=name, Key=key)

    def drop(self, name: str) -> None:
        # SeaweedFS drops a non-empty bucket (and its volumes) in one call; other stores need emptying.
        with contextlib.suppress(Exception):
            self.client.delete_bucket(Bucket=name)
            return
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        self.client.delete_bucket(Bucket=name)


class _Azure(_Backend):
    scheme = "az"

    def __init__(self, server: LocalAzurite) -> None:
        self.service = server.service_client()

    def create(self, name: str) -> None:
        self.service.create_container(name)

    def put(self, name: str, key: str, data: bytes) -> None:
        self.service.get_blob_client(name, key).upload_blob(data, overwrite=True)

    def delete(self, name: str, key: str) -> None:
        self.service.get_blob_client(name, key).delete_blob()

    def drop(self, name: str) -> None:
        self.service.delete_container(name)


class _GCS(_Backend):
    scheme = "gs"
    # The emulator's HTTP server has a listen backlog of 5: more concurrent uploads get resets.
    max_threads = 4

    def __init__(self, server: LocalGCSEmulator) -> None:
        self.server = server

    def create(self, name: str) -> None:
        self.server.create_bucket(name)

    def put(self, name: str, key: str, data: bytes) -> None:
        self.server.upload(name, key, data)

    def delete(self, name: str, key: str) -> None:
        self.server.delete_object(name, key)

    def drop(self, name: str) -> None:
        pass  # the emulator keeps everything in memory and is dropped at session end


class _Memory(_Backend):
    """fsspec's process-wide ``memory://`` store; the bucket is a top-level folder ``/<name>``."""

    scheme = "memory"

    def __init__(self) -> None:
        import fsspec

        self.fs = fsspec.filesystem("memory")

    def create(self, name: str) -> None:
        self.fs.mkdir(f"/{name}")

    def put(self, name: str, key: str, data: bytes) -> None:
        self.fs.pipe_file(f"/{name}/{key}", data)

    def delete(self, name: str, key: str) -> None:
        self.fs.rm_file(f"/{name}/{key}")

    def drop(self, name: str) -> None:
        if self.fs.exists(f"/{name}"):
            self.fs.rm(f"/{name}", recursive=True)


class _Local(_Backend):
    """A local directory; the bucket ``name`` is its absolute path, so ``url()`` is ``file:///...``."""

    scheme = "file"

    def create(self, name: str) -> None:
        os.makedirs(name)

    def put(self, name: str, key: str, data: bytes) -> None:
        path = os.path.join(name, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Write then rename, as an upload replaces an object: a new inode, a new mtime.
        with open(path + ".part", "wb") as f:
            f.write(data)
        os.replace(path + ".part", path)

    def delete(self, name: str, key: str) -> None:
        os.remove(os.path.join(name, key))

    def drop(self, name: str) -> None:
        shutil.rmtree(name, ignore_errors=True)


class TestBucket:
    """A fresh bucket (Azure: container) for one test.

    ``url("a/b")`` gives ``"<scheme>://<name>/a/b"``; ``storage_options`` are the fsspec options that
    reach it (through a proxy when the bucket was made with other options).
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self, backend: _Backend, storage_options: Mapping[str, Any], name: str | None = None
    ) -> None:
        self._backend = backend
        self.scheme = backend.scheme
        self.name = name or unique_name()
        self.storage_options: dict[str, Any] = dict(storage_options)
        backend.create(self.name)

    def url(self, prefix: str = "") -> str:
        return f"{self.scheme}://{self.name}/{prefix}"

    def put(self, key: str, data: bytes) -> None:
        self._backend.put(self.name, key, data)

    def put_many(self, objects: Mapping[str, bytes], *, threads: int = _UPLOAD_THREADS) -> None:
        """Upload every ``{key: data}`` in parallel (``threads`` uploads in flight)."""
        if not objects:
            return
        threads = min(threads, self._backend.max_threads, len(objects))
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(self._backend.put, self.name, k, v) for k, v in objects.items()]
            for future in futures:
                future.result()

    def delete(self, key: str) -> None:
        self._backend.delete(self.name, key)

    def drop(self) -> None:
        """Delete the bucket and everything in it (best effort: a test must not fail in teardown)."""
        with contextlib.suppress(Exception):
            self._backend.drop(self.name)

    def __repr__(self) -> str:
        return f"TestBucket({self.url()!r})"


def s3_bucket(server: S3Endpoint) -> TestBucket:
    return TestBucket(_S3(server), server.storage_options)


def az_bucket(server: LocalAzurite) -> TestBucket:
    return TestBucket(_Azure(server), server.storage_options)


def gcs_bucket(server: LocalGCSEmulator) -> TestBucket:
    return TestBucket(_GCS(server), server.storage_options)


def memory_bucket() -> TestBucket:
    """A fresh ``memory://<name>/`` folder (drop it: the memory store outlives the test)."""
    return TestBucket(_Memory(), {})


def file_bucket(directory: str | os.PathLike[str]) -> TestBucket:
    """A fresh folder below ``directory``; ``url("p")`` is ``file:///<directory>/<name>/p``."""
    base = os.path.abspath(os.fspath(directory))
    return TestBucket(_Local(), {}, name=os.path.join(base, unique_name()))


_PORT = re.compile(r"^(https?://127\.0\.0\.1):(\d+)(/.*)?$")
_AZ_ENDPOINT = re.compile(r"BlobEndpoint=(http://127\.0\.0\.1:\d+/[^;]*)")


@contextlib.contextmanager
def through_proxy(bucket: TestBucket, **proxy_options: Any) -> Iterator[tuple[LatencyProxy, dict[str, Any]]]:
    """A started :class:`LatencyProxy` in front of ``bucket``'s server (``proxy_options`` are its
    keyword arguments) and the storage options that reach the bucket through it.

    S3 and the GCS emulator are addressed by ``endpoint_url``, Azurite by its connection string's
    ``BlobEndpoint``. Raises LookupError for memory:// and file://, which have no server.
    """
    opts = dict(bucket.storage_options)
    if bucket.scheme in ("s3", "gs"):
        key, value = "endpoint_url", str(opts.get("endpoint_url", ""))
        endpoint = value
    elif bucket.scheme == "az":
        key, value = "connection_string", str(opts.get("connection_string", ""))
        found = _AZ_ENDPOINT.search(value)
        endpoint = found.group(1) if found else ""
    else:
        raise LookupError(f"{bucket.scheme}:// is read in process: there is no server to put a proxy before")
    match = _PORT.match(endpoint)
    if match is None:
        raise LookupError(f"{bucket.scheme} endpoint {endpoint!r} is not a local http://127.0.0.1:PORT")
    with LatencyProxy("127.0.0.1", int(match.group(2)), **proxy_options) as proxy:
        proxied = f"{match.group(1)}:{proxy.port}{match.group(3) or ''}"
        opts[key] = value.replace(endpoint, proxied)
        yield proxy, opts

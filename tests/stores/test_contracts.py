"""One conformance check per contract of ``blobdata._stores.base``, run on every implementation and on
the test fakes (as torchdata's ``run_test_save_load_state`` is run on every node):

- :class:`Reader`: every store's reader (memory://, file://, the S3 server, Azurite, the GCS
  emulator) and ``tests.support.fake_reader.FakeReader``, which the engine tests stand on;
- :class:`Lister`: every store's lister, and that what it lists is what its reader reads (the listed
  identity pins the read);
- :class:`StoreInfo`: every store's descriptor.

A fake that drifts from the contract makes the engine tests prove nothing: it is held to the same
checks as the real readers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from blobdata import FetchOptions, NotFound, ObjectChanged
from blobdata._loop import run
from blobdata._stores import (
    Reader,
    StoreInfo,
    lister_for,
    listing_scope,
    reader_for,
    resolve_storage_options,
    store_info,
)
from blobdata._url import parse_url
from tests.support import buckets
from tests.support.fake_reader import FakeReader

T = TypeVar("T")
DATA = bytes(range(256)) * 40  # 10,240 bytes, every byte value
OTHER = b"another object" * 100


def _run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """On blobdata's own loop, as the engine and the listings run: clients are made per (process, loop)."""
    return run(asyncio.wait_for(make(), 60))


class _Subject:
    """A reader under test and how to name its objects."""

    def __init__(
        self, name: str, reader_factory: Callable[[], Reader], locate: Callable[[str], tuple[str, str]]
    ):
        self.name = name
        self.make = reader_factory
        self.locate = locate  # relative key -> (bucket, key) as the engine passes them
        self.verifies_identity = name != "memory"  # memory:// has no identity to check a read against
        self.bounds_bodies = name in ("s3", "az", "gs")  # network readers refuse a body beyond `size`


def _locator(bucket: buckets.TestBucket) -> Callable[[str], tuple[str, str]]:
    def locate(key: str) -> tuple[str, str]:
        url = parse_url(bucket.url(key))
        if url.protocol == "file":
            return "", url.prefix
        if url.protocol == "memory":
            return "", "/" + url.prefix.lstrip("/")
        return url.bucket, url.prefix

    return locate


def test_reader_contract(any_bucket: buckets.TestBucket) -> None:
    any_bucket.put_many({"root/a/x.bin": DATA, "root/b/y.bin": OTHER})
    protocol = parse_url(any_bucket.url()).protocol
    opts = resolve_storage_options(protocol, any_bucket.storage_options)
    _check_reader(_Subject(protocol, lambda: reader_for(protocol, opts, concurrency=4), _locator(any_bucket)))


def test_fake_reader_keeps_the_reader_contract() -> None:
    fake = FakeReader({"b/root/a/x.bin": DATA, "b/root/b/y.bin": OTHER})
    _check_reader(_Subject("fake", lambda: fake, lambda key: ("b", key)))


def _check_reader(subject: _Subject) -> None:
    async def check() -> None:
        reader = subject.make()
        bucket, key = subject.locate("root/a/x.bin")
        try:
            whole = await reader.read(bucket, key, start=None, end=None, expect_identity=None, timeout=30)
            assert whole.body == DATA and whole.total in (len(DATA), None), subject.name
            part = await reader.read(bucket, key, start=7, end=300, expect_identity=None, timeout=30)
            assert part.body == DATA[7:300], subject.name
            pinned = await reader.read(
                bucket, key, start=None, end=None, expect_identity=whole.identity or None, timeout=30,
                size=len(DATA),
            )  # fmt: skip
            assert pinned.body == DATA
            if subject.verifies_identity:
                assert whole.identity, f"{subject.name}: a read must report the object's identity"
                with pytest.raises(ObjectChanged):
                    await reader.read(
                        bucket, key, start=None, end=None, expect_identity="0-not-it", timeout=30
                    )
            missing_bucket, missing_key = subject.locate("root/a/missing.bin")
            with pytest.raises(NotFound) as err:
                await reader.read(missing_bucket, missing_key, start=None, end=None, expect_identity=None,
                                  timeout=30)  # fmt: skip
            assert "missing.bin" in str(err.value), err.value
            if subject.bounds_bodies:  # a listed size smaller than the object: never a longer body
                with pytest.raises(Exception) as too_long:
                    await reader.read(bucket, key, start=None, end=None, expect_identity=None, timeout=30,
                                      size=len(DATA) - 1)  # fmt: skip
                assert not isinstance(too_long.value, AssertionError)
        finally:
            await reader.close()
            await reader.close()  # closing twice is allowed

    _run(check)


def test_lister_contract_and_listed_identity_pins_the_read(any_bucket: buckets.TestBucket) -> None:
    any_bucket.put_many({"root/a/x.bin": DATA, "root/a/deep/z.bin": b"z" * 10, "root/b/y.bin": OTHER})
    url = parse_url(any_bucket.url("root"))
    opts = resolve_storage_options(url.protocol, any_bucket.storage_options)

    async def check() -> None:
        lister = lister_for(url, opts, FetchOptions(attempts=2, timeout=30))
        reader = reader_for(url.protocol, opts, concurrency=4)
        try:
            folders, anything = await lister.folders()
            assert sorted(folders) == ["a", "b"] and anything is True, (folders, anything)
            entries = await lister.below("a")
            listed = {k: (size, ident) for k, size, ident in entries if not k.endswith("/")}
            assert set(listed) == {"a/x.bin", "a/deep/z.bin"}, listed
            assert listed["a/x.bin"][0] == len(DATA)
            locate = _locator(any_bucket)
            bucket, key = locate("root/a/x.bin")
            got = await reader.read(bucket, key, start=None, end=None, expect_identity=listed["a/x.bin"][1],
                                    timeout=30, size=len(DATA))  # fmt: skip
            assert got.body == DATA
        finally:
            await lister.aclose()
            await reader.close()

    _run(check)


_STORE_ENV = (
    "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST", "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
)  # fmt: skip


@pytest.mark.parametrize("protocol", ["s3", "gs", "az", "file", "memory"])
def test_store_info_contract(protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _STORE_ENV:
        monkeypatch.delenv(var, raising=False)
    info = store_info(protocol)
    assert isinstance(info, StoreInfo) and info.credential_hint
    given = {"endpoint_url": "http://127.0.0.1:1", "key": "AKIA-not-a-secret", "secret": "s3cr3t"}
    resolved = info.resolved(given)
    assert resolved is not given and given == {
        "endpoint_url": "http://127.0.0.1:1", "key": "AKIA-not-a-secret", "secret": "s3cr3t",
    }  # fmt: skip
    assert resolved["endpoint_url"] == "http://127.0.0.1:1"  # explicit options win over the environment
    scope = listing_scope(protocol, resolved)
    assert "s3cr3t" not in scope and "s3cr3t" not in info.endpoint_of(resolved)  # never credentials
    assert scope == listing_scope(protocol, {**resolved, "secret": "another"})  # one listing per URL


def test_environment_is_folded_in_by_each_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:8")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    assert resolve_storage_options("s3", {})["endpoint_url"] == "http://127.0.0.1:9"
    assert resolve_storage_options("gs", {})["endpoint_url"] == "http://127.0.0.1:8"
    assert resolve_storage_options("az", {})["connection_string"] == "UseDevelopmentStorage=true"
    assert resolve_storage_options("file", {"x": 1}) == {"x": 1}

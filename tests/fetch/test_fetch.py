"""The fetch engine (blobdata._fetch) against the local S3 server and its fault proxy."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import pickle
import re
import time
from pathlib import Path
from typing import Any

import pytest

from blobdata._config import FetchOptions
from blobdata._errors import ConfigError, FetchError, FetchTimeout, NotFound, ObjectChanged, Throttled
from blobdata._fetch import FetchEngine
from blobdata._loop import run
from blobdata._stores import resolve_storage_options
from blobdata._stores.s3 import S3Reader

pytestmark = pytest.mark.network

FAST: dict[str, Any] = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 10.0}


def _engine(storage_options: dict[str, Any], **options: Any) -> FetchEngine:
    return FetchEngine(FetchOptions(**{**FAST, **options}), "s3", storage_options)


def _fetch(engine: FetchEngine, url: str, **kw: Any) -> tuple[bytes, str]:
    async def go() -> tuple[bytes, str]:
        return await engine.fetch(url, **kw)

    return run(go(), 120)


@pytest.fixture
def close_engines() -> Any:
    engines: list[FetchEngine] = []
    yield engines.append
    for e in engines:
        e.close()


def test_fetch_many_round_trip_and_stats(s3_bucket: Any, close_engines: Any) -> None:
    objects = {f"d/{i:03d}.bin": os.urandom(1000 + i) for i in range(60)}
    s3_bucket.put_many(objects)
    engine = _engine(s3_bucket.storage_options, concurrency=8)
    close_engines(engine)
    items: list[tuple[str, int | None, str | None]] = [
        (s3_bucket.url(k), len(v), None) for k, v in objects.items()
    ]
    items.append((s3_bucket.url("d/missing.bin"), None, None))
    out = engine.fetch_many_sync(items, timeout=60)
    assert out[:-1] == list(objects.values())
    assert isinstance(out[-1], NotFound)
    st = engine.stats()
    assert st["requests"] == 61 and st["retries"] == 0 and st["objects"] == 60
    assert st["bytes"] == sum(map(len, objects.values()))
    assert st["errors"] == {"not_found": 1}


@pytest.mark.parametrize("mode", ["status503", "status500", "reset", "close"])
def test_transient_failures_are_retried(s3_bucket: Any, s3_proxy: Any, close_engines: Any, mode: str) -> None:
    s3_bucket.put("a.bin", b"payload" * 100)
    engine = _engine(s3_proxy.storage_options, attempts=4)
    close_engines(engine)
    _fetch(engine, s3_bucket.url("a.bin"))  # warm connection
    engine.reset_stats()
    before = len(s3_proxy.requests)
    s3_proxy.fail_next(2, mode)
    body, _ = _fetch(engine, s3_bucket.url("a.bin"))
    assert body == b"payload" * 100
    assert engine.stats()["retries"] == 2
    assert len(s3_proxy.requests) - before >= 3


def test_retries_exhausted_is_throttled(s3_bucket: Any, s3_proxy: Any, close_engines: Any) -> None:
    # adaptive=False: throttled answers spend attempts, as every failure does.
    s3_bucket.put("a.bin", b"x")
    engine = _engine(s3_proxy.storage_options, attempts=3, adaptive=False)
    close_engines(engine)
    s3_proxy.fail_next(50, "status503")
    before = len(s3_proxy.requests)
    with pytest.raises(Throttled) as info:
        _fetch(engine, s3_bucket.url("a.bin"))
    assert "3 attempts" in str(info.value) and s3_bucket.url("a.bin") in str(info.value)
    assert len(s3_proxy.requests) - before == 3
    assert engine.stats()["errors"]["throttle"] == 3


def test_throttling_exhausts_its_time_not_the_attempts(
    s3_bucket: Any, s3_proxy: Any, close_engines: Any
) -> None:
    # The default: throttled answers are retried for throttle_wait seconds, whatever attempts says.
    s3_bucket.put("a.bin", b"x")
    engine = _engine(s3_proxy.storage_options, attempts=3, throttle_wait=0.5)
    close_engines(engine)
    s3_proxy.fail_next(10**6, "status503")
    before = len(s3_proxy.requests)
    t0 = time.monotonic()
    with pytest.raises(Throttled) as info:
        _fetch(engine, s3_bucket.url("a.bin"))
    assert time.monotonic() - t0 >= 0.5
    assert re.match(rf"{re.escape(s3_bucket.url('a.bin'))}: (still )?throttled ", str(info.value))
    sent = len(s3_proxy.requests) - before
    # Every throttled answer is counted, and the wait for admission that ended the read, if it did.
    assert sent > 3 and engine.stats()["errors"]["throttle"] in (sent, sent + 1)


def test_server_errors_exhausted_is_fetch_error(s3_bucket: Any, s3_proxy: Any, close_engines: Any) -> None:
    s3_bucket.put("a.bin", b"x")
    engine = _engine(s3_proxy.storage_options, attempts=2)
    close_engines(engine)
    s3_proxy.fail_next(50, "status500")
    with pytest.raises(FetchError, match="2 attempts") as info:
        _fetch(engine, s3_bucket.url("a.bin"))
    assert not isinstance(info.value, Throttled)


def test_stall_is_fetch_timeout_in_bounded_time(s3_bucket: Any, s3_proxy: Any, close_engines: Any) -> None:
    s3_bucket.put("a.bin", b"x")
    engine = _engine(s3_proxy.storage_options, attempts=2, timeout=0.5)
    close_engines(engine)
    s3_proxy.fail_next(50, "stall")
    t0 = time.monotonic()
    with pytest.raises(FetchTimeout) as info:
        _fetch(engine, s3_bucket.url("a.bin"))
    assert time.monotonic() - t0 < 5.0
    assert isinstance(info.value, TimeoutError) and "2 attempts" in str(info.value)


def test_not_retried_errors(s3_bucket: Any, s3_proxy: Any, close_engines: Any) -> None:
    s3_bucket.put("a.bin", b"x")
    engine = _engine(s3_proxy.storage_options, attempts=5)
    close_engines(engine)
    before = len(s3_proxy.requests)
    with pytest.raises(NotFound):
        _fetch(engine, s3_bucket.url("nope.bin"))
    with pytest.raises(ObjectChanged):
        _fetch(engine, s3_bucket.url("a.bin"), identity="ffffffffffffffffffffffffffffffff")
    assert len(s3_proxy.requests) - before == 2
    bad = _engine(dict(s3_proxy.storage_options, secret="wrong-secret-xyz"), attempts=5)
    close_engines(bad)
    with pytest.raises(PermissionError) as info:
        _fetch(bad, s3_bucket.url("a.bin"))
    assert "wrong-secret-xyz" not in str(info.value)
    assert len(s3_proxy.requests) - before == 3


def test_identity_and_size_are_verified(s3_bucket: Any, close_engines: Any) -> None:
    s3_bucket.put("a.bin", b"0123456789")
    engine = _engine(s3_bucket.storage_options)
    close_engines(engine)
    body, identity = _fetch(engine, s3_bucket.url("a.bin"), size=10)
    assert body == b"0123456789" and identity
    assert _fetch(engine, s3_bucket.url("a.bin"), size=10, identity=identity) == (body, identity)
    with pytest.raises(ObjectChanged, match=r"a\.bin"):
        _fetch(engine, s3_bucket.url("a.bin"), identity="00000000000000000000000000000000")
    with pytest.raises(ObjectChanged, match="11 were listed"):
        _fetch(engine, s3_bucket.url("a.bin"), size=11)


def test_large_object_in_parts_is_byte_exact(s3_bucket: Any, close_engines: Any) -> None:
    data = os.urandom(20 * 1024**2 + 12345)
    s3_bucket.put("big.bin", data)
    engine = _engine(s3_bucket.storage_options, part_size="1MiB", concurrency=8)
    close_engines(engine)
    body, identity = _fetch(engine, s3_bucket.url("big.bin"), size=len(data))
    assert hashlib.sha256(body).digest() == hashlib.sha256(data).digest() and len(body) == len(data)
    assert engine.stats()["requests"] == 21
    body2, _ = _fetch(engine, s3_bucket.url("big.bin"), size=len(data), identity=identity)
    assert body2 == data


class _OverwriteAfterFirstRead:
    """A reader that replaces the object (same size, new ETag) right after the first read returns."""

    def __init__(self, inner: Any, overwrite: Any) -> None:
        self.inner = inner
        self.overwrite = overwrite
        self.done = False

    async def read(self, bucket: str, key: str, **kwargs: Any) -> Any:
        res = await self.inner.read(bucket, key, **kwargs)
        if not self.done:
            self.done = True
            await asyncio.to_thread(self.overwrite)
        return res

    async def close(self) -> None:
        await self.inner.close()


def test_object_replaced_between_parts_is_object_changed(s3_bucket: Any, close_engines: Any) -> None:
    size = 3 * 1024**2
    s3_bucket.put("big.bin", b"a" * size)
    opts = resolve_storage_options("s3", s3_bucket.storage_options)
    overwriting = _OverwriteAfterFirstRead(S3Reader(opts), lambda: s3_bucket.put("big.bin", b"b" * size))
    engine = FetchEngine(FetchOptions(part_size="1MiB", concurrency=2), "s3", opts, reader=overwriting)
    close_engines(engine)
    with pytest.raises(ObjectChanged) as info:
        _fetch(engine, s3_bucket.url("big.bin"), size=size)
    assert s3_bucket.url("big.bin") in str(info.value)
    # A listing taken before the overwrite is stale for every part as well.
    engine = _engine(s3_bucket.storage_options, part_size="1MiB", concurrency=2)
    close_engines(engine)
    with pytest.raises(ObjectChanged):
        _fetch(engine, s3_bucket.url("big.bin"), size=size, identity="0" * 32)
    assert _fetch(engine, s3_bucket.url("big.bin"), size=size)[0] == b"b" * size


def test_wrong_protocol_url_is_config_error(s3_bucket: Any, close_engines: Any) -> None:
    engine = _engine(s3_bucket.storage_options)
    close_engines(engine)
    with pytest.raises(ConfigError):
        _fetch(engine, "gs://bucket/key")
    with pytest.raises(ConfigError):
        _fetch(engine, "s3://bucket-only")


def test_generic_reader_file_and_memory(tmp_path: Path) -> None:
    import fsspec

    data = os.urandom(300 * 1024)
    (tmp_path / "a b+c.bin").write_bytes(data)
    engine = FetchEngine(FetchOptions(part_size="64KiB", **FAST), "file", {})
    url = "file://" + str(tmp_path / "a b+c.bin")  # file URLs are taken verbatim, like keys
    assert _fetch(engine, url, size=len(data))[0] == data  # five ranged parts
    assert _fetch(engine, str(tmp_path / "a b+c.bin"))[0] == data
    with pytest.raises(FileNotFoundError):
        _fetch(engine, str(tmp_path / "missing"))
    fsspec.filesystem("memory").pipe_file("/fetchtest/x.bin", b"mem")
    mem = FetchEngine(FetchOptions(**FAST), "memory", {})
    assert (
        mem.fetch_many_sync([("memory://fetchtest/x.bin", 3, None), ("memory://fetchtest/no", None, None)])[0]
        == b"mem"
    )
    engine.close()
    mem.close()


# -- processes ----------------------------------------------------------------------------------
def _child(engine_bytes: bytes | None, engine: FetchEngine | None, url: str, queue: Any) -> None:
    try:
        eng = pickle.loads(engine_bytes) if engine_bytes is not None else engine
        assert eng is not None
        out = eng.fetch_many_sync([(url, None, None)], timeout=60)
        eng.close()
        queue.put(hashlib.sha256(out[0]).hexdigest() if isinstance(out[0], bytes) else repr(out[0]))
    except BaseException as exc:  # report, never hang the parent
        queue.put(f"error: {exc!r}")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_engine_in_child_process(
    s3_bucket: Any, close_engines: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, method: str
) -> None:
    """A live engine keeps working in a fork child; a pickled one in a spawn child. The spawn case
    also has no key/secret in its options: botocore's chain (here the environment) supplies them."""
    data = os.urandom(5000)
    s3_bucket.put("c.bin", data)
    so = dict(s3_bucket.storage_options)
    if method == "spawn":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", so.pop("key"))
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", so.pop("secret"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # never ask the instance metadata service
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    engine = _engine(so)
    close_engines(engine)
    assert _fetch(engine, s3_bucket.url("c.bin"))[0] == data  # the parent holds a live session
    ctx: Any = multiprocessing.get_context(method)
    queue = ctx.Queue()
    if method == "fork":
        proc = ctx.Process(target=_child, args=(None, engine, s3_bucket.url("c.bin"), queue))
    else:
        proc = ctx.Process(target=_child, args=(pickle.dumps(engine), None, s3_bucket.url("c.bin"), queue))
    proc.start()
    try:
        result = queue.get(timeout=120)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert result == hashlib.sha256(data).hexdigest()
    assert proc.exitcode == 0
    assert _fetch(engine, s3_bucket.url("c.bin"))[0] == data  # and the parent still works

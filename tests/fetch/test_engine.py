"""The fetch engine alone, over a scripted reader (tests/support/fake_reader.py): no socket, no server.

What is checked is the engine's own contract: one retry budget (attempts counted, the right final
error), backoff raised to Retry-After but never past ``max_backoff``, ranged reads assembled in
order and pinned to one identity, ObjectChanged when a part disagrees, and the concurrency bound.
Times are only compared with what the engine was told to wait (lower bounds from ``asyncio.sleep``),
never with a wall-clock budget.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from blobdata._config import FetchOptions
from blobdata._errors import FetchError, FetchTimeout, NotFound, ObjectChanged, Throttled
from blobdata._fetch import FetchEngine
from blobdata._loop import run
from tests.support.fake_reader import FakeReader

KIB = 1024
FAST: dict[str, Any] = {"backoff": 0.001, "max_backoff": 0.01, "timeout": 5.0}


@pytest.fixture
def engines() -> Iterator[list[FetchEngine]]:
    made: list[FetchEngine] = []
    yield made
    for engine in made:
        engine.close()


def _engine(engines: list[FetchEngine], reader: FakeReader, **options: Any) -> FetchEngine:
    engine = FetchEngine(FetchOptions(**{**FAST, **options}), "s3", {}, reader=reader)
    engines.append(engine)
    return engine


def _fetch(engine: FetchEngine, url: str, **kw: Any) -> tuple[bytes, str]:
    async def go() -> tuple[bytes, str]:
        return await engine.fetch(url, **kw)

    return run(go(), 60)


# ------------------------------------------------------------------------------- retry budget


@pytest.mark.parametrize("kind", ["throttle", "server", "timeout", "connection", "short_read"])
def test_transient_failures_are_retried_within_the_budget(engines: list[FetchEngine], kind: str) -> None:
    reader = FakeReader({"b/k": b"payload"})
    reader.fail("b/k", 2, kind)
    engine = _engine(engines, reader, attempts=3)
    assert _fetch(engine, "s3://b/k")[0] == b"payload"
    assert len(reader.reads("b/k")) == 3
    stats = engine.stats()
    assert stats["requests"] == 3 and stats["retries"] == 2 and stats["errors"] == {kind: 2}


@pytest.mark.parametrize(
    ("kind", "error"), [("timeout", FetchTimeout), ("server", FetchError), ("connection", FetchError)]
)
def test_exhausted_budget_is_the_final_error_naming_the_url(
    engines: list[FetchEngine], kind: str, error: type[Exception]
) -> None:
    reader = FakeReader({"b/k": b"payload"})
    reader.fail("b/k", 10, kind)
    engine = _engine(engines, reader, attempts=4)
    with pytest.raises(error) as info:
        _fetch(engine, "s3://b/k")
    assert type(info.value) is error  # a server error is not reported as throttling, nor the reverse
    assert "s3://b/k" in str(info.value) and "4 attempts" in str(info.value)
    assert len(reader.reads("b/k")) == 4  # exactly the budget: the first attempt and three retries
    assert engine.stats()["retries"] == 3


def test_throttling_does_not_spend_the_attempts(engines: list[FetchEngine]) -> None:
    """Throttling is the store asking for a lower rate, not a failure: ten throttled answers in a
    row do not exhaust attempts=4, and the read completes."""
    reader = FakeReader({"b/k": b"payload"})
    reader.fail("b/k", 10, "throttle")
    engine = _engine(engines, reader, attempts=4)
    assert _fetch(engine, "s3://b/k")[0] == b"payload"
    assert len(reader.reads("b/k")) == 11
    assert engine.stats()["errors"] == {"throttle": 10}


def test_a_store_that_only_throttles_ends_each_read_with_throttled(engines: list[FetchEngine]) -> None:
    """Throttled for ever: each read ends after throttle_wait with Throttled naming its URL."""
    reader = FakeReader({f"b/{i}": b"x" for i in range(20)})
    for i in range(20):
        reader.fail(f"b/{i}", 1000, "throttle")
    engine = _engine(engines, reader, attempts=4, throttle_wait=0.3, max_backoff=0.05)
    t0 = time.monotonic()
    out = engine.fetch_many_sync([(f"s3://b/{i}", None, None) for i in range(20)], timeout=60)
    elapsed = time.monotonic() - t0
    for i, err in enumerate(out):
        assert type(err) is Throttled, err
        assert err.url == f"s3://b/{i}" and re.match(rf"s3://b/{i}: (still )?throttled ", str(err))
    assert elapsed >= 0.3  # the budget is time, not attempts: 4 attempts would take milliseconds
    # Every read ended: the controller slowed down to its floor meanwhile, so fewer than the
    # attempts a 1 ms backoff would allow were made (the patience, not a count, ended them).
    assert len(reader.calls) < 20 * 100


def test_one_attempt_means_no_retry(engines: list[FetchEngine]) -> None:
    reader = FakeReader({"b/k": b"x"})
    reader.fail("b/k", 1, "server")
    engine = _engine(engines, reader, attempts=1)
    with pytest.raises(FetchError, match="1 attempt"):
        _fetch(engine, "s3://b/k")
    assert len(reader.calls) == 1


def test_final_errors_are_not_retried(engines: list[FetchEngine]) -> None:
    reader = FakeReader({"b/k": b"x"})
    engine = _engine(engines, reader, attempts=5)
    with pytest.raises(NotFound) as info:
        _fetch(engine, "s3://b/missing")
    assert "s3://b/missing" in str(info.value) and info.value.url == "s3://b/missing"
    with pytest.raises(ObjectChanged):
        _fetch(engine, "s3://b/k", identity="another-version")
    assert len(reader.calls) == 2
    assert engine.stats()["errors"] == {"not_found": 1, "changed": 1}


def test_each_item_of_a_batch_has_its_own_budget(engines: list[FetchEngine]) -> None:
    # 5xx: throttling spends no attempts (test_throttling_does_not_spend_the_attempts).
    reader = FakeReader({f"b/{i}": bytes([i]) for i in range(10)})
    for i in range(0, 10, 2):
        reader.fail(f"b/{i}", 2, "server")
    engine = _engine(engines, reader, attempts=3)
    out = engine.fetch_many_sync([(f"s3://b/{i}", 1, None) for i in range(10)], timeout=60)
    assert out == [bytes([i]) for i in range(10)]
    assert engine.stats()["retries"] == 10 and len(reader.calls) == 20


# ------------------------------------------------------------------------------------ backoff


def _gaps(reader: FakeReader, path: str) -> list[float]:
    starts = [c.at for c in reader.reads(path)]
    return [b - a for a, b in itertools.pairwise(starts)]


def test_retry_after_raises_the_backoff(engines: list[FetchEngine]) -> None:
    reader = FakeReader({"b/k": b"x"})
    reader.fail("b/k", 2, "throttle", retry_after=0.15)
    engine = _engine(engines, reader, attempts=3, backoff=0.001, max_backoff=1.0)
    _fetch(engine, "s3://b/k")
    assert all(gap >= 0.15 for gap in _gaps(reader, "b/k"))  # the store's hint, not the 1 ms backoff


def test_retry_after_is_capped_at_max_backoff(engines: list[FetchEngine]) -> None:
    """A store asking for an hour gets ``max_backoff``: the retry comes after it, not an hour later."""
    reader = FakeReader({"b/k": b"x"})
    reader.fail("b/k", 2, "throttle", retry_after=3600)
    engine = _engine(engines, reader, attempts=3, backoff=0.001, max_backoff=0.1)
    assert _fetch(engine, "s3://b/k")[0] == b"x"
    gaps = _gaps(reader, "b/k")
    assert len(gaps) == 2 and all(0.1 <= gap < 3600 for gap in gaps)


def test_backoff_without_a_hint_stays_below_its_cap(engines: list[FetchEngine]) -> None:
    """backoff=1 hour doubled, capped at 50 ms: full jitter draws from [0, cap], so 4 retries end."""
    reader = FakeReader({"b/k": b"x"})
    reader.fail("b/k", 4, "server")
    engine = _engine(engines, reader, attempts=5, backoff=3600, max_backoff=0.05)
    assert _fetch(engine, "s3://b/k")[0] == b"x"
    assert len(_gaps(reader, "b/k")) == 4


# --------------------------------------------------------------------------------- ranged reads


def test_ranged_reads_assemble_the_parts_in_order(engines: list[FetchEngine]) -> None:
    data = os.urandom(10 * 64 * KIB + 123)
    reader = FakeReader({"b/big": data})
    engine = _engine(engines, reader, part_size="64KiB", concurrency=4)
    body, identity = _fetch(engine, "s3://b/big", size=len(data))
    assert body == data and identity == reader.identity("b/big")
    ranges = sorted((c.start, c.end) for c in reader.calls)
    assert ranges == [(s, min(s + 64 * KIB, len(data))) for s in range(0, len(data), 64 * KIB)]
    # Unpinned: the first part's identity pins every later part.
    first, *rest = reader.calls
    assert first.start == 0 and first.expect_identity is None
    assert {c.expect_identity for c in rest} == {reader.identity("b/big")}


def test_a_listed_identity_pins_every_part(engines: list[FetchEngine]) -> None:
    data = os.urandom(3 * 64 * KIB)
    reader = FakeReader({"b/big": data})
    engine = _engine(engines, reader, part_size="64KiB")
    _fetch(engine, "s3://b/big", size=len(data), identity=reader.identity("b/big"))
    assert {c.expect_identity for c in reader.calls} == {reader.identity("b/big")}


def test_a_failing_part_is_retried_alone(engines: list[FetchEngine]) -> None:
    data = os.urandom(4 * 64 * KIB)
    reader = FakeReader({"b/big": data})
    engine = _engine(engines, reader, part_size="64KiB", attempts=3)

    def fail_third(path: str, number: int) -> None:
        if number == 3:
            reader.fail(path, 1, "connection")  # this very read fails; the others are not repeated

    reader.on_read = fail_third
    assert _fetch(engine, "s3://b/big", size=len(data))[0] == data
    assert len(reader.calls) == 5 and engine.stats()["retries"] == 1


def test_object_replaced_between_parts_is_object_changed(engines: list[FetchEngine]) -> None:
    """Same size, new version once the first part was answered: the pinned parts are refused."""
    data = os.urandom(4 * 64 * KIB)
    reader = FakeReader({"b/big": data})
    engine = _engine(engines, reader, part_size="64KiB", attempts=3)
    reader.on_read = lambda path, n: reader.replace(path, os.urandom(len(data))) if n == 2 else None
    with pytest.raises(ObjectChanged) as info:
        _fetch(engine, "s3://b/big", size=len(data))
    assert "s3://b/big" in str(info.value)


def test_a_part_whose_total_differs_is_object_changed(engines: list[FetchEngine]) -> None:
    """A store that cannot pin the identity (as memory://) still reports the object's total size."""
    data = os.urandom(4 * 64 * KIB)
    reader = FakeReader({"b/big": data}, verify_identity=False)
    engine = _engine(engines, reader, part_size="64KiB", attempts=3)
    reader.on_read = lambda path, n: reader.replace(path, data + b"grown") if n == 2 else None
    with pytest.raises(ObjectChanged) as info:
        _fetch(engine, "s3://b/big", size=len(data))
    assert "s3://b/big" in str(info.value) and str(len(data)) in str(info.value)
    assert engine.stats()["retries"] == 0  # a changed object is final, not retried


def test_listed_size_that_differs_is_object_changed(engines: list[FetchEngine]) -> None:
    reader = FakeReader({"b/k": b"0123456789"})
    engine = _engine(engines, reader)
    with pytest.raises(ObjectChanged, match="were listed"):
        _fetch(engine, "s3://b/k", size=12)


# ---------------------------------------------------------------------------------- concurrency


def test_concurrency_bounds_requests_in_flight(engines: list[FetchEngine]) -> None:
    reader = FakeReader({f"b/{i}": b"x" for i in range(40)}, delay_s=0.005)
    engine = _engine(engines, reader, concurrency=4)
    out = engine.fetch_many_sync([(f"s3://b/{i}", None, None) for i in range(40)], timeout=60)
    assert out == [b"x"] * 40
    assert reader.max_in_flight == 4  # reached, never passed


def test_concurrency_bounds_the_parts_of_one_object(engines: list[FetchEngine]) -> None:
    data = os.urandom(16 * 64 * KIB)
    reader = FakeReader({"b/big": data}, delay_s=0.005)
    engine = _engine(engines, reader, concurrency=3, part_size="64KiB")
    assert _fetch(engine, "s3://b/big", size=len(data))[0] == data
    assert reader.max_in_flight == 3


def test_retries_wait_outside_the_concurrency_bound(engines: list[FetchEngine]) -> None:
    """A request backing off holds no slot: with one slot, others are served while it waits. (A 5xx
    with Retry-After: a throttled answer's Retry-After pauses every request to the store.)"""
    reader = FakeReader({"b/slow": b"s", "b/a": b"a", "b/b": b"b"})
    reader.fail("b/slow", 1, "server", retry_after=0.2)
    engine = _engine(engines, reader, concurrency=1, attempts=2, max_backoff=1.0)
    out = engine.fetch_many_sync([(f"s3://b/{k}", None, None) for k in ("slow", "a", "b")], timeout=60)
    assert out == [b"s", b"a", b"b"]
    order = [c.key for c in reader.calls]
    assert order.index("a") < len(order) - 1 and order[-1] == "slow"


def test_close_closes_the_injected_reader(engines: list[FetchEngine]) -> None:
    reader = FakeReader({"b/k": b"x"})
    engine = FetchEngine(FetchOptions(**FAST), "s3", {}, reader=reader)
    _fetch(engine, "s3://b/k")
    engine.close()
    assert reader.closed

"""Numbers that are not numbers: nan, inf and absurd magnitudes are ConfigErrors (issue 29, finding 8)."""

from __future__ import annotations

import math

import pytest

from blobdata._config import FetchOptions, parse_duration, parse_size
from blobdata._errors import ConfigError

DURATIONS = ("timeout", "backoff", "max_backoff", "listing_timeout", "throttle_wait")


@pytest.mark.parametrize("name", DURATIONS)
@pytest.mark.parametrize(
    "value", [math.nan, math.inf, -math.inf, 1e300, 10**400], ids=["nan", "inf", "-inf", "1e300", "10**400"]
)
def test_fetch_options_refuse_a_duration_that_is_not_one(name: str, value: float) -> None:
    with pytest.raises(ConfigError) as info:
        FetchOptions(**{name: value})
    assert name in str(info.value)


@pytest.mark.parametrize("value", [math.nan, math.inf, 2**70, 1e30])
def test_fetch_options_refuse_a_part_size_that_is_not_one(value: float) -> None:
    with pytest.raises(ConfigError, match="part_size"):
        FetchOptions(part_size=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, 0, -3, 2.5])
def test_fetch_options_refuse_a_concurrency_that_is_not_a_count(value: object) -> None:
    with pytest.raises(ConfigError, match="concurrency"):
        FetchOptions(concurrency=value)  # type: ignore[arg-type]


def test_sensible_numbers_still_parse() -> None:
    assert parse_size(2**40, name="x") == 2**40
    assert parse_size(1.5e9, name="x") == 1_500_000_000
    assert parse_size("1TiB", name="x") == 2**40
    assert parse_duration("2d", name="x") == 172_800.0
    assert FetchOptions(timeout=0.5, listing_timeout="12h").listing_timeout == 43_200.0

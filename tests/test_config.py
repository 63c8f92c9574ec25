import pytest
from hypothesis import given
from hypothesis import strategies as st

from blobdata import ConfigError, FetchOptions
from blobdata._config import parse_duration, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("100GB", 100 * 10**9),
        ("512MiB", 512 * 2**20),
        ("8M", 8 * 10**6),
        ("1.5kb", 1500),
        (" 7 ", 7),
        (42, 42),
        ("0", 0),
        ("2TiB", 2 * 2**40),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "GB", "10 parsecs", "-1GB", -5, True, "1e9"])
def test_parse_size_rejects_with_the_value_in_the_message(bad: object) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(bad, name="cache_size")  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=10**15))
def test_parse_size_of_a_byte_count_is_identity(n: int) -> None:
    assert parse_size(str(n)) == n == parse_size(n)


@pytest.mark.parametrize(
    "text,expected", [("30s", 30.0), ("250ms", 0.25), ("2m", 120.0), (1.5, 1.5), ("1h", 3600.0)]
)
def test_parse_duration(text: object, expected: float) -> None:
    assert parse_duration(text) == pytest.approx(expected)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["0s", "soon", -1, 0])
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)  # type: ignore[arg-type]


def test_fetch_options_are_keyword_only_frozen_and_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = FetchOptions(concurrency=8, timeout="2s", part_size="1MiB")
    assert (opts.concurrency, opts.timeout, opts.part_size) == (8, 2.0, 2**20)
    with pytest.raises(TypeError):
        FetchOptions(8)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        opts.concurrency = 3  # type: ignore[misc]
    with pytest.raises(ConfigError):
        FetchOptions(concurrency=0)
    with pytest.raises(ConfigError):
        FetchOptions(attempts=0)
    monkeypatch.setenv("BLOBDATA_CONCURRENCY", "128")
    assert FetchOptions().concurrency == 128
    monkeypatch.setenv("BLOBDATA_CONCURRENCY", "lots")
    with pytest.raises(ConfigError, match="BLOBDATA_CONCURRENCY"):
        FetchOptions()


def test_retries_is_a_deprecated_name_of_attempts() -> None:
    with pytest.warns(DeprecationWarning, match="attempts="):
        opts = FetchOptions(retries=3)
    assert opts.attempts == 3 and opts.retries == 3
    assert FetchOptions(attempts=2).retries == 2
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="disagree"):
        FetchOptions(attempts=2, retries=3)
    with pytest.raises(ConfigError, match="attempts"):
        FetchOptions(attempts=True)

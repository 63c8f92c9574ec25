"""Configuration: human sizes and durations, the settings objects, and every environment variable.

Environment variables are read here and only here, when a setting is resolved (never at import):

=============================  ===============================================================
``BLOBDATA_CACHE_HOME``        where manifests are remembered (default ``$XDG_CACHE_HOME/blobdata``
                               or ``~/.cache/blobdata``)
``BLOBDATA_CONCURRENCY``       default requests in flight per process (default 64)
``BLOBDATA_SHARED_DIR``        where rank 0 hands its listing to the other ranks before the process
                               group exists (default: the cache home; shared by the nodes)
``BLOBDATA_SHARED_TIMEOUT``    how long a rank waits for it (default 600 s)
``RANK``, ``WORLD_SIZE``,      torchrun's: this process's place in the job when no process group
``LOCAL_RANK``, ...            is initialised (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_PORT``)
``AWS_ENDPOINT_URL_S3``,       S3 endpoint (MinIO, SeaweedFS, R2, ...), as boto3 reads them
``AWS_ENDPOINT_URL``
``STORAGE_EMULATOR_HOST``      GCS endpoint of an emulator, as google-cloud-storage reads it
``AZURE_STORAGE_CONNECTION_STRING``  Azure account, as the Azure SDK reads it
``AZURE_STORAGE_ACCOUNT_NAME``  Azure account without a connection string, with
                               ``AZURE_STORAGE_ACCOUNT_KEY``, ``_SAS_TOKEN``, ``_CLIENT_ID``,
                               ``_CLIENT_SECRET``, ``_TENANT_ID`` (as adlfs reads them); no
                               credential means anonymous unless ``AZURE_STORAGE_ANON=false``
``HTTP_PROXY``, ``HTTPS_PROXY``,  proxies of the S3, GCS and Azure readers, as botocore reads them
``ALL_PROXY``, ``NO_PROXY``    (lower-case names too; see ``blobdata/_stores/network.py``)
``AWS_CA_BUNDLE``              CA bundle of the S3 client (or ``ca_bundle`` in the AWS config file)
=============================  ===============================================================

Sizes accept ``"100GB"``, ``"512MiB"``, ``"8M"`` or plain ints (bytes); decimal units are powers of
1000 and ``i`` units powers of 1024. Durations accept ``"30s"``, ``"250ms"``, ``"2m"`` or numbers (seconds).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._errors import ConfigError

__all__ = ["FetchOptions", "cache_home", "env", "parse_duration", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "ki": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "mi": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "gi": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "ti": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {
    "": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0,
}  # fmt: skip
MAX_SIZE = 2**60  # 1 EiB: no disk or object is larger, and SQLite's integers stop at 2**63
MAX_SECONDS = 365 * 86400.0  # a longer timeout is a mistake (and overflows threading's waits)


def parse_size(value: int | float | str, *, name: str = "size") -> int:
    """Return ``value`` in bytes; accepts ints and strings such as ``"100GB"`` or ``"8MiB"``.

    Raises ConfigError for anything else: a negative or non-finite number, or more than 1 EiB."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a size such as 100GB, not {value!r}")
    if isinstance(value, (int, float)):
        number: int | float = value
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(f"{name} must be a size such as 100GB, 512MiB or 1048576, got {value!r}")
        number = float(match.group(1)) * _SIZE_UNITS[unit]
    if isinstance(number, float) and not math.isfinite(number):
        raise ConfigError(f"{name} must be a finite size such as 100GB, got {value!r}")
    if number < 0:
        raise ConfigError(f"{name} must not be negative, got {value!r}")
    if number > MAX_SIZE:
        raise ConfigError(f"{name} must be at most 1EiB ({MAX_SIZE} bytes), got {value!r}")
    return int(number)


def parse_duration(value: int | float | str, *, name: str = "duration") -> float:
    """Return ``value`` in seconds; accepts numbers and strings such as ``"30s"`` or ``"250ms"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a duration such as 30s, not {value!r}")
    if isinstance(value, (int, float)):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float
            seconds = math.inf
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _DURATION_UNITS:
            raise ConfigError(f"{name} must be a duration such as 30s or 250ms, got {value!r}")
        seconds = float(match.group(1)) * _DURATION_UNITS[unit]
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise ConfigError(f"{name} must be a finite duration of at most 365d, got {value!r}")
    if seconds <= 0:
        raise ConfigError(f"{name} must be positive, got {value!r}")
    return seconds


def env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Read one environment variable (empty counts as unset). The single place blobdata reads them."""
    value = (os.environ if environ is None else environ).get(name)
    return value if value else None


def cache_home() -> Path:
    """Directory for remembered listings: ``BLOBDATA_CACHE_HOME`` or the XDG cache directory."""
    explicit = env("BLOBDATA_CACHE_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = env("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "blobdata"


#: How long a remembered bucket listing is reused before the bucket is listed again (``listing_max_age``).
DEFAULT_LISTING_MAX_AGE = "7d"


@dataclasses.dataclass(frozen=True)
class FetchOptions:
    """How objects are fetched. Keyword-only; sizes and durations accept human forms.

    concurrency:     requests in flight per process at most (default 64; ``BLOBDATA_CONCURRENCY``);
                     a store that throttles gets fewer, as its node-wide rate allows.
    timeout:         per-request deadline in seconds, connect to last byte (default 30).
    attempts:        attempts per request in total, the first included (default 6; 1 = no retry);
                     throttling, 5xx, timeouts and connection resets are retried, 403/404 never.
                     (``retries=`` is its former, deprecated name.)
    backoff:         first backoff in seconds, doubled each retry with full jitter (default 0.1).
    max_backoff:     cap of a single backoff in seconds (default 5).
    part_size:       objects larger than this are fetched as parallel range requests (default 8 MiB).
    listing_timeout: deadline in seconds of a whole S3 listing, every page and retry included
                     (default 3600): a store that keeps sending pages cannot keep it going for ever.
    throttle_wait:   how long a read may go on being throttled (429, 503 SlowDown) before it fails
                     with Throttled, in seconds (default 10). Throttled answers do not count against
                     ``attempts``: the node's throttle controller slows down to what the store accepts
                     and the read waits its turn, failing only when the store accepted none of the
                     node's requests for this long (or throttled this read for this long).
    lookahead:       samples each process fetches ahead of the sampler's order (default 1024; 0
                     disables), with loaders from ``ds.dataloader()``. Each epoch starts two batches
                     ahead and doubles per batch up to this depth, so the first batch does not wait
                     behind a burst of requests. A local folder on a local disk has none unless this
                     is given: each batch reads its files directly, which costs less than fetching
                     ahead saves there (a network or FUSE mount keeps the default). A dataset
                     with peers has 256 unless this is given: a peer answers in a millisecond or
                     a few, not the bucket's tens (``docs/peers.md``).
    lookahead_bytes: bytes each process may hold staged ahead (default 256MiB).
    adaptive:        share the node's throttle controller (default True). False: requests go at the
                     fixed ``concurrency`` whatever the store answers, and throttled answers spend
                     ``attempts`` like failures (blobdata's behaviour before the controller).
    """

    concurrency: int = 64
    timeout: float = 30.0
    attempts: int = 6
    backoff: float = 0.1
    max_backoff: float = 5.0
    part_size: int = 8 * 1024**2
    listing_timeout: float = 3600.0
    throttle_wait: float = 10.0
    adaptive: bool = True
    lookahead: int = 1024
    lookahead_bytes: int = 256 * 1024**2

    def __init__(
        self,
        *,
        concurrency: int | None = None,
        timeout: float | str = 30.0,
        attempts: int | None = None,
        retries: int | None = None,
        backoff: float | str = 0.1,
        max_backoff: float | str = 5.0,
        part_size: int | str = 8 * 1024**2,
        listing_timeout: float | str = 3600.0,
        throttle_wait: float | str = 10.0,
        adaptive: bool = True,
        lookahead: int | None = None,
        lookahead_bytes: int | str = 256 * 1024**2,
    ) -> None:
        if concurrency is None:
            raw = env("BLOBDATA_CONCURRENCY")
            try:
                concurrency = int(raw) if raw else 64
            except ValueError:
                raise ConfigError(f"BLOBDATA_CONCURRENCY must be an integer, got {raw!r}") from None
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise ConfigError(f"concurrency must be a positive integer, got {concurrency!r}")
        if retries is not None:
            warnings.warn(
                "FetchOptions(retries=) is deprecated: it counts attempts, the first included; pass "
                "attempts= instead",
                DeprecationWarning,
                stacklevel=2,
            )
            if attempts is not None and attempts != retries:
                raise ConfigError(
                    f"attempts={attempts!r} and retries={retries!r} disagree: pass attempts only"
                )
            attempts = retries
        if attempts is None:
            attempts = 6
        if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
            raise ConfigError(
                f"attempts must be an integer >= 1 (the first attempt included), got {attempts!r}"
            )
        part = parse_size(part_size, name="part_size")
        if part < 1024 * 64:
            raise ConfigError(f"part_size must be at least 64KiB, got {part_size!r}")
        set_ = object.__setattr__
        set_(self, "concurrency", concurrency)
        set_(self, "timeout", parse_duration(timeout, name="timeout"))
        set_(self, "attempts", attempts)
        set_(self, "backoff", parse_duration(backoff, name="backoff"))
        set_(self, "max_backoff", parse_duration(max_backoff, name="max_backoff"))
        set_(self, "part_size", part)
        set_(self, "listing_timeout", parse_duration(listing_timeout, name="listing_timeout"))
        set_(self, "throttle_wait", parse_duration(throttle_wait, name="throttle_wait"))
        if not isinstance(adaptive, bool):
            raise ConfigError(f"adaptive must be True or False, got {adaptive!r}")
        set_(self, "adaptive", adaptive)
        set_(self, "_lookahead_default", lookahead is None)
        if lookahead is None:
            lookahead = 1024
        if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0:
            raise ConfigError(f"lookahead must be a non-negative number of samples, got {lookahead!r}")
        set_(self, "lookahead", lookahead)
        set_(self, "lookahead_bytes", parse_size(lookahead_bytes, name="lookahead_bytes"))

    @property
    def retries(self) -> int:
        """Deprecated name of :attr:`attempts` (which it always was: attempts, the first included)."""
        return self.attempts

    @property
    def lookahead_given(self) -> bool:
        """Whether ``lookahead`` was given (else its default applies, and a local disk has none)."""
        return not getattr(self, "_lookahead_default", False)

    def replace(self, **changes: Any) -> FetchOptions:
        """A copy with ``changes`` applied (validated as the constructor validates)."""
        if "lookahead" not in changes and not self.lookahead_given:
            changes["lookahead"] = None
        return dataclasses.replace(self, **changes)

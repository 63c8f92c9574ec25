"""The one retry budget of blobdata: every read, listing page and manifest download goes through it.

Stores make exactly one attempt per call and raise :class:`~blobdata._errors.TransientError` for
what may be retried; :func:`with_retries` owns the only retry loop (exponential backoff with full
jitter, raised to the store's Retry-After), so retries never stack with a client library's own.

Two budgets. Failures (5xx, timeouts, resets, short reads) count against ``FetchOptions.attempts``,
attempts in total (1 means no retry). Throttling (429, 503 SlowDown) is the store asking for a lower
rate, not a failure: it is retried without counting against ``attempts`` (the node's throttle
controller, :mod:`blobdata._fetch.throttle`, slows down meanwhile), for up to ``FetchOptions.throttle_wait``
seconds from the read's first throttled answer. A wait for admission that ends because the store
accepted nothing of the node's for that long (:class:`~blobdata._errors.PatienceSpent`) is final
at once. So a store that only throttles still ends each read with Throttled naming its URL, about
``throttle_wait`` seconds after the read began waiting.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ._config import FetchOptions
from ._errors import (
    BlobdataError,
    FetchError,
    FetchTimeout,
    PatienceSpent,
    Throttled,
    TransientError,
    translate,
)

__all__ = ["final_error", "give_up", "with_retries"]

T = TypeVar("T")


async def with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    url: str,
    options: FetchOptions,
    on_error: Callable[[TransientError, bool], None] | None = None,
) -> T:
    """Await ``call()`` under the retry budgets of ``options``.

    Failures: ``options.attempts`` in total. Throttling: retried for ``options.throttle_wait``
    seconds from the first throttled answer (with ``attempts=1``, not at all; with ``adaptive=False``,
    as a failure). Backoff: exponential
    from ``options.backoff`` seconds with full jitter, capped at ``options.max_backoff`` and raised to
    the store's Retry-After (itself capped at ``max_backoff``). Only :class:`TransientError` is
    retried; the last one becomes Throttled, FetchTimeout or FetchError naming ``url``, chained to
    it. ``on_error(exc, will_retry)`` sees every transient failure.
    """
    failures = tries = throttles = 0
    throttled_since = 0.0
    began = time.monotonic()
    while True:
        tries += 1
        try:
            return await call()
        except TransientError as exc:
            if exc.kind == "throttle" and options.attempts > 1 and options.adaptive:
                now = time.monotonic()
                throttles += 1
                throttled_since = throttled_since or now
                left = throttled_since + options.throttle_wait - now
                retry = left > 0 and not isinstance(exc, PatienceSpent)
                step = throttles
            else:
                failures += 1
                retry = failures < options.attempts
                left, step = options.max_backoff, failures
            if on_error is not None:
                on_error(exc, retry)
            if not retry:
                since = began if isinstance(exc, PatienceSpent) else (throttled_since or began)
                waited = time.monotonic() - since if exc.kind == "throttle" else 0.0
                raise give_up(url, exc, tries, options.timeout, throttled_s=waited) from exc
            delay = random.uniform(0.0, min(options.max_backoff, options.backoff * 2 ** (step - 1)))
            if exc.retry_after:
                delay = max(delay, min(exc.retry_after, options.max_backoff))
            await asyncio.sleep(min(delay, max(left, 0.0)))


def give_up(
    url: str, exc: TransientError, attempts: int, timeout: float, *, throttled_s: float = 0.0
) -> FetchError:
    """The final error after ``attempts`` attempts, the last failing with ``exc``; ``throttled_s``:
    how long a throttled read was retried."""
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    if exc.kind == "throttle":
        if isinstance(exc, PatienceSpent):  # it may have waited its turn, not been answered at all
            head = f"throttled for {throttled_s:.1f}s"
        else:
            head = f"still throttled after {tries}" + (
                f" over {throttled_s:.1f}s" if throttled_s >= 0.05 else ""
            )
        return Throttled(
            f"{url}: {head} ({exc}); the store limits its request rate: retry later, spread the keys "
            "over more prefixes, or raise throttle_wait",
            url,
        )
    if exc.kind == "timeout":
        return FetchTimeout(
            f"{url}: no complete response within {timeout:g}s on {tries}; raise timeout= or check the "
            "network",
            url,
        )
    return FetchError(f"{url}: failed after {tries} ({exc}); retry later", url)


def final_error(
    exc: BaseException, url: str, *, hint: str = "", what: str = "", timeout: float = 0.0, attempts: int = 1
) -> BlobdataError:
    """:func:`~blobdata._errors.translate`, with a transient failure stated as the final error it is
    once no attempt is left (for callers whose client library already retried)."""
    err = translate(exc, url, hint=hint, what=what, timeout=timeout)
    return give_up(url, err, attempts, timeout) if isinstance(err, TransientError) else err

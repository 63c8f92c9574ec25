"""The one retry budget of blobdata: every read, listing page and manifest download goes through it.

Stores make exactly one attempt per call and raise :class:`~blobdata._errors.TransientError` for
what may be retried; :func:`with_retries` owns the only retry loop (exponential backoff with full
jitter, raised to the store's Retry-After), so retries never stack with a client library's own.
``FetchOptions.retries`` counts attempts in total (1 means no retry).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ._config import FetchOptions
from ._errors import BlobdataError, FetchError, FetchTimeout, Throttled, TransientError, translate

__all__ = ["final_error", "give_up", "with_retries"]

T = TypeVar("T")


async def with_retries(
    call: Callable[[], Awaitable[T]],
    *,
    url: str,
    options: FetchOptions,
    on_error: Callable[[TransientError, bool], None] | None = None,
) -> T:
    """Await ``call()`` under the retry budget of ``options``.

    ``options.retries`` attempts in total, exponential backoff from ``options.backoff`` seconds with
    full jitter, capped at ``options.max_backoff`` and raised to the store's Retry-After. Only
    :class:`TransientError` is retried; the last one becomes Throttled, FetchTimeout or FetchError
    naming ``url``, chained to it. ``on_error(exc, will_retry)`` sees every transient failure.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except TransientError as exc:
            retry = attempt < options.retries
            if on_error is not None:
                on_error(exc, retry)
            if not retry:
                raise give_up(url, exc, attempt, options.timeout) from exc
            delay = random.uniform(0.0, min(options.max_backoff, options.backoff * 2 ** (attempt - 1)))
            if exc.retry_after:
                delay = max(delay, min(exc.retry_after, options.max_backoff))
            await asyncio.sleep(delay)


def give_up(url: str, exc: TransientError, attempts: int, timeout: float) -> FetchError:
    """The final error after ``attempts`` transient failures, the last being ``exc``."""
    tries = f"{attempts} attempt{'s' if attempts != 1 else ''}"
    if exc.kind == "throttle":
        return Throttled(
            f"{url}: still throttled after {tries} ({exc}); lower concurrency or retry later", url
        )
    if exc.kind == "timeout":
        return FetchTimeout(
            f"{url}: no complete response within {timeout:g}s on {tries}; raise timeout= or check the "
            "network",
            url,
        )
    return FetchError(f"{url}: failed after {tries} ({exc}); retry later", url)


def final_error(
    exc: BaseException, url: str, *, store: str = "", what: str = "", timeout: float = 0.0, attempts: int = 1
) -> BlobdataError:
    """:func:`~blobdata._errors.translate`, with a transient failure stated as the final error it is
    once no attempt is left (for callers whose client library already retried)."""
    err = translate(exc, url, store=store, what=what, timeout=timeout)
    return give_up(url, err, attempts, timeout) if isinstance(err, TransientError) else err

"""The latency proxy's throttle mode: a store's request-rate limit, answered as the store answers it."""

from __future__ import annotations

import threading
import time

from ._wire import Request, Throttle, ThrottleStyle

__all__ = ["ThrottleMode"]


class ThrottleMode:
    """What :class:`~blobdata.testing.LatencyProxy` adds for throttle mode (its requests call
    :meth:`_throttle_answer` as they arrive)."""

    _lock: threading.Lock
    _throttle: Throttle | None
    _answers: list[tuple[float, str, bool]]

    def set_throttle(
        self,
        rps: float | None,
        *,
        burst: float | None = None,
        style: ThrottleStyle = "s3",
        retry_after_s: float | None = None,
        methods: tuple[str, ...] | None = None,
    ) -> None:
        """Accept at most ``rps`` requests per second from now on (None: no limit); may change while running.

        A token bucket of ``burst`` requests (default: a tenth of a second's worth, at least 1), full at
        the start, refilled at ``rps``. A request that finds it empty is answered by the proxy, never
        forwarded: ``style`` ``"s3"`` gives ``503 Slow Down`` (SlowDown), ``"gcs"`` ``429 Too Many
        Requests`` (rateLimitExceeded), ``"azure"`` ``503`` with ``x-ms-error-code: ServerBusy``; with a
        ``Retry-After: retry_after_s`` header when that is set. ``methods`` limits it to those methods
        (default: every request). :attr:`answers` records each request's fate.
        """
        bucket = None if rps is None else Throttle.of(rps, burst, style, retry_after_s, methods)
        with self._lock:
            self._throttle = bucket

    @property
    def answers(self) -> list[tuple[float, str, bool]]:
        """``(time.monotonic() at arrival, method, throttled)`` of every request the proxy parsed
        since the start or :meth:`reset_counts` (those answered by a fault excepted)."""
        with self._lock:
            return list(self._answers)

    @property
    def throttled(self) -> int:
        """Requests answered with a throttling status so far (since :meth:`reset_counts`)."""
        with self._lock:
            return sum(1 for _, _, t in self._answers if t)

    def _throttle_answer(self, req: Request) -> bytes | None:
        """The throttling answer to ``req``, or None when it goes through (recorded either way)."""
        now = time.monotonic()
        with self._lock:
            bucket = self._throttle
            ok = bucket is None or bucket.admit(req.method, now)
            self._answers.append((now, req.method, not ok))
        if ok or bucket is None:
            return None
        return bucket.response(close=req.expects_continue, head_only=req.method == "HEAD")

"""The training process's side of a loader's statistics: the loop's clock and the epoch summary.

:class:`TimedIter` wraps each epoch's DataLoader iterator: it times every ``next()`` (the seconds
the loop waits for batches) and, at the epoch's end, logs the epoch's :class:`~blobdata.LoaderStats`
summary on the ``blobdata`` logger (INFO): its records' difference over the epoch, with the
gauges (requests in flight, the node's rate limit) as they stand at its end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from .report import LoaderStats
from .stats import Records

__all__ = ["LoopClock", "TimedIter"]

log = logging.getLogger("blobdata")


class LoopClock:
    """The training process's clock of one loader: seconds in ``next()`` and seconds iterating."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        self.batches = 0
        self.elapsed_s = 0.0
        self.samples = 0  # samples in the batches the loop received, as planned
        self.unplanned = 0  # batches the loop received whose size was not known (then: workers' count)


class TimedIter:
    """Wraps a DataLoader iterator: times each ``next()`` and logs an epoch summary at its end.

    Attributes not defined here are the wrapped iterator's (``_num_yielded`` and the like).
    """

    def __init__(
        self, make: Callable[[], Iterator[Any]], clock: LoopClock, records: Records, log_epoch: bool = True
    ) -> None:
        self._clock = clock
        self._records = records
        self._log = log_epoch and log.isEnabledFor(logging.INFO)
        self._t0 = time.perf_counter()
        totals = records.total() if self._log else None
        self._start = (totals, clock.wait_s, clock.batches, clock.samples, clock.unplanned)
        self._it = make()  # worker start-up is waiting too
        self._mark = self._t0
        clock.wait_s += time.perf_counter() - self._t0
        self._done = False

    def __iter__(self) -> TimedIter:
        return self

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_it", "_clock", "_records"):
            raise AttributeError(name)
        return getattr(self._it, name)

    def __next__(self) -> Any:
        clock = self._clock
        t = time.perf_counter()
        try:
            batch = next(self._it)
        except StopIteration:
            self._finish()
            raise
        now = time.perf_counter()
        clock.wait_s += now - t
        clock.elapsed_s += now - self._mark
        self._mark = now
        clock.batches += 1
        return batch

    def _finish(self) -> None:
        now = time.perf_counter()
        self._clock.elapsed_s += now - self._mark
        self._mark = now
        if self._done:
            return
        self._done = True
        totals, wait0, batches0, samples0, unplanned0 = self._start
        if totals is not None:
            end = self._records.total()
            clock = self._clock
            epoch = LoaderStats.from_totals(
                end - totals,
                now=end,
                loop_wait_s=clock.wait_s - wait0,
                loop_batches=clock.batches - batches0,
                loop_samples=clock.samples - samples0 if clock.unplanned == unplanned0 else None,
                elapsed_s=now - self._t0,
            )
            log.info("epoch: %s", epoch.summary())

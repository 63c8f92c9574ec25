"""What is measured and shown: per-process counters summed by ``loader.stats()``, the training
loop's clock, the workers' skip reports, and progress lines.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``stats``          counters of each process in shared memory, summed by :class:`Records`
``report``         :class:`LoaderStats`: a snapshot of the sums, its summary line and verdict
``timing``         the training loop's clock of a loader, and the epoch's summary line
``skips``          workers' ``on_error="skip"`` reports, carried to the training process
``progress``       progress bars and the requests line of ``warm``/``ls``
=================  ==========================================================================

``stats`` is used as a namespace of counters (``stats.note_get(...)``): import the module itself.
"""

from __future__ import annotations

from . import progress, stats
from .progress import RequestsLine
from .report import LoaderStats, limiting_source, stages, throttle_bound
from .skips import SkipLog
from .stats import Records, TimedCollate, combined
from .timing import LoopClock, TimedIter

__all__ = [
    "LoaderStats",
    "LoopClock",
    "Records",
    "RequestsLine",
    "SkipLog",
    "TimedCollate",
    "TimedIter",
    "combined",
    "limiting_source",
    "progress",
    "stages",
    "stats",
    "throttle_bound",
]

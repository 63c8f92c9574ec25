"""Waiting, in a test, for a loader's next epoch to be announced to its workers."""

from __future__ import annotations

import time
from typing import Any

from blobdata._fetch import PlanChannel


def wait_announced(loader: Any, timeout_s: float = 60.0) -> None:
    """Until the epoch begun has the next one's order announced (a thread predicts it as the epoch
    begins). Called at an epoch's first batch: the workers run at most the prefetch ahead of the loop,
    so their look-ahead then reaches the epoch's end after the announcement, whatever the machine's
    load (which could otherwise delay the prediction past a short epoch's end)."""
    channel = PlanChannel(loader.channel.path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        plan = channel.current(reload=True)
        if plan is not None and channel.next_of(plan) is not None:
            return
        time.sleep(0.005)
    raise AssertionError("the next epoch's order was never announced")

"""A plan whose indices repeat (a mixture reads a small source more than once an epoch, issue 41): each
process's look-ahead finds every batch it is given, also one that begins with an index read before."""

from __future__ import annotations

import numpy as np

from blobdata._fetch.plans import Plan


def test_every_batch_is_found_when_indices_repeat() -> None:
    batches = [[7, 1, 2], [3, 7, 4], [7, 5, 6], [8, 7, 9], [7, 8, 0]]  # 7 begins three batches
    flat = np.array([i for b in batches for i in b], dtype=np.int64)
    offsets = np.arange(0, len(flat) + 1, 3, dtype=np.int64)
    plan = Plan(1, flat, offsets)
    assert [plan.locate(b) for b in batches] == [0, 1, 2, 3, 4]
    assert plan.locate([7, 5, 9]) is None and plan.locate([7]) is None

"""When the next epoch's first batches are handed over to be fetched for workers that do not outlive
the epoch: from the second epoch on, once per epoch, about ``HAND_OVER_LEAD_S`` before the last batch
is dealt and never before half of the epoch's batches are. An epoch shorter than twice the lead (here
one dealt as fast as it is asked for) used to hand over at its first batch, among the epoch's own first
fetches that every process of the node makes at that moment."""

from __future__ import annotations

from collections.abc import Sequence

import torch.utils.data

from blobdata._fetch import PlanChannel, PlanningBatchSampler
from blobdata._sampling import NextEpoch

BATCHES = 20


class _Recorder:
    """A hand-over that notes how many batches the loop had when it was given the next epoch's."""

    def __init__(self) -> None:
        self.had = 0
        self.ends: list[tuple[int, int]] = []  # (epoch, batches had)
        self.epoch = 0

    def begin(self) -> None:
        self.epoch += 1

    def end(self, batches: Sequence[Sequence[int]]) -> None:
        assert [list(b) for b in batches[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the next epoch's
        self.ends.append((self.epoch, self.had))


def test_the_next_epochs_batches_are_handed_over_past_half_of_a_short_epoch() -> None:
    sampler = torch.utils.data.SequentialSampler(range(4 * BATCHES))
    batches = torch.utils.data.BatchSampler(sampler, 4, drop_last=False)
    planner = PlanningBatchSampler(batches, PlanChannel(), next_epoch=NextEpoch())
    recorder = planner.hand_over = _Recorder()
    for _ in range(3):
        recorder.had = 0
        for batch in planner:
            if recorder.had == 0 and planner._predicted is not None:  # predicted in a thread
                assert planner._predicted.done.wait(30)
            recorder.had += 1
            assert len(batch) == 4
    # Not in the first pass (an epoch that may never come); in each later one past its half, however
    # fast it is dealt: the lead alone (2 s at this pace) was met at its first batch.
    assert recorder.ends == [(2, BATCHES // 2), (3, BATCHES // 2)]

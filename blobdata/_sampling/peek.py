"""An epoch's batches as numpy arrays, and the next epoch's batches, known before it begins: what lets
persistent workers fetch across an epoch's end and the next epoch start without planning again (see
:mod:`blobdata._fetch.lookahead`).

:meth:`NextEpoch.order` iterates a ``BatchSampler`` over a sampler of a kind known here into ``(flat,
offsets)`` arrays (batch ``k`` is ``flat[offsets[k]:offsets[k + 1]]``): the same draws from the same
generators as the sampler's own ``__iter__``, without a Python int per sample (at ImageNet's size a
list plan costs a few hundred milliseconds at each epoch's start, while no worker gets an index).

:meth:`NextEpoch.prepare` predicts the next epoch's batches, only for samplers whose next order is a
function of state blobdata can read without changing it: ``SequentialSampler`` (the same order),
``RandomSampler`` with a generator (the order it will draw from the generator's current state, which
is restored), and ``DistributedSampler`` and its subclasses (the order of the next epoch number,
``set_epoch`` being the user's: the step between the last two epochs seen is assumed again, 1 at
first). It works on a copy of the sampler, so the prediction runs in a background thread, off the
epoch's start. A :class:`Prediction` remembers the sampler state it was made from (the generator's
state; the seed, epoch, ranks, ``start`` or ``consumed``...): when the next epoch begins from exactly
that state the prediction *is* its order and is used as it is (:meth:`Prediction.advance` leaves the
generator where iterating the sampler would have); otherwise the sampler is iterated. A
wrong guess costs fetches (bounded by the look-ahead's bytes), never a wrong batch.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .elastic import ElasticDistributedSampler
from .mixsampler import MixtureSampler
from .partition import PartitionedSampler

__all__ = ["NextEpoch", "Prediction", "batched", "indices_of"]

Packed = tuple[np.ndarray, np.ndarray]  # (flat, offsets), int64
_KINDS = (SequentialSampler, RandomSampler, DistributedSampler, ElasticDistributedSampler, PartitionedSampler,
          MixtureSampler)  # fmt: skip


def indices_of(sampler: Any) -> np.ndarray:
    """The indices ``iter(sampler)`` yields, drawn from the same generators in the same order, as
    int64: computed as arrays for the samplers of ``_KINDS`` (exactly those types), iterated otherwise."""
    kind = type(sampler)
    if kind in (ElasticDistributedSampler, PartitionedSampler, MixtureSampler):
        return np.ascontiguousarray(sampler.indices(), dtype=np.int64)  # what their __iter__ lists
    if kind is SequentialSampler:
        return np.arange(len(sampler.data_source), dtype=np.int64)
    if kind is RandomSampler and not sampler.replacement:
        # torch 2's RandomSampler.__iter__: its seed from torch's RNG without a generator, then
        # num_samples // n whole permutations and the head of one more (always drawn).
        n, want = len(sampler.data_source), sampler.num_samples
        gen = sampler.generator
        if gen is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            gen = torch.Generator()
            gen.manual_seed(seed)
        parts = [torch.randperm(n, generator=gen) for _ in range(want // n)]
        parts.append(torch.randperm(n, generator=gen)[: want % n])
        return torch.cat(parts).numpy()
    if kind is DistributedSampler:
        n = len(sampler.dataset)
        if sampler.shuffle:  # torch 2's DistributedSampler.__iter__, in numpy
            g = torch.Generator()
            g.manual_seed(sampler.seed + sampler.epoch)
            order = torch.randperm(n, generator=g).numpy()
        else:
            order = np.arange(n, dtype=np.int64)
        total = sampler.total_size
        order = np.resize(order, total) if len(order) else order  # padded by repeating its start, or cut
        mine = order[sampler.rank : total : sampler.num_replicas]
        if len(order) == total and len(mine) == sampler.num_samples:
            return mine
    # A size that changed since the sampler was made (its own __iter__ raises), or draws with replacement.
    return np.fromiter(iter(sampler), dtype=np.int64)


def _packed(sampler: Any, size: int, drop_last: bool) -> Packed:
    """``BatchSampler(sampler, size, drop_last)``'s batches as (flat, offsets)."""
    return batched(indices_of(sampler), size, drop_last)


def batched(flat: np.ndarray, size: int, drop_last: bool) -> Packed:
    """``flat`` in batches of ``size`` (the last one short, or left out with ``drop_last``), as
    ``BatchSampler`` makes them: (flat, offsets)."""
    count = len(flat) // size if drop_last else -(-len(flat) // size)
    flat = flat[: count * size] if drop_last else flat
    offsets = np.minimum(np.arange(count + 1, dtype=np.int64) * size, len(flat))
    return flat, offsets


def _known(batch_sampler: Any) -> bool:
    return type(batch_sampler) is BatchSampler and type(batch_sampler.sampler) in _KINDS


def _fingerprint(sampler: Any) -> tuple[Any, ...]:
    """All that a sampler of ``_KINDS`` draws its order from (its generator's state, seed, epoch, ranks,
    ``start``, ``consumed``, dataset and its length ...), comparable with ``==``."""
    out: list[Any] = [type(sampler)]
    for name, value in sorted(vars(sampler).items()):
        if name in ("_memo", "_set_epoch_calls"):  # PartitionedSampler's last order (a cache), its calls
            continue
        if name in ("dataset", "data_source"):
            out.append((name, id(value), len(value)))
        elif isinstance(value, torch.Generator):
            out.append((name, value.get_state().numpy().tobytes()))
        else:
            out.append((name, _plain(value)))
    return tuple(out)


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` made of plain values (tuples, lists and small objects' attributes of them) to compare
    with ``==``; anything else gives a new object, which equals nothing: no prediction is taken."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth < 3 and isinstance(value, (tuple, list)):
        return tuple(_plain(v, depth + 1) for v in value)
    if depth < 3 and hasattr(value, "__dict__"):  # e.g. PartitionedSampler's Layout
        return (type(value), tuple((k, _plain(v, depth + 1)) for k, v in sorted(vars(value).items())))
    return object()


class Prediction:
    """The batches of the epoch after the one begun, computed (by calling it, in a thread) from a copy of
    the sampler, with the sampler state that copy started from."""

    def __init__(self, batch_sampler: Any, clone: Any) -> None:
        self._of = batch_sampler.sampler
        self._size, self._drop_last = int(batch_sampler.batch_size), bool(batch_sampler.drop_last)
        self._clone = clone
        self._key = _fingerprint(clone)
        self._after: torch.Tensor | None = None  # the clone's generator state after its epoch

    def __call__(self) -> Packed:
        packed = _packed(self._clone, self._size, self._drop_last)
        if isinstance(getattr(self._clone, "generator", None), torch.Generator):
            self._after = self._clone.generator.get_state()
        return packed

    def holds(self, batch_sampler: Any) -> bool:
        """Whether ``batch_sampler`` is now exactly in the state the prediction was made from."""
        return (
            type(batch_sampler) is BatchSampler
            and batch_sampler.sampler is self._of
            and (batch_sampler.batch_size, batch_sampler.drop_last) == (self._size, self._drop_last)
            and _fingerprint(batch_sampler.sampler) == self._key
        )

    def advance(self, batch_sampler: Any) -> None:
        """Leave the sampler as iterating it for the predicted epoch would have (its generator past the
        epoch's draws): call when its batches are taken as the epoch's, :meth:`holds` having said yes
        and the call having returned."""
        if self._after is not None:
            batch_sampler.sampler.generator.set_state(self._after)


class NextEpoch:
    """An epoch's batches as arrays, and predictions of the next epoch's (see the module docstring)."""

    def __init__(self, *, seed_drawn_from: torch.Generator | None = None) -> None:
        self._last_epoch: int | None = None
        self._step = 1
        # The loader's generator where each epoch's iterator draws the workers' base seed from it
        # before the sampler runs (a DataLoader makes a new iterator per epoch unless its workers
        # persist): a RandomSampler sharing it draws its next order after that draw.
        self._seed_drawn_from = seed_drawn_from

    def order(self, batch_sampler: Any) -> Packed | None:
        """This epoch's batches, iterating the sampler (the same draws as ``iter(batch_sampler)``), as
        (flat, offsets); None for a batch sampler or sampler of a kind not known here."""
        if not _known(batch_sampler):
            return None
        return _packed(batch_sampler.sampler, int(batch_sampler.batch_size), bool(batch_sampler.drop_last))

    def prepare(self, batch_sampler: Any) -> Prediction | None:
        """Call right after the batch sampler yielded the current epoch: the next epoch's prediction, to
        call (in another thread: it works on a copy of the sampler's state) for its batches; None when
        they cannot be known."""
        if not _known(batch_sampler):
            return None
        sampler: Any = batch_sampler.sampler
        if type(sampler) is SequentialSampler:
            clone: Any = copy.copy(sampler)  # no state
        elif type(sampler) is RandomSampler:
            if not isinstance(sampler.generator, torch.Generator):
                return None  # it would draw its seed from torch's global generator
            clone = copy.copy(sampler)
            clone.generator = torch.Generator().set_state(sampler.generator.get_state())
            if sampler.generator is self._seed_drawn_from:
                torch.empty((), dtype=torch.int64).random_(generator=clone.generator)
        else:
            epoch = int(sampler.epoch)
            if self._last_epoch is not None:
                self._step = epoch - self._last_epoch if epoch >= self._last_epoch else 1
            self._last_epoch = epoch
            clone = copy.copy(sampler)
            clone.epoch = epoch + self._step
            if isinstance(clone, ElasticDistributedSampler):
                clone.start = 0
            if isinstance(clone, PartitionedSampler):
                clone.consumed = []
                clone._memo = None
            if isinstance(clone, MixtureSampler):
                clone.forget()
        return Prediction(batch_sampler, clone)

    def batches(self, batch_sampler: Any) -> list[list[int]] | None:
        """The next epoch's batches, computed now (see :meth:`prepare`), as lists."""
        predict = self.prepare(batch_sampler)
        if predict is None:
            return None
        flat, offsets = predict()
        return [flat[a:b].tolist() for a, b in itertools.pairwise(offsets.tolist())]

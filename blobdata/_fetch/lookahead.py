"""Look-ahead: fetch the samples that come next in the sampler's order, before they are asked for.

An epoch's order is known as soon as the sampler is iterated. :class:`PlanningBatchSampler` wraps the
DataLoader's batch sampler, materialises each epoch's batches and publishes them as a *plan* in a small
shared directory (``/dev/shm`` when available). Each process that serves batches (a DataLoader worker,
or the main process with ``num_workers=0``) reads the plan, finds the batch it was just given, and
stages the batches it will be given next: the DataLoader hands batch ``k`` to worker ``k % W``, so
worker ``w`` stages batches ``k+W, k+2W, ...`` up to a depth in samples and in bytes (reached over
the epoch's first batches: two batches ahead, then doubling). Staged bytes live
in a bounded in-memory :class:`Stager` and are dropped once consumed. If the plan does not match (a
sampler blobdata did not see), nothing is staged and batches are still fetched all at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Container, Coroutine, Iterator, Sequence
from typing import Any, Protocol

from .._metrics import stats as _stats
from .packed import PackedBatches, Predicted
from .plans import Plan, PlanChannel

log = logging.getLogger("blobdata")

__all__ = ["IN_FLIGHT", "HandOver", "KeyedBatch", "LookAhead", "PlanningBatchSampler", "Stager"]


#: How long before an epoch's last batch is dealt the next epoch's first batches are handed over to
#: be fetched for workers that do not outlive the epoch: time for new connections and a few round
#: trips, while holding the bytes for as little of the epoch as that allows. Never before half of the
#: epoch's batches are dealt: in an epoch shorter than twice this, the pace measured at its start
#: (the first batches dealt at once) handed over at once, and those fetches joined the epoch's own
#: first ones, which every process of the node (and with peers, of the job) makes at that moment.
HAND_OVER_LEAD_S = 2.0


class HandOver(Protocol):
    """Where the next epoch's first batches go when workers do not outlive the epoch (the
    :class:`~blobdata.BlobLoader` fetches them in the training process for the workers it starts)."""

    def begin(self) -> None:
        """An epoch begins: its workers exist."""

    def end(self, batches: Sequence[Sequence[int]]) -> None:
        """The epoch's last batches are being dealt; ``batches`` are the next epoch's, as predicted."""


class KeyedBatch(list[int]):
    """A batch's indices, with the seed its samples' augmentation draws are keyed by (the loader's
    seed mixed with the epoch; see :mod:`blobdata._sampling.rng`). DataLoader hands the batch
    sampler's lists as they are to the dataset's ``__getitems__`` (pickled to a worker), so the seed
    travels with the very batch it belongs to, whichever worker serves it."""

    def __init__(self, indices: Sequence[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeyedBatch, (list(self), self.seed))


class PlanningBatchSampler:
    """Wraps a batch sampler; each ``iter()`` publishes the epoch's batches before yielding them.

    The order is exactly the wrapped sampler's (``RandomSampler`` with a generator, a seeded sampler,
    ``DistributedSampler`` after ``set_epoch``): this only observes it.

    ``next_epoch`` (a :class:`blobdata._sampling.NextEpoch`) knows the samplers whose batches it can
    compute as arrays (``order``: the same draws, no Python list per batch) and predict for the next
    epoch (``prepare``). With ``across_epochs`` (persistent workers) the next epoch's batches are
    predicted in a thread during the epoch and published; when that epoch begins from the very sampler
    state they were predicted from, they are its batches and the sampler is not iterated again.
    """

    def __init__(
        self,
        batch_sampler: Any,
        channel: PlanChannel,
        progress: Any = None,
        next_epoch: Any = None,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.channel = channel
        self.progress = progress  # a resumed epoch drops its first batches before they are planned
        # Prepares the next epoch's batches from the batch sampler, where they can be known: with
        # `across_epochs` (persistent workers) they are computed in a thread and published during the
        # epoch, so that the look-ahead runs across its end, and the next epoch starts from them.
        self.next_epoch = next_epoch
        self.across_epochs = False
        #: Workers that do not outlive the epoch (``persistent_workers=False``): told when an epoch
        #: begins (the new workers exist) and, near its end, the next epoch's predicted batches, to
        #: fetch for the workers that will be started. From the second epoch on: a loader
        #: iterated once (an evaluation, a single pass) fetches nothing for an epoch that never comes.
        self.hand_over: HandOver | None = None
        self._epochs = 0
        self._predicted: Predicted | None = None
        self.epochs_predicted = 0  # epochs whose batches were the prediction (the sampler not iterated)

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the wrapped sampler runs at the first next(), as it does inside a plain
        # DataLoader (which draws its worker base seed from the generator between iter() and
        # next()), so a seeded generator gives exactly the plain DataLoader's order.
        self._epochs += 1
        hand_over = self.hand_over if self._epochs > 1 else None
        if self.hand_over is not None:
            self.hand_over.begin()
        skip = self.progress.begin() if self.progress is not None else 0
        seed = self.progress.sample_seed() if self.progress is not None else None
        # The batches predicted for this epoch, if it begins from the state they were predicted from;
        # else the sampler iterated into arrays, where its kind is known (the same draws).
        batches: Sequence[list[int]] | PackedBatches
        predicted, self._predicted = self._predicted, None
        # A resumed epoch: what is left of its order, batched at this loader's batch size.
        rest = self.progress.rest(self.batch_sampler) if self.progress is not None else None
        got = predicted.take(self.batch_sampler) if predicted is not None and rest is None else None
        if rest is not None:
            got = PackedBatches(*rest)
        elif got is not None:
            self.epochs_predicted += 1
        else:
            order = self.next_epoch.order(self.batch_sampler) if self.next_epoch is not None else None
            got = PackedBatches(*order) if order is not None else None
        if got is not None:
            batches = got[skip:] if skip else got
        else:  # a batch sampler of a kind not known here: its own batches, listed as they are
            listed = (list(b) if seed is None else KeyedBatch(b, seed) for b in self.batch_sampler)
            batches = list(itertools.islice(listed, skip, None))
        plan = self.channel.publish(batches, seed)
        if self.progress is not None:
            self.progress.planned(batches)
        upcoming = self._predict_next(plan.seq)
        dealt = _lists(batches, seed) if isinstance(batches, PackedBatches) else iter(batches)
        if hand_over is None or upcoming is None:
            yield from dealt
        else:
            yield from self._deal(dealt, len(batches), upcoming, hand_over)

    def _predict_next(self, seq: int) -> Predicted | None:
        ahead = self.across_epochs or self.hand_over is not None
        make = self.next_epoch.prepare(self.batch_sampler) if ahead and self.next_epoch else None
        if make is None:
            return None
        # Off the epoch's start, in a thread: kept to be the next epoch's batches if it begins from the
        # sampler state it was predicted from, published to persistent workers, handed over to others.
        predicted = Predicted(make)
        nseed = self.progress.next_sample_seed() if self.progress is not None else None
        channel = self.channel if self.across_epochs else None
        # Not a daemon: a program that ends meanwhile waits for it (a fraction of a second), where a
        # daemon thread still in torch would abort the interpreter's exit ("terminate called ...").
        threading.Thread(target=_announce, args=(channel, seq, predicted.compute, nseed)).start()
        self._predicted = predicted
        return predicted

    def _deal(
        self, batches: Iterator[list[int]], n: int, upcoming: Predicted, hand_over: HandOver
    ) -> Iterator[list[int]]:
        """Yield ``batches`` (``n`` of them); about :data:`HAND_OVER_LEAD_S` before the last is dealt (at
        the pace dealt so far), and once half of them are, give ``hand_over`` the next epoch's
        batches, once predicted."""
        start, handed = time.perf_counter(), False
        for k, batch in enumerate(batches):
            yield batch
            if handed or 2 * (k + 1) < n or not upcoming.done.is_set() or upcoming.batches is None:
                continue
            if (n - k - 1) * (time.perf_counter() - start) / (k + 1) <= HAND_OVER_LEAD_S:
                handed = True
                hand_over.end(upcoming.batches)

    def __len__(self) -> int:
        # The whole epoch's count (a resumed epoch's: blobdata._sampling.Progress.length).
        resumed = self.progress.length(self.batch_sampler) if self.progress is not None else None
        return len(self.batch_sampler) if resumed is None else int(resumed)

    def __getattr__(self, name: str) -> Any:
        # set_epoch, sampler, batch_size, drop_last ... of the wrapped batch sampler.
        own = ("batch_sampler", "channel", "progress", "next_epoch", "across_epochs", "hand_over", "_epochs",
               "_predicted", "epochs_predicted")  # fmt: skip
        if name in own:
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def _announce(
    channel: PlanChannel | None, seq: int, make: Callable[[], Sequence[Sequence[int]]], seed: int | None
) -> None:
    try:
        batches = make()
        if channel is not None:
            channel.publish_next(seq, batches, seed)
    except Exception:  # a prediction is an optimisation: the epoch's own plan is the truth
        log.debug("blobdata: the next epoch's order could not be announced", exc_info=True)


def _lists(batches: PackedBatches, seed: int | None) -> Iterator[list[int]]:
    """The batches as lists (keyed by ``seed``), one at a time, as they are dealt."""
    flat, offsets = batches.flat, batches.offsets.tolist()
    for a, b in itertools.pairwise(offsets):
        indices: list[int] = flat[a:b].tolist()
        yield indices if seed is None else KeyedBatch(indices, seed)


def _consume(task: asyncio.Future[Any]) -> None:
    # A dropped look-ahead fetch may have failed; its error matters only if the sample is asked for.
    if not task.cancelled():
        task.exception()


#: What :meth:`Stager.take_ready` says of an index the loop is fetching (or holds fetched).
IN_FLIGHT: Any = object()


class Stager:
    """Bounded staging area of fetched-ahead bytes in one process, keyed by sample index.

    ``max_items`` and ``max_bytes`` bound what is staged or in flight (bytes counted by the listed
    object sizes). Runs on the process's blobdata event loop, except :meth:`take_ready`, which the
    thread serving batches calls once per batch. With ``cached`` (a batch of indices -> whether each
    one's objects are all in the node cache: one index lookup), what the cache holds is not fetched:
    it is marked *present* and left to the thread serving its batch, which reads it from the cache
    itself (one lookup per batch, in the thread that uses the bytes); only the rest is fetched. What
    is in ``handed`` (a new worker's hand-over, which that thread takes itself) is neither. With
    ``fetch_many`` (indices -> a future of each one's bytes), what the cache misses is started as one
    batch there instead of a task per index (``fetch``).
    """

    def __init__(
        self,
        fetch: Callable[[int], Coroutine[Any, Any, bytes]],
        size_of: Callable[[int], int],
        *,
        max_items: int,
        max_bytes: int,
        cached: Callable[[list[int]], list[bool]] | None = None,
        handed: Container[int] = (),
        fetch_many: Callable[[list[int]], list[asyncio.Future[Any]]] | None = None,
    ) -> None:
        self._fetch = fetch
        self._fetch_many = fetch_many
        self._size_of = size_of
        self._cached = cached
        self._handed = handed
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._tasks: dict[int, asyncio.Future[Any]] = {}
        self._present: set[int] = set()  # found in the cache: read by the thread serving the batch
        self._bytes = 0
        self._lock = threading.Lock()  # _tasks and _present are read by the thread serving batches
        self.peak_items = 0
        self.peak_bytes = 0

    @property
    def staged_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._tasks) + len(self._present)

    def schedule(self, indices: Sequence[int]) -> int:
        """Stage ``indices`` in order until a bound is reached (those the cache holds marked present,
        one lookup for them all; the others fetched); returns how many of them are staged (now or
        already): fewer than given where a bound stopped it."""
        chosen: list[int] = []
        sizes: list[int] = []
        tasks, present, handed = self._tasks, self._present, self._handed
        handled = 0
        with self._lock:
            count, total = len(tasks) + len(present), self._bytes
            for raw in indices:
                i = int(raw)
                if i in tasks or i in present or i in handed:
                    handled += 1
                    continue
                size = self._size_of(i)
                if count >= self.max_items or (count and total + size > self.max_bytes):
                    break
                chosen.append(i)
                sizes.append(size)
                count, total, handled = count + 1, total + size, handled + 1
        if not chosen:
            return handled
        found = self._cached(chosen) if self._cached is not None else None
        with self._lock:
            missing: list[int] = []  # positions in chosen
            for k, i in enumerate(chosen):
                if found is not None and found[k]:
                    present.add(i)
                else:
                    missing.append(k)
            many = self._fetch_many
            if many is not None and missing:
                started = many([chosen[k] for k in missing])
            else:
                started = [asyncio.ensure_future(self._fetch(chosen[k])) for k in missing]
            for k, fut in zip(missing, started, strict=True):
                tasks[chosen[k]] = fut
                self._bytes += sizes[k]
            self.peak_items = max(self.peak_items, len(tasks) + len(present))
            self.peak_bytes = max(self.peak_bytes, self._bytes)
        return handled

    def pop(self, index: int) -> asyncio.Future[Any] | None:
        """Remove and return the staged fetch of ``index`` (None if not fetched here: not staged, or
        present in the cache); call on the loop."""
        with self._lock:
            self._present.discard(index)
            task = self._tasks.pop(index, None)
            if task is not None:
                self._bytes -= self._size_of(index)
        return task

    def take_ready(self, indices: Sequence[int]) -> list[bool]:
        """For each of ``indices``, whether the loop fetches it (take it there: :meth:`pop`); the
        others (present in the cache, or not staged) are the caller's to read, and no longer marked.
        From the thread serving batches, once per batch."""
        with self._lock:
            present, tasks = self._present, self._tasks
            if present:
                present.difference_update(indices)
            return [i in tasks for i in indices]

    def clear(self) -> None:
        """Drop everything staged or in flight (a new epoch made it useless)."""
        with self._lock:
            tasks, self._tasks, self._bytes = self._tasks, {}, 0
            self._present = set()
        for task in tasks.values():
            task.cancel()
            task.add_done_callback(_consume)


class LookAhead:
    """One process's look-ahead: its :class:`Stager` and where the current epoch's ramp stands.

    After each batch it is given, the process calls :meth:`advance` with the batch's indices; the
    look-ahead finds that batch in the loader's plan and stages this process's next batches (every
    ``stride``-th batch: the DataLoader deals batches round-robin to its workers). Each epoch starts
    two batches ahead and doubles per batch up to ``max_items`` samples, so that the first batch does
    not wait behind a burst of requests.

    Where the plan carries the next epoch's batches (persistent workers), staging goes on past the
    epoch's end into this process's first two batches of the next epoch (a persistent DataLoader
    deals each epoch from worker 0 again), within the same bounds; when that epoch's plan arrives and
    is the one announced, what was staged is kept and the ramp goes on from there: the next epoch's
    first batches do not wait for their fetches.
    """

    def __init__(
        self,
        fetch: Callable[[int], Coroutine[Any, Any, bytes]],
        size_of: Callable[[int], int],
        *,
        max_items: int,
        max_bytes: int,
        cached: Callable[[list[int]], list[bool]] | None = None,
        handed: Container[int] = (),
        fetch_many: Callable[[list[int]], list[asyncio.Future[Any]]] | None = None,
    ) -> None:
        self.stager = Stager(
            fetch, size_of, max_items=max_items, max_bytes=max_bytes, cached=cached, handed=handed,
            fetch_many=fetch_many,
        )  # fmt: skip
        self._plan_key: tuple[str, int] | None = None  # (channel, plan) of the epoch being staged
        self._plan: Plan | None = None
        self._ramp = 0  # batches served this epoch, up to where the depth is full
        self._frontier = 0  # the plan's batches before this one are staged already (or were served)
        #: ``(indices, seed)`` of the first batch this process will be given in the next epoch, set at
        #: its last batch of this one where the next epoch is announced (a batch to build ahead).
        self.next_first: tuple[list[int], int | None] | None = None

    def take(self, index: int) -> asyncio.Future[Any] | None:
        """The staged fetch of ``index`` (removed from the staging area), or None."""
        return self.stager.pop(index)

    def advance(
        self, channel: PlanChannel, indices: Sequence[int], stride: int, seed: int | None = None
    ) -> None:
        """Stage what this process will be given after the batch ``indices`` keyed by ``seed`` (call on
        the loop)."""
        plan = channel.current()
        k = plan.locate(indices) if plan is not None else None
        if plan is None or k is None or plan.seed != seed:  # an epoch of the same order has another seed
            plan = channel.current(reload=True)
            k = plan.locate(indices) if plan is not None else None
            if plan is None or k is None:
                return  # a sampler blobdata did not see: batches are still fetched all at once
        stager = self.stager
        if self._plan_key != (channel.path, plan.seq):
            # A new epoch, or a new loader (whose channel numbers its plans from 1 again): what was
            # staged for the old order is useless, unless it was staged for this very order.
            prev = self._plan
            announced = prev is not None and prev.next is not None and prev.next.same_batches(plan)
            if self._plan_key is None:
                pass  # this process's first plan: what is staged was handed over for it
            elif not (announced and self._plan_key[0] == channel.path):
                stager.clear()
                self._ramp = 0
            else:  # its first two batches are staged: the ramp goes on from there
                self._ramp = min(self._ramp, 1)
            self._plan_key = (channel.path, plan.seq)
            self._plan = plan
            self._frontier = 0
        depth = min(stager.max_items, max(len(indices), 1) << (self._ramp + 1))
        if depth < stager.max_items:
            self._ramp += 1
        # This process's batches k+stride, k+2*stride, ... up to `depth` samples; those before the
        # frontier were staged by an earlier call: only the new ones are handed to the stager (one
        # batch per call once the depth is reached, not the whole depth again).
        ahead: list[int] = []
        nxt, count, frontier = k + stride, 0, self._frontier
        offsets = plan.offsets
        while nxt < plan.num_batches and count < depth:
            if nxt >= frontier:
                ahead.extend(plan.batch(nxt).tolist())
            count += int(offsets[nxt + 1] - offsets[nxt])
            nxt += stride
        reached = nxt
        upcoming = channel.next_of(plan) if nxt >= plan.num_batches and count < depth else None
        if stager.schedule(ahead) == len(ahead) and upcoming is None:
            self._frontier = max(frontier, reached)  # else (a bound reached): tried again next time
        if upcoming is not None:  # across the epoch's end: this process's first two batches of the next
            # (the ramp's start: a whole epoch staged at once would make its first batch wait for all)
            following: list[int] = []
            nxt, limit = k % stride, min(depth - count, 2 * max(len(indices), 1))
            while nxt < upcoming.num_batches and len(following) < limit:
                following.extend(upcoming.batch(nxt).tolist())
                nxt += stride
            if k + stride >= plan.num_batches and k % stride < upcoming.num_batches:
                # This process's last batch of the epoch: the first it will be given in the next.
                self.next_first = (upcoming.batch(k % stride).tolist(), upcoming.seed)
            with _stats.for_next_epoch():  # its reads are counted as the next epoch's
                stager.schedule(following)

    def clear(self) -> None:
        """Drop everything staged (call on the loop)."""
        self.stager.clear()
        self._frontier = 0

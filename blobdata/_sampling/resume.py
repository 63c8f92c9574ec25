"""Runs that stop: the loader's position as a small JSON-friendly state.

:class:`Progress` follows one :class:`~blobdata.BlobLoader`: the epochs it began, the batches it yielded
in the current one and the samples of it this rank read, and the sampler's state *at the start* of
that epoch (a ``torch.Generator``'s state in base64, or a ``DistributedSampler``'s seed and epoch;
never a list of indices). Loading a state makes the next epoch the loader begins replay the
interrupted epoch's order from that start state and leave out the samples already read, before the
plan is published, so that workers' look-ahead starts at the resumed position and nothing already
trained on is fetched again.

The position is counted in samples, and the rest of the epoch is batched at the resuming loader's
batch size: another per-rank batch size (another global batch, or the same global batch on another
number of ranks) reads each remaining sample once. At another world size the elastic and partitioned
samplers keep the position in their own terms (a global position; what each layout read), and an
epoch begun under a plain ``DistributedSampler`` goes on through its elastic equivalent
(:func:`blobdata._sampling.elastic.equivalent`): the same permutation, dealt from where the ranks
stopped. A batch sampler blobdata cannot batch again (not a ``BatchSampler``) skips whole batches.

State versions, by the release that writes them: 1, blobdata 0.2.0 before it recorded the run; 2,
blobdata 0.2.0 (``run``, ``served``, ``seed``); 3, blobdata 0.3.0 (``samples``, a
``DistributedSampler``'s ``start``). All three are read.
"""

from __future__ import annotations

import base64
import binascii
import copy
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from .._errors import ConfigError
from .elastic import ElasticDistributedSampler, equivalent
from .identity import ORDER, ServedDigest, differences
from .mixsampler import MixtureSampler
from .partition import PartitionedSampler
from .peek import batched, indices_of
from .rng import epoch_seed

__all__ = ["STATE_VERSION", "Progress", "own_generator"]

log = logging.getLogger("blobdata")

STATE_VERSION = 3  # 3: the samples read (another batch size resumes), a DistributedSampler's start
_READS = (1, 2, STATE_VERSION)
_OWN_ORDER = ("elastic", "partitioned", "mixture")  # samplers that leave out what a resumed epoch read


def own_generator() -> torch.Generator:
    """A generator for ``shuffle=True`` without one, seeded from torch's global RNG (so
    ``torch.manual_seed`` still fixes the order) and whose state a loader can save."""
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    return torch.Generator().manual_seed(seed)


def _encode(gen: torch.Generator) -> str:
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii")


def _decode(text: Any) -> torch.Tensor:
    try:
        raw = base64.b64decode(str(text), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("loader state: the generator state is not base64") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def capture(sampler: Any) -> dict[str, Any]:
    """The sampler's state needed to replay its next epoch (JSON-friendly)."""
    if isinstance(sampler, (PartitionedSampler, MixtureSampler)):
        return sampler.loader_state()
    if isinstance(sampler, ElasticDistributedSampler):
        state = {"kind": "elastic", "seed": sampler.seed, "epoch": sampler.epoch, "start": sampler.start}
        return state if sampler.permutation == "torch" else {**state, "permutation": sampler.permutation}
    if isinstance(sampler, DistributedSampler):
        return {"kind": "distributed", "seed": sampler.seed, "epoch": sampler.epoch}
    gen = getattr(sampler, "generator", None)
    if isinstance(gen, torch.Generator):
        return {"kind": "generator", "state": _encode(gen)}
    return {"kind": "sequential" if isinstance(sampler, torch.utils.data.SequentialSampler) else "other"}


class _Resume:
    """A loaded state's interrupted epoch, from the load until that epoch ends."""

    def __init__(self, state: dict[str, Any], sampler: dict[str, Any], samples: int) -> None:
        self.sampler = sampler  # the sampler's state at the epoch's start
        self.epoch = int(sampler.get("epoch", -1))
        self.batches = int(state["batches"])  # yielded before: counted by len() and the next state
        self.samples = samples  # read before by this rank, of the order `sampler` gives (elastic: 0)
        self.start: int | None = None  # a DistributedSampler's epoch, dealt from this global position
        self.skip = 0  # whole batches to skip: a batch sampler that cannot be batched again
        self.whole = 0  # the batches of a whole epoch here (what len() said before the load)
        self.saved = (state.get("batch_size"), int(state["world_size"]))


class Progress:
    """Where one loader stands; see the module docstring. Lives in the main process only."""

    def __init__(
        self,
        sampler: Any,
        batch_size: int | None,
        seed: int | None = None,
        identity: Callable[[str], dict[str, Any]] | None = None,
        batch_sampler: Any = None,
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.batch_sampler = batch_sampler  # the loader's; a plain BatchSampler is batched again on resume
        self.seed = seed  # the augmentation's (blobdata._sampling.rng); None: not keyed
        self._identity_of = identity  # (sampler kind) -> the run's identity (blobdata._sampling.identity)
        self._identity: dict[str, Any] | None = None
        self.served = ServedDigest()  # every batch handed out, over the epochs
        self._plan: Sequence[Sequence[int]] | None = None  # the current epoch's batches, as planned
        self.epoch = -1  # epochs begun, minus one
        self.batches = 0  # batches yielded in the current epoch, those before a resume included
        self.samples = 0  # samples of the current epoch's order read (see _Resume.samples)
        self.last_size = -1  # samples in the last batch yielded, as planned (-1: not known)
        self.complete = True
        self._start: dict[str, Any] | None = None  # the sampler's state when the current epoch began
        self._pending: _Resume | None = None  # loaded, its epoch not begun
        self._resume: _Resume | None = None  # the resumed epoch, begun
        self._fresh = False  # the resumed epoch just began: its batches are yet to be planned
        self._loaded: dict[str, Any] | None = None  # the state loaded, until its epoch begins
        self._at_iter: dict[str, Any] | None = None  # the sampler's state at iter(), before the seed draw
        # A sampler the loader made (dataloader(sampler="partitioned")): its epoch and set_epoch calls
        # when the last epoch began, to move it on when nobody called set_epoch since.
        self._owned_at: tuple[int, int] | None = None

    def at_iter(self) -> None:
        """Called when the loader's iterator is made, before DataLoader draws its base seed."""
        if self._pending is None:
            self._check_not_cut()
            self._next_owned_epoch()
            self._at_iter = capture(self.sampler)

    def _next_owned_epoch(self) -> None:
        """A sampler the loader made itself is the loader's to move on: each epoch is the next one
        unless ``set_epoch`` was called since the last began (as a loop written for a
        ``DistributedSampler`` does; its epochs are kept)."""
        owned, began = getattr(self.sampler, "owned_by_loader", False), self._owned_at
        if owned and began is not None and self.sampler._set_epoch_calls == began[1]:
            self.sampler.set_epoch(began[0] + 1)

    def begin(self) -> int:
        """Called just before the sampler is iterated for an epoch; returns the whole batches to skip
        (a resumed epoch under a batch sampler that :meth:`rest` cannot batch again)."""
        self._at_iter = None
        resume, self._pending, self._loaded = self._pending, None, None
        if resume is not None and _moved_on(self.sampler, resume):
            _forget_consumed(self.sampler)  # set_epoch to another epoch since the load: a whole one
            resume = None
        if resume is not None:
            if resume.sampler["kind"] == "generator":
                self.sampler.generator.set_state(_decode(resume.sampler["state"]))
        else:
            self.epoch += 1
            if self._resume is not None:  # the resumed epoch was left: this one is whole
                _forget_consumed(self.sampler)
        self._resume, self._fresh = resume, resume is not None
        self._start = capture(self.sampler)
        if resume is not None and resume.start is not None:
            self._start["start"] = resume.start
        self.batches = resume.batches if resume is not None else 0
        self.samples = resume.samples if resume is not None else 0
        self.complete = False
        if getattr(self.sampler, "owned_by_loader", False):
            self._owned_at = (int(self.sampler.epoch), self.sampler._set_epoch_calls)
        return resume.skip if resume is not None else 0

    def rest(self, batch_sampler: Any) -> tuple[np.ndarray, np.ndarray] | None:
        """Right after :meth:`begin`: the resumed epoch's batches (flat, offsets), the samples not yet
        read batched at this loader's batch size; None for an epoch that is not a resumed one."""
        resume, fresh, self._fresh = self._resume, self._fresh, False
        if resume is None or not fresh or resume.skip or type(batch_sampler) is not BatchSampler:
            return None
        if resume.start is not None:
            flat = equivalent(self.sampler, start=resume.start).indices()
        else:
            flat = indices_of(self.sampler)  # the same draws as iterating it
            flat = flat[min(resume.samples, len(flat)) :]
        return batched(flat, int(batch_sampler.batch_size), bool(batch_sampler.drop_last))

    def length(self, batch_sampler: Any) -> int | None:
        """``len()`` of a loaded or resumed epoch not yet over: the whole epoch's count here, as
        ``StatefulDataLoader`` keeps it (a loop that counts batches, as Lightning's does, runs the
        batches before the stop and then until the rest runs out), or more when the rest needs more
        batches than that (a larger global batch); None otherwise (the batch sampler's own length)."""
        resume = self._pending if self._pending is not None else self._resume
        if resume is None or (resume is self._resume and self.complete) or _moved_on(self.sampler, resume):
            return None
        if type(batch_sampler) is not BatchSampler:  # its own batches: of what the sampler leaves
            own = resume.batches + len(batch_sampler)
            return max(resume.whole, own) if _leaves_out(self.sampler) else None
        size, left = int(batch_sampler.batch_size), self._left(resume)
        left_batches = left // size if batch_sampler.drop_last else -(-left // size)
        return max(resume.whole, resume.batches + left_batches)

    def _left(self, resume: _Resume) -> int:
        """The samples this rank has left to read in ``resume``'s epoch."""
        if resume.start is not None:
            return len(equivalent(self.sampler, start=resume.start))
        return max(0, len(self.sampler) - resume.samples)  # elastic, partitioned: their len() is the rest

    def _check_not_cut(self) -> None:
        """A new epoch begins while the resumed one has batches left, after exactly as many batches as a
        whole epoch has here: a loop counting against ``len()`` taken before the load (Lightning) cut
        it, which happens when the global batch grew. Refused, naming what to change."""
        resume = self._resume
        if resume is None or self.complete or self._plan is None or self.batches != resume.whole:
            return
        left = resume.batches + len(self._plan) - self.batches
        if left <= 0:
            return
        (size, world), now = resume.saved, (self.batch_size, self.world_size())
        raise ConfigError(
            f"the epoch resumed from a loader state saved at batch size {size} x {world} ranks, here "
            f"{now[0]} x {now[1]}, was left after {self.batches} batches, as many as a whole epoch has "
            f"here, with {left} of its batches not read: a training loop that counts the batches done "
            "before the checkpoint against len() taken before the state was loaded (as Lightning does) "
            "ends such an epoch early when the global batch (batch size x ranks) grows. Resume that "
            f"checkpoint with a global batch no larger than {(size or 1) * world}, or from a checkpoint "
            "saved at an epoch's end"
        )

    def sample_seed(self) -> int | None:
        """The seed the current epoch's augmentation draws are keyed by (with each sample's URL)."""
        return None if self.seed is None else epoch_seed(self.seed, self.epoch)

    def next_sample_seed(self) -> int | None:
        """The seed of the next epoch's draws, unless a state is loaded before it begins."""
        return None if self.seed is None else epoch_seed(self.seed, self.epoch + 1)

    def planned(self, batches: Sequence[Sequence[int]]) -> None:
        """The batches the epoch begun will hand out (after those a resume skips), in order."""
        self._plan = batches

    def track(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The loader's batches, counted (and their indices digested) as they are handed out."""
        for j, batch in enumerate(batches):
            self.batches += 1
            plan = self._plan  # set when the sampler began the epoch, before its first batch
            if plan is not None and j < len(plan):
                self.samples += len(plan[j])
                self.served.update(self.epoch, plan[j])
                self.last_size = len(plan[j])
            else:
                self.samples += self.batch_size or 1
                self.last_size = -1  # not known here
            yield batch
        self.complete = True
        if self._resume is not None:  # the resumed epoch is over: the sampler's next are whole
            _forget_consumed(self.sampler)

    def identity(self) -> dict[str, Any] | None:
        """What identifies this run (computed once: it digests the listing)."""
        if self._identity is None and self._identity_of is not None:
            self._identity = self._identity_of(capture(self.sampler)["kind"])
        return self._identity

    def world_size(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1))

    def state_dict(self) -> dict[str, Any]:
        if self._loaded is not None:  # loaded, its epoch not begun: the same position (as StatefulDataLoader)
            return {**copy.deepcopy(self._loaded), **self._own()}
        complete = self.complete or self._start is None
        if not complete:
            sampler = dict(self._start or {})
        elif self._at_iter is not None:  # between iter() and the epoch's first batch
            sampler = dict(self._at_iter)
        else:
            sampler = capture(self.sampler)
        samples = 0 if complete else self.samples
        if not complete and sampler["kind"] in ("partitioned", "mixture"):  # what each layout read
            sampler, samples = self.sampler.state_after(sampler, samples), 0
        elif not complete and (sampler["kind"] == "elastic" or "start" in sampler):  # a global position
            n = len(self.sampler.dataset)
            sampler["start"], samples = min(n, int(sampler.get("start", 0)) + samples * self.world_size()), 0
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches": 0 if complete else self.batches,
            "samples": samples,
            "complete": complete,
            "batch_size": self.batch_size,
            "world_size": self.world_size(),
            "sampler": sampler,
            **self._own(),
        }

    def _own(self) -> dict[str, Any]:
        """What this loader's state says of the run, whatever state it loaded."""
        return {
            "version": STATE_VERSION,
            "run": self.identity(),
            "served": self.served.state(),
            "seed": self.seed,  # the augmentation's: a resumed run draws the same crops
        }

    def load_state_dict(self, state: Any, *, strict: bool = True) -> None:
        if not isinstance(state, dict) or state.get("version") not in _READS:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"not a blobdata loader state of version 1, 2 or {STATE_VERSION} (got {got!r})")
        try:
            saved, epoch, batches = dict(state["sampler"]), int(state["epoch"]), int(state["batches"])
            complete = bool(state["complete"])
            saved_world = int(state["world_size"])
            samples = _samples(state, batches)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"blobdata loader state is missing or has a bad field: {exc}") from None
        if isinstance(self.sampler, MixtureSampler):  # other sources: refused whatever strict, named
            self.sampler.check_state(state)
        self._check_run(state, strict, complete)
        here = capture(self.sampler)
        if saved.get("kind") != here["kind"]:
            raise ConfigError(
                f"the loader state was saved with a {saved.get('kind')} sampler; "
                f"this loader's is {here['kind']}"
            )
        kind = here["kind"]
        self._pending = self._resume = None
        _forget_consumed(self.sampler)  # a state loaded before replaces nothing of this one
        whole = _len(self.batch_sampler)  # a whole epoch's batches here, before the load
        if kind in ("elastic", "distributed"):
            if int(saved["seed"]) != self.sampler.seed and (strict or not complete):
                raise ConfigError(
                    f"the state's sampler seed is {saved['seed']}, this sampler's {self.sampler.seed}"
                    + ("" if complete else ": mid-epoch, its order would differ, even with strict=False")
                )
            was, now = saved.get("permutation", "torch"), here.get("permutation", "torch")
            if was != now:
                raise ConfigError(
                    f"the state was saved with an ElasticDistributedSampler of permutation={was!r}, this "
                    f"one has {now!r}: its order would differ, so it cannot resume there"
                )
            self.sampler.set_epoch(int(saved["epoch"]))
        if kind == "partitioned":
            self.sampler.load_loader_state(saved, complete=complete)
        if kind == "mixture":  # other weights: asked for by the mixture (said at INFO), or strict=False
            asked = bool(getattr(self.sampler.dataset, "reweight_on_resume", False))
            said = self.sampler.load_loader_state(saved, complete=complete, reweight=asked or not strict)
            if said is not None:
                text = f"resuming a mixture's state saved with other {said}: the rest follows this mixture's"
                if asked:
                    log.info("blobdata: %s", text)
                else:
                    warnings.warn(text, UserWarning, stacklevel=3)
        resume = None if complete else _Resume(state, saved, samples)
        if resume is not None:
            resume.whole = whole
            if kind == "elastic":  # the sampler itself leaves out what was read, at any world size
                self.sampler.start, resume.samples = int(saved["start"]), 0
            elif kind in ("partitioned", "mixture"):
                resume.samples = 0
            elif kind == "distributed" and (saved_world != self.world_size() or "start" in saved):
                resume.start, resume.samples = self._equivalent_start(saved, saved_world, samples), 0
            if type(self.batch_sampler) is not BatchSampler and kind not in _OWN_ORDER:
                self._whole_batches_only(state, resume)
        if kind == "generator" and complete:
            self.sampler.generator.set_state(_decode(saved["state"]))
        if state.get("seed") is not None:
            self.seed = int(state["seed"])
        self.served = ServedDigest.from_state(state.get("served"))
        self.epoch = epoch
        self.batches, self.samples, self.complete = 0, 0, True
        self._start = self._at_iter = None
        self._pending = resume
        self._loaded = None if complete else {**copy.deepcopy(dict(state)), "samples": samples}

    def _equivalent_start(self, saved: dict[str, Any], saved_world: int, samples: int) -> int:
        """The global position an epoch begun under a ``DistributedSampler`` reached: its ranks read
        ``samples`` each, round-robin, from ``saved``'s ``start`` (0 unless resumed before)."""
        if type(self.sampler) is not DistributedSampler:
            raise ConfigError(
                f"the state was saved at world size {saved_world}, this is {self.world_size()}: the "
                f"rest of its epoch is dealt to these ranks in DistributedSampler's order, which a "
                f"{type(self.sampler).__name__} may not have. Resume it at world size {saved_world}, "
                "or use torch's DistributedSampler itself or blobdata.ElasticDistributedSampler"
            )
        n = len(self.sampler.dataset)  # type: ignore[arg-type]
        return min(n, int(saved.get("start", 0)) + samples * saved_world)

    def _whole_batches_only(self, state: dict[str, Any], resume: _Resume) -> None:
        """A batch sampler blobdata cannot batch again resumes by skipping its own whole batches."""
        what = type(self.batch_sampler).__name__
        if state.get("batch_size") != self.batch_size or resume.start is not None:
            raise ConfigError(
                f"the state was saved with batch_size={state.get('batch_size')} at world size "
                f"{state['world_size']}; this loader has {self.batch_size} at {self.world_size()}, and "
                f"its batch_sampler ({what}) makes batches of its own, which blobdata cannot make "
                "again at another size: resume with the same batch size and world size, or pass "
                "batch_size= and sampler= instead of batch_sampler="
            )
        resume.skip = resume.batches

    def _check_run(self, state: dict[str, Any], strict: bool, complete: bool) -> None:
        """Refuse a state of another run mid-epoch where its order would differ (whatever ``strict``);
        otherwise refuse (``strict``) or warn of another dataset, listing or sampler."""
        if state.get("version") == 1:
            warnings.warn(
                "a blobdata loader state of version 1 (written by blobdata 0.2.0 before it recorded the "
                "run) records no run identity: it is loaded without checking that it was saved over "
                "this dataset, listing and sampler, and the digest of the indices served starts again here",
                UserWarning,
                stacklevel=4,
            )
            return
        here = self.identity()
        saved = state.get("run")
        if here is None or not isinstance(saved, dict):
            return
        order = differences(saved, here, keys=ORDER)
        if order and not complete:
            raise ConfigError(
                f"this loader state was saved by another run ({'; '.join(order)}): mid-epoch, the rest of "
                "its epoch is not the rest of this loader's order, so some samples would be read twice "
                "and others never. It is refused even with strict=False; resume it with the same "
                "dataset and sampler, or load a state saved at an epoch's end" + _hint(saved, here)
            )
        diffs = [d for d in differences(saved, here) if not d.startswith("batch size:")]
        if not diffs:
            return
        text = "; ".join(diffs)
        if strict:
            raise ConfigError(
                f"this loader state was saved by another run ({text}): resuming it here would not continue "
                "that run. Pass strict=False to load_state_dict to load it anyway"
            )
        warnings.warn(f"loading a loader state of another run ({text}), as strict=False asks", UserWarning,
                      stacklevel=4)  # fmt: skip


def _hint(saved: dict[str, Any], here: dict[str, Any]) -> str:
    """A distributed sampler's state, and a loader without one: Lightning on one device."""
    distributed, single = ("distributed", "elastic"), ("generator", "sequential")
    if saved.get("sampler") in distributed and here.get("sampler") in single:
        return (
            " (Lightning puts its DistributedSampler in only under a distributed strategy: on one "
            'device, Trainer(strategy="ddp") keeps it, and it resumes this state)'
        )
    return ""


def _samples(state: dict[str, Any], batches: int) -> int:
    """The samples this rank read of the interrupted epoch's order: recorded since version 3, whole
    batches of the state's batch size before (the batch size could not change then)."""
    if state.get("version") == STATE_VERSION:
        return max(0, int(state["samples"]))
    return max(0, batches * int(state.get("batch_size") or 0))


def _len(batch_sampler: Any) -> int:
    try:
        return len(batch_sampler)
    except TypeError:  # a batch sampler without a length
        return 0


def _moved_on(sampler: Any, resume: _Resume) -> bool:
    """Whether ``set_epoch`` moved a distributed sampler to another epoch since ``resume`` was loaded."""
    return isinstance(sampler, DistributedSampler) and resume.epoch >= 0 and sampler.epoch != resume.epoch


def _leaves_out(sampler: Any) -> bool:
    """Whether ``sampler`` now leaves out the start of a resumed epoch (elastic or partitioned)."""
    if isinstance(sampler, (PartitionedSampler, MixtureSampler)):
        return bool(sampler.consumed)
    return getattr(sampler, "start", 0) > 0


def _forget_consumed(sampler: Any) -> None:
    """``sampler`` yields whole epochs again (no resumed epoch's start left out)."""
    if isinstance(sampler, PartitionedSampler):
        sampler.consumed = []
    elif isinstance(sampler, MixtureSampler):
        sampler.forget()
    elif isinstance(sampler, ElasticDistributedSampler):
        sampler.start = 0

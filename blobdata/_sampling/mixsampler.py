""":class:`MixtureSampler`: a :class:`~blobdata.Mixture`'s epochs as exact plans
(:mod:`blobdata._sampling.mixing`), dealt to the job's ranks, resumable.

Two ways to deal an epoch to ranks:

* **global** (default): the epoch's one order of ``N`` positions, dealt round-robin as
  ``DistributedSampler`` deals (rank ``r`` of ``W`` reads positions ``r, r + W, ...``; the tail padded
  by repeating the start, or cut with ``drop_last``). The ranks together read the epoch once; a loader
  state records the global position read, so a run resumed at another world size deals the rest.
* **by node** (``by_node=True``, ``dataloader(sampler="partitioned")``): each node reads its own share
  of every source every epoch (:func:`blobdata._sampling.shares.node_share`, as
  :class:`~blobdata.PartitionedSampler` does), so node caches add up. Node ``j`` plans its part of the
  epoch (``N / nnodes`` positions, to within one) with the same weights over its shares, and its ranks
  deal it round-robin, every rank ``ceil(N / W)`` samples (padding from the node's own part). A source
  smaller than the number of nodes is not split. Mid-epoch, a state resumes at the same layout only.

Weights: a state saved with other weights loads with ``strict=False`` (or into a mixture made with
``reweight_on_resume=True``): what was read stays read, and the rest of the epoch (the same length)
follows the new weights (a new :class:`~blobdata._sampling.mixing.Segment` from the global position, or
per node from its position).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from .._errors import ConfigError
from .._listing import dist_info
from .mixing import Segment, epoch_plan, stream
from .shares import node_share

__all__ = ["MixtureSampler"]


class MixtureSampler(DistributedSampler[int]):
    """The planned order of a :class:`~blobdata.Mixture` (see :mod:`blobdata._sampling.mixing`), this
    rank's part of each epoch. ``mix.dataloader()`` makes one; make your own for other settings.

    ``num_replicas`` and ``rank`` default to the job's (the process group, or torchrun's ``RANK`` and
    ``WORLD_SIZE``); ``seed`` to the mixture's. ``shuffle=False`` reads each source in index order (the
    interleave stays even). Call ``set_epoch(e)`` each epoch, as with ``DistributedSampler`` (a loader
    that made its sampler moves it on itself). ``by_node=True``: each node reads its own shares of every
    source (``nproc_per_node`` defaults to torchrun's ``LOCAL_WORLD_SIZE``).
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
        *,
        by_node: bool = False,
        nproc_per_node: int | None = None,
    ) -> None:
        if not hasattr(dataset, "source_sizes"):
            raise ConfigError(f"MixtureSampler reads a blobdata.Mixture, got {type(dataset).__name__}")
        info = dist_info() if num_replicas is None or rank is None or nproc_per_node is None else None
        world = int(num_replicas if num_replicas is not None else info.world_size)  # type: ignore[union-attr]
        me = int(rank if rank is not None else info.rank)  # type: ignore[union-attr]
        if world < 1 or not 0 <= me < world:
            raise ConfigError(f"MixtureSampler: rank {me} is not in 0..{world - 1} (num_replicas={world})")
        super().__init__(
            dataset, num_replicas=world, rank=me, shuffle=shuffle,
            seed=int(dataset.seed if seed is None else seed), drop_last=drop_last,
        )  # fmt: skip
        per_node = world if not by_node else int(nproc_per_node or info.local_world_size)  # type: ignore[union-attr]
        if per_node < 1 or world % per_node:
            raise ConfigError(
                f"MixtureSampler: {world} ranks cannot sit on nodes of nproc_per_node={per_node} ranks each "
                "(it must divide num_replicas)"
            )
        self.by_node = bool(by_node)
        self.nproc_per_node = per_node
        self.nnodes = world // per_node
        self.node_rank, self.local_rank = divmod(me, per_node)
        self.sizes: tuple[int, ...] = tuple(int(n) for n in dataset.source_sizes)
        self.keys: tuple[int, ...] = tuple(dataset.source_keys)
        self.weights: tuple[float, ...] = tuple(dataset.weight_tuple)
        self.samples_per_epoch = int(dataset.samples_per_epoch)
        #: Read of the current epoch before this run: global positions, or (by node) samples per rank.
        self.start = 0
        #: The current epoch's segments, when a resume changed its weights (else one, of ``weights``).
        self.segments: tuple[Segment, ...] | None = None
        self.epoch_samples: int | None = None  # the resumed epoch's length (the state's)
        self.owned_by_loader = False  # made by mix.dataloader(): the loader moves its epoch on
        self._set_epoch_calls = 0
        self._memo: tuple[tuple[Any, ...], np.ndarray] | None = None
        self.num_samples = len(self)
        self.total_size = self.num_samples * world

    # -- the order ---------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.forget()
        self._set_epoch_calls += 1
        super().set_epoch(epoch)

    def set_weights(self, weights: Any) -> None:
        """New weights from the next epoch begun (a curriculum); the same checks as the mixture's."""
        from .mixing import checked_weights

        self.weights = checked_weights(self.dataset.names, weights)  # type: ignore[attr-defined]

    def forget(self) -> None:
        """Whole epochs again: nothing of a resumed epoch left out."""
        self.start, self.segments, self.epoch_samples = 0, None, None

    def _total(self) -> int:
        return self.samples_per_epoch if self.epoch_samples is None else self.epoch_samples

    def _segments(self) -> tuple[Segment, ...]:
        return self.segments if self.segments is not None else (Segment(0, self.weights),)

    def _per_rank(self) -> int:
        n, w = self._total(), self.num_replicas
        if self.by_node:
            return n // w if self.drop_last else math.ceil(n / w)
        rest = max(0, n - self.start)
        return rest // w if self.drop_last else math.ceil(rest / w)

    def __len__(self) -> int:
        per = self._per_rank()
        return max(0, per - self.start) if self.by_node else per

    def _plan(self) -> np.ndarray:
        """The epoch's order (global), or this node's part of it (by node)."""
        total, segs = self._total(), self._segments()
        key = (total, segs, self.seed, self.epoch, self.shuffle, self.weights, self.by_node, self.nnodes,
               self.node_rank, self.sizes)  # fmt: skip
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        if not self.by_node:
            plan = epoch_plan(total, self.sizes, self.keys, segs, seed=self.seed, epoch=self.epoch,
                              shuffle=self.shuffle)  # fmt: skip
        else:
            k, j = self.nnodes, self.node_rank
            mine = total // k + (1 if j < total % k else 0)
            pools = [
                node_share(n, seed=self.seed, nnodes=k, node=j) if n >= k else np.arange(n, dtype=np.int64)
                for n in self.sizes
            ]
            offsets = np.concatenate([[0], np.cumsum(self.sizes)]).tolist()
            node_segs = [Segment(min(s.start * self.nproc_per_node, mine), s.weights) for s in segs]
            plan = stream(mine, pools, offsets, self.keys, node_segs, seed=self.seed, epoch=self.epoch,
                          shuffle=self.shuffle)  # fmt: skip
        self._memo = (key, plan)
        return plan

    def indices(self) -> np.ndarray:
        """This rank's samples for the current epoch (global indices of the mixture), in the order
        ``__iter__`` yields them (int64)."""
        plan, per = self._plan(), self._per_rank()
        if self.by_node:
            p = self.nproc_per_node
            k = np.arange(self.start, per, dtype=np.int64)
            return plan[(self.local_rank + p * k) % max(len(plan), 1)] if len(plan) else plan[:0]
        rest = plan[min(self.start, len(plan)) :]
        w = self.num_replicas
        mine = np.arange(self.rank, per * w, w, dtype=np.int64)
        return rest[mine % max(len(rest), 1)] if len(rest) else rest

    def global_order(self) -> list[int]:
        """The whole epoch's order (global mode), the same on every rank (for inspection)."""
        order: list[int] = self._plan().tolist()
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    # -- the loader's state (blobdata._sampling.resume) ----------------------------------------------
    def loader_state(self) -> dict[str, Any]:
        """What replays the current epoch from its start (JSON-friendly)."""
        names = self.dataset.names  # type: ignore[attr-defined]
        return {
            "kind": "mixture", "seed": self.seed, "epoch": self.epoch, "samples": self._total(),
            "shuffle": self.shuffle, "drop_last": self.drop_last, "by_node": self.by_node,
            "layout": [self.nnodes, self.nproc_per_node], "start": self.start,
            "weights": dict(zip(names, self._segments()[-1].weights, strict=True)),
            "segments": [[s.start, list(s.weights)] for s in self._segments()],
            "sources": self.dataset.source_identities(),  # type: ignore[attr-defined]
        }  # fmt: skip

    def state_after(self, start: dict[str, Any], per_rank: int) -> dict[str, Any]:
        """``start`` (:meth:`loader_state` at the epoch's start) after every rank read ``per_rank`` more."""
        if self.by_node:
            return {**start, "start": int(start["start"]) + max(0, int(per_rank))}
        n = int(start["samples"])
        return {**start, "start": min(n, int(start["start"]) + max(0, int(per_rank)) * self.num_replicas)}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse (whatever ``strict``) a state saved over other sources, naming each difference."""
        saved = state.get("sampler")
        if not isinstance(saved, dict) or saved.get("kind") != "mixture":
            return
        here = self.dataset.source_identities()  # type: ignore[attr-defined]
        theirs = saved.get("sources")
        if not isinstance(theirs, list):
            raise ConfigError("blobdata loader state: a mixture state without its sources")
        diffs = _source_differences(theirs, here)
        if diffs:
            raise ConfigError(
                f"this loader state was saved over other sources ({'; '.join(diffs)}): a mixture resumes "
                "only a state of the same sources (names, URLs, listings); make the mixture of those, or "
                "start this one afresh"
            )

    def load_loader_state(self, state: dict[str, Any], *, complete: bool, reweight: bool) -> str | None:
        """Make the next iteration resume ``state``'s epoch (the one after it when ``complete``).
        ``reweight``: other weights are taken (the rest of the epoch follows this sampler's); else
        refused. Returns the weights' difference in words, or None."""
        try:
            epoch, total, start = int(state["epoch"]), int(state["samples"]), int(state["start"])
            saved = {k: state[k] for k in ("seed", "shuffle", "drop_last", "by_node")}
            layout = [int(x) for x in state["layout"]]
            segs = tuple(Segment(int(a), tuple(float(x) for x in w)) for a, w in state["segments"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"blobdata loader state: a bad mixture state ({exc!r})") from None
        if (
            not segs
            or segs[0].start != 0
            or any(len(s.weights) != len(self.sizes) for s in segs)
            or not (0 <= start <= total and total > 0)
        ):
            raise ConfigError("blobdata loader state: a bad mixture state (segments, start or samples)")
        here = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "by_node": self.by_node,
        }
        for key, value in here.items():
            if saved[key] != value and (key != "drop_last" or not complete):
                raise ConfigError(
                    f"the loader state was saved with a MixtureSampler of {key}={saved[key]!r}, this one has "
                    f"{key}={value!r}: its order would differ, so it cannot resume there"
                )
        if self.by_node and not complete and layout != [self.nnodes, self.nproc_per_node]:
            raise ConfigError(
                f"the loader state was saved mid-epoch by node on {layout[0]} nodes of {layout[1]} ranks; "
                f"this job has {self.nnodes} of {self.nproc_per_node}: a by-node mixture resumes mid-epoch "
                "at the same layout only (or load a state saved at an epoch's end)"
            )
        changed = _weights_differ(segs[-1].weights, self.weights)
        names = self.dataset.names  # type: ignore[attr-defined]
        words = (
            f"weights {_named(names, segs[-1].weights)} in the state, {_named(names, self.weights)} here"
            if changed
            else None
        )
        if words is not None and not reweight:
            raise ConfigError(
                f"this loader state was saved with other {words}: pass strict=False to load_state_dict, or "
                "make the mixture with reweight_on_resume=True, to resume it with this mixture's weights "
                "(what was read stays read; the rest of its epoch follows the new weights)"
            )
        self.set_epoch(epoch)
        self.forget()
        if not complete:
            self.start, self.epoch_samples = start, total
            self.segments = segs + ((Segment(start, self.weights),) if changed else ())
        return words


def _weights_differ(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    sa, sb = sum(a), sum(b)
    if len(a) != len(b):
        return True
    return any(not math.isclose(x / sa, y / sb, rel_tol=1e-12) for x, y in zip(a, b, strict=True))


def _named(names: Any, weights: tuple[float, ...]) -> str:
    return "{" + ", ".join(f"{n}: {w:g}" for n, w in zip(names, weights, strict=True)) + "}"


def _source_differences(theirs: list[Any], here: list[dict[str, Any]]) -> list[str]:
    """What differs between a state's sources and this mixture's, in words."""
    a = {str(s.get("name")): s for s in theirs if isinstance(s, dict)}
    b = {s["name"]: s for s in here}
    out = [f"source {n!r} is in the state, not in this mixture" for n in a if n not in b]
    out += [f"source {n!r} is in this mixture, not in the state" for n in b if n not in a]
    for n in b:
        if n in a:
            for key, word in (("url", "URL"), ("samples", "number of samples"), ("listing", "listing")):
                if a[n].get(key) != b[n].get(key):
                    out.append(f"source {n!r}: its {word} is {a[n].get(key)!r} there, {b[n].get(key)!r} here")
    if not out and list(a) != list(b):
        out.append(f"the sources' order is {list(a)} there, {list(b)} here")
    return out

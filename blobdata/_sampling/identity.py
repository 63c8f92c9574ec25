"""What makes a loader's state *this* run's: the dataset, its listing, the sampler, the batch size; and a
running digest of the indices served, so that two runs can be shown to have served the same batches.

A loader's ``state_dict()`` records :func:`run_identity` under ``"run"`` and a :class:`ServedDigest`
under ``"served"``. ``load_state_dict()`` refuses a state whose identity differs from the loader's
(:func:`differences` names each difference) unless ``strict=False``, and mid-epoch one that differs in
what fixes the epoch's order (:data:`ORDER`) whatever ``strict``; the batch size and the layout are
recorded, not compared (a resume may change them). :func:`compare_runs` compares two
states (or loaders): an uninterrupted run and one stopped and resumed served the same indices in the
same order exactly when their ``"served"`` digests are equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

__all__ = ["ORDER", "ServedDigest", "compare_runs", "differences", "listing_digest", "run_identity"]

# What a resume may not change, with the words that name it in an error.
_NAMES = {
    "dataset": "dataset URL",
    "listing": "listing (digest of its keys, object identities, sizes and classes)",
    "samples": "number of samples",
    "sampler": "sampler kind",
    "sampler_seed": "sampler seed",
    "shuffle": "sampler shuffle",
    "drop_last": "drop_last",
    "batch_size": "batch size",
}


def listing_digest(manifest: Any) -> str:
    """A digest of a listing: every key, object identity (ETag, generation), size and class, in order."""
    h = hashlib.blake2b(digest_size=16)
    h.update("\0".join(manifest.classes).encode())
    for name, array in sorted(manifest._arrays().items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()


def run_identity(dataset: Any, sampler: Any, batch_size: int | None, kind: str) -> dict[str, Any]:
    """The run's identity (JSON-friendly): what a resumed run must share with the one it resumes."""
    manifest = getattr(dataset, "manifest", None)
    out: dict[str, Any] = {
        "dataset": getattr(dataset, "_url", None),
        "listing": listing_digest(manifest) if manifest is not None else None,
        "samples": len(dataset),
        "sampler": kind,
        "batch_size": batch_size,
    }
    if kind in ("distributed", "elastic", "partitioned", "mixture"):
        out["sampler_seed"] = int(sampler.seed)
        out["shuffle"] = bool(sampler.shuffle)
        out["drop_last"] = bool(sampler.drop_last)
        # Recorded, not compared: elastic and partitioned samplers resume at another layout, and a
        # plain DistributedSampler's world size is checked where it matters (mid-epoch).
        out["layout"] = {"world_size": int(sampler.num_replicas),
                         "nproc_per_node": int(getattr(sampler, "nproc_per_node", 0) or 0)}  # fmt: skip
    return out


def _short(value: Any) -> str:
    return f"{value[:12]}..." if isinstance(value, str) and len(value) == 32 else repr(value)


#: What fixes an epoch's order: a state that differs in one of these cannot resume mid-epoch exactly.
ORDER = ("samples", "sampler", "sampler_seed", "shuffle", "drop_last")


def differences(
    saved: dict[str, Any], here: dict[str, Any], keys: Collection[str] | None = None
) -> list[str]:
    """What differs between a saved identity and this loader's (in ``keys``, default all), in words;
    empty when it is the same run."""
    out = []
    for key, name in _NAMES.items():
        if keys is not None and key not in keys:
            continue
        if key in saved or key in here:
            a, b = saved.get(key), here.get(key)
            if a != b:
                out.append(f"{name}: the state's is {_short(a)}, this loader's {_short(b)}")
    return out


class ServedDigest:
    """A running digest of the batches a loader served: chained per batch over (epoch, indices), so
    it is small, JSON-friendly, and goes on from a loaded state exactly as an unbroken run would."""

    def __init__(self, hexdigest: str = "", batches: int = 0) -> None:
        self.hexdigest = hexdigest or hashlib.blake2b(b"blobdata", digest_size=16).hexdigest()
        self.batches = batches

    def update(self, epoch: int, indices: Sequence[int]) -> None:
        h = hashlib.blake2b(bytes.fromhex(self.hexdigest), digest_size=16)
        h.update(np.int64(epoch).tobytes())
        h.update(np.asarray(indices, dtype=np.int64).tobytes())
        self.hexdigest = h.hexdigest()
        self.batches += 1

    def state(self) -> dict[str, Any]:
        return {"batches": self.batches, "digest": self.hexdigest}

    @classmethod
    def from_state(cls, state: Any) -> ServedDigest:
        if not isinstance(state, dict):
            return cls()
        text = str(state.get("digest", ""))
        try:
            bytes.fromhex(text)
        except ValueError:
            text = ""
        return cls(text, int(state.get("batches", 0))) if len(text) == 32 else cls()


def _state_of(run: Any) -> dict[str, Any]:
    state = run.state_dict() if hasattr(run, "state_dict") else run
    if not isinstance(state, dict):
        raise TypeError(f"compare_runs takes loader states or loaders, got {type(run).__name__}")
    return state


def compare_runs(a: Any, b: Any) -> list[str]:
    """What differs between two runs, each a :class:`~blobdata.BlobLoader` or its ``state_dict()``:
    the run's identity (dataset, listing, sampler, batch size), the batches served, and the digest of
    the indices served, in order. An empty list: the same run, which served the same indices in the
    same order (for example an uninterrupted run and one stopped, saved and resumed, compared at the
    same point). Per rank under DDP: each rank's digest covers its own batches.

    >>> assert not blobdata.compare_runs(uninterrupted_loader, resumed_loader)
    """
    sa, sb = _state_of(a), _state_of(b)
    ra, rb = sa.get("run"), sb.get("run")
    if not isinstance(ra, dict) or not isinstance(rb, dict):
        return ["a state without a run identity (version 1: blobdata 0.2.0 before it recorded the run): "
                "the runs cannot be compared"]  # fmt: skip
    out = differences(ra, rb)
    da, db = ServedDigest.from_state(sa.get("served")), ServedDigest.from_state(sb.get("served"))
    if da.batches != db.batches:
        out.append(f"batches served: {da.batches} against {db.batches}")
    elif da.hexdigest != db.hexdigest:
        a, b = _short(da.hexdigest), _short(db.hexdigest)
        out.append(f"the indices served differ (digest {a} against {b})")
    return out

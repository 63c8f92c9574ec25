"""A loader state knows its run: it is refused by a loader over another dataset, listing or sampler
(naming what differs), and two runs' digests of the indices served can be compared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import blobdata
from blobdata import ConfigError, FolderDataset
from tests.support.id_folders import sample_id, write_id_folder


def _folder(root: Path, n: int = 48, payload: bytes = b"x") -> Path:
    return write_id_folder(root, n, payload=payload)


def _loader(root: Path, *, batch_size: int = 4, seed: int = 3, workers: int = 0, **kw: Any) -> Any:
    ds = FolderDataset(root, loader=sample_id, lookahead=8)
    if "sampler" in kw:
        kw["sampler"] = kw["sampler"](ds)
    else:
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(seed))
    return ds.dataloader(batch_size=batch_size, num_workers=workers, **kw)


def _take(loader: Any, epochs: int, stop_after: int | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    out: list[list[int]] = []
    for epoch in range(epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for k, (ids, _) in enumerate(loader):
            out.append(ids.tolist())
            if stop_after is not None and epoch == epochs - 1 and k + 1 == stop_after:
                break
    return out, json.loads(json.dumps(loader.state_dict()))


def test_a_state_from_another_folder_of_the_same_size_is_refused(tmp_path: Path) -> None:
    a, b = _folder(tmp_path / "a"), _folder(tmp_path / "b", payload=b"yy")
    _, state = _take(_loader(a), 1, stop_after=5)
    other = _loader(b)
    with pytest.raises(ConfigError) as err:
        other.load_state_dict(state)
    text = str(err.value)
    assert "dataset URL" in text and str(tmp_path / "a") in text and str(tmp_path / "b") in text
    assert "listing" in text and "number of samples" not in text and "strict=False" in text
    with pytest.warns(UserWarning, match="another run"):
        other.load_state_dict(state, strict=False)
    rest, _ = _take(other, 1)
    assert len(rest) == 7  # loaded anyway: the rest of the epoch


def test_a_changed_listing_or_sampler_is_named(tmp_path: Path) -> None:
    root = _folder(tmp_path / "a")
    _, state = _take(_loader(root), 1, stop_after=2)
    _loader(root, batch_size=8).load_state_dict(state)  # another batch size resumes (issue 43)
    (root / "c0" / "0.png").write_bytes(b"changed, and longer")  # another size: another listing
    with pytest.raises(ConfigError, match="listing") as err:
        _loader(root).load_state_dict(state)
    assert "dataset URL" not in str(err.value)
    with pytest.raises(ConfigError, match="sampler kind: the state's is 'generator'"):
        _loader(root, sampler=lambda ds: DistributedSampler(ds, 1, 0)).load_state_dict(state)
    _, dstate = _take(_loader(root, sampler=lambda ds: DistributedSampler(ds, 1, 0, seed=1)), 1, stop_after=2)
    with pytest.raises(ConfigError, match="sampler seed: the state's is 1, this loader's 2"):
        _loader(root, sampler=lambda ds: DistributedSampler(ds, 1, 0, seed=2)).load_state_dict(dstate)


@pytest.mark.parametrize("workers", [0, 2])
def test_compare_runs_proves_a_resumed_run_is_the_uninterrupted_one(tmp_path: Path, workers: int) -> None:
    root = _folder(tmp_path / "a")
    full = _loader(root, workers=workers)
    full_batches, full_state = _take(full, 2)
    first, state = _take(_loader(root, workers=workers), 1, stop_after=5)
    assert state["served"]["batches"] == 5
    resumed = _loader(root, seed=99, workers=workers)  # the state restores the order, whatever the seed
    resumed.load_state_dict(state)
    assert blobdata.compare_runs(state, resumed) == []  # loaded, not yet begun: the same position
    rest_1, _ = _take(resumed, 1)
    rest_2, resumed_state = _take(resumed, 1)
    assert first + rest_1 + rest_2 == full_batches
    assert blobdata.compare_runs(full, resumed) == []
    assert blobdata.compare_runs(full_state, resumed_state) == []
    # A run that served other indices, or fewer batches, is told apart.
    _, other = _take(_loader(root, seed=4, workers=workers), 2)
    assert [d for d in blobdata.compare_runs(full_state, other) if "indices served differ" in d]
    assert blobdata.compare_runs(full_state, state) == ["batches served: 24 against 5"]


def test_a_state_of_the_previous_format_loads_with_a_warning(tmp_path: Path) -> None:
    root = _folder(tmp_path / "a")
    full, _ = _take(_loader(root), 1)
    first, state = _take(_loader(root), 1, stop_after=5)
    old = {k: v for k, v in state.items() if k not in ("run", "served", "seed")}
    old["version"] = 1
    resumed = _loader(root)
    with pytest.warns(UserWarning, match="version 1"):
        resumed.load_state_dict(old)
    rest, new_state = _take(resumed, 1)
    assert first + rest == full and new_state["version"] == 3
    assert "no run identity" not in " ".join(blobdata.compare_runs(new_state, new_state))
    assert blobdata.compare_runs(old, new_state)[0].startswith("a state without a run identity")
    with pytest.raises(ConfigError, match="version 1, 2 or 3"):
        resumed.load_state_dict({**state, "version": 4})

"""Lightning, for real (issue 22): ``Trainer.fit``, ``predict``, DDP over 2 processes (gloo, CPU) and a
crash mid-epoch then a resume from the checkpoint, with examples/lightning_datamodule.py's data module
and model. Each run is a process of its own (tests/support/lightning_app.py, which writes down the
samples each rank trained on); the checks are on exactly which samples, in which order.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

from blobdata import ElasticDistributedSampler, FolderDataset, Mixture, MixtureSampler

ROOT = Path(__file__).resolve().parents[1]
N = 200  # 13 batches of 16 on one device, 7 per rank on two
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lightning") / "train"
    for i in range(N):
        d = root / f"c{i % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i}.png").write_bytes(f"{i:016d}".encode())  # the example model reads the first 16 bytes
    return root


def _run(folder: Path, log: Path, *args: str, expect: int = 0, script: str | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = (
        [sys.executable, str(ROOT / script)]
        if script
        else [sys.executable, "-m", "tests.support.lightning_app"]
    )
    cmd += [str(folder)] if script else [str(folder), "--log", str(log)]
    cwd = log if script else ROOT  # where the example's Trainer writes its logs
    cwd.mkdir(parents=True, exist_ok=True)
    # A session of its own: Lightning starts rank 1 and DataLoader workers as children of rank 0, and
    # a run that overstays is stopped whole (a plain timeout kills rank 0 only and orphans the rest).
    proc = subprocess.Popen(
        [*cmd, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"no end within 240 s: {' '.join(args)}\n{out[-3000:]}\n{err[-6000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the run left behind
    assert proc.returncode == expect, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-6000:]}"
    return out + err


def _records(log: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log / f"rank{rank}.jsonl").read_text().splitlines()]


def _fit(log: Path, rank: int, epoch: int) -> list[list[int]]:
    return [r["fit"] for r in _records(log, rank) if "fit" in r and r["epoch"] == epoch]


def _expected(folder: Path, epoch: int, world: int, rank: int, batch: int = 16) -> list[list[int]]:
    """The batches of ids an ElasticDistributedSampler(seed=0) rank reads: DistributedSampler's."""
    ds = FolderDataset(folder, loader=lambda f: f.read())
    ids = [int(Path(p).stem) for p, _ in ds.samples]
    sampler = ElasticDistributedSampler(ds, num_replicas=world, rank=rank, seed=0)
    sampler.set_epoch(epoch)
    order = [ids[i] for i in sampler]
    return [order[k : k + batch] for k in range(0, len(order), batch)]


@pytest.mark.parametrize("loader", ["blobdata", "stateful"])
def test_crash_mid_epoch_then_resume_trains_on_exactly_the_rest(
    folder: Path, tmp_path: Path, loader: str
) -> None:
    """The example's loader (ElasticDistributedSampler), stopped after step 5 of 13 and resumed from
    the checkpoint: the rest of epoch 0 (8 batches; before, 3: Lightning counts from len(), which
    dropped to 8), then a whole epoch 1 (before, 8 of 13). torchdata's StatefulDataLoader over the same
    dataset and sampler runs next to it, as the reference."""
    log, ckpt = tmp_path / "log", tmp_path / "mid.ckpt"
    extra = ["--stateful"] if loader == "stateful" else []
    _run(folder, log, "--fit", "--epochs", "2", "--crash-at", "5", "--ckpt", str(ckpt), *extra, expect=3)
    assert len(_fit(log, 0, 0)) == 5 and ckpt.exists()
    _run(folder, log, "--fit", "--epochs", "2", "--resume", str(ckpt), *extra)
    assert _fit(log, 0, 0) == _expected(folder, 0, 1, 0)  # 5 batches, then the other 8, each sample once
    assert _fit(log, 0, 1) == _expected(folder, 1, 1, 0)  # a whole second epoch
    end = _records(log, 0)[-1]["end"]
    assert end["len"] == 13
    if loader == "blobdata":
        assert end["loader"] == "BlobLoader" and end["samples"] == (N - 5 * 16) + N


def test_ddp_crash_then_resume_each_rank_exact(folder: Path, tmp_path: Path) -> None:
    """2 processes (gloo), the example's loader with 2 workers: stopped after step 3 of 7 and
    resumed, each rank trains on exactly DistributedSampler's share, in its order, in both epochs."""
    log, ckpt = tmp_path / "log", tmp_path / "mid.ckpt"
    common = ["--fit", "--epochs", "2", "--devices", "2", "--workers", "2"]
    _run(folder, log, *common, "--crash-at", "3", "--ckpt", str(ckpt), expect=3)
    _run(folder, log, *common, "--resume", str(ckpt))
    for rank in (0, 1):
        assert _fit(log, rank, 0) == _expected(folder, 0, 2, rank)
        assert _fit(log, rank, 1) == _expected(folder, 1, 2, rank)
        assert _records(log, rank)[-1]["end"]["len"] == 7


def test_ddp_with_lightnings_own_distributed_sampler(folder: Path, tmp_path: Path) -> None:
    """use_distributed_sampler=True (the default) and ds.dataloader(batch_size=16, shuffle=True):
    Lightning rebuilds the loader with its DistributedSampler (before: MisconfigurationException); the
    rebuilt loader is a BlobLoader that still fetches ahead, the ranks split the folder, and
    trainer.predict(dataloaders=ds.dataloader(batch_size=16)) returns every sample once."""
    log = tmp_path / "log"
    _run(folder, log, "--fit", "--devices", "2", "--workers", "2", "--sampler", "lightning", "--predict")
    seen: list[int] = []
    predicted: list[int] = []
    for rank in (0, 1):
        records = _records(log, rank)
        end = next(r["end"] for r in records if "end" in r)
        assert end["loader"] == "BlobLoader" and end["sampler"] == "DistributedSampler" and end["len"] == 7
        assert end["samples"] == N // 2 and end["staged"] > 0  # the look-ahead works in the rebuilt loader
        seen += [i for batch in _fit(log, rank, 0) for i in batch]
        predicted += [i for r in records if "predict" in r for i in r["predict"]]
    assert sorted(seen) == list(range(N)) and seen != sorted(seen)  # shuffled, each sample once
    assert sorted(predicted) == list(range(N))


def test_resume_at_another_batch_size(folder: Path, tmp_path: Path) -> None:
    """Stopped after step 5 of 13 (batches of 16), resumed with batches of 8: the rest of epoch 0 in
    batches of 8, each sample once, then a whole epoch 1 of 25 batches (Lightning takes len() once, for
    every epoch). From the same checkpoint with batches of 32 (a larger global batch), Lightning ends
    the resumed epoch at the 7 batches an epoch has at 32: the run stops with a ConfigError saying so
    (before, batch sizes were refused; with strict=False samples went missing silently)."""
    log, ckpt = tmp_path / "log", tmp_path / "mid.ckpt"
    _run(folder, log, "--fit", "--epochs", "2", "--crash-at", "5", "--ckpt", str(ckpt), expect=3)
    before = [i for batch in _fit(log, 0, 0) for i in batch]
    assert len(before) == 5 * 16
    smaller = tmp_path / "smaller"
    _run(folder, smaller, "--fit", "--epochs", "2", "--resume", str(ckpt), "--batch-size", "8")
    rest = _fit(smaller, 0, 0)
    assert sorted(before + [i for batch in rest for i in batch]) == list(range(N))
    assert [len(b) for b in rest] == [8] * 15
    assert _fit(smaller, 0, 1) == _expected(folder, 1, 1, 0, batch=8)  # 25 batches: the whole epoch
    larger = tmp_path / "larger"
    err = _run(folder, larger, "--fit", "--epochs", "2", "--resume", str(ckpt), "--batch-size", "32",
               expect=1)  # fmt: skip
    assert "ConfigError: the epoch resumed from a loader state saved at batch size 16 x 1 ranks" in err
    assert "with 2 of its batches not read" in err and "no larger than 16" in err
    assert [len(b) for b in _fit(larger, 0, 0)] == [32, 32]  # 7 - 5: Lightning's count


def test_resume_with_lightnings_sampler_on_other_devices_at_the_same_global_batch(
    folder: Path, tmp_path: Path
) -> None:
    """use_distributed_sampler=True (Lightning's DistributedSampler in the rebuilt loader): 2 devices x
    16, stopped after step 3 of 7, resumed on 4 devices x 8, and on 1 device x 32 (strategy="ddp", so
    that Lightning keeps its sampler): the rest of epoch 0 dealt to the ranks there are, each sample
    once, then a whole epoch 1 (before: refused, "resume at another world size needs
    blobdata.ElasticDistributedSampler")."""
    log, ckpt = tmp_path / "log", tmp_path / "mid.ckpt"
    common = ["--fit", "--epochs", "2", "--sampler", "lightning"]
    _run(folder, log, *common, "--devices", "2", "--crash-at", "3", "--ckpt", str(ckpt), expect=3)
    before = [i for rank in (0, 1) for batch in _fit(log, rank, 0) for i in batch]
    assert len(before) == 3 * 16 * 2
    for devices, batch, sizes, whole in ((4, 8, [8, 8, 8, 2], 7), (1, 32, [32, 32, 32, 8], 7)):
        again = tmp_path / f"on{devices}"
        size = ["--devices", str(devices), "--batch-size", str(batch), "--strategy", "ddp"]
        _run(folder, again, *common, *size, "--resume", str(ckpt))
        rest = [_fit(again, rank, 0) for rank in range(devices)]
        assert all([len(b) for b in r] == sizes for r in rest)
        assert sorted(before + [i for r in rest for b in r for i in b]) == list(range(N))
        nxt = [i for rank in range(devices) for b in _fit(again, rank, 1) for i in b]
        assert sorted(nxt) == list(range(N))
        assert all(_records(again, r)[-1]["end"]["len"] == whole for r in range(devices))


def test_predict_on_one_device_with_a_blobdata_loader(folder: Path, tmp_path: Path) -> None:
    """trainer.predict(dataloaders=ds.dataloader(batch_size=16)): before, PlanningBatchSampler got an
    unexpected keyword argument 'batch_size' when Lightning re-made the batch sampler."""
    log = tmp_path / "log"
    _run(folder, log, "--predict")
    ds = FolderDataset(folder, loader=lambda f: f.read())
    order = [int(Path(p).stem) for p, _ in ds.samples]
    batches = [r["predict"] for r in _records(log, 0) if "predict" in r]
    assert batches == [order[k : k + 16] for k in range(0, N, 16)]
    assert _records(log, 0)[-1] == {"predictions": N}


def test_the_example_as_its_readme_runs_it(folder: Path, tmp_path: Path) -> None:
    """examples/lightning_datamodule.py itself: 2 devices, 2 epochs, then predict."""
    out = _run(folder, tmp_path, "--devices", "2", "--epochs", "2", "--batch-size", "16", "--predict",
               script="examples/lightning_datamodule.py")  # fmt: skip
    for rank in (0, 1):
        assert f"rank {rank}: {N} samples" in out  # 2 epochs of 100 per rank
        assert f"rank {rank}: {N // 2} predictions" in out


# -- issue 41: a mixture under Lightning ------------------------------------------------------------


@pytest.fixture(scope="module")
def two_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/a (ids 0..119) and ROOT/b (ids 1000..1079), for the app's --mixture (weights 1 and 3)."""
    root = tmp_path_factory.mktemp("lightning-mix")
    for name, ids in (("a", range(120)), ("b", range(1000, 1080))):
        for i in ids:
            d = root / name / f"c{i % 4}"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i}.png").write_bytes(f"{i:016d}".encode())
    return root


def _mixture_expected(root: Path, epoch: int, world: int, rank: int, batch: int = 16) -> list[list[int]]:
    """The batches of ids rank ``rank`` of ``world`` reads in ``epoch`` under the mixture's sampler."""
    sources = {k: FolderDataset(root / k, loader=lambda f: f.read()) for k in "ab"}
    mix = Mixture(sources, {"a": 1, "b": 3})
    sampler = MixtureSampler(mix, num_replicas=world, rank=rank)
    sampler.set_epoch(epoch)
    ids = [int(Path(sources[s].samples[j][0]).stem) for s, j in map(mix.source_of, sampler)]
    return [ids[k : k + batch] for k in range(0, len(ids), batch)]


@pytest.mark.parametrize(("devices", "workers", "crash"), [(1, 0, 5), (2, 2, 3)])
def test_a_mixture_crashed_mid_epoch_resumes_exactly_under_lightning(
    two_folders: Path, tmp_path: Path, devices: int, workers: int, crash: int
) -> None:
    """mix.dataloader() under Trainer.fit (its MixtureSampler is a DistributedSampler: Lightning keeps
    it under DDP): stopped after a few steps and resumed from the checkpoint, each rank trains on
    exactly its part of the planned epoch 0, then of epoch 1 (Lightning's set_epoch)."""
    log, ckpt = tmp_path / "log", tmp_path / "mid.ckpt"
    common = ["--fit", "--epochs", "2", "--mixture", "--devices", str(devices), "--workers", str(workers)]
    _run(two_folders, log, *common, "--crash-at", str(crash), "--ckpt", str(ckpt), expect=3)
    assert len(_fit(log, 0, 0)) == crash
    _run(two_folders, log, *common, "--resume", str(ckpt))
    for rank in range(devices):
        for epoch in (0, 1):
            assert _fit(log, rank, epoch) == _mixture_expected(two_folders, epoch, devices, rank)
        assert _records(log, rank)[-1]["end"]["loader"] == "BlobLoader"
        assert _records(log, rank)[-1]["end"]["sampler"] == "MixtureSampler"

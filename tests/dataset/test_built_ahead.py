"""A persistent worker builds its first batch of the next epoch while idle at an epoch's end (issue
33: no stall between epochs). The batches are exactly those made on demand: with blobdata's keyed
transforms, with transforms that draw from torch's, numpy's and ``random``'s global generators, when
the next epoch's order was guessed wrong, and when a sample of the built batch fails."""

from __future__ import annotations

import functools
import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

from blobdata import FolderDataset
from blobdata._fetch import PlanChannel
from blobdata.transforms import RandomResizedCrop
from tests.support.announce import wait_announced

N = 40


def _sum_loader(f: Any) -> int:
    return int(np.frombuffer(f.read(), np.uint8).sum())


def _global_draws(x: int) -> tuple[int, int, float, int]:
    """A transform as users write them: draws from every global generator a worker seeds."""
    return x, int(torch.randint(0, 1 << 30, (1,))), random.random(), int(np.random.randint(0, 1 << 30))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for i in range(N):
        d = tmp_path / f"c{i % 2}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.png").write_bytes(bytes([i % 251 + 1]) * (i + 3))
    return tmp_path


@pytest.fixture
def jpegs(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    for i in range(24):
        d = tmp_path / f"c{i % 3}"
        d.mkdir(exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (48 + i, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
        (d / f"{i:03d}.jpg").write_bytes(buf.getvalue())
    return tmp_path


def _epochs(loader: Any, epochs: list[int] | int, sampler: Any = None) -> tuple[list[Any], list[int]]:
    """Every batch of each epoch (as nested lists), and the batches built ahead in each. Where the next
    epoch is announced (across epochs), each epoch's first batch waits for that: a loaded machine could
    delay it past a short epoch's end, and then nothing is built ahead."""
    out, built, before = [], [], 0
    for epoch in epochs if isinstance(epochs, list) else range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        batches = []
        for k, batch in enumerate(loader):
            if k == 0 and loader._planner.across_epochs:
                wait_announced(loader)
            batches.append(_plain(batch))
        out.append(batches)
        now = loader.stats().batches_built_ahead
        built.append(now - before)
        before = now
    return out, built


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _loader(ds: FolderDataset, across: bool, **kw: Any) -> Any:
    torch.manual_seed(11)  # the workers' base seed, drawn from torch's global generator
    loader = ds.dataloader(batch_size=4, num_workers=2, persistent_workers=True, **kw)
    loader._planner.across_epochs = across
    return loader


@pytest.mark.timeout(180)
def test_keyed_crops_built_ahead_equal_those_made_on_demand(jpegs: Path) -> None:
    def run(across: bool) -> tuple[list[Any], list[int]]:
        ds = FolderDataset(jpegs, transform=RandomResizedCrop(16), lookahead=16)
        gen = torch.Generator().manual_seed(3)
        return _epochs(_loader(ds, across, shuffle=True, generator=gen), 3)

    built_run, built = run(True)
    on_demand, none = run(False)
    # Each worker's first batch of epochs 2 and 3 was built while it waited, and is the same pixels.
    assert built == [0, 2, 2] and none == [0, 0, 0]
    assert built_run == on_demand and built_run[1] != built_run[2]


@pytest.mark.timeout(180)
def test_global_generators_draw_as_if_nothing_was_built_ahead(folder: Path) -> None:
    def run(across: bool) -> tuple[list[Any], list[int]]:
        ds = FolderDataset(folder, loader=_sum_loader, transform=_global_draws, lookahead=16)
        return _epochs(_loader(ds, across, shuffle=True, generator=torch.Generator().manual_seed(5)), 3)

    built_run, built = run(True)
    on_demand, _ = run(False)
    assert built == [0, 2, 2]
    assert built_run == on_demand


@pytest.mark.timeout(180)
def test_a_wrong_guess_drops_the_built_batch_and_its_draws(folder: Path) -> None:
    """Epochs 0, 1, 5, 6: the next epoch is guessed 1 (right), 2 and 9 (wrong). A dropped batch's draws
    from the global generators are put back, so every epoch equals the run that built nothing."""

    def run(across: bool) -> tuple[list[Any], list[int]]:
        ds = FolderDataset(folder, loader=_sum_loader, transform=_global_draws, lookahead=16)
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
        return _epochs(_loader(ds, across, sampler=sampler), [0, 1, 5, 6], sampler)

    built_run, built = run(True)
    on_demand, _ = run(False)
    assert built == [0, 2, 0, 0]
    assert built_run == on_demand


@pytest.mark.timeout(180)
def test_a_bad_sample_in_a_built_batch_is_reported_when_served(folder: Path) -> None:
    (folder / "c0" / "00-bad.png").write_bytes(b"x")  # sorts first: sample 0, in worker 0's first batch

    def strict_loader(f: Any) -> int:
        data = f.read()
        if data == b"x":
            raise ValueError("not a sample")
        return int(np.frombuffer(data, np.uint8).sum())

    ds = FolderDataset(folder, loader=strict_loader, on_error="skip", lookahead=16)
    bad_url = ds._manifest.url(0)
    assert bad_url.endswith("/c0/00-bad.png")
    out, built = _epochs(_loader(ds, True), 3)  # in order: every epoch the same batches
    # Built ahead, worker 0's first batch was dropped at the bad sample and made again when asked
    # for (the sample skipped and reported once per epoch); worker 1's was used.
    assert built == [0, 1, 1]
    assert [len(batch[1]) for batch in out[1][:2]] == [3, 4]
    assert [url for url, _ in ds.errors] == [bad_url] * 3
    assert out[0] == out[1] == out[2]


def test_the_next_epochs_seed_travels_with_its_order() -> None:
    channel = PlanChannel()
    plan = channel.publish([[3, 1], [2]])
    worker = PlanChannel(channel.path)
    seen = worker.current()
    assert seen is not None
    channel.publish_next(plan.seq, [[0], [1, 2]], (1 << 64) - 5)  # a uint64 seed, past int64's range
    upcoming = worker.next_of(seen)
    assert upcoming is not None and upcoming.seed == (1 << 64) - 5 and upcoming.batch(1).tolist() == [1, 2]
    channel.publish_next(plan.seq, [[0]])
    fresh = PlanChannel(channel.path).current()
    assert fresh is not None
    again = PlanChannel(channel.path).next_of(fresh)
    assert again is not None and again.seed is None


def _staged_per_epoch(loader: Any, epochs: int, wait_hand_over: bool = True) -> tuple[list[Any], list[int]]:
    """Every epoch's batches and the samples of each served from what was fetched before it was asked
    for; before each epoch, the training process's fetches for its workers are waited for (they run
    on its loop while the epoch before ends)."""
    out, staged, before = [], [], 0
    for _ in range(epochs):
        proc = loader.dataset._proc
        if wait_hand_over and proc is not None and proc.handing is not None:
            proc.handing.result(timeout=60)
        out.append([_plain(batch) for batch in loader])
        now = loader.stats().samples_staged
        staged.append(now - before)
        before = now
    return out, staged


@pytest.mark.timeout(180)
def test_new_workers_find_their_first_batches_fetched_for_them(folder: Path) -> None:
    """``persistent_workers=False``: from the second epoch on, the training process fetches the next
    epoch's first two batches of each worker near the epoch's end; the forked workers stage them."""

    def run(hand_over: bool) -> tuple[list[Any], list[int]]:
        ds = FolderDataset(folder, loader=_sum_loader, lookahead=16)
        loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2, multiprocessing_context="fork",
                               generator=torch.Generator().manual_seed(9))  # fmt: skip
        if not hand_over:
            loader._planner.hand_over = None
        return _staged_per_epoch(loader, 4)

    handed, staged = run(True)
    fetched_by_workers, alone = run(False)
    plain = torch.utils.data.DataLoader(
        FolderDataset(folder, loader=_sum_loader), batch_size=4, shuffle=True, num_workers=2,
        generator=torch.Generator().manual_seed(9),
    )  # fmt: skip
    assert handed == fetched_by_workers == [[_plain(b) for b in plain] for _ in range(1)] + handed[1:]
    assert handed[1:] == [[_plain(b) for b in plain] for _ in range(3)]
    # Each new worker's first batch waited for its fetches (4 samples each), except where they were
    # handed over: epochs 3 and 4 (the first pass hands nothing over, for an epoch that may not come).
    assert alone == [N - 8] * 4
    assert staged == [N - 8, N - 8, N, N]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mixture"])
def test_a_new_worker_reads_its_hand_over_in_its_own_thread_and_nothing_twice(
    s3_bucket: Any, s3_proxy: Any, mixed: bool
) -> None:
    """The hand-over is read by the thread serving a new worker's first batches, as the cache's hits
    are (a first batch then waits for neither the worker's loop to start nor its look-ahead's first
    requests); and the worker's look-ahead, which skips it, fetches none of it again. A mixture's
    workers take theirs alike."""
    from blobdata import Mixture
    from blobdata._metrics import stats as _stats

    s3_bucket.put_many({f"h/c{i % 2}/{i:03d}.png": bytes([i + 1]) * 9 for i in range(N)})
    ds = FolderDataset(s3_bucket.url("h"), storage_options=s3_proxy.storage_options, loader=_sum_loader,
                       lookahead=16)  # fmt: skip
    if mixed:
        mix = Mixture({"h": ds}, {"h": 1.0}, samples_per_epoch=N, seed=3)
        loader = mix.dataloader(batch_size=4, num_workers=2, multiprocessing_context="fork")
    else:
        loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2, multiprocessing_context="fork",
                               generator=torch.Generator().manual_seed(3))  # fmt: skip
    listed = len(s3_proxy.requests)
    out, staged = _staged_per_epoch(loader, 2)
    loader._planner.hand_over = None  # the last epoch: nothing fetched for a fourth, which never comes
    third, total = _staged_per_epoch(loader, 1)
    out, staged = out + third, [*staged, total[0] - sum(staged)]
    gets = [target for method, target in s3_proxy.requests[listed:] if method == "GET" and "/h/c" in target]
    main, parts = loader._records.by_source()
    assert _stats.combined(main, parts)[_stats.B_STAGED] == 16  # taken by the workers' serving threads
    # Each sample's objects once per epoch: the third epoch's first batches (2 per worker: 16 samples)
    # were read in the training process near the second's end, and by no worker again.
    assert len(gets) == 3 * N
    if mixed:  # its own order (drawn with replacement): the rest is the dataset's
        return
    plain = torch.utils.data.DataLoader(
        FolderDataset(s3_bucket.url("h"), storage_options=s3_proxy.storage_options, loader=_sum_loader),
        batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    assert out == [[_plain(b) for b in plain] for _ in range(3)]
    assert len(set(gets)) == N and staged == [N - 8, N - 8, N]


@pytest.mark.slow  # spawned workers import torch afresh: half a minute on 2 cores
@pytest.mark.timeout(180)
def test_nothing_is_handed_over_to_spawned_workers_or_with_a_cache(
    folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from blobdata import BlobCache

    for method in ("forkserver", "fork"):
        cache = BlobCache(tmp_path_factory.mktemp("cache")) if method == "fork" else None
        kw = {"multiprocessing_context": method}
        ds = FolderDataset(folder, loader=_sum_loader, cache=cache, lookahead=16)
        loader = ds.dataloader(batch_size=4, shuffle=True, num_workers=2, persistent_workers=False,
                               generator=torch.Generator().manual_seed(9), **kw)  # fmt: skip
        _staged_per_epoch(loader, 3)
        proc = ds._proc
        assert proc is None or proc.handing is None, kw  # no fetch in the training process
        assert loader._planner.epochs_predicted == 2  # the order was still predicted and taken


def test_a_prediction_draws_the_base_seed_a_new_iterator_draws_first() -> None:
    from torch.utils.data import BatchSampler, RandomSampler

    from blobdata._sampling import NextEpoch

    gen = torch.Generator().manual_seed(4)
    batches = BatchSampler(RandomSampler(range(30), generator=gen), 4, False)
    list(batches)  # epoch 1
    guess = NextEpoch(seed_drawn_from=gen).batches(batches)
    persistent_guess = NextEpoch().batches(batches)
    torch.empty((), dtype=torch.int64).random_(generator=gen)  # what DataLoader's new iterator draws
    assert guess == list(batches) != persistent_guess


@pytest.mark.timeout(120)
def test_a_batch_not_used_gives_up_its_fetches(s3_bucket: Any, s3_server: Any) -> None:
    """A worker given another batch than the one it built waits for the building thread: that must
    not mean waiting for its requests, which are cancelled (the proxy answers only after a minute)."""
    from blobdata._dataset.ahead import BuiltAhead
    from tests.conftest import S3Proxy

    s3_bucket.put_many({f"d/c{i % 2}/{i:03d}.png": bytes([i + 1]) * 9 for i in range(8)})
    with S3Proxy(s3_server) as proxy:
        ds = FolderDataset(s3_bucket.url("d"), storage_options=proxy.storage_options, loader=_sum_loader)
        proxy.delay_s = 60.0  # listed already; no answer now before the test's timeout
        built = BuiltAhead([0, 1, 2, 3], 7, functools.partial(ds._build_ahead, [0, 1, 2, 3], 7))
        assert built.take([4, 5, 6, 7], 7) is None  # another batch: returns once the thread gave up
        proxy.delay_s = 0.0


@pytest.mark.timeout(120)
def test_no_fork_while_the_training_process_still_fetches_or_predicts(s3_bucket: Any, s3_server: Any) -> None:
    """Before a new epoch forks its workers (``persistent_workers=False``), the training process's
    hand-over fetches are done or cancelled and the next epoch's prediction is computed: a child
    forked while another thread is inside torch or the runtime can inherit a lock held by it."""
    import threading

    from blobdata._fetch import Predicted
    from tests.conftest import S3Proxy

    s3_bucket.put_many({f"d/c{i % 2}/{i:03d}.png": bytes([i + 1]) * 9 for i in range(8)})
    with S3Proxy(s3_server) as proxy:
        ds = FolderDataset(s3_bucket.url("d"), storage_options=proxy.storage_options, loader=_sum_loader)
        loader = ds.dataloader(batch_size=4, num_workers=2)
        proxy.delay_s = 60.0  # listed already: the hand-over's requests will not be answered
        ds._hand_over([0, 1, 2, 3])
        release = threading.Event()
        predicted = Predicted(lambda: (release.wait(), (np.arange(8), np.array([0, 4, 8])))[1])
        threading.Thread(target=predicted.compute).start()
        loader._planner._predicted = predicted
        threading.Timer(0.5, release.set).start()  # the prediction ends half a second later
        loader._before_workers_start()
        handing = ds._proc.handing if ds._proc is not None else None
        assert handing is not None and handing.done()  # cancelled after its wait: not in flight
        assert predicted.done.is_set()
        proxy.delay_s = 0.0

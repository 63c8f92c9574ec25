"""Resume under torchrun (gloo, CPU) at another per-rank batch size and at another world size with the
loader made the default way under DDP (a plain ``DistributedSampler``): stopped mid-epoch, resumed, each
sample of the interrupted epoch read once, the next epoch a permutation, and every sample's pixels those
of an uninterrupted run (keyed transforms: blobdata's ``RandomResizedCrop`` and ``sample_rng()``).
The loop is tests/support/resume_app.py; the reference pixels are made in this process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobdata.testing import find_free_port, synthetic_jpeg
from tests.support import resume_app

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
N = 96  # a multiple of every world size here: no DistributedSampler padding
RUN_TIMEOUT = 150.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resume") / "train"
    rng = np.random.default_rng(43)
    for i in range(N):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(synthetic_jpeg(rng, min_side=20, max_side=36))
    return root


@pytest.fixture(scope="module")
def reference(folder: Path) -> dict[int, dict[int, str]]:
    """epoch -> sample id -> pixel digest, from one uninterrupted process (the augmentation is keyed by
    the loader seed, the epoch and the sample's URL: not by ranks, batch size or workers)."""
    loader = resume_app.make_loader(str(folder), sampler="shuffle", batch_size=N, workers=0)
    out: dict[int, dict[int, str]] = {}
    for epoch in range(2):
        for (pixels, ids), _ in loader:
            out[epoch] = {int(i): resume_app.digest(x) for i, x in zip(ids, pixels, strict=True)}
    assert sum(out[0][i] != out[1][i] for i in range(N)) > N * 0.9  # each epoch draws afresh
    return out


def _run(folder: Path, log: Path, state: Path, *, nproc: int, batch: int, **opts: Any) -> None:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in opts.items()]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={find_free_port()}",
        str(ROOT / "tests/support/resume_app.py"),
        str(folder), "--ids-log", str(log), "--state", str(state), "--batch-size", str(batch), *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {RUN_TIMEOUT}s:\n{out.decode()[-3000:]}")
    assert proc.returncode == 0, out.decode()[-3000:]


def _records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(log.glob("rank*.jsonl")) for line in f.read_text().splitlines()]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("sampler", "before", "after", "stop_after", "workers"),
    [
        ("shuffle", (1, 32), (1, 16), 1, 2),  # batch 32 -> 16
        ("shuffle", (1, 16), (1, 32), 3, 0),  # batch 16 -> 32
        ("distributed", (2, 16), (4, 8), 1, 0),  # the same global batch on more ranks
        ("distributed", (2, 8), (1, 8), 2, 1),  # the default DistributedSampler loader, 2 -> 1
        ("distributed", (2, 8), (4, 8), 2, 0),  # and 2 -> 4
    ],
    ids=["batch-32-16", "batch-16-32", "2x16-4x8", "distributed-2-1", "distributed-2-4"],
)
def test_resume_at_another_batch_size_or_world_size_is_exact(
    folder: Path,
    reference: dict[int, dict[int, str]],
    tmp_path: Path,
    sampler: str,
    before: tuple[int, int],
    after: tuple[int, int],
    stop_after: int,
    workers: int,
) -> None:
    state, first, second = tmp_path / "state.json", tmp_path / "first", tmp_path / "second"
    _run(folder, first, state, nproc=before[0], batch=before[1], sampler=sampler, workers=workers,
         stop_after=stop_after)  # fmt: skip
    assert json.loads(state.read_text())["complete"] is False
    _run(folder, second, state, nproc=after[0], batch=after[1], sampler=sampler, workers=workers)
    done, rest = _records(first), _records(second)
    assert len(done) == before[0] * stop_after and {r["epoch"] for r in done} == {0}
    read = [i for r in done for i in r["ids"]]
    assert len(read) == stop_after * before[0] * before[1]
    epoch0 = read + [i for r in rest if r["epoch"] == 0 for i in r["ids"]]
    epoch1 = [i for r in rest if r["epoch"] == 1 for i in r["ids"]]
    assert sorted(epoch0) == list(range(N))  # the interrupted epoch: each sample once
    assert sorted(epoch1) == list(range(N))  # the next one: a permutation
    assert {len(r["ids"]) for r in rest if r["epoch"] == 1} == {after[1]}  # at the new batch size
    for r in done + rest:  # every sample's pixels: the uninterrupted run's
        assert r["px"] == [reference[r["epoch"]][i] for i in r["ids"]], r

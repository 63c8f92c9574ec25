"""Many ranks, one job, against the S3 server: real torchrun process groups (gloo, CPU) running
examples/train_ddp.py in its smoke mode, killed with SIGKILL and resumed, at 1, 2 and 4 ranks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from blobdata import FolderDataset
from blobdata.testing import find_free_port
from tests.conftest import S3Proxy
from tests.support.buckets import TestBucket

pytestmark = [pytest.mark.slow, pytest.mark.network]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
N = 48  # samples; batch 4
RUN_TIMEOUT = 150.0


def _fill(bucket: TestBucket) -> str:
    bucket.put_many({f"train/c{i % 3}/{i:03d}.png": os.urandom(200 + i) for i in range(N)})
    return bucket.url("train")


def _env(proxy: S3Proxy) -> dict[str, str]:
    opts = proxy.storage_options
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),  # the children import this checkout's blobdata
        "AWS_ENDPOINT_URL_S3": opts["endpoint_url"],
        "AWS_ACCESS_KEY_ID": opts["key"],
        "AWS_SECRET_ACCESS_KEY": opts["secret"],
        "AWS_REGION": opts["client_kwargs"]["region_name"],
        "OMP_NUM_THREADS": "1",
    }


def _torchrun(
    url: str, env: dict[str, str], *args: str, nproc: int, nnodes: int = 1, node: int = 0, port: int = 0
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}",
        f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port or find_free_port()}",
        str(EXAMPLE), url, "--smoke", *args,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _finish(proc: subprocess.Popen[bytes]) -> None:
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {RUN_TIMEOUT}s:\n{out.decode()[-3000:]}")
    assert proc.returncode == 0, out.decode()[-3000:]


def _logs(d: Path) -> dict[int, tuple[list[dict[str, Any]], list[tuple[int, list[int]]]]]:
    """rank -> (header lines, [(epoch, ids)] per batch)."""
    out: dict[int, tuple[list[dict[str, Any]], list[tuple[int, list[int]]]]] = {}
    for f in sorted(d.glob("rank*.jsonl")):
        lines = [json.loads(x) for x in f.read_text().splitlines()]
        heads = [x for x in lines if "table" in x]
        out[int(f.stem[4:])] = (heads, [(x["epoch"], x["ids"]) for x in lines if "ids" in x])
    return out


def _run_until_killed(
    url: str, env: dict[str, str], ckpt: Path, log: Path, steps: int, *args: str, nproc: int
) -> dict[str, Any]:
    """Run, SIGKILL the training processes and torchrun once the checkpoint is at ``steps`` steps."""
    args = (*args, "--ids-log", str(log), "--checkpoint", str(ckpt), "--step-delay", "0.3")
    proc = _torchrun(url, env, *args, nproc=nproc)
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while time.monotonic() < deadline:
            try:
                state = json.loads((ckpt / "loader.json").read_text())["loader"]
            except (OSError, ValueError):
                state = None
            if state is not None and _steps(state, nproc) >= steps:
                # The training processes first (torchrun starts them in sessions of their own).
                for heads, _ in _logs(log).values():
                    for head in heads:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(head["pid"], signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return dict(json.loads((ckpt / "loader.json").read_text())["loader"])
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            time.sleep(0.05)
        pytest.fail("the run never reached the checkpoint to kill it at")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _steps(state: dict[str, Any], world: int) -> int:
    per_epoch = N // (4 * world)
    return (state["epoch"] + int(state["complete"])) * per_epoch + state["batches"]


@pytest.mark.timeout(300)
def test_smoke_example_runs_on_the_test_kits_synthetic_dataset(
    s3_bucket: TestBucket, s3_proxy: S3Proxy, tmp_path: Path
) -> None:
    """blobdata.testing.synthetic_dataset's keys (train/n00000001/n00000001_125.JPEG): before, --smoke
    failed with DecodeError "invalid literal for int() 'n00000001_125'"."""
    from blobdata.testing import synthetic_dataset

    s3_bucket.put_many(dict(synthetic_dataset(24, num_classes=3, prefix="kit")))
    log = tmp_path / "log"
    _finish(_torchrun(s3_bucket.url("kit"), _env(s3_proxy), "--epochs", "1", "--workers", "1",
                      "--ids-log", str(log), nproc=2))  # fmt: skip
    shares = [sorted(i for _, ids in batches for i in ids) for _, batches in _logs(log).values()]
    assert len(shares) == 2 and sorted(shares[0] + shares[1]) == list(range(24))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [2, 4])
def test_one_listing_per_job_identical_tables_disjoint_shares(
    s3_bucket: TestBucket, s3_proxy: S3Proxy, tmp_path: Path, nproc: int
) -> None:
    url = _fill(s3_bucket)
    _finish(_torchrun(url, _env(s3_proxy), "--epochs", "1", "--ids-log", str(tmp_path / "log"), nproc=nproc))
    reqs = s3_proxy.requests
    job_lists = [t for m, t in reqs if m == "GET" and "list-type=2" in t]
    job_gets = [t for m, t in reqs if m == "GET" and "list-type=2" not in t]
    logs = _logs(tmp_path / "log")
    assert sorted(logs) == list(range(nproc))
    assert len({h["table"] for heads, _ in logs.values() for h in heads}) == 1
    shares = [sorted(i for _, ids in batches for i in ids) for _, batches in logs.values()]
    assert all(not set(a) & set(b) for k, a in enumerate(shares) for b in shares[k + 1 :])
    assert sorted(i for s in shares for i in s) == list(range(N))
    assert len(job_gets) == N  # each object fetched once, by the one rank that reads it
    s3_proxy.reset_counts()
    FolderDataset(url, storage_options=s3_proxy.storage_options, refresh=True, share_listing=False)
    one_listing = [t for m, t in s3_proxy.requests if "list-type=2" in t]
    assert len(job_lists) == len(one_listing) > 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("sampler", "nproc"), [("shuffle", 1), ("distributed", 2)])
def test_sigkill_then_resume_gives_the_uninterrupted_batches(
    s3_bucket: TestBucket, s3_proxy: S3Proxy, tmp_path: Path, sampler: str, nproc: int, workers: int
) -> None:
    url, env = _fill(s3_bucket), _env(s3_proxy)
    common = ["--epochs", "2", "--sampler", sampler, "--workers", str(workers)]
    # The uninterrupted run goes on while the other is run and killed (its steps mostly sleep): the
    # two are independent, and each torchrun costs seconds of start-up on the suite's 2 cores.
    whole = _torchrun(url, env, *common, "--ids-log", str(tmp_path / "full"), nproc=nproc)
    ckpt, log = tmp_path / "ckpt", tmp_path / "run"
    per_epoch = N // (4 * nproc)
    try:
        state = _run_until_killed(url, env, ckpt, log, per_epoch + 2, *common, nproc=nproc)
    except BaseException:
        os.killpg(whole.pid, signal.SIGKILL)
        whole.communicate()
        raise
    _finish(whole)
    done = _steps(state, nproc)
    assert per_epoch < done < 2 * per_epoch and not state["complete"]  # killed mid-epoch
    before = {r: batches[:done] for r, (_, batches) in _logs(log).items()}
    for f in log.glob("*.jsonl"):
        f.unlink()
    s3_proxy.reset_counts()
    _finish(_torchrun(url, env, *common, "--ids-log", str(log), "--checkpoint", str(ckpt), nproc=nproc))
    after = {r: batches for r, (_, batches) in _logs(log).items()}
    # The look-ahead started at the resumed batch: nothing already trained on was fetched again.
    gets = [t for m, t in s3_proxy.requests if m == "GET" and "list-type=2" not in t]
    assert len(gets) == sum(len(ids) for batches in after.values() for _, ids in batches)
    full = {r: batches for r, (_, batches) in _logs(tmp_path / "full").items()}
    assert len(full[0]) == 2 * per_epoch
    for r in range(nproc):
        assert before[r] + after[r] == full[r]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4)])
def test_elastic_resume_at_another_world_size(
    s3_bucket: TestBucket, s3_proxy: S3Proxy, tmp_path: Path, before: int, after: int
) -> None:
    url, env = _fill(s3_bucket), _env(s3_proxy)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    state = _run_until_killed(url, env, ckpt, log, 2, "--epochs", "1", nproc=before)
    done = _steps(state, before)
    assert 0 < done < N // (4 * before)
    seen = [i for _, (_, batches) in _logs(log).items() for _, ids in batches[:done] for i in ids]
    assert state["world_size"] == before and len(seen) == done * 4 * before
    for f in log.glob("*.jsonl"):
        f.unlink()
    _finish(
        _torchrun(url, env, "--epochs", "1", "--ids-log", str(log), "--checkpoint", str(ckpt), nproc=after)
    )
    rest = [i for _, (_, batches) in _logs(log).items() for _, ids in batches for i in ids]
    assert sorted(seen + rest) == list(range(N))  # every sample of the epoch once, across the two runs


@pytest.mark.timeout(300)
def test_two_nodes_two_caches(s3_bucket: TestBucket, s3_proxy: S3Proxy, tmp_path: Path) -> None:
    """Two torchrun "nodes" of 2 ranks on 127.0.0.1, each with its own cache directory; the dataset is
    made before the process group exists, so rank 0 hands the listing over the shared-file path."""
    url, env = _fill(s3_bucket), _env(s3_proxy)
    env["BLOBDATA_SHARED_DIR"] = str(tmp_path / "shared")
    port = find_free_port()
    procs = [
        _torchrun(
            url,
            env,
            "--epochs",
            "1",
            "--list-before-init",
            "--ids-log",
            str(tmp_path / "log"),
            "--cache-dir",
            str(tmp_path / f"cache{node}"),
            nproc=2,
            nnodes=2,
            node=node,
            port=port,
        )
        for node in range(2)
    ]
    for proc in procs:
        _finish(proc)
    logs = _logs(tmp_path / "log")
    assert sorted(logs) == [0, 1, 2, 3]
    assert len({h["table"] for heads, _ in logs.values() for h in heads}) == 1
    ids = sorted(i for _, batches in logs.values() for _, b in batches for i in b)
    assert ids == list(range(N))
    assert len([t for m, t in s3_proxy.requests if m == "GET" and "list-type=2" not in t]) == N
    from blobdata import BlobCache

    for node in range(2):  # each node's cache holds its two ranks' share, fetched once
        with BlobCache(str(tmp_path / f"cache{node}")) as cache:
            assert cache.info()["entries"] == N // 2


@pytest.mark.timeout(120)
def test_warm_fills_exactly_the_nodes_share_of_the_epoch(
    s3_bucket: TestBucket, s3_proxy: S3Proxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.utils.data.distributed import DistributedSampler

    from blobdata import BlobCache
    from blobdata._cli import main

    url = _fill(s3_bucket)
    opts = s3_proxy.storage_options
    o = [f"endpoint_url={opts['endpoint_url']}", f"key={opts['key']}", f"secret={opts['secret']}"]
    o.append(f"client_kwargs.region_name={opts['client_kwargs']['region_name']}")
    flags = [x for kv in o for x in ("-o", kv)]
    cache = tmp_path / "cache1"
    argv = ["warm", url, "--cache-dir", str(cache), "--nnodes", "2", "--node-rank", "1"]
    argv += ["--sampler", "distributed", "--nproc-per-node", "2", "--epoch", "3", "--seed", "7"]
    assert main([*argv, "--no-progress", *flags]) == 0
    ds = FolderDataset(url, storage_options=opts, share_listing=False)
    want: set[int] = set()
    for rank in (2, 3):  # node 1's ranks under torchrun
        sampler = DistributedSampler(ds, num_replicas=4, rank=rank, seed=7)
        sampler.set_epoch(3)
        want |= set(sampler)
    m = ds.manifest
    with BlobCache(str(cache)) as c:
        cached = {i for i in range(len(m)) if (m.url(i), m.identity(i)) in c}
    assert cached == want and len(want) == N // 2
    assert "24 objects" in capsys.readouterr().out


def test_lightning_example_imports() -> None:
    pytest.importorskip("lightning", reason="lightning is not installed here (pip install lightning)")
    import runpy

    runpy.run_path(str(ROOT / "examples" / "lightning_datamodule.py"), run_name="not_main")


@pytest.mark.timeout(300)
def test_local_ranks_share_one_cache(s3_bucket: TestBucket, s3_proxy: S3Proxy, tmp_path: Path) -> None:
    """Two ranks, one cache directory, two epochs: every object is fetched once for the node; in the
    second epoch a rank reads from the cache what the other rank fetched in the first (the steps take
    0.1 s, longer than the cache writer lingers before it commits, 0.2 s, over the look-ahead's lead)."""
    url = _fill(s3_bucket)
    args = ["--epochs", "2", "--workers", "2", "--cache-dir", str(tmp_path / "cache"), "--step-delay", "0.1"]
    _finish(_torchrun(url, _env(s3_proxy), *args, "--ids-log", str(tmp_path / "log"), nproc=2))
    gets = [t for m, t in s3_proxy.requests if m == "GET" and "list-type=2" not in t]
    epoch1 = {
        i for _, (_, batches) in _logs(tmp_path / "log").items() for e, ids in batches if e == 1 for i in ids
    }
    assert len(epoch1) == N
    assert len(gets) == N  # not 2N: the second epoch came from the node's cache


def _list_missing(rank: int, port: int, root: str, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        FolderDataset(root)
        out.put((rank, "no error"))
    except Exception as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_rank_0s_listing_error_reaches_the_other_ranks(tmp_path: Path) -> None:
    """Under a process group, a listing that fails on rank 0 fails on every rank, naming the URL."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    root = str(tmp_path / "missing")
    port = find_free_port()
    procs = [ctx.Process(target=_list_missing, args=(r, port, root, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert "missing" in got[0] and got[0] != "no error"
    assert got[1].startswith("ManifestError: rank 0 could not list") and "missing" in got[1]

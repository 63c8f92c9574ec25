"""A listing split across the job (blobdata._listing.job.split): 2 ranks under torchrun (gloo, CPU) list
disjoint parts of one synthetic bucket, each page is asked once in the whole job, and both ranks end
with the very manifest one process lists alone; through the process group and through the shared
directory, for class folders and for a flat folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from blobdata._listing import list_flat, list_folder
from blobdata.testing import SyntheticListServer, find_free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "split_rank.py"
RUN_TIMEOUT = 240.0


def _torchrun(tmp_path: Path, server: SyntheticListServer, mode: str, *extra: str) -> list[dict[str, Any]]:
    out = tmp_path / mode
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "BLOBDATA_CONCURRENCY": "8",
        "BLOBDATA_SHARED_DIR": str(tmp_path / "shared"),
        "BLOBDATA_CACHE_HOME": str(tmp_path / "cache"),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={find_free_port()}",
        str(SCRIPT),
        mode,
        server.url,
        server.endpoint_url,
        str(out),
        *extra,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, timeout=RUN_TIMEOUT)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()[-4000:]
    return [
        json.loads((out / f"rank{r}.json").read_text()) | {"manifest": np.load(out / f"manifest{r}.npz")}
        for r in range(2)
    ]


def _ranges_are_disjoint(ranks: list[dict[str, Any]]) -> None:
    """Every (folder, after, upto] range was listed by one rank only, and both ranks listed keys."""
    seen: dict[tuple[int, Any], int] = {}
    listed = []
    for rank, got in enumerate(ranks):
        keys = 0
        for folder, ranges in got["parts"]:
            for after, _upto, _first, _stop, _sound, count in ranges:
                assert (folder, after) not in seen, f"range after {after!r} of folder {folder} listed twice"
                seen[folder, after] = rank
                keys += count
        listed.append(keys)
    assert min(listed) > 0.2 * sum(listed), listed  # both ranks did a good share of the work


@pytest.mark.parametrize("mode", ["group", "files"])
def test_two_ranks_list_disjoint_parts_and_end_with_one_process_manifest(tmp_path: Path, mode: str) -> None:
    # Each request waits 80 ms, as a far store does: no rank can list it all before the other starts.
    with SyntheticListServer(count=60_000, classes=2, delay_s=0.08) as server:
        alone = list_folder(server.url, storage_options=server.storage_options, concurrency=8)
        before = server.requests
        ranks = _torchrun(tmp_path, server, mode)
        asked = server.requests - before
    requests = [tuple(r) for got in ranks for r in got["requests"]]
    assert len(requests) == asked  # every request the server saw came from one rank's count
    assert len(set(requests)) == len(requests)  # no page asked twice in the job
    assert all(got["requests"] for got in ranks)  # both ranks asked the store
    _ranges_are_disjoint(ranks)
    for got in ranks:  # rank 0's manifest, and the one rank 1 received: the one-process listing
        m = got["manifest"]
        assert list(m["classes"]) == alone.classes
        for name, array in alone._arrays().items():
            assert np.array_equal(m[name], array), name


def test_a_flat_folder_split_across_two_ranks(tmp_path: Path) -> None:
    with SyntheticListServer(count=20_000, classes=1, delay_s=0.04) as server:
        alone = list_flat(server.url + "/c0000", storage_options=server.storage_options)
        url = server.url + "/c0000"
        before = server.requests
        ranks = _torchrun(tmp_path, _Url(server, url), "group", "flat")
        asked = server.requests - before
    requests = [tuple(r) for got in ranks for r in got["requests"]]
    assert len(requests) == asked and len(set(requests)) == len(requests)
    _ranges_are_disjoint(ranks)
    for got in ranks:
        for name, array in alone._arrays().items():
            assert np.array_equal(got["manifest"][name], array), name


class _Url:
    """A server with another dataset URL (a folder below its root)."""

    def __init__(self, server: SyntheticListServer, url: str) -> None:
        self.url, self.endpoint_url = url, server.endpoint_url

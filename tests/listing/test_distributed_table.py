"""The index (or metadata) file is read once per job: under torchrun, rank 0 builds the sample table and
the other ranks receive it in its saved form, by a collective broadcast (an initialised gloo process group)
or through the BLOBDATA_SHARED_DIR hand-off (none yet). Counted at the S3 proxy: one GET of the index for
two ranks, and rank 1 still reads its samples."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from blobdata._errors import ManifestError
from blobdata._listing import Member, SampleTable, shared_file, shared_table
from blobdata.testing import find_free_port
from tests.listing.test_distributed import _env

RUN_TIMEOUT = 120.0
N = 6

JOB = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from blobdata import BlobDataset

url, index, out, mode = sys.argv[1:5]
if mode == "pg":
    dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
ds = BlobDataset(url, index=None if index == "-" else index, cache=None)
sample = ds[rank]
doc = {"keys": ds.keys(), "txt": sample["txt"], "label": sample["label"],
       "unknown": int((ds.table.sizes < 0).sum()), "where": ds.table.where(0),
       "listing": ds.manifest is not None}
Path(out, f"rank{rank}.json").write_text(json.dumps(doc))
if mode == "pg":
    dist.barrier()
    dist.destroy_process_group()
"""


def _run(script: Path, args: list[str], env: dict[str, str]) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={find_free_port()}", str(script), *args,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {RUN_TIMEOUT}s:\n{out.decode()[-3000:]}")
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return text


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("mode", ["pg", "file"])
def test_rank_1_does_not_read_the_index(s3_bucket: Any, s3_proxy: Any, tmp_path: Path, mode: str) -> None:
    s3_bucket.put_many({f"ix/s{i}.txt": f"text {i}".encode() for i in range(N)})
    rows = "".join(f"s{i}.txt,,{i * 10}\n" for i in range(N))  # no sizes: learned at first read
    s3_bucket.put("idx/index.csv", ("key,size,label\n" + rows).encode())
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "out"
    out.mkdir()
    env = _env(s3_proxy)
    env.pop("BLOBDATA_CACHE_DIR", None)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    env["BLOBDATA_SHARED_DIR"] = str(shared)
    index = s3_bucket.url("idx/index.csv")
    s3_proxy.reset_counts()
    _run(script, [s3_bucket.url("ix"), index, str(out), mode], env)
    index_gets = [(m, p) for m, p in s3_proxy.requests if p.endswith("/idx/index.csv")]
    assert index_gets == [("GET", index_gets[0][1])]  # one GET of the index for the job: rank 0's
    assert not [p for m, p in s3_proxy.requests if "?" in p or m != "GET"]  # no LIST, no HEAD
    docs = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert docs[0]["keys"] == docs[1]["keys"] == [f"s{i}" for i in range(N)]
    assert [(d["txt"], d["label"], d["unknown"]) for d in (docs[0], docs[1])] == [
        ("text 0", 0, N),
        ("text 1", 10, N),
    ]
    assert docs[1]["where"] == f"index {index} line 2"  # rank 1's errors still name the index's line
    if mode == "file":  # handed over through a file of the shared directory
        assert [p.suffix for p in shared.iterdir()] == [".manifest"]


@pytest.mark.slow
@pytest.mark.network
def test_rank_1_does_not_read_the_metadata_file(s3_bucket: Any, s3_proxy: Any, tmp_path: Path) -> None:
    s3_bucket.put_many({f"md/s{i}.txt": f"text {i}".encode() for i in range(N)})
    lines = "".join(json.dumps({"file_name": f"s{i}.txt", "label": i * 10}) + "\n" for i in range(N))
    s3_bucket.put("md/metadata.jsonl", lines.encode())
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "out"
    out.mkdir()
    env = _env(s3_proxy)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    env["BLOBDATA_SHARED_DIR"] = str(shared)
    env["BLOBDATA_CACHE_HOME"] = str(tmp_path / "home")  # no remembered listing: rank 0 lists
    s3_proxy.reset_counts()
    _run(script, [s3_bucket.url("md"), "-", str(out), "pg"], env)
    assert len([p for _, p in s3_proxy.requests if p.endswith("/md/metadata.jsonl")]) == 1  # rank 0's
    assert len([p for _, p in s3_proxy.requests if "?" in p]) == 1  # one LIST page, rank 0's
    docs = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert docs[0]["keys"] == docs[1]["keys"] == [f"s{i}" for i in range(N)]
    assert [(d["txt"], d["label"], d["listing"]) for d in (docs[0], docs[1])] == [
        ("text 0", 0, True),
        ("text 1", 10, True),
    ]


def test_the_hand_off_file_is_the_saved_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a process group: rank 0's table reaches rank 1 through BLOBDATA_SHARED_DIR, whole; a
    hand-off file rank 1 finds corrupt is refused, naming it."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    job = {"BLOBDATA_SHARED_DIR": str(shared), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "BLOBDATA_SHARED_TIMEOUT": "2", "TORCHELASTIC_RUN_ID": f"t-{os.getpid()}"}  # fmt: skip
    for name, value in job.items():
        monkeypatch.setenv(name, value)
    root = "s3://bucket/ix"
    made = SampleTable(
        root,
        [("a", [Member("a.jpg", 10, "e1", "jpg", 2), Member("a.txt", -1, "", "txt", 3)], {"label": 1})],
        where="index i.csv line {}",
    )
    monkeypatch.setenv("RANK", "0")
    assert shared_table(root, lambda: made, key="k").key(0) == "a"
    monkeypatch.setenv("RANK", "1")
    got = shared_table(root, lambda: pytest.fail("only rank 0 reads the index"), key="k")
    assert (got.key(0), got.fields(0), got.where(1), got.identity(1), int(got.sizes[1])) == (
        "a", {"label": 1}, "index i.csv line 3", "", -1,
    )  # fmt: skip
    path = shared_file(root, "table|k2", 1)
    monkeypatch.setenv("RANK", "0")
    shared_table(root, lambda: made, key="k2")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.unlink()
    path.write_bytes(bytes(data))
    path.chmod(0o600)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ManifestError, match="checksum mismatch") as info:
        shared_table(root, lambda: pytest.fail("only rank 0 reads the index"), key="k2")
    assert str(path) in str(info.value)

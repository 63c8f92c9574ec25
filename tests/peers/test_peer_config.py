"""Turning peers on, and the nodes' meeting through the job's store: settings checked when made, one
argument or one variable, a meeting that names the node that never came, entries checked as read."""

from __future__ import annotations

import gc
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from blobdata import ConfigError, FetchOptions, FolderDataset, Peers
from blobdata._loop import run
from blobdata._peers import SERVICE_READERS, Service, ServiceProcess, join, peers_setting, service_of
from tests.support.peer_nodes import node_1_came


def _folder(tmp_path: Path) -> str:
    (tmp_path / "data" / "c").mkdir(parents=True)
    (tmp_path / "data" / "c" / "x.png").write_bytes(b"x")
    return str(tmp_path / "data")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nnodes": 0}, r"nnodes=\) must be an integer of at least 1"),
        ({"nnodes": True}, r"nnodes=\) must be an integer"),
        ({"node_rank": -1}, r"node_rank=\) must be an integer of at least 0"),
        ({"nnodes": 2, "node_rank": 2}, r"node_rank=2\) must be below nnodes=2"),
        ({"port": 70000}, r"port=\) must be a port number"),
        ({"host": ""}, r"host=\) must be a non-empty printable string"),
        ({"node_name": "a\nb"}, r"node_name=\) must be a non-empty printable string"),
        ({"per_peer": 0}, r"per_peer=\) must be an integer of at least 1"),
        ({"timeout": "soon"}, r"timeout=\) must be a duration"),
        ({"serves": 1}, r"serves=\) must be True, False or None"),
        ({"service_process": None}, r"service_process=\) must be True or False, got None"),
        ({"service_process": "no"}, r"service_process=\) must be True or False"),
        ({"service_concurrency": 0}, r"service_concurrency=\) must be an integer of at least 1"),
        ({"service_concurrency": 2.5}, r"service_concurrency=\) must be an integer"),
    ],
)
def test_bad_settings_are_refused_when_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Peers(**kwargs)


def test_one_argument_or_one_variable_turns_peers_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLOBDATA_PEERS", raising=False)
    assert peers_setting(None) is None  # off by default
    assert peers_setting(True) == Peers() and peers_setting(False) is None
    given = Peers(nnodes=3)
    assert peers_setting(given) is given
    for on in ("1", "true", "ON"):
        monkeypatch.setenv("BLOBDATA_PEERS", on)
        assert peers_setting(None) == Peers()
        assert peers_setting(False) is None  # the argument wins
    monkeypatch.setenv("BLOBDATA_PEERS", "0")
    assert peers_setting(None) is None
    monkeypatch.setenv("BLOBDATA_PEERS", "maybe")
    with pytest.raises(ConfigError, match="BLOBDATA_PEERS must be 1 or 0"):
        peers_setting(None)
    with pytest.raises(ConfigError, match=r"peers= takes True, False or a blobdata\.Peers"):
        peers_setting("yes")  # type: ignore[arg-type]


def test_peers_without_a_cache_are_refused_naming_the_folder(tmp_path: Path) -> None:
    root = _folder(tmp_path)
    with pytest.raises(ConfigError, match=r"peers need a cache for .*data: .*pass cache=DIR"):
        FolderDataset(root, peers=True)


def test_a_job_of_one_node_meets_nobody(tmp_path: Path) -> None:
    ds = FolderDataset(_folder(tmp_path), cache=str(tmp_path / "c"), peers=Peers(nnodes=1))
    assert ds._peers is None and len(ds) == 1


def test_a_local_folder_meets_nobody(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its files are read directly in the thread serving the batch, so no node would ask: the dataset
    does not meet the others (meeting them needs a store, which this test has not: an error)."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="blobdata"):
        ds = FolderDataset(_folder(tmp_path), cache=str(tmp_path / "c"), peers=Peers(nnodes=2, node_rank=0))
    assert ds._peers is None and len(ds) == 1
    assert "peers are off for" in caplog.text and "a local folder is read directly" in caplog.text


def test_without_a_store_the_error_says_where_one_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"peers need the job's store .* torchrun"):
        join(Peers(nnodes=2, node_rank=1, job="nostore"))


def test_a_node_that_never_comes_is_named() -> None:
    store = dist.HashStore()
    with pytest.raises(ConfigError, match=r"node 1's address did not come within 1 s"):
        join(Peers(store=store, nnodes=2, node_rank=0, host="127.0.0.1", job="late", timeout=1))


@pytest.mark.parametrize(
    "entry",
    [
        b"not json",
        json.dumps({"name": "b"}).encode(),
        json.dumps({"name": "b", "address": "x", "local": "x"}).encode(),
        json.dumps({"name": "b\n", "address": "1.2.3.4:5", "local": "1.2.3.4:5"}).encode(),
        b"x" * 5000,
    ],
)
def test_a_nodes_entry_is_checked_as_it_is_read(entry: bytes) -> None:
    store, job, _ = node_1_came("entry", entry)
    with pytest.raises(ConfigError, match=r"node 1's entry in the job's store|node 1's address .* bytes"):
        join(Peers(store=store, nnodes=2, node_rank=0, host="127.0.0.1", job=job, timeout=5))


def test_node_names_must_be_distinct() -> None:
    same = json.dumps({"name": "127.0.0.1", "address": "1.2.3.4:5", "local": "1.2.3.4:5"}).encode()
    store, job, _ = node_1_came("dup", same)
    with pytest.raises(ConfigError, match="names are not distinct"):
        join(Peers(store=store, nnodes=2, node_rank=0, host="127.0.0.1", job=job, timeout=5))


@pytest.mark.parametrize("own_process", [True, False], ids=["service-process", "service-thread"])
def test_a_meeting_leaves_a_note_of_the_service_in_the_nodes_directory_and_no_secret(
    own_process: bool,
) -> None:
    store, job, prefix = node_1_came("note")
    config = Peers(
        store=store, nnodes=2, node_rank=0, host="127.0.0.1", job=job, timeout=5, service_process=own_process
    )
    table = join(config)
    assert table is not None and table.names == ("127.0.0.1", "other") and table.me == 0
    service = service_of(table)
    assert service is not None
    if own_process:
        assert isinstance(service, ServiceProcess) and service.proc.poll() is None
        directory, pid, job_of = service.note, service.pid, service.job
        assert pid != os.getpid()
    else:
        assert isinstance(service, Service) and service.note is not None
        directory, pid, job_of = service.note[0], os.getpid(), service.verifier.job
    try:
        assert directory and table.addresses[0] == service.address  # this node's own: where it listens
        note = Path(directory) / "service.json"
        st = note.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert stat.S_IMODE(Path(directory).stat().st_mode) == 0o700
        got = json.loads(note.read_text())
        assert got == {"address": service.address, "job": job_of, "pid": pid}
        assert table.secret.hex() not in note.read_text()
        secret = store.get(prefix + "secret")
        assert bytes.fromhex(secret.decode()) == table.secret
        assert "secret" not in repr(table) and table.secret.hex() not in repr(table)
        # The same job met again in this process: the same table, no second meeting.
        assert join(config) is table
    finally:
        if isinstance(service, ServiceProcess):
            service.close()
        else:
            run(service.server.aclose())


@pytest.mark.parametrize(("given", "want"), [(None, SERVICE_READERS * 48), (300, 300)])
def test_the_nodes_service_reads_the_bucket_with_the_concurrency_of_many_processes(
    tmp_path: Path, s3_bucket: Any, given: int | None, want: int
) -> None:
    """In a job's first epoch the service reads the node's share of every node's samples: it is told
    to read with the concurrency of :data:`SERVICE_READERS` processes (or as given), not of one."""
    s3_bucket.put("train/c/x.bin", b"x")
    store, job, _ = node_1_came("readers")
    peers = Peers(
        store=store, nnodes=2, node_rank=0, host="127.0.0.1", job=job, timeout=5, service_concurrency=given
    )
    ds = FolderDataset(
        s3_bucket.url("train"), extensions=(".bin",), cache=str(tmp_path / "cache"), peers=peers,
        storage_options=s3_bucket.storage_options, fetch_options=FetchOptions(concurrency=48),
    )  # fmt: skip
    service = service_of(ds._peers)
    assert isinstance(service, ServiceProcess)
    try:
        told = [m for m, _ in service._told.values() if m["op"] == "source"]
        assert [m["options"]["concurrency"] for m in told] == [want]
        assert ds.fetch_options.concurrency == 48  # the dataset's own processes: as given
        # A dataset gone: its root is dropped before the service is told anything else.
        root = told[0]["root"]
        del ds
        gc.collect()
        service.set_homes(("127.0.0.1", "other"), 0)
        assert not [m for m, _ in service._told.values() if m["op"] == "source"], root
    finally:
        service.close()

"""A node's peer service in a process of its own: it ends with the process that started it however
that one ends, refuses with a clear error what cannot be sent to it, and its counts reach the loaders
of the process that started it. (It serving real nodes is tests/peers/test_peer_nodes.py's job: its
nodes run the default, the service's own process.)"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from blobdata import ConfigError, FetchOptions
from blobdata._cache import BlobCache
from blobdata._loop import run
from blobdata._metrics import stats as _stats
from blobdata._peers import (
    PATH,
    EngineSpec,
    Homes,
    PeerClient,
    Peers,
    PeerTable,
    ServiceProcess,
    Signer,
    join,
    service_of,
)
from blobdata._peers.daemon import start
from tests.support.peer_nodes import node_1_came

pytestmark = pytest.mark.timeout(120)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie not yet reaped counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


_PARENT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch.distributed as dist
    from blobdata._peers import Peers, join, service_of

    store = dist.HashStore()
    job = "parent-" + str(os.getpid())
    import hashlib
    prefix = "blobdata/peers/v1/" + hashlib.sha256(job.encode()).hexdigest()[:16] + "/"
    other = {"name": "other", "address": "127.0.0.9:9", "local": "127.0.0.9:9"}
    store.set(prefix + "node/1", json.dumps(other))
    table = join(Peers(store=store, nnodes=2, node_rank=0, host="127.0.0.1", job=job, timeout=5))
    worker = os.fork() if sys.argv[1] == "worker" else -1  # as a DataLoader worker: holds the pipes
    if worker == 0:
        time.sleep(60)
        os._exit(0)
    print(service_of(table).pid, worker, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("how", ["SIGKILL", "worker", "SIGINT", "exit"])
def test_the_service_process_ends_with_the_process_that_started_it(how: str) -> None:
    """Killed (no handler runs; "worker": while a forked child of it, as a DataLoader worker, lives on
    and keeps the service's stdin open), interrupted (Ctrl-C: the service ignores it, its parent does
    not) or exiting normally (atexit ends it): the service's process does not outlive its parent."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with subprocess.Popen(
        [sys.executable, "-c", _PARENT, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    ) as parent:  # fmt: skip
        worker = -1
        try:
            assert parent.stdout is not None and parent.stderr is not None
            line = parent.stdout.readline().split()
            assert len(line) == 2, parent.stderr.read()
            child, worker = int(line[0]), int(line[1])
            assert child != parent.pid and not _gone(child)
            if how in ("SIGKILL", "worker"):
                parent.kill()
            elif how == "SIGINT":
                parent.send_signal(signal.SIGINT)
            parent.wait(30)
            assert _wait_gone(child, 10.0), f"the service process {child} outlived its parent ({how})"
        finally:
            if parent.poll() is None:
                parent.kill()
            if worker > 0:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)


def _met() -> tuple[ServiceProcess, bytes]:
    """A node 0 of two that met (node 1's entry put in the store by hand), its service's process."""
    store, job, _ = node_1_came("daemon")
    table = join(Peers(store=store, nnodes=2, node_rank=0, host="127.0.0.1", job=job))
    assert table is not None
    service = service_of(table)
    assert isinstance(service, ServiceProcess)
    return service, table.secret


def test_settings_that_cannot_be_sent_are_refused_naming_the_dataset(tmp_path: Path) -> None:
    """What the child is told is plain data (JSON, never a pickle): storage options that are not are
    refused before anything is sent; a message the child cannot use is answered with its error, and
    the child goes on serving."""
    service, _ = _met()
    try:
        cache = BlobCache(tmp_path / "cache")
        root = "s3://bucket/train/"
        with pytest.raises(ConfigError, match=r"s3://bucket/train/.*cannot be sent.*service_process=False"):
            service.add_source(root, cache, EngineSpec(FetchOptions(), "s3", {"client_kwargs": lambda: 0}))
        with pytest.raises(ConfigError, match=r"s3://bucket/train/.*cannot be sent"):
            service.add_source(root, cache, EngineSpec(FetchOptions(), "s3", {"session": object()}))
        # Checked by the child as it reads them: its own error comes back, naming what was sent.
        bad = {
            "op": "source", "root": "s3://bucket/other/", "cache": [str(tmp_path / "c"), 1, "fifo"],
            "options": {}, "protocol": "s3", "storage_options": {}, "number": 1,
        }  # fmt: skip
        with pytest.raises(ConfigError, match=r"peers: the dataset s3://bucket/other/: ValueError: .*'fifo'"):
            service._send(bad, "the dataset s3://bucket/other/")
        with pytest.raises(ConfigError, match=r"unknown message 'pickle'"):
            service._send({"op": "pickle"}, "a message")
        with pytest.raises(ConfigError, match=r"'me' is not a int"):
            service._send({"op": "homes", "names": ["a", "b"], "me": True}, "the job's nodes")
        # The process goes on and takes the next dataset.
        service.add_source(root, cache, EngineSpec(FetchOptions(), "s3", {"anon": True}))
        assert service.proc.poll() is None
    finally:
        service.close()
    assert service.proc is not None and service.proc.returncode == 0  # ended by its stdin's end, as asked


def test_a_service_that_cannot_listen_says_where() -> None:
    busy, _ = _met()
    try:
        port = int(busy.address.rpartition(":")[2])
        where = rf"cannot listen on 127\.0\.0\.1:{port}.*Peers\(host=, port=\)"
        with pytest.raises(ConfigError, match=where):
            start(bytes(32), "127.0.0.1", port)
    finally:
        busy.close()


def test_what_the_service_process_counts_reaches_the_loaders_made_since() -> None:
    fd, record = _stats.shared_record()
    assert fd >= 0 and record is not None
    os.close(fd)
    try:
        record[_stats.PEER_SERVED] += 3  # before the loader: not its work
        records = _stats.Records(os.devnull + "-none")  # no records of its own
        record[_stats.PEER_SERVED] += 5
        record[_stats.PEER_SERVED_BYTES] += 500
        record[_stats.INFLIGHT] = 2.0  # a gauge: what it holds now, not a difference
        total = records.total()
        assert (total[_stats.PEER_SERVED], total[_stats.PEER_SERVED_BYTES]) == (5.0, 500.0)
        assert total[_stats.INFLIGHT] == 2.0
        later = _stats.Records(os.devnull + "-none")
        assert later.total()[_stats.PEER_SERVED] == 0.0
    finally:
        _stats._shared.remove(record)


def test_the_child_counts_into_the_record_its_parent_passed() -> None:
    """A real child (as the service's process is started) counting with count_in: its counts are the
    parent's to read, and a descriptor that is not such a record leaves its counts private."""
    fd, record = _stats.shared_record()
    assert fd >= 0 and record is not None
    code = (
        "import sys; from blobdata._metrics import stats as s; s.count_in(int(sys.argv[1])); "
        "s.rec()[s.PEER_SERVED] += 7"
    )
    try:
        subprocess.run([sys.executable, "-c", code, str(fd)], pass_fds=(fd,), check=True, timeout=60)
        assert record[_stats.PEER_SERVED] == 7.0
        assert np.array(record)[_stats.PEER_SERVED_BYTES] == 0.0
    finally:
        os.close(fd)
        _stats._shared.remove(record)


def _home_object(tmp_path: Path) -> tuple[BlobCache, str, str, bytes]:
    """A cache holding one object of ``s3://bucket/train/`` homed on node 0 of ``_met``'s job."""
    homes = Homes(("127.0.0.1", "other"))
    url = next(u for u in (f"s3://bucket/train/{i:04d}.bin" for i in range(100)) if homes.home_of(u) == 0)
    data = os.urandom(3000)
    cache = BlobCache(tmp_path / "cache")
    assert cache.put(url, "etag-1", data)
    return cache, url, "etag-1", data


def _read_from(service: ServiceProcess, secret: bytes, url: str, identity: str, size: int) -> bytes:
    """``url`` read from ``service`` by node 1 of its job, as a dataset's read asks its home."""

    async def bucket() -> tuple[bytes, str]:
        raise AssertionError(f"{url} was not read from the service")

    client = PeerClient(PeerTable(secret, ("127.0.0.1", "other"), (service.address, "127.0.0.9:9"), 1))
    try:
        data, from_peer = run(client.read(0, url, size, identity, bucket), 30.0)
    finally:
        run(client.aclose())
    assert from_peer
    return data


def _killed_and_started_again(service: ServiceProcess) -> bool:
    """Whether ``service``'s process, killed, was started again within 30 s and told what to serve."""
    first = service.pid
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while service.pid == first and time.monotonic() < deadline:
        time.sleep(0.02)
    with service._lock:  # held while the new one starts and is told what to serve
        pass
    return service.pid != first


def test_a_service_process_that_ends_is_started_again_where_it_was(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed, it is started again on the same address and told again what to serve (a read of a
    dataset it was told of is answered from the cache); ended too often, it is left ended, said in a
    warning (the other nodes then read its objects from the bucket)."""
    cache, url, identity, data = _home_object(tmp_path)
    service, secret = _met()
    try:
        for _ in range(2):  # the same dataset twice (made again): remembered once, to tell a new process
            service.add_source("s3://bucket/train/", cache, EngineSpec(FetchOptions(), "s3", {"anon": True}))
        assert len(service._told) == 2  # the job's nodes, the dataset
        assert _read_from(service, secret, url, identity, len(data)) == data
        address = service.address
        with caplog.at_level(logging.WARNING, logger="blobdata"):
            for k in range(3):
                assert _killed_and_started_again(service), f"not started again after kill {k + 1}"
                assert service.address == address
                assert _read_from(service, secret, url, identity, len(data)) == data
            last = service.pid
            os.kill(last, signal.SIGKILL)
            assert _wait_gone(last, 10.0)
            time.sleep(1.0)
            assert service.pid == last and service.proc is not None and service.proc.poll() is not None
        said = [r.getMessage() for r in caplog.records]
        assert sum("starting it again" in m for m in said) == 3, said
        assert any("it is not started again" in m for m in said), said
    finally:
        service.close()


def _status(service: ServiceProcess, secret: bytes, url: str, identity: str, size: int) -> int:
    """The status of node 1's signed request for ``url`` to ``service``."""
    target = f"{PATH}?u={quote(url, safe='')}&e={quote(identity, safe='')}&n={size}"
    headers, _ = Signer(secret, "other").sign("GET", target)
    host, _, port = service.address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", target, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_a_dataset_gone_is_served_no_more_and_never_takes_a_later_ones_root_with_it(tmp_path: Path) -> None:
    """The service's process holds an engine per dataset root: one whose dataset is gone is dropped
    (told before the next message: a finalizer neither locks nor writes), and not told to a process
    started again; a dataset made again on the same root keeps it served when the first one goes."""
    import gc

    class Dataset:  # what the parent's datasets are to the handle: owners, held weakly
        pass

    cache, url, identity, data = _home_object(tmp_path)
    service, secret = _met()
    spec = EngineSpec(FetchOptions(), "s3", {"anon": True})
    try:
        first, second = Dataset(), Dataset()
        service.add_source("s3://bucket/train/", cache, spec, first)
        service.add_source("s3://bucket/train/", cache, spec, second)  # made again: the same root
        del first
        gc.collect()
        service.add_source("s3://bucket/other/", cache, spec)  # the next message: what went is told first
        assert _status(service, secret, url, identity, len(data)) == 200  # the later one's: kept
        assert "source:s3://bucket/train/" in service._told
        del second
        gc.collect()
        assert _status(service, secret, url, identity, len(data)) == 200  # not told yet
        service.set_homes(("127.0.0.1", "other"), 0)
        assert _status(service, secret, url, identity, len(data)) == 404  # not an object of its datasets
        assert "source:s3://bucket/train/" not in service._told
        assert _killed_and_started_again(service)  # and told of what is left only
        assert _status(service, secret, url, identity, len(data)) == 404
    finally:
        service.close()

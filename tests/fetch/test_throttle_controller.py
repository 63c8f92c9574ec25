"""The node-wide throttle controller alone (:mod:`blobdata._fetch.throttle`, owners): no server.

Two :class:`Table` objects opened on one file stand for two processes of a node (each has its own
open file description, so the ``fcntl`` lock separates them as it separates processes). Times are
the controller's own clock values passed in, so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blobdata._errors import PatienceSpent
from blobdata._fetch import Limit, Table, key_id, private_gate, throttle
from blobdata._node import owners as _owners

# the controller's constants and the shared table's layout, white-box
_OWNERS0, BETA, HOLD_S = throttle._OWNERS0, throttle.BETA, throttle.HOLD_S
K_LIMIT, MIN_RATE = throttle.K_LIMIT, throttle.MIN_RATE
O_FIELDS, O_PID, OWNERS, allowed = throttle.O_FIELDS, throttle.O_PID, throttle.OWNERS, throttle.allowed


def _limits(tmp_path: Path) -> tuple[Limit, Limit]:
    path = str(tmp_path / "throttle.bin")
    return Limit(Table(path), key_id("s3|e|b|p")), Limit(Table(path), key_id("s3|e|b|p"))


def _feed(limit: Limit, start: float, seconds: float, rate: float) -> float:
    """``rate`` requests/s sent and accepted for ``seconds`` from ``start``; returns the end."""
    n = int(seconds * rate)
    for i in range(n):
        t = start + i / rate
        limit.sent(t)
        limit.accepted(t)
    limit.sync(start + seconds)
    return start + seconds


def test_unlimited_until_the_store_throttles(tmp_path: Path) -> None:
    a, _ = _limits(tmp_path)
    now = time.monotonic()
    assert a.open(now) and a.take(1000, now) == (1000, 0.0)
    assert a.snapshot(now)["rate_limit"] == 0.0


def test_a_throttle_cuts_the_rate_to_what_the_store_accepted(tmp_path: Path) -> None:
    a, b = _limits(tmp_path)
    t = _feed(a, time.monotonic(), 1.0, 200.0)  # the node got 200/s through
    assert a.throttled(t, 0.0, t)
    v = a.table.v
    assert v[a.base + K_LIMIT] == pytest.approx(200.0, rel=0.1)
    # The other process sees the same limit at once: 3/4 of it is allowed.
    assert not b.open(t)
    assert allowed(b.table.v, b.base, t) == pytest.approx(BETA * 200.0, rel=0.1)


def test_late_answers_of_the_same_congestion_decrease_nothing(tmp_path: Path) -> None:
    a, b = _limits(tmp_path)
    t = _feed(a, time.monotonic(), 1.0, 200.0)
    assert a.throttled(t - 0.01, 0.0, t)
    limit = a.table.v[a.base + K_LIMIT]
    # Throttled answers to requests sent before the decrease, or just after it, are the same event.
    assert not b.throttled(t - 0.005, 0.0, t + 0.01)
    assert not b.throttled(t + HOLD_S / 2, 0.0, t + HOLD_S)
    assert a.table.v[a.base + K_LIMIT] == limit
    # A request sent well after it, throttled again: a new decrease.
    assert b.throttled(t + 1.0, 0.0, t + 1.01)


def test_the_rate_grows_back_and_beyond_while_nothing_is_throttled(tmp_path: Path) -> None:
    a, _ = _limits(tmp_path)
    t0 = _feed(a, time.monotonic(), 1.0, 100.0)
    a.throttled(t0, 0.0, t0)
    v, base = a.table.v, a.base
    limit = v[base + K_LIMIT]
    assert limit == pytest.approx(100.0, rel=0.1)
    start = allowed(v, base, t0)
    t1 = _feed(a, t0, 0.6, 0.9 * 100.0)
    back = allowed(v, base, t1)
    t2 = _feed(a, t1, 1.0, 1.5 * 100.0)
    assert start == pytest.approx(BETA * limit)
    assert start < back <= limit < allowed(v, base, t2)  # additive back to it, then probing above


def test_the_rate_never_goes_below_its_floor(tmp_path: Path) -> None:
    a, _ = _limits(tmp_path)
    t = time.monotonic()
    for _ in range(50):  # a store that throttles everything: nothing is ever accepted
        a.sent(t)
        a.throttled(t, 0.0, t + 0.001)
        t += 1.0
    assert allowed(a.table.v, a.base, t) >= MIN_RATE


def test_tokens_are_shared_by_the_processes_of_a_node(tmp_path: Path) -> None:
    """Two processes drawing at once get the node's rate between them, not each."""
    a, b = _limits(tmp_path)
    t = _feed(a, time.monotonic(), 1.0, 100.0)
    a.throttled(t, 0.0, t)
    rate = allowed(a.table.v, a.base, t)
    got = 0
    for i in range(1, 101):  # one second, both asking for 50 every 10 ms
        now = t + i * 0.01
        got += a.take(50, now)[0] + b.take(50, now)[0]
    assert got == pytest.approx(rate, rel=0.25)


def test_retry_after_pauses_the_store_for_every_process(tmp_path: Path) -> None:
    a, b = _limits(tmp_path)
    t = time.monotonic()
    a.throttled(t, 1.5, t)
    assert b.paused_until() == pytest.approx(t + 1.5)
    assert b.take(5, t + 1.0) == (0, pytest.approx(0.5))
    assert b.take(1, t + 1.6)[0] == 1


def _pids(table: Table) -> set[int]:
    return {int(table.v[o + O_PID]) for o in range(_OWNERS0, _OWNERS0 + OWNERS * O_FIELDS, O_FIELDS)}


def _owner(path: str, then: str) -> subprocess.Popen[str]:
    """A process that joins the table at ``path`` as an owner, then runs ``then`` (Python)."""
    return subprocess.Popen(
        [sys.executable, "-c", f"from blobdata._fetch.throttle import *; import os, sys, time\n"
         f"Limit(Table({path!r}), key_id('x'))\n{then}"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.parametrize("reads_its_file", [False, True], ids=["plain", "reading-the-owners-file"])
def test_a_dead_owner_is_swept_and_a_live_one_kept(tmp_path: Path, reads_its_file: bool) -> None:
    """An owner is kept while it lives and swept once it is gone; also an owner another part of whose
    process read the node's files (a scan, a backup), closing a descriptor of the owners' lock file
    (that close would have dropped every POSIX record lock the process held on it)."""
    path = str(tmp_path / "throttle.bin")
    scan = f"open({path!r} + '.owners', 'rb').read()\n" if reads_its_file else ""
    child = _owner(path, scan + "print('ok', flush=True); time.sleep(60)")
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        table = Table(path)
        Limit(table, key_id("y"))  # joining sweeps every owner: the child lives
        assert child.pid in _pids(table)
    finally:
        child.kill()
        child.communicate(timeout=30)
    Limit(table, key_id("z"))
    assert child.pid not in _pids(table) and os.getpid() in _pids(table)


def test_a_dead_owners_forked_child_does_not_keep_its_slot(tmp_path: Path) -> None:
    """An owner killed while a child it forked lives on (a DataLoader worker that has not noticed yet):
    the child does not hold the owner's slot, which the next sweeper clears."""
    path = str(tmp_path / "throttle.bin")
    owner = _owner(path, "pid = os.fork()\nif pid == 0:\n    time.sleep(60); os._exit(0)\n"
                         "print(pid, flush=True); time.sleep(60)")  # fmt: skip
    forked = 0
    try:
        assert owner.stdout is not None
        forked = int(owner.stdout.readline())
        table = Table(path)
        Limit(table, key_id("y"))
        assert owner.pid in _pids(table)
        owner.kill()
        owner.wait(30)  # not communicate(): the forked child holds the pipe open
        assert _owners.alive(forked)
        Limit(table, key_id("z"))  # joining sweeps every owner: the killed one is gone
        assert owner.pid not in _pids(table)
    finally:
        owner.kill()
        owner.wait(30)
        if forked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(forked, signal.SIGKILL)
        assert owner.stdout is not None
        owner.stdout.close()


def test_a_reused_pid_is_not_the_owner() -> None:
    me = os.getpid()
    assert _owners.alive(me, _owners.started(me))
    if _owners.started(me):  # /proc: a process that started after the owner was alive is another one
        assert not _owners.alive(me, _owners.started(me) - 3600)
    assert not _owners.alive(2**22 + 12345)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _owners.alive(child.pid) and time.monotonic() < deadline:  # exited, not reaped: a zombie
        time.sleep(0.01)
    assert not _owners.alive(child.pid)
    child.wait(30)


def test_the_node_state_is_its_users_only(tmp_path: Path) -> None:
    directory = _owners.per_user_dir(str(tmp_path), "blobdata-test")
    assert directory is not None and stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    table = Table(os.path.join(directory, "t.bin"))
    assert stat.S_IMODE(os.stat(table.path or "").st_mode) == 0o600 and table.shared
    # A file others may read or write is not used; nor a directory open to others, nor a link.
    loose = tmp_path / "loose.bin"
    loose.write_bytes(b"")
    os.chmod(loose, 0o644)
    with pytest.raises(PermissionError):
        Table(str(loose))
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    assert _owners.per_user_dir(str(tmp_path), "open") is None
    os.symlink(directory, tmp_path / "link")
    assert _owners.per_user_dir(str(tmp_path), "link") is None
    os.symlink(table.path or "", tmp_path / "link-file")  # to a good file: the link itself is refused
    with pytest.raises(OSError):
        Table(str(tmp_path / "link-file"))


def test_a_private_table_works_alone() -> None:
    a = Limit(Table(None), key_id("p"))
    t = time.monotonic()
    a.sent(t)
    assert a.throttled(t, 0.0, t)
    assert not a.open(t) and math.isfinite(allowed(a.table.v, a.base, t))


def test_requests_queued_at_a_paused_store_end_when_their_patience_runs_out() -> None:
    """A store that accepts nothing (paused by its Retry-After here) ends every queued wait with
    PatienceSpent, the ones behind the first too, within about the patience: none waits for ever."""

    async def run() -> tuple[list[BaseException | float], float]:
        gate = private_gate(4)
        now = time.monotonic()
        gate.limit.throttled(now, 60.0, now)  # the store says: come back in 60 s
        began = time.monotonic()
        waits = [gate.admit(retry=k % 2 == 0, patience=0.3, since=began) for k in range(12)]
        got = await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), 10.0)
        return got, time.monotonic() - began

    got, took = asyncio.run(run())
    assert all(isinstance(g, PatienceSpent) for g in got), got
    assert took < 5.0  # the patience (0.3 s), not the store's 60 s

"""The /dev/shm sweep proves an owner dead by the lock it held for its life, not by its pid, which
means nothing across the pid namespaces of containers sharing /dev/shm (issue 29, finding 6)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from blobdata._fetch import Limit, Table, key_id, sweep_dead_channels, throttle
from blobdata._node import owners

_OWNERS0, O_FIELDS, O_PID, OWNERS = throttle._OWNERS0, throttle.O_FIELDS, throttle.O_PID, throttle.OWNERS
ROOT = Path(__file__).resolve().parents[2]

# A loader in "another container": it makes its plan channel under ROOT_DIR and lives on.
_LOADER = """
import sys, time
import blobdata._node.shm as shm
shm.shm_root = lambda: sys.argv[1]
from blobdata._fetch import PlanChannel
channel = PlanChannel()
channel.publish([[0, 1], [2, 3]])
print(channel.path, flush=True)
time.sleep(120)
"""


def _dead_pid() -> int:
    """A pid no process here has: what a live process of another pid namespace looks like."""
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


@pytest.fixture
def loader(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", _LOADER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    path = child.stdout.readline().strip()
    assert path and os.path.isdir(path)
    yield child, path
    child.kill()
    child.communicate(timeout=30)


def test_a_live_loader_of_another_pid_namespace_keeps_its_plan_directory(
    tmp_path: Path, loader: tuple[subprocess.Popen[str], str]
) -> None:
    child, path = loader
    # As a sweeper in another container sees it: the directory names a pid that is not running here.
    parent = os.path.dirname(path)  # the user's directory of node-shared state, below tmp_path
    foreign = os.path.join(parent, f"plan-{_dead_pid()}-elsewhere")
    os.rename(path, foreign)
    assert sweep_dead_channels(parent) == []
    assert os.path.isfile(os.path.join(foreign, "plan.npy"))  # the loader's next epoch still finds it
    child.send_signal(signal.SIGKILL)  # the owner dies: its lock goes with it, and the sweep takes it
    child.wait(30)
    assert sweep_dead_channels(parent) == [foreign]
    assert not os.path.exists(foreign)


def test_a_live_loaders_directory_is_kept_and_swept_once_it_is_killed(
    tmp_path: Path, loader: tuple[subprocess.Popen[str], str]
) -> None:
    child, path = loader
    assert sweep_dead_channels(os.path.dirname(path)) == []
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert sweep_dead_channels(os.path.dirname(path)) == [path]


def test_a_directory_without_a_lock_is_judged_by_its_pid(tmp_path: Path) -> None:
    old = tmp_path / f"plan-{_dead_pid()}-old"  # made by a blobdata before the lock
    old.mkdir(mode=0o700)
    assert owners.owner_gone(str(old)) is None
    assert sweep_dead_channels(str(tmp_path)) == [str(old)]


def test_the_owner_lock_cannot_be_taken_twice_and_goes_with_its_holder(tmp_path: Path) -> None:
    fd = owners.hold(str(tmp_path))
    try:
        assert owners.owner_gone(str(tmp_path)) is False
        with pytest.raises(OSError):
            owners.hold(str(tmp_path))
    finally:
        os.close(fd)
    assert owners.owner_gone(str(tmp_path)) is True


# -- the node's throttle table: its owner entries ---------------------------------------------------


def _owner_entries(table: Table) -> dict[int, int]:
    """pid -> entry offset of every owner in ``table``."""
    entries = range(_OWNERS0, _OWNERS0 + OWNERS * O_FIELDS, O_FIELDS)
    return {int(table.v[o + O_PID]): o for o in entries if table.v[o + O_PID]}


def test_a_live_throttle_owner_of_another_pid_namespace_keeps_its_entry(tmp_path: Path) -> None:
    path = str(tmp_path / "throttle.bin")
    code = (
        "from blobdata._fetch import Limit, Table, key_id; import time; "
        f"Limit(Table({path!r}), key_id('x')); print('ok', flush=True); time.sleep(120)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        table = Table(path)
        foreign = _dead_pid()
        with table.locked() as v:  # as another container sees the child: a pid not running here
            o = _owner_entries(table)[child.pid]
            v[o + O_PID] = float(foreign)
        Limit(table, key_id("y"))  # joining sweeps every owner
        assert foreign in _owner_entries(table)
    finally:
        child.kill()
        child.communicate(timeout=30)
    Limit(table, key_id("z"))  # the owner is gone with its lock: its entry is swept
    assert foreign not in _owner_entries(table) and os.getpid() in _owner_entries(table)

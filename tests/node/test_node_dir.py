"""The node's shared state lives where ``BLOBDATA_NODE_DIR`` says (issue 40, item 4): a test suite (this
one included) or a job keeps its own, and never reads or disturbs the user's ``/dev/shm/blobdata-<uid>``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blobdata._node import memory_dir, shm_root, user_dir


def test_the_suite_runs_in_its_own_node_state() -> None:
    root = os.environ["BLOBDATA_NODE_DIR"]
    assert shm_root() == root and os.path.basename(root).startswith("blobdata-tests-")
    assert user_dir() == os.path.join(root, f"blobdata-{os.geteuid()}")
    assert user_dir() != f"/dev/shm/blobdata-{os.geteuid()}"


def test_a_private_node_dir_is_made_and_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = tmp_path / "a" / "node"
    monkeypatch.setenv("BLOBDATA_NODE_DIR", str(node))
    assert shm_root() == str(node) and node.is_dir()
    assert user_dir() == str(node / f"blobdata-{os.geteuid()}")
    assert (node / f"blobdata-{os.geteuid()}").stat().st_mode & 0o777 == 0o700
    assert memory_dir() is None  # on a disk: credentials are never shared there


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="needs a writable /dev/shm")
def test_a_node_dir_in_memory_shares_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    node = os.environ["BLOBDATA_NODE_DIR"]
    if not os.path.realpath(node).startswith("/dev/shm/"):
        pytest.skip("the suite's node state is not in /dev/shm")
    assert memory_dir() == user_dir()


def test_subprocesses_inherit_it() -> None:
    code = "from blobdata._node import user_dir; print(user_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == user_dir()

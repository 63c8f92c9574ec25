"""Another user of the node, for trust tests: a forked child that drops to :data:`OTHER_UID` (setgid,
setuid) and does what an attacker sharing the machine could do; skipped where the tests are not root."""

from __future__ import annotations

import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import wait_child

#: A uid (and gid) no account of the test machine has.
OTHER_UID = 54321


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("another user of the node needs root (fork, then setuid to another uid)")


def as_other_user(action: Callable[[], object], *, timeout_s: float = 30.0) -> None:
    """Run ``action`` in a forked child as uid and gid :data:`OTHER_UID` (no supplementary groups); the
    test fails with the child's traceback if ``action`` raises. The child never returns to pytest."""
    needs_root()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the other user, act, and leave without running pytest's atexit
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            assert os.geteuid() == OTHER_UID
            action()
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(code)
    os.close(write)
    code = wait_child(pid, timeout_s)
    with os.fdopen(read, "rb") as fh:
        told = fh.read().decode("utf-8", "replace")
    assert code == 0, f"the other user's action failed:\n{told}"


@contextmanager
def shared_place() -> Iterator[Path]:
    """A new directory both users can reach (mode 0755, in the temporary directory: pytest's own
    ``tmp_path`` lies under a 0700 directory the other user cannot enter); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="blobdata-trust-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

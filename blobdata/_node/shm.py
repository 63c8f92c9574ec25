"""Where the node's shared state lives, and its one naming rule.

Everything blobdata shares between the processes of a node lives in one directory per user,
``<root>/blobdata-<uid>/`` (mode 0700, checked without following links by
:func:`~blobdata._node.owners.per_user_dir`), where ``<root>`` is ``BLOBDATA_NODE_DIR`` when set (a
private node state: a test suite run beside live jobs uses its own), else ``/dev/shm`` (memory: the
plans and counters of a running loader are rewritten every epoch) or, where there is none, the
temporary directory. Inside it, names say what a thing is and who made it:

========================  ====================================================================
``throttle-v1.bin``       the node's throttle table (one per user, shared by every process)
``plan-<pid>-<rand>/``    one loader's plan channel and its processes' counters
``copies-<pid>-<rand>/``  one process's temporary copies of objects, for a ``loader=`` that asks for a path
``verified/``             markers of manifest files whose checksum passed on this node
``credentials-*.json``    refreshable AWS credentials resolved once per node (only in ``/dev/shm``)
========================  ====================================================================

A thing named ``<kind>-<pid>-...`` belongs to the process ``pid``; once that process is gone,
:func:`sweep` removes it (a process killed by SIGKILL cannot remove its own, and ``/dev/shm`` is memory).
A directory made by :func:`make_locked_dir` holds its owner's lock for the owner's life, so an owner
in another pid namespace (containers sharing ``/dev/shm``) is never taken for dead; one without a lock
is judged by its pid and start time. Nothing outside this user's directory is ever swept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from .. import _process
from .._config import env
from .owners import alive, hold, owner_gone, per_user_dir, remove_owned_tree

__all__ = ["make_locked_dir", "make_owned_dir", "memory_dir", "shm_root", "sweep", "user_dir"]

_SHM = "/dev/shm"


def shm_root() -> str:
    """``BLOBDATA_NODE_DIR`` when set (a test suite's, or a job's, private node state); else ``/dev/shm``
    where it is a directory this process may write, else the temporary directory."""
    chosen = env("BLOBDATA_NODE_DIR")
    if chosen is not None:
        path = os.path.abspath(os.path.expanduser(chosen))
        with contextlib.suppress(OSError):
            os.makedirs(path, mode=0o700, exist_ok=True)
        return path
    if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK):
        return _SHM
    return tempfile.gettempdir()


def _in_memory(path: str) -> bool:
    real = os.path.realpath(path)
    return real == _SHM or real.startswith(_SHM + "/")


def user_dir(root: str | None = None) -> str | None:
    """This user's directory of node-shared state (made if missing, mode 0700); None when the path
    is something else (a link, another user's, open to others): then nothing is shared."""
    return per_user_dir(root or shm_root(), f"blobdata-{os.geteuid()}")


def memory_dir() -> str | None:
    """:func:`user_dir` only where it is memory (``/dev/shm``): for what must never reach a disk
    (credentials); None elsewhere, and then nothing of the kind is shared."""
    root = shm_root()
    return user_dir(root) if _in_memory(root) else None


def make_owned_dir(kind: str, root: str | None = None) -> str:
    """A new directory ``<kind>-<pid>-<random>`` (mode 0700) of this process in this user's directory,
    after sweeping those of dead processes; in ``root`` itself when the user's directory is unusable."""
    parent = user_dir(root) or root or shm_root()
    sweep(kind, parent)
    path = tempfile.mkdtemp(prefix=f"{kind}-{_process.pid()}-", dir=parent)
    os.chmod(path, 0o700)
    return path


def make_locked_dir(kind: str, root: str | None = None) -> tuple[str, int]:
    """As :func:`make_owned_dir`, holding the directory's owner lock (the descriptor returned: keep it
    open while the directory is in use). The lock is taken before the directory bears its owner's
    name, so a sweeper never sees it unlocked."""
    parent = user_dir(root) or root or shm_root()
    sweep(kind, parent)
    tmp = tempfile.mkdtemp(prefix=f".{kind}-new-", dir=parent)
    os.chmod(tmp, 0o700)
    try:
        lock = hold(tmp)
        path = os.path.join(parent, f"{kind}-{_process.pid()}-{tmp.rpartition('-')[2]}")
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path, lock


def sweep(kind: str, parent: str | None = None) -> list[str]:
    """Remove the directories ``<kind>-<pid>-*`` in ``parent`` (this user's directory by default) whose
    process is gone: a pid now held by a process that started after the directory was last written is
    another process, so its owner is gone too. Only this user's directories, never through a link.
    Returns the paths removed."""
    parent = parent or user_dir()
    removed: list[str] = []
    if parent is None:
        return removed
    prefix = f"{kind}-"
    try:
        names = [n for n in os.listdir(parent) if n.startswith(prefix)]
    except OSError:
        return removed
    uid = os.geteuid()
    for name in names:
        pid_text = name[len(prefix) :].partition("-")[0]
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not pid_text.isdigit() or st.st_uid != uid or int(pid_text) == _process.pid():
            continue
        gone = owner_gone(path)  # by the owner's lock, whatever pid namespace it ran in
        if gone is None:  # no lock: judged by pid and start time
            gone = not alive(int(pid_text), since=st.st_mtime)
        if gone and remove_owned_tree(path):
            removed.append(path)
    return removed

"""Who owns what this user left in shared places: is the process that made it still running?

blobdata keeps node-local state outside any one process: each loader's plan channel in ``/dev/shm``
and the node-wide throttle state (:mod:`blobdata._fetch.throttle`). A process killed by SIGKILL (the OOM
killer, a preempted node) cannot remove its share, so whoever comes next sweeps what dead owners
left. An owner is named by its pid and, where the system tells it (Linux ``/proc``), the time it
started: a pid reused by another process since is not mistaken for the owner.

A pid proves nothing across pid namespaces: containers of one pod share ``/dev/shm`` but not their
pids, so a live owner in another container looks dead here. So an owner also proves that it lives
with a lock it holds for its whole life (:func:`hold`: an exclusive ``flock`` on ``.owner.lock`` in
its directory; the kernel drops it when the owner exits, however it dies, and it is the same lock in
every pid namespace). A sweeper that can take that lock knows the owner is gone (:func:`owner_gone`);
the pid is only a fallback for directories made before the lock existed.

Only this user's things are ever looked at or removed (checked by ``lstat``, never following a link).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import struct
import sys

from .. import _process

__all__ = [
    "LOCK_NAME",
    "SlotLocks",
    "alive",
    "hold",
    "owner_gone",
    "per_user_dir",
    "remove_owned_tree",
    "started",
]

LOCK_NAME = ".owner.lock"

_BOOT: float | None = None
_TICKS = 100.0


def _boot_time() -> float:
    global _BOOT, _TICKS
    if _BOOT is None:
        _BOOT = 0.0
        with contextlib.suppress(OSError, ValueError), open("/proc/stat", "rb") as fh:
            for line in fh:
                if line.startswith(b"btime "):
                    _BOOT = float(line.split()[1])
                    break
        with contextlib.suppress(ValueError, OSError, AttributeError):
            _TICKS = float(os.sysconf("SC_CLK_TCK"))
    return _BOOT


def _stat(pid: int) -> tuple[str, float] | None:
    """(state letter, start time in seconds since the epoch) of process ``pid`` from ``/proc``; None
    where there is no ``/proc`` entry to read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read(4096)
    except OSError:
        return None
    # The fields after the command name, which may hold spaces and parentheses: from the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    boot = _boot_time()
    if len(fields) < 20:
        return None
    try:
        return fields[0].decode("ascii", "replace"), (boot + int(fields[19]) / _TICKS) if boot else 0.0
    except ValueError:
        return None


def started(pid: int) -> float:
    """When process ``pid`` started (seconds since the epoch, 10 ms resolution); 0.0 where unknown."""
    st = _stat(pid)
    return st[1] if st is not None else 0.0


def alive(pid: int, since: float = 0.0) -> bool:
    """Whether the owner ``pid`` still runs (a zombie does not). With ``since`` (its :func:`started`,
    or a time it is known to have been alive at), a process with that pid that started later is
    another one."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid now: ours would answer
        return False
    except OSError:
        return True
    st = _stat(pid)
    if st is None:
        return True
    state, began = st
    if state in ("Z", "X"):  # exited, not yet reaped by its parent
        return False
    return not (since > 0.0 and began and began > since + 1.0)  # started after: a reused pid


def per_user_dir(root: str, name: str) -> str | None:
    """``root/name`` as a directory of this user's only (mode 0700), made if missing; None if that
    path is something else (a link, another user's, open to others): nothing is used then."""
    path = os.path.join(root, name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path


def remove_owned_tree(path: str) -> bool:
    """Remove the directory ``path`` if it is this user's (not a link); whether it went."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def hold(directory: str) -> int:
    """Take the owner's lock of ``directory`` (this process made it); returns the descriptor, to keep
    open for as long as the directory is in use (closing it lets a sweeper remove the directory).
    Forked children share the lock; OSError if another process holds it."""
    fd = os.open(
        os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def owner_gone(directory: str) -> bool | None:
    """Whether the process that holds ``directory``'s owner lock has exited, in whatever pid namespace
    it ran: True if the lock can be taken, False if it is held (or the lock file is not this user's
    regular file), None if the directory has no lock file (made before the lock existed: judge by
    :func:`alive`)."""
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK)
        return False
    finally:
        os.close(fd)  # drops the lock just taken
    return True


#: Byte-range locks owned by the open file (Linux's OFD locks), where this system has them: unlike a
#: process's POSIX record locks, they are not all dropped when the process closes any descriptor of
#: the file (some other code in it reading the node's directory, say).
_OFD = sys.platform == "linux" and hasattr(fcntl, "F_OFD_SETLK") and struct.calcsize("P") == 8


def _range_lock(fd: int, slot: int, *, take: bool) -> None:
    """Take (without waiting: OSError if another holds it) or drop the lock on byte ``slot`` of ``fd``."""
    if _OFD:  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for an OFD lock), as the kernel's
        kind = fcntl.F_WRLCK if take else fcntl.F_UNLCK
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", kind, os.SEEK_SET, slot, 1, 0))
    else:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if take else fcntl.LOCK_UN, 1, slot)


class SlotLocks:
    """Liveness of the owners of a table's slots, by lock: a process holds a lock on byte ``slot`` of
    the file ``path`` for as long as it owns that slot (:meth:`claim`, :meth:`release`; the kernel
    drops it when the process exits), and a sweeper that can take a slot's byte knows its owner is
    gone (:meth:`gone`), whatever pid namespace it ran in. One object per process, whose descriptor
    stays open: the locks are the open file's (:data:`_OFD`; else the process's POSIX record locks,
    which closing any descriptor of the file would drop). A forked child closes its inherited copy of
    the descriptor first thing, so that a dead parent's slots are not kept held by its children.
    OSError if ``path`` cannot be opened as this user's own file."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise PermissionError(f"{path} is not a file of this user's only")
        self._fd = fd
        self._mine: set[int] = set()
        _slot_files[fd] = self

    def claim(self, slot: int) -> bool:
        """Hold ``slot``'s lock; False if another live process holds it."""
        if slot not in self._mine:
            try:
                _range_lock(self._fd, slot, take=True)
            except OSError:
                return False
            self._mine.add(slot)
        return True

    def release(self, slot: int) -> None:
        if slot in self._mine:
            self._mine.discard(slot)
            with contextlib.suppress(OSError):
                _range_lock(self._fd, slot, take=False)

    def gone(self, slot: int) -> bool:
        """Whether nobody holds ``slot``'s lock (its owner exited, or never took one)."""
        if slot in self._mine:
            return False
        try:
            _range_lock(self._fd, slot, take=True)
        except OSError:
            return False
        with contextlib.suppress(OSError):
            _range_lock(self._fd, slot, take=False)
        return True


#: This process's :class:`SlotLocks`, by descriptor (each open for the process's whole life).
_slot_files: dict[int, SlotLocks] = {}


def _forget_inherited() -> None:
    """In a forked child: the parent's locks stay the parent's. Its descriptors are closed here (an
    inherited object is left unusable: no lock to take or test); the child opens its own."""
    for fd, locks in list(_slot_files.items()):
        locks._fd, locks._mine = -1, set()
        with contextlib.suppress(OSError):
            os.close(fd)
    _slot_files.clear()


_process.at_fork(after_in_child=_forget_inherited)

"""State shared by the processes of one node and owned by one user: where it lives (one directory
per user, one naming rule), who owns what, and sweeping what dead owners left.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``shm``            ``/dev/shm/blobdata-<uid>/``: the root, the naming rule, owned dirs, the sweep
``owners``         is the process that left shared state behind still running (pid, start time)
``files``          files ranks hand each other: read only if this user's own, written following no link
=================  ==========================================================================
"""

from __future__ import annotations

from . import shm
from .files import check_shared_dir, is_own, open_own, read_own, write_own
from .owners import alive, per_user_dir, remove_owned_tree, started
from .shm import make_locked_dir, make_owned_dir, memory_dir, shm_root, sweep, user_dir

__all__ = [
    "alive",
    "check_shared_dir",
    "is_own",
    "make_locked_dir",
    "make_owned_dir",
    "memory_dir",
    "open_own",
    "per_user_dir",
    "read_own",
    "remove_owned_tree",
    "shm",
    "shm_root",
    "started",
    "sweep",
    "user_dir",
    "write_own",
]

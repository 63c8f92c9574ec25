"""State shared by the processes of one node and owned by one user: who owns what, and sweeping
what dead owners left.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``owners``         is the process that left shared state behind still running (pid, start time)
``files``          files ranks hand each other: read only if this user's own, written following no link
=================  ==========================================================================
"""

from __future__ import annotations

from .files import check_shared_dir, read_own, write_own
from .owners import alive, per_user_dir, remove_owned_tree, started

__all__ = [
    "alive",
    "check_shared_dir",
    "per_user_dir",
    "read_own",
    "remove_owned_tree",
    "started",
    "write_own",
]

"""State shared by the processes of one node and owned by one user: who owns what, and sweeping
what dead owners left.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``owners``         is the process that left shared state behind still running (pid, start time)
=================  ==========================================================================
"""

from __future__ import annotations

from .owners import alive, per_user_dir, remove_owned_tree, started

__all__ = ["alive", "per_user_dir", "remove_owned_tree", "started"]

"""One listing per job: the ranks meet (a process group, torchrun's store, or the shared directory),
list together or receive rank 0's listing, and each node may keep only its share.

================  ==========================================================================
module            its one job
================  ==========================================================================
``distributed``   ranks; one listing per job, the node's ranks map one file
``split``         the listing split across the job: folders by ticket, key ranges claimed on the
                  store, parts joined on rank 0
``share``         a node's share of a manifest, cut from its file a slice at a time, mapped alone
================  ==========================================================================
"""

from __future__ import annotations

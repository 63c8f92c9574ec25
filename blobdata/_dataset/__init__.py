"""Where samples come from: :class:`FolderDataset` (ImageFolder's contract over a bucket URL) and the
DataLoader it returns.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``folder``         :class:`FolderDataset`: a listing, the fetch engine, the cache and decode as
                   ImageFolder's contract
``imagefolder``    ImageFolder's attributes and hooks: ``samples``/``targets``/``imgs``, overrides
``loader``         :class:`BlobLoader`: the DataLoader ``ds.dataloader()`` returns
=================  ==========================================================================

Importing this package imports torch.
"""

from __future__ import annotations

from .folder import FolderDataset
from .loader import BlobLoader

__all__ = ["BlobLoader", "FolderDataset"]

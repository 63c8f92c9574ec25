"""Where samples come from: :class:`FolderDataset` (ImageFolder's contract over a bucket URL) and the
DataLoader it returns.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``base``           what every dataset shares: per-process engine and cache, look-ahead, loader
``blob``           :class:`BlobDataset`: any folder, samples of several objects, metadata, index
``folder``         :class:`FolderDataset`: a listing, the fetch engine, the cache and decode as
                   ImageFolder's contract
``imagefolder``    ImageFolder's attributes and hooks: ``samples``/``targets``/``imgs``, overrides
``loader``         :class:`BlobLoader`: the DataLoader ``ds.dataloader()`` returns
``mixture``        :class:`Mixture`: several datasets as one stream, by weight, split per batch
=================  ==========================================================================

Importing this package imports torch.
"""

from __future__ import annotations

from .blob import BlobDataset
from .folder import FolderDataset
from .loader import BlobLoader
from .mixture import Mixture

__all__ = ["BlobDataset", "BlobLoader", "FolderDataset", "Mixture"]

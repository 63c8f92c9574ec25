"""How the folder is known: ImageFolder's rules over what a store lists, the listing kept as a
compact manifest and remembered on disk, and one listing per job shared from rank 0.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``folders``        ImageFolder's rules (classes, extensions, order); the remembered listing
``manifest``       :class:`Manifest`: the listing as numpy arrays, saved and loaded without pickle
``filters``        what identifies an ``is_valid_file`` filter, so a listing is reused only for it
``distributed``    ranks, and one listing per job (rank 0 lists, the others receive it)
=================  ==========================================================================
"""

from __future__ import annotations

from .distributed import dist_info, env_info, shared_file, shared_manifest
from .filters import UNIDENTIFIED, filter_identity
from .folders import IMG_EXTENSIONS, identity_from_info, list_folder, list_with, listing_params, load_or_list
from .manifest import Manifest, manifest_path

__all__ = [
    "IMG_EXTENSIONS",
    "UNIDENTIFIED",
    "Manifest",
    "dist_info",
    "env_info",
    "filter_identity",
    "identity_from_info",
    "list_folder",
    "list_with",
    "listing_params",
    "load_or_list",
    "manifest_path",
    "shared_file",
    "shared_manifest",
]

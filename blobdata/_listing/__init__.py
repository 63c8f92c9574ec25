"""How the folder is known: ImageFolder's rules over what a store lists, the listing kept as a
compact manifest and remembered on disk, and one listing per job shared from rank 0.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``folders``        ImageFolder's rules (classes, extensions, order) over what a store lists
``remembered``     the remembered listing: saved per folder and options, reused while it holds
``manifest``       :class:`Manifest`: the listing as numpy arrays, saved and loaded without pickle
``mapping``        a manifest file mapped read-only and checked, shared by a node's processes
``packed``         the on-disk form both saved listings share (checksummed, arrays aligned)
``bulk``           ImageFolder's rules applied to a lister's columns with numpy, in bulk
``filters``        what identifies an ``is_valid_file`` filter, so a listing is reused only for it
``job``            one listing per job: rank 0 reads or the ranks list together; a node's share
``flat``           every object below a folder (a BlobDataset's listing), remembered
``samples``        webdataset's key rule; :class:`SampleTable`, the samples of a BlobDataset
``metadata``       Hugging Face's metadata files (``file_name`` columns) as samples
``index``          index files and S3 Inventory reports instead of a listing
``build``          which of those makes a BlobDataset's samples
``tablefile``      a SampleTable saved (an index converted once) and loaded without parsing
=================  ==========================================================================

Table files themselves (CSV, JSON Lines, Parquet) are read by :mod:`blobdata._tables`.
"""

from __future__ import annotations

from .build import METADATA_NAMES, build_table
from .filters import UNIDENTIFIED, filter_identity
from .flat import FLAT_PARAMS, list_flat, load_or_list_flat
from .folders import IMG_EXTENSIONS, identity_from_info, list_folder, list_with, listing_params, load_or_list
from .job.distributed import DistInfo, dist_info, env_info, shared_file, shared_manifest, shared_table
from .job.share import ShareManifest, cut_share, share_in_memory
from .job.split import help_list
from .manifest import Manifest, manifest_path
from .metadata import find_metadata
from .remembered import REMEMBERED_RECORD, load_remembered
from .samples import Member, SampleTable, split_key
from .tablefile import is_table, load_table, save_table, table_from_bytes, table_to_bytes

__all__ = [
    "DistInfo",
    "FLAT_PARAMS",
    "IMG_EXTENSIONS",
    "METADATA_NAMES",
    "REMEMBERED_RECORD",
    "Member",
    "SampleTable",
    "build_table",
    "find_metadata",
    "list_flat",
    "load_or_list_flat",
    "split_key",
    "is_table",
    "load_table",
    "save_table",
    "table_from_bytes",
    "table_to_bytes",
    "UNIDENTIFIED",
    "Manifest",
    "ShareManifest",
    "cut_share",
    "share_in_memory",
    "dist_info",
    "env_info",
    "filter_identity",
    "help_list",
    "identity_from_info",
    "list_folder",
    "list_with",
    "listing_params",
    "load_or_list",
    "load_remembered",
    "manifest_path",
    "shared_file",
    "shared_manifest",
    "shared_table",
]

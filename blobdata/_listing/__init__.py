"""How the folder is known: ImageFolder's rules over what a store lists, the listing kept as a
compact manifest and remembered on disk, and one listing per job shared from rank 0.

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``folders``        ImageFolder's rules (classes, extensions, order); the remembered listing
``manifest``       :class:`Manifest`: the listing as numpy arrays, saved and loaded without pickle
``filters``        what identifies an ``is_valid_file`` filter, so a listing is reused only for it
``distributed``    ranks, and one listing (and index) per job: rank 0 reads, the others receive it
``flat``           every object below a folder (a BlobDataset's listing), remembered
``samples``        webdataset's key rule; :class:`SampleTable`, the samples of a BlobDataset
``metadata``       Hugging Face's metadata files (``file_name`` columns) as samples
``index``          index files and S3 Inventory reports instead of a listing
``tables``         rows of a CSV, JSONL or Parquet file, local or in a bucket
``parquet``        a Parquet file's rows, a row group and a batch at a time, each bounded
``columns``        their columns typed as the owners type them (pandas for CSV, pyarrow for JSONL)
``build``          which of those makes a BlobDataset's samples
``tablefile``      a SampleTable saved (an index converted once) and loaded without parsing
=================  ==========================================================================
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

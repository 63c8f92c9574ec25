"""The command line (``blobdata warm|ls|bench|cache|demo``) and what its commands do, including the
library's :func:`warm_cache` (``blobdata.warm``).

=================  ==========================================================================
module             its one job
=================  ==========================================================================
``main``           the parser, the entry point, exit codes and one-line errors
``commands``       what ``ls``, ``warm``, ``cache info|trim|clear`` do
``layout``         class folders or what BlobDataset reads: asked for, or found; the line saying it
``ls_samples``     ``ls`` of a folder read as a BlobDataset: samples, members, fields
``warm_objects``   :func:`blobdata.warm` of a BlobDataset: every member of every sample
``warm``           ``blobdata warm`` / :func:`blobdata.warm`: fill a cache ahead of training
``warm_summary``   what a warm did (:class:`WarmSummary`) and its exit code
``bench``          ``blobdata bench``: where a loader's time goes, with a verdict
``demo``           ``blobdata demo``: a local S3 server, a synthetic dataset, one epoch
=================  ==========================================================================
"""

from __future__ import annotations

from . import warm
from .bench import BenchResult, advise, plot, run_bench
from .main import entry, main, parse_storage_options
from .warm import human_size
from .warm_objects import warm_cache
from .warm_summary import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, WarmSummary

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "BenchResult",
    "WarmSummary",
    "advise",
    "entry",
    "human_size",
    "main",
    "parse_storage_options",
    "plot",
    "run_bench",
    "warm",
    "warm_cache",
]

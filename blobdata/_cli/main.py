"""The ``blobdata`` command line: warm a cache before training, inspect or clear it, list a folder.

::

    blobdata warm s3://bucket/train --cache-dir /mnt/nvme/blobdata [--rank R --world-size N]
    blobdata warm s3://bucket/train --cache-dir /mnt/nvme/blobdata --nnodes N --node-rank R
    blobdata ls s3://bucket/train [--json] [--save-manifest PATH_OR_URL]
    blobdata bench s3://bucket/train [--workers W --batch-size B --lookahead L --plot P.png --json]
    blobdata cache info --cache-dir D
    blobdata cache trim --cache-dir D [--cache-size S] [URL --nnodes N --node-rank R]
    blobdata cache clear --cache-dir D --yes
    blobdata demo
    blobdata serve --demo            # a local S3 server with a generated dataset, until Ctrl-C

Exit codes: 0 success; 1 runtime failure (missing bucket, refused credentials, objects that could not
be fetched, unusable cache); 2 usage or configuration error (bad URL, size, option, manifest);
130 interrupted (Ctrl-C). Errors print one line ``blobdata: error: <message>`` (``--debug`` adds the
traceback). Storage options are printed only through :func:`blobdata._stores.options.redact`.

Sharding (``warm --rank R --world-size N``): node R warms the samples whose index ``i`` in the
listing (ImageFolder order) satisfies ``i % N == R``, so ranks ``0..N-1`` together warm every sample
exactly once, and each node's share is known without talking to the others. ``warm --nnodes N
--node-rank R`` warms instead what node R reads in training: under ``blobdata.PartitionedSampler``
(``--sampler partitioned``, the default) its fixed share, the same every epoch, after evicting from
the cache first what that share does not need; under ``--sampler distributed`` its share of one
epoch (``--epoch``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import traceback
from collections.abc import Callable

from .._errors import BlobdataError, ConfigError, ManifestError
from .._url import printable
from . import bench as _bench
from .commands import (
    EscapingFormatter,
    cmd_bench,
    cmd_cache_clear,
    cmd_cache_info,
    cmd_cache_trim,
    cmd_ls,
    cmd_warm,
    parse_storage_options,
)
from .layout import add_layout_args
from .warm_summary import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE

__all__ = ["main", "parse_storage_options"]

log = logging.getLogger("blobdata")


# -- parser and entry point ----------------------------------------------------------------------


def _listing_parent(*, url_required: bool) -> argparse.ArgumentParser:
    listing = argparse.ArgumentParser(add_help=False)
    listing.add_argument(
        "url", nargs=None if url_required else "?",
        help="dataset folder: s3://bucket/prefix, gs://..., az://..., or a local path",
    )  # fmt: skip
    listing.add_argument(
        "--manifest", help="use this saved listing (path or URL) instead of listing the bucket"
    )
    listing.add_argument(
        "--refresh", action="store_true", help="list the bucket again even if a listing is remembered"
    )
    listing.add_argument(
        "--extensions", help="comma-separated file extensions (default: torchvision's image ones)"
    )
    listing.add_argument(
        "--storage-option", "-o", action="append", metavar="KEY=VALUE",
        help="fsspec storage option (repeatable; dotted keys nest: client_kwargs.region_name=eu-west-1)",
    )  # fmt: skip
    listing.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    listing.add_argument(
        "--quiet", "-q", action="store_true", help="no progress bars (shown only on a terminal anyway)"
    )
    listing.add_argument(
        "--allow-empty", action="store_true",
        help="accept class folders without a valid file (as allow_empty=True)",
    )
    listing.add_argument(
        "--split-listing", action="store_true",
        help="list the folder together with the other nodes (--nnodes/--node-rank, or torchrun's variables): "
        "each lists a part, node 0 joins them; every node runs the command at once and shares "
        "BLOBDATA_SHARED_DIR",
    )  # fmt: skip

    return listing


def _share_args(p: argparse.ArgumentParser) -> None:
    """--nnodes and the options that say which samples a node reads."""
    p.add_argument(
        "--nnodes", type=int, default=None,
        help="this node's share as training reads it, with this many nodes (default: torchrun's variables)",
    )  # fmt: skip
    p.add_argument("--node-rank", type=int, default=None, help="this node (default: GROUP_RANK)")
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="ranks per node (default: LOCAL_WORLD_SIZE, 1)"
    )
    p.add_argument(
        "--sampler", choices=["partitioned", "distributed"], default="partitioned",
        help="partitioned (default): the node's fixed share under blobdata.PartitionedSampler, the same "
        "every epoch; distributed: its share of epoch --epoch under (Elastic)DistributedSampler",
    )  # fmt: skip
    p.add_argument(
        "--num-canonical-nodes", type=int, default=None,
        help="PartitionedSampler's num_canonical_nodes (checked against --nnodes; default --nnodes)",
    )  # fmt: skip
    p.add_argument("--epoch", type=int, default=0, help="with --sampler distributed: the epoch (default 0)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs"
    )
    listing = _listing_parent(url_required=True)
    layout = argparse.ArgumentParser(add_help=False)
    add_layout_args(layout)
    parser = argparse.ArgumentParser(
        prog="blobdata", description="Train PyTorch models straight from a bucket folder.", parents=[common]
    )
    parser.add_argument("--version", action="version", version=f"blobdata {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    w = sub.add_parser(
        "warm", parents=[common, listing, layout], help="fill a local cache with a folder's objects"
    )
    w.add_argument("--cache-dir", required=True, help="cache directory (an SSD)")
    w.add_argument(
        "--cache-size",
        help="raise the cache's size bound to this, e.g. 100GB or 512GiB (default: the bound stored in the "
        "cache, 100GB for a new one; a smaller one shrinks nothing: use blobdata cache trim --cache-size)",
    )
    w.add_argument("--cache-policy", choices=["admit", "lru"], default="admit", help="admit (default) or lru")
    w.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be fetched and whether it fits; fetch nothing",
    )
    w.add_argument(
        "--rank",
        type=int,
        default=0,
        help="this node's rank: it warms samples i with i %% world-size == rank",
    )
    w.add_argument("--world-size", type=int, default=1, help="number of nodes sharing the work (default 1)")
    _share_args(w)
    w.add_argument(
        "--buffer-size", default="256MiB", help="fetched bytes held in memory at most (default 256MiB)"
    )
    w.add_argument("--no-progress", action="store_true", help="no progress bar (as --quiet)")
    w.set_defaults(func=cmd_warm)

    ls = sub.add_parser(
        "ls",
        parents=[common, listing, layout],
        help="list a folder: its layout, classes or samples, objects, bytes",
    )
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--nnodes", type=int, default=None, help="with --split-listing: the nodes that list")
    ls.add_argument("--node-rank", type=int, default=None, help="with --split-listing: this node")
    ls.add_argument(
        "--save-manifest", metavar="PATH_OR_URL",
        help="write the listing there for other nodes (with --index: the samples, converted once; "
        "BlobDataset(URL, index=PATH) loads them without parsing)",
    )  # fmt: skip
    ls.set_defaults(func=cmd_ls)

    cache = sub.add_parser("cache", parents=[common], help="inspect or clear a local cache")
    csub = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    csub.required = True
    info = csub.add_parser("info", parents=[common], help="directory, entries, bytes, limit, how far over it")
    info.add_argument("--cache-dir", required=True, help="the cache directory (nothing is created in it)")
    info.add_argument("--cache-size", help="the size bound its users set, to show the free room (e.g. 100GB)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=cmd_cache_info)
    trim = csub.add_parser(
        "trim", parents=[common, _listing_parent(url_required=False)],
        help="evict down to the limit, first what a node's share (URL --nnodes N --node-rank R) "
        "does not need",
    )  # fmt: skip
    trim.add_argument("--cache-dir", required=True, help="the cache directory to trim")
    trim.add_argument(
        "--cache-size", help="the limit to trim to, stored as the cache's bound (default: the stored bound)"
    )
    _share_args(trim)
    trim.set_defaults(func=cmd_cache_trim)
    clear = csub.add_parser("clear", parents=[common], help="remove every entry")
    clear.add_argument("--cache-dir", required=True, help="the cache directory to empty")
    clear.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    clear.set_defaults(func=cmd_cache_clear)

    _bench.add_parser(sub, [common, listing, layout], cmd_bench)

    sub.add_parser(
        "demo", help="train a small model from a local S3 server and a generated dataset", add_help=False
    )
    sub.add_parser(
        "serve", help="a local S3 server until Ctrl-C (--demo: with a generated dataset); prints the exports",
        add_help=False,
    )  # fmt: skip
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def entry() -> None:
    """The console script: dies quietly on a closed pipe (``blobdata ls ... | head -1``), as other
    command-line tools do, instead of printing BrokenPipeError."""
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())


def _demo(argv: list[str]) -> int:
    from .demo import main as demo_main

    return int(demo_main(argv) or 0)


def _serve(argv: list[str]) -> int:
    from ..testing.serve import main as serve_main

    try:
        return serve_main(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, printed by argparse)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    handler: logging.Handler | None = None
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(EscapingFormatter("blobdata: %(levelname)s: %(message)s"))
        handler.addFilter(_said_by_the_command)
        log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        return _main(argv, debug)
    finally:
        log.setLevel(old_level)
        if handler is not None:
            log.removeHandler(handler)


def _said_by_the_command(record: logging.LogRecord) -> bool:
    """A remembered listing is said by the command's own line (with its age and --refresh): the
    library's warning for it is left out."""
    from .._listing import REMEMBERED_RECORD

    return not hasattr(record, REMEMBERED_RECORD)


def _main(argv: list[str], debug: bool) -> int:
    rest = [a for a in argv if a != "--debug"]
    if rest and rest[0] == "demo":
        return _guarded(lambda: _demo(rest[1:]), debug)
    if rest and rest[0] == "serve":
        return _guarded(lambda: _serve(rest[1:]), debug)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed by argparse)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    return _guarded(lambda: int(args.func(args)), debug)


def _guarded(fn: Callable[[], int], debug: bool) -> int:
    """Run a command; map errors to one line on stderr and an exit code."""
    try:
        return fn()
    except KeyboardInterrupt:
        print("\nblobdata: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ConfigError, ManifestError) as exc:
        return _report(exc, EXIT_USAGE, debug)
    except (BlobdataError, OSError) as exc:
        return _report(exc, EXIT_FAILED, debug)


def _report(exc: BaseException, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    message = str(exc) if isinstance(exc, BlobdataError) else f"{type(exc).__name__}: {exc}"
    # A message names URLs and keys from a bucket or an index: escaped, it stays one line of text.
    print(f"blobdata: error: {printable(message)}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

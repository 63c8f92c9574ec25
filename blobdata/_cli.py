"""The ``blobdata`` command line: warm a cache before training, inspect or clear it, list a folder.

::

    blobdata warm s3://bucket/train --cache-dir /mnt/nvme/blobdata [--rank R --world-size N]
    blobdata ls s3://bucket/train [--json] [--save-manifest PATH_OR_URL]
    blobdata cache info --cache-dir D
    blobdata cache clear --cache-dir D --yes
    blobdata demo

Exit codes: 0 success; 1 runtime failure (missing bucket, refused credentials, objects that could not
be fetched, unusable cache); 2 usage or configuration error (bad URL, size, option, manifest);
130 interrupted (Ctrl-C). Errors print one line ``blobdata: error: <message>`` (``--debug`` adds the
traceback). Storage options are printed only through :func:`blobdata._stores.options.redact`.

Sharding (``warm --rank R --world-size N``): node R warms the samples whose index ``i`` in the
listing (ImageFolder order) satisfies ``i % N == R``, so ranks ``0..N-1`` together warm every sample
exactly once, and each node's share is known without talking to the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._config import parse_size
from ._errors import BlobdataError, ConfigError, ManifestError
from ._stores.options import redact, resolve_storage_options
from ._url import parse_url
from ._warm import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    human_size,
    open_cache,
    print_summary,
    used_bytes,
    warm,
)

__all__ = ["main", "parse_storage_options"]

log = logging.getLogger("blobdata")

_SECRET_WORDS = ("secret", "token", "password", "key", "credential", "sas", "connection", "signature")


# -- small helpers -------------------------------------------------------------------------------


def parse_storage_options(items: Sequence[str]) -> dict[str, Any]:
    """``["k=v", "client_kwargs.region_name=x"]`` -> nested dict.

    Dotted keys nest; values ``true``/``false``/``null``, numbers and JSON objects or lists are
    decoded, except for secret-looking keys, whose values always stay strings (and never appear in
    an error message).
    """
    out: dict[str, Any] = {}
    for n, item in enumerate(items, 1):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--storage-option expects key=value; occurrence {n} has no key or no '='")
        value: Any = raw
        secret = any(w in key.lower() for w in _SECRET_WORDS)
        if not secret and raw and (raw in ("true", "false", "null") or raw[0] in "{[-0123456789"):
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--storage-option {key}: {part!r} is set both as a value and as a group")
            node = child
        node[leaf] = value
    return out


def _extensions(text: str | None) -> tuple[str, ...] | None:
    if not text:
        return None
    exts = tuple(
        e.strip() if e.strip().startswith(".") else "." + e.strip() for e in text.split(",") if e.strip()
    )
    return exts or None


def _manifest_for(args: argparse.Namespace, url: str, storage_options: dict[str, Any]) -> Any:
    """The listing of ``url``: ``--manifest``, else the remembered one, else a fresh listing."""
    from ._listing import load_or_list

    return load_or_list(
        url,
        storage_options=storage_options,
        refresh=args.refresh,
        manifest=args.manifest,
        extensions=_extensions(args.extensions),
        is_valid_file=None,
        allow_empty=False,
        concurrency=args.concurrency,
    )


# -- warm ----------------------------------------------------------------------------------------


def _cmd_warm(args: argparse.Namespace) -> int:
    url = str(parse_url(args.url))
    opts = parse_storage_options(args.storage_option or [])
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be a positive integer, got {args.concurrency}")
    size = parse_size(args.cache_size, name="--cache-size")
    parse_size(args.buffer_size, name="--buffer-size")
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise ConfigError(
            f"--rank must be in 0..{args.world_size - 1} for --world-size {args.world_size}, got {args.rank}"
        )
    log.debug("storage options: %s", redact(opts))
    resolved = resolve_storage_options(parse_url(url).protocol, opts)
    t0 = time.monotonic()
    manifest = _manifest_for(args, url, resolved)
    log.debug("listing of %s: %d objects in %.2fs", url, len(manifest), time.monotonic() - t0)
    summary = warm(
        url,
        cache_dir=args.cache_dir,
        cache_size=size,
        cache_policy=args.cache_policy,
        storage_options=resolved,
        concurrency=args.concurrency,
        rank=args.rank,
        world_size=args.world_size,
        manifest=manifest,
        buffer_size=args.buffer_size,
        progress=not args.no_progress,
        dry_run=args.dry_run,
    )
    if args.dry_run:
        return EXIT_OK
    print_summary(
        summary, rank=args.rank, world_size=args.world_size, cache_dir=args.cache_dir, out=sys.stdout
    )
    if summary.interrupted:
        return EXIT_INTERRUPTED
    if summary.write_error is not None:
        raise summary.write_error
    if summary.aborted and summary.first_error is not None:
        first = summary.first_error
        if isinstance(first, BlobdataError):
            raise first
        raise BlobdataError(f"every object failed; the first: {type(first).__name__}: {first}")
    return summary.exit_code()


# -- ls ------------------------------------------------------------------------------------------


def _cmd_ls(args: argparse.Namespace) -> int:
    url = str(parse_url(args.url))
    opts = resolve_storage_options(parse_url(url).protocol, parse_storage_options(args.storage_option or []))
    m = _manifest_for(args, url, opts)
    counts = (
        np.bincount(m.targets, minlength=len(m.classes)) if len(m) else np.zeros(len(m.classes), np.int64)
    )
    sizes = np.zeros(len(m.classes), dtype=np.int64)
    if len(m):
        np.add.at(sizes, m.targets, m.sizes)  # exact int64 sums (bincount weights would be float64)
    total = int(m.sizes.sum()) if len(m) else 0
    if args.save_manifest:
        _save_manifest(
            m, args.save_manifest, opts if parse_url(args.save_manifest).protocol != "file" else {}
        )
    if args.json:
        doc = {
            "root": m.root,
            "objects": len(m),
            "bytes": total,
            "listed_at": m.listed_at,
            "classes": [
                {"name": c, "objects": int(n), "bytes": int(b)}
                for c, n, b in zip(m.classes, counts, sizes, strict=True)
            ],
            "skipped": list(m.skipped),
        }
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return EXIT_OK
    width = max([len("class"), *(len(c) for c in m.classes)])
    listed = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.listed_at))
    print(f"{m.root}: {len(m.classes)} classes, {len(m)} objects, {human_size(total)} (listed {listed})")
    print(f"{'class':<{width}}  {'objects':>10}  {'bytes':>12}")
    for c, n, b in zip(m.classes, counts, sizes, strict=True):
        print(f"{c:<{width}}  {int(n):>10}  {human_size(int(b)):>12}")
    print(f"{'total':<{width}}  {len(m):>10}  {human_size(total):>12}")
    if m.skipped:
        print(f"{len(m.skipped)} objects belong to no class and were skipped, e.g. {m.skipped[0]}")
    if args.save_manifest:
        print(f"saved the listing to {args.save_manifest} (pass it as --manifest / manifest= on other nodes)")
    return EXIT_OK


def _save_manifest(m: Any, target: str, storage_options: dict[str, Any]) -> None:
    if "://" not in target or target.startswith("file://"):
        m.save(target[len("file://") :] if target.startswith("file://") else target)
        return
    from ._loop import run
    from ._retry import final_error
    from ._stores.fsspec import get_fs

    dest = parse_url(target)
    fs = get_fs(dest.protocol, resolve_storage_options(dest.protocol, storage_options))
    data = m.to_bytes()

    async def put() -> None:
        if getattr(fs, "async_impl", False):
            await fs._pipe_file(dest.fs_path, data)
        else:
            fs.pipe_file(dest.fs_path, data)

    try:
        run(put())
    except Exception as exc:
        raise final_error(exc, target, store=dest.protocol, what="manifest upload") from exc


# -- cache ---------------------------------------------------------------------------------------


def _existing_cache(directory: str) -> Any:
    if not os.path.isdir(directory):
        from ._errors import NotFound

        raise NotFound(f"no cache at {directory}: the directory does not exist", url=directory)
    return open_cache(directory)


def _cmd_cache_info(args: argparse.Namespace) -> int:
    size = parse_size(args.cache_size, name="--cache-size") if args.cache_size else None
    cache = _existing_cache(args.cache_dir)
    try:
        info = cache.info()
    finally:
        cache.close()
    # The limit and policy belong to whoever opens the cache (the dataset, warm): they are not stored.
    info.pop("policy", None)
    info.pop("limit", None)
    if size is not None:
        info["limit"] = size
        info["free"] = max(0, size - used_bytes(info))
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return EXIT_OK
    for key, value in info.items():
        sizey = isinstance(value, int) and not isinstance(value, bool) and key in ("bytes", "limit", "free")
        print(f"{key + ':':<11} {human_size(value) + f' ({value} bytes)' if sizey else value}")
    return EXIT_OK


def _cmd_cache_clear(args: argparse.Namespace) -> int:
    if not args.yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"refusing to clear {args.cache_dir} without --yes (no terminal to ask on)")
        answer = input(f"remove every entry of the cache in {args.cache_dir}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return EXIT_OK
    cache = _existing_cache(args.cache_dir)
    try:
        before = cache.info()
        cache.clear()
    finally:
        cache.close()
    removed = f"{before.get('entries', '?')} entries, {human_size(used_bytes(before))}"
    print(f"cleared {args.cache_dir}: removed {removed}")
    return EXIT_OK


# -- parser and entry point ----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs"
    )
    listing = argparse.ArgumentParser(add_help=False)
    listing.add_argument(
        "url", help="dataset folder: s3://bucket/prefix, gs://..., az://..., or a local path"
    )
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

    parser = argparse.ArgumentParser(
        prog="blobdata", description="Train PyTorch models straight from a bucket folder.", parents=[common]
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    w = sub.add_parser("warm", parents=[common, listing], help="fill a local cache with a folder's objects")
    w.add_argument("--cache-dir", required=True, help="cache directory (an SSD)")
    w.add_argument(
        "--cache-size", default="100GB", help="cache size bound, e.g. 100GB or 512GiB (default 100GB)"
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
    w.add_argument(
        "--buffer-size", default="256MiB", help="fetched bytes held in memory at most (default 256MiB)"
    )
    w.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    w.set_defaults(func=_cmd_warm)

    ls = sub.add_parser("ls", parents=[common, listing], help="list a folder: classes, objects, bytes")
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.add_argument("--save-manifest", metavar="PATH_OR_URL", help="write the listing there for other nodes")
    ls.set_defaults(func=_cmd_ls)

    cache = sub.add_parser("cache", parents=[common], help="inspect or clear a local cache")
    csub = cache.add_subparsers(dest="cache_command", metavar="ACTION")
    csub.required = True
    info = csub.add_parser("info", parents=[common], help="directory, entries, bytes")
    info.add_argument("--cache-dir", required=True)
    info.add_argument("--cache-size", help="the size bound its users set, to show the free room (e.g. 100GB)")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=_cmd_cache_info)
    clear = csub.add_parser("clear", parents=[common], help="remove every entry")
    clear.add_argument("--cache-dir", required=True)
    clear.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    clear.set_defaults(func=_cmd_cache_clear)

    sub.add_parser(
        "demo", help="train a small model from a local S3 server (runs blobdata._demo)", add_help=False
    )
    return parser


def _demo(argv: list[str]) -> int:
    from ._demo import main as demo_main

    return int(demo_main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    handler: logging.Handler | None = None
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("blobdata: %(levelname)s: %(message)s"))
        log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.DEBUG if debug else logging.WARNING)
    try:
        return _main(argv, debug)
    finally:
        log.setLevel(old_level)
        if handler is not None:
            log.removeHandler(handler)


def _main(argv: list[str], debug: bool) -> int:
    rest = [a for a in argv if a != "--debug"]
    if rest and rest[0] == "demo":
        return _guarded(lambda: _demo(rest[1:]), debug)
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
    print(f"blobdata: error: {message}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

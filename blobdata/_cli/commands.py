"""What each ``blobdata`` command does (the parser and the entry point are in :mod:`blobdata._cli`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._config import parse_size
from .._errors import BlobdataError, ConfigError
from .._stores import redact, resolve_storage_options
from .._url import parse_url, printable
from . import bench as _bench
from .layout import choose, manifest_for, memory_note, parse_extensions
from .warm import has_cache, human_size, print_summary, used_bytes, warm
from .warm_objects import dataset_for, warm_dataset
from .warm_summary import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK

__all__ = [
    "EscapingFormatter",
    "cmd_bench",
    "cmd_cache_clear",
    "cmd_cache_info",
    "cmd_cache_trim",
    "cmd_ls",
    "cmd_warm",
    "parse_storage_options",
]

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


# -- warm ----------------------------------------------------------------------------------------


def _warm_folder(
    args: argparse.Namespace, url: str, resolved: dict[str, Any], size: int | None, t0: float, started: float
) -> tuple[Any, str | None, Any, str | None]:
    """Warm a class folder (FolderDataset's listing): (summary, eviction line, node share, memory note)."""
    manifest = manifest_for(args, url, resolved)
    memory = memory_note(manifest, args.manifest, started)
    if memory is not None:
        print(printable(f"{url}: {memory}"), flush=True)
    indices = _node_share(args, len(manifest))
    log.debug("listing of %s: %d objects in %.2fs", url, len(manifest), time.monotonic() - t0)
    evicted = _make_room(args, manifest, indices, size) if args.cache_policy == "admit" else None
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
        indices=indices,
        buffer_size=args.buffer_size,
        progress=_bar(args),
        dry_run=args.dry_run,
    )
    return summary, evicted, indices, memory


def _bar(args: argparse.Namespace) -> bool:
    # A bar only on a terminal: into a file or a pipe each redraw would be a line of \r noise.
    return not (args.no_progress or args.quiet) and sys.stderr.isatty()


def cmd_warm(args: argparse.Namespace) -> int:
    from .._cache import parse_limit

    url = str(parse_url(args.url))
    opts = parse_storage_options(args.storage_option or [])
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency must be a positive integer, got {args.concurrency}")
    size = parse_limit(args.cache_size, name="--cache-size") if args.cache_size is not None else None
    parse_size(args.buffer_size, name="--buffer-size")
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise ConfigError(
            f"--rank must be in 0..{args.world_size - 1} for --world-size {args.world_size}, got {args.rank}"
        )
    log.debug("storage options: %s", redact(opts))
    resolved = resolve_storage_options(parse_url(url).protocol, opts)
    t0, started = time.monotonic(), time.time()
    layout = choose(args, url, resolved, parse_extensions(args.extensions))
    print(printable(layout.line()), flush=True)
    memory: str | None = None
    if layout.blob:  # what a BlobDataset reads, every member of every sample
        ds = dataset_for(args, url, resolved, layout)
        memory = memory_note(ds.manifest, args.manifest, started)
        if memory is not None:
            print(printable(f"{url}: {memory}"), flush=True)
        shares = _node_share(args, len(ds))
        indices = ds.object_rows(shares.tolist()) if shares is not None else None
        evicted = None
        summary = warm_dataset(
            ds, args.cache_dir, rank=args.rank, world_size=args.world_size, indices=indices,
            concurrency=args.concurrency, cache_size=size, cache_policy=args.cache_policy,
            buffer_size=args.buffer_size, progress=_bar(args), dry_run=args.dry_run,
        )  # fmt: skip
    else:
        summary, evicted, indices, memory = _warm_folder(args, url, resolved, size, t0, started)
    if args.dry_run:
        return EXIT_OK if summary.fits else EXIT_FAILED  # "does NOT fit" is a failure to scripts
    if summary.denied and summary.first_error is not None and not summary.interrupted:
        raise _denied(summary, memory)
    print_summary(
        summary, rank=args.rank, world_size=args.world_size, cache_dir=args.cache_dir, out=sys.stdout
    )
    for line in (evicted, _share_fit(summary, indices is not None)):
        if line is not None:
            print(line, flush=True)
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


def _denied(summary: Any, memory: str | None) -> BlobdataError:
    """The one message of a warm stopped by refused credentials."""
    first = summary.first_error
    before = f" after {summary.fetched} objects" if summary.fetched else ""
    why = (
        "; the listing was remembered, so these credentials were not checked before"
        if memory is not None and memory.startswith("remembered")
        else ""
    )
    text = f"{first}; warm stopped at the first refusal{before} (it will not get better){why}"
    return (
        type(first)(text, url=getattr(first, "url", None))
        if isinstance(first, BlobdataError)
        else (BlobdataError(text))
    )


def _node_share(args: argparse.Namespace, n: int) -> Any:
    """With --nnodes (or torchrun's variables): the samples this node reads, else None. Under
    --sampler partitioned (the default) its fixed share, the same every epoch; under distributed,
    its share of epoch --epoch."""
    from .._listing import env_info

    info = env_info()
    nnodes = args.nnodes if args.nnodes is not None else (info.nnodes if info.world_size > 1 else None)
    if nnodes is None:
        return None
    if getattr(args, "world_size", 1) != 1:
        raise ConfigError("--nnodes/--node-rank and --rank/--world-size are two ways to shard: use one")
    node = args.node_rank if args.node_rank is not None else info.node_rank
    per_node = args.nproc_per_node if args.nproc_per_node is not None else info.local_world_size
    if nnodes < 1 or per_node < 1 or not 0 <= node < nnodes:
        raise ConfigError(f"--node-rank must be in 0..{nnodes - 1} with --nnodes {nnodes} >= 1, got {node}")
    if getattr(args, "sampler", "partitioned") == "partitioned":
        from .._sampling import canonical_nodes, node_share

        canonical_nodes(args.num_canonical_nodes, nnodes)
        return node_share(n, seed=args.seed, nnodes=nnodes, node=node)
    from .._sampling import epoch_share  # needs torch: only for this form of warm

    return epoch_share(n, nnodes=nnodes, node_rank=node, nproc_per_node=per_node, seed=args.seed,
                       epoch=args.epoch)  # fmt: skip


def _make_room(args: argparse.Namespace, manifest: Any, indices: Any, size: int | None) -> str | None:
    """Before warming a node's share: evict from the cache first what that share does not need
    (this dataset's other samples), as far as the share's missing bytes or the bound require.
    Returns a line for the summary, or None when nothing was evicted."""
    if indices is None or args.dry_run or not has_cache(args.cache_dir):
        return None
    from .._cache import DEFAULT_LIMIT, BlobCache

    share = [(manifest.url(i), manifest.identity(i)) for i in np.asarray(indices).tolist()]
    with BlobCache.inspect(args.cache_dir) as probe:  # a smaller --cache-size than stored shrinks nothing
        bound = max(probe.size_limit or DEFAULT_LIMIT, size or 0)
    cache = BlobCache.inspect(args.cache_dir, size_limit=bound)
    try:
        missing = sum(int(manifest.sizes[i]) for (url, ident), i in zip(share, indices, strict=True)
                      if (url, ident) not in cache)  # fmt: skip
        done = cache.trim(share, prefix=manifest.root.rstrip("/") + "/", room=missing)
    finally:
        cache.close()
    if not done.evicted:
        return None
    freed = human_size(done.evicted_bytes)
    return f"  evicted  {done.evicted} entries ({freed}) that this node's share does not need"


def _share_fit(summary: Any, nnodes_given: bool) -> str | None:
    """How much of the node's share the cache holds after the run."""
    if not nnodes_given or not summary.shard_objects:
        return None
    held = summary.skipped + summary.fetched
    held_bytes = summary.skipped_bytes + summary.fetched_bytes
    pct = 100.0 * held_bytes / summary.shard_bytes if summary.shard_bytes else 100.0
    if held == summary.shard_objects:
        return f"  share    the cache holds all of this node's share ({human_size(held_bytes)})"
    return (
        f"  share    the cache holds {held} of the share's {summary.shard_objects} objects ({pct:.0f}% of "
        f"{human_size(summary.shard_bytes)}); the rest is read from the bucket every epoch"
    )


# -- ls ------------------------------------------------------------------------------------------


class EscapingFormatter(logging.Formatter):
    """Log lines with :func:`printable` messages (a traceback, under --debug, is left as it is)."""

    def format(self, record: logging.LogRecord) -> str:
        record = logging.makeLogRecord(record.__dict__)  # a copy: other handlers see the original
        record.msg, record.args = printable(record.getMessage()), None
        return super().format(record)


def cmd_ls(args: argparse.Namespace) -> int:
    url = str(parse_url(args.url))
    opts = resolve_storage_options(parse_url(url).protocol, parse_storage_options(args.storage_option or []))
    started = time.time()
    layout = choose(args, url, opts, parse_extensions(args.extensions))
    if layout.blob:
        from .ls_samples import cmd_ls_samples

        return cmd_ls_samples(args, url, opts, layout, started, _save_manifest)
    m = manifest_for(args, url, opts)
    memory = memory_note(m, args.manifest, started)
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
            "layout": layout.kind,
            "layout_reason": layout.why,
            "objects": len(m),
            "bytes": total,
            "listed_at": m.listed_at,
            "remembered": memory is not None,
            "classes": [
                {"name": c, "objects": int(n), "bytes": int(b)}
                for c, n, b in zip(m.classes, counts, sizes, strict=True)
            ],
            "skipped": list(m.skipped),
        }
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return EXIT_OK
    print(printable(layout.line()))
    names = [printable(c) for c in m.classes]  # names come from the bucket: escaped for the terminal
    width = max([len("class"), *(len(c) for c in names)])
    listed = memory if memory is not None else "listed now"
    root = printable(m.root)
    print(f"{root}: {len(m.classes)} classes, {len(m)} objects, {human_size(total)} ({listed})")
    print(f"{'class':<{width}}  {'objects':>10}  {'bytes':>12}")
    for c, n, b in zip(names, counts, sizes, strict=True):
        print(f"{c:<{width}}  {int(n):>10}  {human_size(int(b)):>12}")
    print(f"{'total':<{width}}  {len(m):>10}  {human_size(total):>12}")
    if m.skipped:
        skipped = printable(m.skipped[0])
        print(f"{len(m.skipped)} objects belong to no class and were skipped, e.g. {skipped}")
    if args.save_manifest:
        saved = printable(args.save_manifest)
        print(f"saved the listing to {saved} (pass it as --manifest / manifest= on other nodes)")
    return EXIT_OK


def _save_manifest(m: Any, target: str, storage_options: dict[str, Any]) -> None:
    if "://" not in target or target.startswith("file://"):
        m.save(target[len("file://") :] if target.startswith("file://") else target)
        return
    from .._loop import run
    from .._retry import final_error
    from .._stores import credential_hint, get_fs

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
        raise final_error(exc, target, hint=credential_hint(dest.protocol), what="manifest upload") from exc


# -- bench ---------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    opts = parse_storage_options(args.storage_option or [])
    url = str(parse_url(args.url))
    resolved = resolve_storage_options(parse_url(url).protocol, opts)
    started = time.time()
    layout = choose(args, url, resolved, parse_extensions(args.extensions))
    header = [printable(layout.line())]
    listing = layout.listing
    if layout.blob:  # BlobDataset's listing, made just now to find the layout, or remembered
        args.refresh = args.refresh and listing is None
    elif not args.manifest:  # list here, with a bar unless --quiet; the dataset finds it
        listing = manifest_for(args, url, resolved)
        args.refresh = False
    memory = memory_note(listing, args.manifest, started) if listing is not None else None
    if memory is not None:
        header.append(printable(f"{url}: {memory}"))
    return _bench.command(
        args,
        storage_options=opts,
        extensions=parse_extensions(args.extensions),
        blob=layout.blob,
        header=header,
    )


# -- cache ---------------------------------------------------------------------------------------


def _existing_cache(directory: str, size_limit: int | None = None) -> Any:
    """The cache in ``directory``, opened to inspect it (it records no limit, trims nothing);
    NotFound (nothing created) when there is none."""
    if not os.path.isdir(directory) or not has_cache(directory):
        from .._errors import NotFound

        why = "the directory does not exist" if not os.path.isdir(directory) else "it holds no cache index"
        raise NotFound(f"no cache at {directory}: {why}", url=directory)
    from .._cache import BlobCache

    return BlobCache.inspect(directory, size_limit=size_limit)


def cmd_cache_info(args: argparse.Namespace) -> int:
    size = parse_size(args.cache_size, name="--cache-size") if args.cache_size else None
    cache = _existing_cache(args.cache_dir)
    try:
        info = cache.info()
    finally:
        cache.close()
    # The limit belongs to whoever opens the cache (the dataset, warm); the last one's is recorded.
    info.pop("policy", None)
    info.pop("limit", None)
    bound = info.pop("bound", None)
    limit = size if size is not None else bound
    if limit is not None:
        info["limit"] = limit
        info["over"] = max(0, used_bytes(info) - limit)
        info["free"] = max(0, limit - used_bytes(info))
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return EXIT_OK
    sizes = ("bytes", "limit", "over", "free")
    for key, value in info.items():
        sizey = isinstance(value, int) and not isinstance(value, bool) and key in sizes
        print(f"{key + ':':<11} {human_size(value) + f' ({value} bytes)' if sizey else value}")
    if limit is None:
        print("limit:      none recorded (pass --cache-size to compare)")
    elif info["over"]:
        print(
            f"the cache is {human_size(info['over'])} over its limit: to trim it, run: "
            f"blobdata cache trim --cache-dir {args.cache_dir}"
        )
    return EXIT_OK


def cmd_cache_trim(args: argparse.Namespace) -> int:
    from .._cache import parse_limit

    size = parse_limit(args.cache_size, name="--cache-size") if args.cache_size else None
    cache = _existing_cache(args.cache_dir, size)
    try:
        if cache.size_limit <= 0 and size is None:
            raise ConfigError(f"no limit is recorded for the cache in {args.cache_dir}: pass --cache-size")
        if size is not None:  # the bound later openers naming no size use (a shrink on purpose)
            cache.record_bound()
        keep = prefix = None
        if args.url:
            url = str(parse_url(args.url))
            given = parse_storage_options(args.storage_option or [])
            opts = resolve_storage_options(parse_url(url).protocol, given)
            started = time.time()
            manifest = manifest_for(args, url, opts)
            memory = memory_note(manifest, args.manifest, started)
            if memory is not None:
                print(printable(f"{url}: {memory}"), flush=True)
            indices = _node_share(args, len(manifest))
            if indices is None:
                raise ConfigError("with a URL, say which node's share to keep: --nnodes N --node-rank R")
            keep = [(manifest.url(i), manifest.identity(i)) for i in np.asarray(indices).tolist()]
            prefix = manifest.root.rstrip("/") + "/"
        before = cache.info()
        done = cache.trim(keep, prefix=prefix)
    finally:
        cache.close()
    print(
        f"trimmed {args.cache_dir}: evicted {done.evicted} entries ({human_size(done.evicted_bytes)}); "
        f"{human_size(done.volume_bytes)} of its {human_size(done.size_limit)} limit "
        f"(was {human_size(used_bytes(before))})"
    )
    return EXIT_OK


def cmd_cache_clear(args: argparse.Namespace) -> int:
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

"""Which layout ``blobdata ls``, ``warm`` and ``bench`` read a folder as, and the line that says it.

Two classes read folders: :class:`~blobdata.FolderDataset` (class folders, ``<root>/<class>/<file>``)
and :class:`~blobdata.BlobDataset` (anything else: one file per sample, samples of several files by
webdataset's key rule, a metadata file's rows, an index's rows). The commands take the one asked for
(``--classes``, ``--objects``, ``--index FILE``, ``--metadata FILE``); otherwise the layout is found
from the listing a ``BlobDataset(URL)`` makes (the same listing, remembered as its is), by these rules,
first match:

1. a metadata file at the root (``metadata.jsonl``, ``.csv``, ``.parquet``, as ``BlobDataset`` finds
   it): its rows are the samples;
2. image files at the root (``--extensions``, default torchvision's): not class folders (ImageFolder
   ignores them), the folder's samples;
3. fewer than two sub-folders: not class folders (one class is not a classification dataset);
4. no image file in the sub-folders, or a sample of several files there (``a/x.jpg`` + ``a/x.txt``):
   the folder's samples;
5. else class folders.

When a class folders' listing of two classes or more is remembered and BlobDataset's is not, the folder
is read as class folders without a request (``--refresh`` lists it and looks again). The line printed
says which layout was used, why, and how to ask for another.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from typing import Any

from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions
from .._errors import ConfigError

__all__ = [
    "CLASSES", "INDEX", "METADATA", "OBJECTS", "Layout", "add_layout_args", "choose", "manifest_for",
    "memory_note", "parse_extensions",
]  # fmt: skip

CLASSES, OBJECTS, METADATA, INDEX = "classes", "objects", "metadata", "index"


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout chosen for a folder: ``kind`` (one of the four), ``why`` (asked, or what was found),
    the metadata file found or named, and BlobDataset's listing of the folder when it was read here (to
    find the layout, or for ``--objects`` / ``--metadata``; None for an index, ``--classes``, a
    remembered class listing or ``--manifest``)."""

    kind: str
    why: str
    metadata: str | None = None
    listing: Any = None

    @property
    def blob(self) -> bool:
        """Read as a BlobDataset (every layout but class folders)."""
        return self.kind != CLASSES

    def line(self) -> str:
        """``layout: ... (why); how to ask for another``, one line (names from the bucket: print it
        through :func:`~blobdata._url.printable`)."""
        what = {
            CLASSES: "class folders, as FolderDataset reads them",
            OBJECTS: "samples by file name (x.jpg + x.txt: one sample), as BlobDataset reads them",
            METADATA: f"the rows of {self.metadata}, as BlobDataset reads them",
            INDEX: "the rows of the index, as BlobDataset(URL, index=FILE) reads them",
        }[self.kind]
        other = {
            CLASSES: "--objects reads it as BlobDataset does",
            OBJECTS: "--classes reads its sub-folders as classes",
            METADATA: "--classes reads its sub-folders as classes",
            INDEX: "without --index the folder is listed",
        }[self.kind]
        return f"layout: {what} ({self.why}); {other}"


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """``--classes``, ``--objects``, ``--index FILE``, ``--metadata FILE``: one layout asked for."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--classes", action="store_true",
        help="read the folder as class folders (<root>/<class>/<file>), as FolderDataset(URL)",
    )  # fmt: skip
    g.add_argument(
        "--objects", action="store_true",
        help="read the folder as BlobDataset(URL) does: a metadata file found at the root, else every "
        "file, samples by webdataset's key rule (x.jpg + x.txt: one sample)",
    )  # fmt: skip
    g.add_argument(
        "--index", metavar="FILE",
        help="the samples an index names (CSV, JSONL, Parquet or an S3 Inventory manifest.json), as "
        "BlobDataset(URL, index=FILE): no listing",
    )  # fmt: skip
    p.add_argument(
        "--metadata", metavar="FILE",
        help="the samples a metadata file's rows name, as BlobDataset(URL, metadata=FILE)",
    )  # fmt: skip


def choose(
    args: argparse.Namespace, url: str, storage_options: dict[str, Any], extensions: tuple[str, ...] | None
) -> Layout:
    """The layout asked for on the command line, else the one found (see the module docstring). A
    BlobDataset's layout but an index's comes with the folder's listing, made (or remembered) here."""
    if getattr(args, "classes", False) and getattr(args, "metadata", None):
        from .._errors import ConfigError

        raise ConfigError("--classes and --metadata are two layouts: pass one")
    if getattr(args, "index", None):
        return Layout(INDEX, "asked: --index", metadata=getattr(args, "metadata", None))
    if getattr(args, "classes", False):
        return Layout(CLASSES, "asked: --classes")
    if args.manifest:
        return _from_manifest(args, url, storage_options)
    if not (args.refresh or getattr(args, "metadata", None) or getattr(args, "objects", False)):
        classes = _remembered_classes(url, storage_options, extensions)
        if classes is not None:
            return classes
    listing = _flat(url, storage_options, args)
    if getattr(args, "metadata", None):
        return Layout(METADATA, "asked: --metadata", metadata=args.metadata, listing=listing)
    if getattr(args, "objects", False):
        from .._listing import METADATA_NAMES, find_metadata

        found = find_metadata([listing.relkey(j) for j in range(len(listing))], METADATA_NAMES)
        if found is not None:
            return Layout(
                METADATA, f"asked: --objects, and {found} is at the root", metadata=found, listing=listing
            )
        return Layout(OBJECTS, "asked: --objects", listing=listing)
    return detect(listing, extensions)


def _remembered_classes(
    url: str, storage_options: dict[str, Any], extensions: tuple[str, ...] | None
) -> Layout | None:
    """Class folders, when a listing of two classes or more is remembered for them and BlobDataset's
    listing is not (the runs after a first one then send no request); else None."""
    from .._listing import FLAT_PARAMS, listing_params, load_remembered, manifest_path
    from .._stores import listing_scope
    from .._url import parse_url

    protocol = parse_url(url).protocol
    if protocol in ("file", "memory"):  # never remembered
        return None
    scope = listing_scope(protocol, storage_options)
    if manifest_path(url, scope, FLAT_PARAMS).exists():
        return None  # the folder's own listing says more
    path = manifest_path(url, scope, listing_params(extensions, None))
    m = load_remembered(path, url, DEFAULT_LISTING_MAX_AGE) if path.exists() else None
    if m is None or len(m.classes) < 2:
        return None
    n = len(m.classes)
    return Layout(CLASSES, f"a listing of its {n} class folders is remembered; --refresh looks again")


def _flat(url: str, storage_options: dict[str, Any], args: argparse.Namespace) -> Any:
    """BlobDataset's listing of ``url`` (remembered as its is); with ``--split-listing``, listed by every
    node together, each a part, as the class folders' listing is (:func:`manifest_for`)."""
    import functools

    from .._listing import load_or_list_flat

    fetch_options = FetchOptions(concurrency=args.concurrency)
    make = functools.partial(load_or_list_flat, url, storage_options=storage_options, refresh=args.refresh,
                             fetch_options=fetch_options)  # fmt: skip
    if not getattr(args, "split_listing", False):
        return make()
    from .._listing import help_list, shared_manifest

    help = functools.partial(help_list, url, storage_options=storage_options, fetch_options=fetch_options,
                             flat=True)  # fmt: skip
    return shared_manifest(url, make, key="flat", help=help, info=_nodes(args))


def _from_manifest(args: argparse.Namespace, url: str, storage_options: dict[str, Any]) -> Layout:
    """A saved listing says which it is: a flat one (``BlobDataset``'s) or a class folders' one."""
    from .._listing import Manifest
    from .._url import parse_url

    source = args.manifest
    proto = parse_url(source).protocol if "://" in source else "file"
    same = proto == parse_url(url).protocol
    m = Manifest.load(source, storage_options=storage_options if same else None, expect_root=url)
    if m.params.get("layout") == "flat":
        kind = METADATA if getattr(args, "metadata", None) else OBJECTS
        return Layout(
            kind, "--manifest holds a BlobDataset's listing", metadata=getattr(args, "metadata", None)
        )
    if getattr(args, "objects", False) or getattr(args, "metadata", None):
        from .._errors import ConfigError

        raise ConfigError(
            f"--manifest {source} is a class folders' listing (FolderDataset's): BlobDataset reads its own "
            "(blobdata ls URL --objects --save-manifest PATH saves one)"
        )
    return Layout(CLASSES, "--manifest holds a class folders' listing")


def detect(listing: Any, extensions: tuple[str, ...] | None = None) -> Layout:
    """The layout of a folder from BlobDataset's listing of it (see the module docstring); ``extensions``
    are the image files' (default torchvision's)."""
    from .._listing import IMG_EXTENSIONS, METADATA_NAMES, find_metadata, split_key

    relkeys = _relkeys(listing)
    found = find_metadata(relkeys, METADATA_NAMES)
    if found is not None:
        return Layout(METADATA, "found at the root", metadata=found, listing=listing)
    exts = extensions or IMG_EXTENSIONS
    at_root = [k for k in relkeys if "/" not in k and k.lower().endswith(exts)]
    if at_root:
        n = len(at_root)
        return Layout(
            OBJECTS, f"found {n} image{'s' * (n != 1)} at the root, e.g. {at_root[0]}", listing=listing
        )
    folders = sorted({k.partition("/")[0] for k in relkeys if "/" in k})
    if len(folders) < 2:
        why = f"found one sub-folder, {folders[0]}/" if folders else "found no sub-folder"
        return Layout(OBJECTS, why + ": not class folders", listing=listing)
    if not any(k.lower().endswith(exts) for k in relkeys):
        return Layout(OBJECTS, f"found no image ({', '.join(exts)}) in its sub-folders", listing=listing)
    stems = [s[0] for s in map(split_key, relkeys) if s is not None]
    if len(set(stems)) < len(stems):  # a sample of several files: find the first two for the line
        seen: dict[str, str] = {}
        for k in relkeys:
            split = split_key(k)
            if split is not None and seen.setdefault(split[0], k) != k:
                why = f"found samples of several files, e.g. {seen[split[0]]} and {k}"
                return Layout(OBJECTS, why, listing=listing)
    return Layout(
        CLASSES, f"found {len(folders)} sub-folders of images and no image at the root", listing=listing
    )


def _relkeys(listing: Any) -> list[str]:
    """Every key of ``listing``, relative to its root (one decode of its key buffer when it is ASCII, as
    most are: a million keys in a fraction of a second)."""
    arrays = listing._arrays()
    data, offsets = arrays["keys"].tobytes(), arrays["key_offsets"].tolist()
    if data.isascii():
        text = data.decode("ascii")
        return [text[a:b] for a, b in itertools.pairwise(offsets)]
    return [listing.relkey(j) for j in range(len(listing))]


def parse_extensions(text: str | None) -> tuple[str, ...] | None:
    """``--extensions jpg,.png`` -> ``(".jpg", ".png")``; None when not given."""
    if not text:
        return None
    exts = tuple(
        e.strip() if e.strip().startswith(".") else "." + e.strip() for e in text.split(",") if e.strip()
    )
    return exts or None


def memory_note(listing: Any, manifest: str | None, started: float) -> str | None:
    """How ``listing`` was had when it was not listed just now (after ``started``): remembered from an
    earlier run (so it checked no credentials, and misses what changed since) or read from
    ``--manifest``; None for a fresh listing or none."""
    if listing is None or listing.listed_at >= started:  # a fresh listing notes its start
        return None
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(listing.listed_at))
    age = _age(time.time() - listing.listed_at)
    if manifest:
        return f"listing from --manifest {manifest}, made {when} ({age} ago)"
    return f"remembered listing from {when}, {age} old: --refresh lists the bucket again"


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= n:
            return f"{seconds / n:.1f} {unit}"
    return f"{max(0.0, seconds):.0f} s"


def manifest_for(args: argparse.Namespace, url: str, storage_options: dict[str, Any]) -> Any:
    """The listing of ``url``: ``--manifest``, else the remembered one, else a fresh listing (with
    ``--split-listing``, listed by every node together, each a part)."""
    import functools

    from .._config import FetchOptions
    from .._listing import help_list, listing_params, load_or_list, shared_manifest

    extensions = parse_extensions(args.extensions)
    make = functools.partial(load_or_list, url, storage_options=storage_options, refresh=args.refresh,
                             manifest=args.manifest, extensions=extensions, is_valid_file=None,
                             allow_empty=args.allow_empty, concurrency=args.concurrency,
                             progress=False if args.quiet else None)  # fmt: skip
    if not getattr(args, "split_listing", False):
        return make()
    help = functools.partial(help_list, url, storage_options=storage_options,
                             fetch_options=FetchOptions(concurrency=args.concurrency))  # fmt: skip
    key = repr(listing_params(extensions, None))
    return shared_manifest(url, make, key=key, help=help, info=_nodes(args))


def _nodes(args: argparse.Namespace) -> Any:
    """This node's place among those that list together: ``--nnodes/--node-rank``, else torchrun's
    variables; one process per node."""
    from .._listing import DistInfo, env_info

    env = env_info()
    nnodes = args.nnodes if getattr(args, "nnodes", None) is not None else env.nnodes
    node = args.node_rank if getattr(args, "node_rank", None) is not None else env.node_rank
    if nnodes < 1 or not 0 <= node < nnodes:
        raise ConfigError(f"--node-rank must be in 0..{nnodes - 1} with --nnodes {nnodes}, got {node}")
    return DistInfo(node, nnodes, 0, 1, node, False)

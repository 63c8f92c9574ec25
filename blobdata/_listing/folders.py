"""Listing a dataset folder fast, with torchvision ImageFolder semantics, and remembering it.

The root is listed once with a delimiter to find the class folders, then every class prefix is
listed concurrently (one sequential paginated listing of 1.3M keys takes minutes at cloud latency;
1,000 concurrent ones take seconds). The result is a :class:`~blobdata._listing.manifest.Manifest` whose
order is exactly ``torchvision.datasets.ImageFolder``'s: classes sorted, and within a class the
files of ``sorted(os.walk(class_dir))`` with ``sorted(fnames)`` in each directory.

Keys are kept exactly as the store has them (unicode, spaces, ``+``, ``..`` and ``//`` segments).
The stores (:mod:`blobdata._stores`) say what lies below a folder; this module applies ImageFolder's
rules to it. Every listing request obeys the dataset's :class:`~blobdata.FetchOptions` (timeout and
attempts), and backend errors are stated by the one error map, :func:`blobdata._errors.translate`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions, parse_duration
from .._errors import BlobdataError, ConfigError, EmptyDatasetError, NotFound
from .._loop import run
from .._metrics import progress as _progress
from .._retry import final_error
from .._stores import (
    Columns,
    Growing,
    Lister,
    credential_hint,
    identity_from_info,
    lister_for,
    listing_scope,
    resolve_storage_options,
)
from .._url import BlobURL, check_relkeys, parse_url, printable
from .bulk import valid_by, walk_sorted, with_extensions
from .filters import UNIDENTIFIED, filter_identity
from .job import split
from .job.split import Job
from .manifest import Manifest, manifest_path
from .remembered import _say_once, load_remembered, remember_listing

__all__ = [
    "IMG_EXTENSIONS", "identity_from_info", "list_folder", "load_or_list",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: torchvision's IMG_EXTENSIONS. As in torchvision, the file name is lower-cased and the extensions
#: are not: ``a.JPG`` matches ``".jpg"``, and ``".JPG"`` matches nothing.
IMG_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# -- ImageFolder semantics ----------------------------------------------------------------------


def _ext_tuple(extensions: tuple[str, ...] | str | None) -> tuple[str, ...]:
    if extensions is None:
        return IMG_EXTENSIONS
    return (extensions,) if isinstance(extensions, str) else tuple(extensions)


def _validator(
    extensions: tuple[str, ...] | None, is_valid_file: Callable[[str], bool] | None
) -> tuple[Callable[[str, str], bool], tuple[str, ...] | None]:
    """(check(relkey, path), effective extensions) following ImageFolder's rules; ``path`` is what
    ``is_valid_file`` receives (a local path for a local folder, else the object URL)."""
    if extensions is not None and is_valid_file is not None:
        raise ConfigError(
            "extensions and is_valid_file cannot both be given (as in torchvision's ImageFolder)"
        )
    if is_valid_file is not None:
        fn = is_valid_file
        return (lambda relkey, path: not relkey.endswith("/") and bool(fn(path))), None
    exts = _ext_tuple(extensions)
    return (lambda relkey, path: not relkey.endswith("/") and relkey.lower().endswith(exts)), exts


def listing_params(
    extensions: tuple[str, ...] | None, is_valid_file: Callable[[str], bool] | None
) -> dict[str, Any]:
    """The parameters a listing depends on, as stored in (and hashed into the name of) a manifest.

    A callable ``is_valid_file`` is identified by :func:`~blobdata._listing.filter_identity` (its code,
    defaults, closure and the globals it reads); one that cannot be identified is ``UNIDENTIFIED``, and
    its listings are never remembered.
    """
    params: dict[str, Any] = {"extensions": None, "is_valid_file": None}
    if is_valid_file is not None:
        ident = filter_identity(is_valid_file)
        name = f"{getattr(is_valid_file, '__module__', '?')}.{getattr(is_valid_file, '__qualname__', '?')}"
        params["is_valid_file"] = UNIDENTIFIED if ident is None else f"{name}#{ident}"
    else:
        params["extensions"] = sorted(_ext_tuple(extensions))
    return params


def _check_nonempty(manifest: Manifest, extensions: tuple[str, ...] | None) -> None:
    empty = [c for c, n in zip(manifest.classes, manifest.class_counts(), strict=True) if n == 0]
    if empty:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty))} under {manifest.root}. "
        if extensions is not None:
            msg += f"Supported extensions are: {', '.join(extensions)}. "
        msg += "Pass allow_empty=True (blobdata --allow-empty) to accept empty classes."
        hidden = [c for c in sorted(empty) if c.startswith((".", "__"))]
        if hidden:
            msg += (
                f" {', '.join(hidden)}: a hidden or special folder (as Jupyter's .ipynb_checkpoints is); "
                "FolderDataset(..., skip_hidden=True) skips such folders, as Hugging Face does."
            )
        raise EmptyDatasetError(msg, url=manifest.root)


async def _list(
    url: BlobURL, storage_options: Mapping[str, Any], options: FetchOptions, progress: bool | None = None
) -> tuple[list[str], list[Columns]]:
    """(sorted class names, the raw objects below each, then those below an empty-named folder if any)."""
    lister = lister_for(url, storage_options, options)
    try:
        return await list_with(lister, url, options.concurrency, progress)
    finally:
        await lister.aclose()


def _scheme_hint(path: str) -> str:
    """For a missing local path below the working directory (``data/train`` as written): it may have
    been meant as a bucket URL. Nothing for a path elsewhere (``/mnt/data``): that one was a path."""
    rel = os.path.relpath(path)
    if rel.startswith(".."):
        return ""
    return (f". A URL without a scheme is a local path: for a bucket write s3://{rel} (or gs://{rel}, "
            f"az://{rel})")  # fmt: skip


def _found(url: BlobURL, lister: Lister) -> str:
    """What lies at a root without class folders: ``: found 20 images at the root, ...``."""
    files: list[str] | None = getattr(lister, "root_files", None)
    if url.protocol == "file":
        try:
            with os.scandir(url.prefix) as it:
                files = sorted(e.name for e in it if not e.is_dir())
        except OSError:
            files = None
    if not files:
        return "."  # an empty folder: as torchvision says it
    images = sum(1 for f in files if f.lower().endswith(IMG_EXTENSIONS))
    shown = f"{images} image{'' if images == 1 else 's'}"
    what = shown if images == len(files) else f"{len(files)} file{'' if len(files) == 1 else 's'} ({shown})"
    return (f": found {what} at the root (e.g. {files[0]}) and no sub-folder. FolderDataset needs one "
            "sub-folder per class (<root>/<class>/<file>); use blobdata.BlobDataset for folders "
            "without class folders")  # fmt: skip


async def class_folders(lister: Lister, url: BlobURL) -> list[str]:
    """The class folders below ``url``, sorted, then ``""`` when keys such as ``root//x.jpg`` lie in a folder
    with an empty name (listed only to be named as skipped); the errors ImageFolder raises when there
    is nothing, or no class folder."""
    root = str(url)
    names, anything = await lister.folders()
    if not anything and url.protocol == "file" and os.path.isdir(url.prefix):
        anything = True  # an empty folder: said as torchvision says it, below
    if not anything:
        if url.protocol == "file" and not os.path.exists(url.prefix):
            raise NotFound(f"nothing found at {root}: no such local folder{_scheme_hint(url.prefix)}",
                           url=root)  # fmt: skip
        where = "the path (it is empty)" if url.protocol == "file" else "the bucket and prefix"
        raise NotFound(f"nothing found at {root}: check {where}; a dataset folder holds one sub-folder "
                       "per class", url=root)  # fmt: skip
    classes = sorted(set(n for n in names if n))
    if not classes:
        where = url.prefix if url.protocol == "file" else root
        raise EmptyDatasetError(f"Couldn't find any class folder in {where}{_found(url, lister)}", url=root)
    return classes + ([""] if "" in names else [])


async def list_with(
    lister: Lister, url: BlobURL, concurrency: int, progress: bool | None = False
) -> tuple[list[str], list[Columns]]:
    root = str(url)
    folders = await class_folders(lister, url)
    classes = [f for f in folders if f]
    sem = asyncio.Semaphore(concurrency)
    bar = _progress.bar(desc=f"listing {root}", total=len(folders), unit="prefix", progress=progress)
    listed = 0

    async def one(folder: str) -> Columns:
        nonlocal listed
        async with sem:
            found = await lister.below(folder)
        listed += len(found)
        bar.set_postfix_str(f"{listed} objects", refresh=False)
        bar.update(1)
        return found

    tasks = [asyncio.ensure_future(one(f)) for f in folders]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    finally:
        bar.close()
    return classes, list(results)


def _in_order(
    results: list[Columns],
    classes: list[str],
    check: Callable[[str, str], bool],
    exts: tuple[str, ...] | None,
    prefix: str,
) -> tuple[Columns, list[int]]:
    """Every class's valid objects in ImageFolder's order, one class after the other, and how many each
    has; each class's columns are let go once taken (``results`` is emptied)."""
    counts: list[int] = []
    parts = Growing()
    single: Columns | None = None
    for name in classes:
        objects = results.pop(0)
        keep = with_extensions(objects, exts) if exts is not None else valid_by(objects, check, prefix)
        objects = walk_sorted(objects.take(keep), name + "/")
        counts.append(len(objects))
        if len(counts) == 1 and not results:  # one class: its arrays are the manifest's, no copy
            single = objects
        else:
            parts.add(objects)
        del objects
    return (single if single is not None else parts.done()), counts


def list_folder(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    extensions: tuple[str, ...] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    allow_empty: bool = False,
    concurrency: int | None = None,
    fetch_options: FetchOptions | None = None,
    progress: bool | None = None,
    local_root: str | None = None,
    together: Job | None = None,
) -> Manifest:
    """List ``url`` (a folder with one sub-folder per class) into a Manifest, ImageFolder order.

    ``extensions`` defaults to :data:`IMG_EXTENSIONS` (the file name lower-cased, as torchvision
    does); ``is_valid_file`` excludes ``extensions`` and receives each object's URL, or for a local
    folder its path, joined as ImageFolder joins it to ``local_root`` (the root as the caller wrote
    it; default: the absolute path). ``fetch_options`` (default
    ``FetchOptions()``) bound every listing request: its timeout, its attempts, and its concurrency
    (class prefixes listed at once), which ``concurrency`` overrides. ``progress``: a bar of prefixes
    and objects listed on stderr (None: when it is a terminal; see :mod:`blobdata._metrics.progress`).
    Raises EmptyDatasetError (a FileNotFoundError) when there is no class folder or, unless
    ``allow_empty``, a class has no valid file; NotFound, AccessDenied,
    FetchError for a missing bucket/prefix, refused credentials or an unreachable endpoint.
    ``together``: rank 0's side of a listing split across the job (:mod:`blobdata._listing.job.split`).
    """
    parsed = parse_url(url)
    root = str(parsed)
    options = _listing_options(fetch_options, concurrency, root)
    check, exts = _validator(extensions, is_valid_file)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    listed_at = time.time()
    t0 = time.monotonic()
    try:
        if together is not None:
            got = split.together(
                lambda: (parsed, opts), options, together, lambda lister: class_folders(lister, parsed)
            )
            assert got is not None  # rank 0's
            classes, results = [f for f in got[0] if f], got[1]
        else:
            classes, results = run(_list(parsed, opts, options, progress))
    except BlobdataError:
        raise
    except Exception as exc:
        hint = credential_hint(parsed.protocol)
        raise final_error(exc, root, hint=hint, what="listing", timeout=options.timeout) from exc
    # Filtering (a user callable) and sorting run here, in the caller's thread, not on the I/O loop.
    prefix = root + "/"
    if parsed.protocol == "file":
        under = local_root if local_root is not None else parsed.prefix
        prefix = under if under.endswith(os.sep) else under + os.sep
    skipped: list[str] = []
    if len(results) > len(classes):
        skipped = [root + "/" + k for k in results.pop().key_list() if not k.endswith("/")]
    if skipped:
        logger.warning(
            "%d object(s) under %s lie in a folder with an empty name and belong to no class; skipped, "
            "e.g. %s", len(skipped), root, printable(", ".join(skipped[:3])),
        )  # fmt: skip
    objects, counts = _in_order(results, classes, check, exts, prefix)
    manifest = Manifest.from_arrays(
        root,
        classes,
        keys=objects.keys,
        key_offsets=objects.key_offsets,
        sizes=objects.sizes,
        targets=np.repeat(np.arange(len(classes), dtype=np.int32), counts),
        ids=objects.ids,
        id_offsets=objects.id_offsets,
        listed_at=listed_at,
        skipped=skipped,
        params=listing_params(extensions, is_valid_file),
    )
    logger.info("listed %s: %d samples in %d classes in %.2fs", root, len(manifest), len(classes),
                time.monotonic() - t0)  # fmt: skip
    if not allow_empty:
        _check_nonempty(manifest, exts)
    return manifest


def _listing_options(fetch_options: FetchOptions | None, concurrency: int | None, root: str) -> FetchOptions:
    options = fetch_options if fetch_options is not None else FetchOptions()
    if concurrency is not None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"concurrency must be a positive integer, got {concurrency!r}", url=root)
        options = options.replace(concurrency=concurrency)
    return options


def load_or_list(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    refresh: bool = False,
    manifest: str | os.PathLike[str] | None = None,
    extensions: tuple[str, ...] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    allow_empty: bool = False,
    concurrency: int | None = None,
    fetch_options: FetchOptions | None = None,
    save: bool = True,
    progress: bool | None = None,
    max_age: float | str | None = DEFAULT_LISTING_MAX_AGE,
    local_root: str | None = None,
    together: Job | None = None,
) -> Manifest:
    """The remembered listing of ``url``.

    With ``manifest`` (a path or URL of a precomputed manifest): load it, check it is for ``url``,
    and send no listing request. Otherwise return the manifest remembered under
    :func:`~blobdata._listing.manifest.manifest_path` when it is there and valid (no request to the store),
    else list and remember it (``save``). ``refresh=True`` always lists again. ``memory://``
    listings are never remembered (that store lives and dies with the process). ``progress``: bars
    for a listing or a manifest download (None: when stderr is a terminal). ``together``: rank 0's
    side of a listing split across the job: the other ranks are told whether to list with it
    (:mod:`blobdata._listing.job.split`).
    """
    with split.leading(together):
        return _load_or_list(
            url, storage_options=storage_options, refresh=refresh, manifest=manifest, extensions=extensions,
            is_valid_file=is_valid_file, allow_empty=allow_empty, concurrency=concurrency,
            fetch_options=fetch_options, save=save, progress=progress, max_age=max_age, local_root=local_root,
            together=together,
        )  # fmt: skip


def _load_or_list(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None,
    refresh: bool,
    manifest: str | os.PathLike[str] | None,
    extensions: tuple[str, ...] | None,
    is_valid_file: Callable[[str], bool] | None,
    allow_empty: bool,
    concurrency: int | None,
    fetch_options: FetchOptions | None,
    save: bool,
    progress: bool | None,
    max_age: float | str | None,
    local_root: str | None,
    together: Job | None,
) -> Manifest:
    parsed = parse_url(url)
    root = str(parsed)
    _check, exts = _validator(extensions, is_valid_file)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    if manifest is not None:
        split.announce(together, listing=False)
        source = os.fspath(manifest)
        m_proto = parse_url(source).protocol if "://" in source else "file"
        m_opts = opts if m_proto == parsed.protocol else None
        loaded = Manifest.load(source, storage_options=m_opts, expect_root=root, progress=progress)
        if parsed.protocol == "file":  # its keys become local paths: none may leave the root
            arrays = loaded._arrays()
            check_relkeys(arrays["keys"], arrays["key_offsets"], root=root)
        if not allow_empty:
            _check_nonempty(loaded, exts)
        return loaded
    params = listing_params(extensions, is_valid_file)
    # Local folders are listed afresh every time, as ImageFolder does (it costs a directory walk);
    # memory:// lives and dies with the process.
    remember = save and parsed.protocol not in ("memory", "file")
    if remember and params["is_valid_file"] == UNIDENTIFIED:
        remember = False  # a listing made with another filter must never come back for this one
        _say_once(
            f"is_valid_file={getattr(is_valid_file, '__qualname__', type(is_valid_file).__name__)}",
            "listing %s afresh: is_valid_file=%r holds something blobdata cannot identify (an object "
            "with state?), so no remembered listing can be known to match it; a plain function, "
            "lambda, closure or functools.partial over plain values is remembered",
            root,
            is_valid_file,
        )
    if max_age is not None:  # a bad value is refused whatever the store
        parse_duration(max_age, name="listing_max_age")
    path = manifest_path(root, listing_scope(parsed.protocol, opts), params)
    remembered = load_remembered(path, root, max_age) if remember and not refresh else None
    if remembered is not None:
        split.announce(together, listing=False)
        if not allow_empty:
            _check_nonempty(remembered, exts)
        return remembered
    split.announce(together, listing=True)
    listed = list_folder(
        url,
        storage_options=storage_options,
        extensions=extensions,
        is_valid_file=is_valid_file,
        allow_empty=allow_empty,
        concurrency=concurrency,
        fetch_options=fetch_options,
        progress=progress,
        local_root=local_root,
        together=together,
    )
    return remember_listing(listed, path) if remember else listed

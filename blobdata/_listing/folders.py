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
from pathlib import Path
from typing import Any

from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions, parse_duration
from .._errors import BlobdataError, ConfigError, EmptyDatasetError, ManifestError, NotFound
from .._loop import run
from .._metrics import progress as _progress
from .._node import check_shared_dir
from .._retry import final_error
from .._stores import (
    Entry,
    Lister,
    credential_hint,
    identity_from_info,
    lister_for,
    listing_scope,
    resolve_storage_options,
)
from .._url import BlobURL, check_relkeys, parse_url, printable
from .filters import UNIDENTIFIED, filter_identity
from .manifest import Manifest, load_own, manifest_path

__all__ = [
    "IMG_EXTENSIONS", "REMEMBERED_RECORD", "identity_from_info", "list_folder", "load_or_list",
    "load_remembered", "remember_listing",
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


def _walk_order(relkey: str) -> tuple[str, str]:
    # sorted(os.walk(d)) sorts directories by their full path; sorted(fnames) within each.
    head, _, tail = relkey.rpartition("/")
    return head, tail


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
) -> tuple[list[str], list[list[Entry]]]:
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


async def list_with(
    lister: Lister, url: BlobURL, concurrency: int, progress: bool | None = False
) -> tuple[list[str], list[list[Entry]]]:
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
    sem = asyncio.Semaphore(concurrency)

    # "" is the folder of keys such as root//x.jpg: listed only to report them as skipped.
    folders = classes + ([""] if "" in names else [])
    bar = _progress.bar(desc=f"listing {root}", total=len(folders), unit="prefix", progress=progress)
    listed = 0

    async def one(folder: str) -> list[Entry]:
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
    """
    parsed = parse_url(url)
    root = str(parsed)
    options = _listing_options(fetch_options, concurrency, root)
    check, exts = _validator(extensions, is_valid_file)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    listed_at = time.time()
    t0 = time.monotonic()
    try:
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
    per_class: list[list[Entry]] = []
    for objs in results[: len(classes)]:
        kept = [o for o in objs if check(o[0], prefix + o[0])]
        kept.sort(key=lambda o: _walk_order(o[0]))
        per_class.append(kept)
    skipped = (
        [root + "/" + o[0] for o in results[len(classes)] if not o[0].endswith("/")]
        if len(results) > len(classes)
        else []
    )
    if skipped:
        logger.warning(
            "%d object(s) under %s lie in a folder with an empty name and belong to no class; skipped, "
            "e.g. %s", len(skipped), root, printable(", ".join(skipped[:3])),
        )  # fmt: skip
    entries = ((key, size, ident, t) for t, objs in enumerate(per_class) for key, size, ident in objs)
    manifest = Manifest.from_entries(
        root,
        classes,
        entries,
        listed_at=listed_at,
        skipped=skipped,
        params=listing_params(extensions, is_valid_file),
    )
    logger.info("listed %s: %d samples in %d classes in %.2fs", root, len(manifest), len(classes),
                time.monotonic() - t0)  # fmt: skip
    if not allow_empty:
        _check_nonempty(manifest, exts)
    return manifest


_said: set[str] = set()


def _say_once(key: str, msg: str, *args: Any, extra: Mapping[str, Any] | None = None) -> bool:
    """Log ``msg`` at WARNING the first time ``key`` is said in this process; whether it was."""
    if key in _said:
        return False
    _said.add(key)
    logger.warning(msg, *args, extra=extra)
    return True


#: Set on the log record that says a remembered listing is used: a command line that prints its own
#: line for it can leave the record out.
REMEMBERED_RECORD = "blobdata_remembered_listing"


def _human_age(seconds: float) -> str:
    for unit, n in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= n:
            return f"{seconds / n:.1f} {unit}"
    return f"{seconds:.0f} s"


def _listing_options(fetch_options: FetchOptions | None, concurrency: int | None, root: str) -> FetchOptions:
    options = fetch_options if fetch_options is not None else FetchOptions()
    if concurrency is not None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigError(f"concurrency must be a positive integer, got {concurrency!r}", url=root)
        options = options.replace(concurrency=concurrency)
    return options


#: What chose the directory of remembered listings (named in messages about it).
_HOME = "BLOBDATA_CACHE_HOME"


def load_remembered(path: Path, root: str, max_age: float | str | None) -> Manifest | None:
    """The listing of ``root`` remembered at ``path`` if there is one, usable and younger than
    ``max_age`` (None: any age); else None, and the caller lists again (an unusable file is said at
    WARNING, one too old at INFO). The cache home is a place other users of the node may reach: a
    file that is not this user's own (another user's, a link, writable by others, in a directory
    others can write) is never mapped, only said at WARNING (:func:`~blobdata._node.open_own`). A
    listing reused is said at WARNING, once per process and file, with its age and how to list again:
    the first loop with one's own data is upload, run, upload again."""
    limit = None if max_age is None else parse_duration(max_age, name="listing_max_age")
    try:
        loaded = load_own(path, setting=_HOME, expect_root=root)
    except NotFound:
        return None
    except ConfigError as exc:
        logger.warning("remembered listing of %s not used: %s; listing %s again", root, exc, root)
        return None
    except ManifestError as exc:
        logger.warning("remembered listing %s is unusable (%s); listing %s again", path, exc, root)
        return None
    age = max(0.0, time.time() - loaded.listed_at)
    if limit is not None and age > limit:
        logger.info("remembered listing of %s is %s old (listing_max_age=%s): listing again",
                    root, _human_age(age), max_age)  # fmt: skip
        return None
    said = _say_once(
        f"remembered|{path}",
        "using the remembered listing of %s, made %s ago (%d objects): objects uploaded, changed or removed "
        "since are not in it; refresh=True (blobdata ... --refresh) lists the bucket again, listing_max_age= "
        "bounds the age of a listing reused (default 7 days)",
        root, _human_age(age), len(loaded), extra={REMEMBERED_RECORD: root},
    )  # fmt: skip
    if not said:
        logger.info("using the remembered listing of %s from %s ago (%d objects)", root, _human_age(age),
                    len(loaded))  # fmt: skip
    return loaded


def remember_listing(listed: Manifest, path: Path) -> Manifest:
    """``listed`` saved at ``path`` and mapped from there (the node's other processes share its pages);
    ``listed`` itself, with a WARNING, where it cannot be: a directory other users could write (or
    that is not this user's) is never written to."""
    try:
        check_shared_dir(str(path.parent), setting=_HOME)
        listed.save(path)
        return load_own(path, setting=_HOME, expect_root=listed.root)
    except (OSError, ConfigError, ManifestError, NotFound) as exc:
        logger.warning("could not remember the listing of %s in %s: %s", listed.root, path, exc)
        return listed


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
) -> Manifest:
    """The remembered listing of ``url``.

    With ``manifest`` (a path or URL of a precomputed manifest): load it, check it is for ``url``,
    and send no listing request. Otherwise return the manifest remembered under
    :func:`~blobdata._listing.manifest.manifest_path` when it is there and valid (no request to the store),
    else list and remember it (``save``). ``refresh=True`` always lists again. ``memory://``
    listings are never remembered (that store lives and dies with the process). ``progress``: bars
    for a listing or a manifest download (None: when stderr is a terminal).
    """
    parsed = parse_url(url)
    root = str(parsed)
    _check, exts = _validator(extensions, is_valid_file)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    if manifest is not None:
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
        if not allow_empty:
            _check_nonempty(remembered, exts)
        return remembered
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
    )
    return remember_listing(listed, path) if remember else listed

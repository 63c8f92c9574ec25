"""Listing a dataset folder fast, with torchvision ImageFolder semantics, and remembering it.

The root is listed once with a delimiter to find the class folders, then every class prefix is
listed concurrently (one sequential paginated listing of 1.3M keys takes minutes at cloud latency;
1,000 concurrent ones take seconds). The result is a :class:`~blobdata._manifest.Manifest` whose
order is exactly ``torchvision.datasets.ImageFolder``'s: classes sorted, and within a class the
files of ``sorted(os.walk(class_dir))`` with ``sorted(fnames)`` in each directory.

Keys are kept exactly as the store has them (unicode, spaces, ``+``, ``..`` and ``//`` segments).
Backend errors are translated to blobdata's classes here, in :func:`translate_error`.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from ._config import FetchOptions
from ._errors import (
    AccessDenied,
    BlobdataError,
    ConfigError,
    EmptyDatasetError,
    FetchError,
    FetchTimeout,
    ManifestError,
    NotFound,
    Throttled,
)
from ._fetch import TransientError, with_retries
from ._fs import get_fs, options_token, resolve_storage_options
from ._loop import run
from ._manifest import Manifest, manifest_path
from ._s3 import ListPage, S3Reader
from ._url import BlobURL, parse_url

__all__ = ["IMG_EXTENSIONS", "identity_from_info", "list_folder", "load_or_list", "translate_error"]

logger = logging.getLogger(__name__)

#: torchvision's IMG_EXTENSIONS, matched case-insensitively against the end of the file name.
IMG_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# (relkey relative to the root, size in bytes, identity)
_Obj = tuple[str, int, str]


# -- identity ---------------------------------------------------------------------------------


def identity_from_info(protocol: str, info: Mapping[str, Any]) -> str:
    """The string that changes when the object changes, from an fsspec info/listing dict.

    s3: ETag without quotes, plus ``@VersionId`` when the listing has one; gs: the generation;
    az: the etag without quotes; file: ``"{mtime_ns}-{size}"``; memory: ``"{created}-{size}"``.
    """
    if protocol == "s3":
        etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
        version = info.get("VersionId") or info.get("version_id")
        return f"{etag}@{version}" if version and version != "null" else etag
    if protocol in ("gs", "gcs"):
        generation = info.get("generation")
        return str(generation) if generation is not None else str(info.get("etag") or "")
    if protocol in ("az", "abfs"):
        return str(info.get("etag") or info.get("ETag") or "").strip('"')
    size = int(info.get("size") or 0)
    if protocol == "file":
        mtime_ns = info.get("mtime_ns")
        if mtime_ns is None:
            # fsspec's local info has a float mtime (sub-microsecond precision lost): stat again.
            mtime_ns = os.stat(info["name"]).st_mtime_ns
        return f"{int(mtime_ns)}-{size}"
    created = info.get("created")
    if isinstance(created, datetime.datetime):
        created = created.timestamp()
    return f"{created!r}-{size}"


# -- error translation (the one boundary) -------------------------------------------------------

_DENIED = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled",
    "InvalidToken", "AccountProblem", "AuthorizationFailure", "AuthenticationFailed", "Forbidden",
}  # fmt: skip
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
              "ServiceUnavailable", "ServerBusy", "503", "429"}  # fmt: skip
_MISSING = {"NoSuchBucket", "NoSuchKey", "NotFound", "404", "ContainerNotFound", "BlobNotFound"}


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _status(exc: BaseException) -> tuple[str | None, int | None]:
    """(error code, HTTP status) of a botocore/gcsfs/azure error, where it has them."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error") or {}
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return (str(err.get("Code")) if err.get("Code") else None), (int(status) if status else None)
    code = getattr(exc, "error_code", None)  # azure.core HttpResponseError
    status = getattr(exc, "status_code", None)
    if status is None and isinstance(getattr(exc, "code", None), int):
        status = exc.code  # type: ignore[attr-defined]  # gcsfs HttpError
    return (str(code) if code else None), (int(status) if isinstance(status, int) else None)


def translate_error(exc: BaseException, url: str, *, what: str = "listing") -> BlobdataError:
    """Map a backend exception to the most specific blobdata error naming ``url``.

    Callers ``raise translate_error(exc, url) from exc``. A throttled request is never "not found".
    """
    if isinstance(exc, BlobdataError):
        return exc
    for e in _chain(exc):
        code, status = _status(e)
        if code is None and status is None:
            continue
        if code in _THROTTLED or status in (429, 503):
            return Throttled(f"{what} of {url} was throttled by the store ({code or status}): retry later "
                             "or lower the concurrency", url=url)  # fmt: skip
        if code in _DENIED or status in (401, 403):
            return AccessDenied(f"{what} of {url} was refused ({code or status}): check the credentials "
                                "(key/secret, profile, token) and the bucket policy", url=url)  # fmt: skip
        if code == "NoSuchBucket" or code == "ContainerNotFound":
            return NotFound(f"the bucket of {url} does not exist ({code}): check the bucket name and the "
                            "endpoint", url=url)  # fmt: skip
        if code in _MISSING or status == 404:
            return NotFound(f"{url} does not exist ({code or status})", url=url)
        if code == "RequestTimeout" or status == 408:
            return FetchTimeout(f"{what} of {url} timed out ({code or status})", url=url)
        return FetchError(f"{what} of {url} failed: {code or status}: {e}", url=url)
    names = {type(e).__name__ for e in _chain(exc)}
    if names & {"NoCredentialsError", "PartialCredentialsError", "ClientAuthenticationError"}:
        return AccessDenied(f"no usable credentials for {url}: set them in storage_options or the "
                            "environment", url=url)  # fmt: skip
    if names & {"ConnectTimeoutError", "ReadTimeoutError", "TimeoutError", "ServerTimeoutError",
                "FSTimeoutError"}:  # fmt: skip
        return FetchTimeout(f"{what} of {url} timed out: check the endpoint and the network", url=url)
    if names & {"EndpointConnectionError", "ClientConnectorError", "ConnectionRefusedError", "gaierror",
                "ConnectionError", "ServiceRequestError", "ClientConnectionError"}:  # fmt: skip
        return FetchError(
            f"cannot connect to the store for {url} ({type(exc).__name__}): check endpoint_url in "
            "storage_options (or AWS_ENDPOINT_URL_S3, STORAGE_EMULATOR_HOST, "
            "AZURE_STORAGE_CONNECTION_STRING) and that the server is running",
            url=url,
        )
    if isinstance(exc, PermissionError):
        return AccessDenied(f"{what} of {url} was refused: {exc}", url=url)
    if isinstance(exc, FileNotFoundError):
        return NotFound(f"{url} does not exist", url=url)
    return FetchError(f"{what} of {url} failed: {type(exc).__name__}: {exc}", url=url)


# -- backends: list the root's folders, then everything below one folder ----------------------


class _Lister:
    """Two operations per backend; relkeys are relative to the root, exactly as stored."""

    def __init__(self, url: BlobURL, fs: Any) -> None:
        self.url = url
        self.fs = fs

    async def folders(self) -> tuple[list[str], bool]:
        """(names of the immediate sub-folders, whether anything at all lies below the root)."""
        raise NotImplementedError

    async def below(self, folder: str) -> list[_Obj]:
        """Every object below ``root/folder/``, markers included."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Release what the lister opened itself (default: nothing; fsspec clients are shared)."""


class _S3Lister(_Lister):
    """list_objects_v2 pages through s3fs (its per-page retries), bypassing its dircache."""

    def _prefix(self) -> str:
        return self.url.prefix + "/" if self.url.prefix else ""

    def _iter(self, prefix: str, delimiter: str) -> Any:
        return self.fs._iterdir(self.url.bucket, prefix=prefix, delimiter=delimiter)

    async def folders(self) -> tuple[list[str], bool]:
        base = self._prefix()
        cut = len(self.url.bucket) + 1 + len(base)
        names: list[str] = []
        anything = False
        async for info in self._iter(base, "/"):
            anything = True
            if info["type"] == "directory":
                names.append(info["Key"][cut:])  # "bucket/prefix/cls" (s3fs dropped the "/")
        return names, anything

    async def below(self, folder: str) -> list[_Obj]:
        cut = len(self.url.bucket) + 1 + len(self._prefix())
        out: list[_Obj] = []
        async for info in self._iter(self._prefix() + folder + "/", ""):
            out.append((info["Key"][cut:], int(info["size"]), identity_from_info("s3", info)))
        return out


class _S3LeanLister(_Lister):
    """ListObjectsV2 pages through blobdata's own signed requests, parsed with ``xml.etree``
    (:meth:`blobdata._s3.S3Reader.list_page`): a 1,000-key page costs ~0.03 s of client CPU where
    botocore spends ~0.14 s. Each page is retried under one budget (:func:`blobdata._s3.with_retries`,
    FetchOptions' defaults) and a final failure is stated as :func:`translate_error` states s3fs's."""

    def __init__(self, url: BlobURL, storage_options: Mapping[str, Any], concurrency: int) -> None:
        super().__init__(url, None)
        self.reader = S3Reader(storage_options, concurrency=concurrency)
        self.options = FetchOptions(concurrency=concurrency)
        self.base = url.prefix + "/" if url.prefix else ""

    async def _pages(self, prefix: str, delimiter: str | None) -> AsyncIterator[ListPage]:
        bucket, opts, root = self.url.bucket, self.options, str(self.url)
        token: str | None = None
        while True:
            call = functools.partial(
                self.reader.list_page,
                bucket,
                prefix,
                delimiter=delimiter,
                continuation=token,
                timeout=opts.timeout,
            )
            try:
                page = await with_retries(call, url=f"s3://{bucket}/{prefix}", options=opts)
            except BlobdataError as exc:
                # The lean path chains the store's status and code (or the transport error) as the
                # cause, behind the retried TransientError: restated here as s3fs's errors are.
                origin = exc.__cause__
                if isinstance(origin, TransientError) and origin.__cause__ is not None:
                    origin = origin.__cause__
                err = translate_error(origin or exc, root)
                if err is exc:
                    raise
                raise err from exc
            yield page
            if page.next_token is None:
                return
            if page.next_token == token:
                raise FetchError(f"listing of {root} failed: the store sent the same continuation token "
                                 "twice; retry later", url=root)  # fmt: skip
            token = page.next_token

    async def folders(self) -> tuple[list[str], bool]:
        cut = len(self.base)
        names: list[str] = []
        anything = False
        async for page in self._pages(self.base, "/"):
            anything = anything or bool(page.keys or page.common_prefixes)
            names.extend(p[cut:-1] for p in page.common_prefixes)  # "prefix/cls/" -> "cls"
        return names, anything

    async def below(self, folder: str) -> list[_Obj]:
        cut = len(self.base)
        out: list[_Obj] = []
        async for page in self._pages(self.base + folder + "/", None):
            out.extend(zip([k[cut:] for k in page.keys], page.sizes, page.etags, strict=True))
        return out

    async def aclose(self) -> None:
        await self.reader.close()


# storage_options the lean S3 path reads as s3fs does (see S3Reader), or that change nothing in what
# a listing returns. Anything else (a botocore session, use_ssl, s3_additional_kwargs, addressing
# or signature settings, versions, requester pays) keeps the listing on s3fs.
_LEAN_S3_OPTIONS = frozenset({
    "key", "secret", "token", "anon", "profile", "endpoint_url", "client_kwargs", "config_kwargs",
    "version_aware", "requester_pays", "s3_additional_kwargs", "cache_regions", "use_listings_cache",
    "listings_expiry_time", "max_dirs", "default_block_size", "default_fill_cache", "default_cache_type",
    "skip_instance_cache",
})  # fmt: skip
_LEAN_CLIENT_KWARGS = frozenset({
    "endpoint_url", "region_name", "verify", "aws_access_key_id", "aws_secret_access_key",
    "aws_session_token",
})  # fmt: skip
_LEAN_CONFIG_KWARGS = frozenset({"max_pool_connections", "connect_timeout", "read_timeout", "retries"})


def _lean_s3(storage_options: Mapping[str, Any]) -> bool:
    """Whether the lean S3 listing path serves these (resolved) storage options exactly as s3fs would.

    ``version_aware`` (ListObjectVersions), ``requester_pays`` and any option it does not know keep
    the listing on s3fs.
    """
    opts = storage_options
    if opts.get("version_aware") or opts.get("requester_pays") or opts.get("s3_additional_kwargs"):
        return False
    client_kwargs = opts.get("client_kwargs") or {}
    config_kwargs = opts.get("config_kwargs") or {}
    return (
        opts.keys() <= _LEAN_S3_OPTIONS
        and isinstance(client_kwargs, Mapping)
        and client_kwargs.keys() <= _LEAN_CLIENT_KWARGS
        and isinstance(config_kwargs, Mapping)
        and config_kwargs.keys() <= _LEAN_CONFIG_KWARGS
    )


class _AsyncFsLister(_Lister):
    """gcsfs / adlfs: their own listing calls, with the dircache invalidated first."""

    def __init__(self, url: BlobURL, fs: Any, protocol: str) -> None:
        super().__init__(url, fs)
        self.protocol = protocol
        self.base = url.fs_path

    def _rel(self, name: str) -> str:
        return name[len(self.base) + 1 :] if self.base else name

    async def folders(self) -> tuple[list[str], bool]:
        self.fs.invalidate_cache(self.base)
        try:
            entries = await self.fs._ls(self.base, detail=True)
        except FileNotFoundError:
            return [], False
        names = [self._rel(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory"]
        return names, bool(entries)

    async def below(self, folder: str) -> list[_Obj]:
        path = f"{self.base}/{folder}"
        self.fs.invalidate_cache(path)
        found = await self.fs._find(path, detail=True, withdirs=False)
        return [
            (self._rel(n), int(i.get("size") or 0), identity_from_info(self.protocol, i))
            for n, i in found.items()
        ]


class _MemoryLister(_Lister):
    async def folders(self) -> tuple[list[str], bool]:
        if not self.fs.exists(self.url.fs_path):
            return [], False
        entries = self.fs.ls(self.url.fs_path, detail=True)
        cut = len(self.url.fs_path.rstrip("/")) + 1
        return [e["name"][cut:] for e in entries if e["type"] == "directory"], bool(entries)

    async def below(self, folder: str) -> list[_Obj]:
        base = self.url.fs_path.rstrip("/")
        found = self.fs.find(f"{base}/{folder}", detail=True, withdirs=False)
        return [
            (n[len(base) + 1 :], int(i["size"]), identity_from_info("memory", i)) for n, i in found.items()
        ]


class _LocalLister(_Lister):
    """os.scandir / os.walk(followlinks=True) exactly as torchvision does, in threads."""

    async def folders(self) -> tuple[list[str], bool]:
        def scan() -> tuple[list[str], bool]:
            with os.scandir(self.url.prefix) as it:
                entries = list(it)
            return [e.name for e in entries if e.is_dir()], bool(entries)

        try:
            return await asyncio.to_thread(scan)
        except (FileNotFoundError, NotADirectoryError):
            return [], False

    async def below(self, folder: str) -> list[_Obj]:
        root = self.url.prefix

        def walk() -> list[_Obj]:
            out: list[_Obj] = []
            cut = len(root.rstrip("/")) + 1
            for dirpath, _dirs, fnames in os.walk(os.path.join(root, folder), followlinks=True):
                for fname in fnames:
                    path = os.path.join(dirpath, fname)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue  # dangling symlink or vanished file: torchvision would fail later
                    out.append((path[cut:], st.st_size, f"{st.st_mtime_ns}-{st.st_size}"))
            return out

        return await asyncio.to_thread(walk)


def _lister(url: BlobURL, storage_options: Mapping[str, Any], concurrency: int) -> _Lister:
    if url.protocol == "file":
        return _LocalLister(url, None)
    if url.protocol == "s3" and _lean_s3(storage_options):
        return _S3LeanLister(url, storage_options, concurrency)
    fs = get_fs(url.protocol, storage_options)
    if url.protocol == "s3":
        return _S3Lister(url, fs)
    if url.protocol == "memory":
        return _MemoryLister(url, fs)
    return _AsyncFsLister(url, fs, url.protocol)


# -- ImageFolder semantics ----------------------------------------------------------------------


def _ext_tuple(extensions: tuple[str, ...] | str | None) -> tuple[str, ...]:
    if extensions is None:
        return IMG_EXTENSIONS
    return (extensions,) if isinstance(extensions, str) else tuple(extensions)


def _validator(
    extensions: tuple[str, ...] | None, is_valid_file: Callable[[str], bool] | None
) -> tuple[Callable[[str, str], bool], tuple[str, ...] | None]:
    """(check(relkey, url), effective extensions) following ImageFolder's rules."""
    if extensions is not None and is_valid_file is not None:
        raise ConfigError(
            "extensions and is_valid_file cannot both be given (as in torchvision's ImageFolder)"
        )
    if is_valid_file is not None:
        fn = is_valid_file
        return (lambda relkey, url: not relkey.endswith("/") and bool(fn(url))), None
    exts = _ext_tuple(extensions)
    lowered = tuple(e.lower() for e in exts)
    return (lambda relkey, url: not relkey.endswith("/") and relkey.lower().endswith(lowered)), exts


def _walk_order(relkey: str) -> tuple[str, str]:
    # sorted(os.walk(d)) sorts directories by their full path; sorted(fnames) within each.
    head, _, tail = relkey.rpartition("/")
    return head, tail


def listing_params(
    extensions: tuple[str, ...] | None, is_valid_file: Callable[[str], bool] | None
) -> dict[str, Any]:
    """The parameters a listing depends on, as stored in (and hashed into the name of) a manifest.

    A callable ``is_valid_file`` is identified by its qualified name and a hash of its code and
    constants: best effort; list with ``refresh=True`` after changing what it captures.
    """
    params: dict[str, Any] = {"extensions": None, "is_valid_file": None}
    if is_valid_file is not None:
        code = getattr(is_valid_file, "__code__", None)
        digest = hashlib.sha256(repr((code.co_code, code.co_consts)).encode() if code else b"").hexdigest()[
            :16
        ]
        name = f"{getattr(is_valid_file, '__module__', '?')}.{getattr(is_valid_file, '__qualname__', '?')}"
        params["is_valid_file"] = f"{name}#{digest}"
    else:
        exts = _ext_tuple(extensions)
        params["extensions"] = sorted(e.lower() for e in exts)
    return params


def _check_nonempty(manifest: Manifest, extensions: tuple[str, ...] | None) -> None:
    empty = [c for c, n in zip(manifest.classes, manifest.class_counts(), strict=True) if n == 0]
    if empty:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty))} under {manifest.root}. "
        if extensions is not None:
            msg += f"Supported extensions are: {', '.join(extensions)}. "
        msg += "Pass allow_empty=True to accept empty classes."
        raise EmptyDatasetError(msg, url=manifest.root)


async def _list(
    url: BlobURL, storage_options: Mapping[str, Any], concurrency: int
) -> tuple[list[str], list[list[_Obj]]]:
    """(sorted class names, the raw objects below each, then those below an empty-named folder if any)."""
    lister = _lister(url, storage_options, concurrency)
    try:
        return await _list_with(lister, url, concurrency)
    finally:
        await lister.aclose()


async def _list_with(lister: _Lister, url: BlobURL, concurrency: int) -> tuple[list[str], list[list[_Obj]]]:
    root = str(url)
    names, anything = await lister.folders()
    if not anything:
        raise NotFound(f"nothing found at {root}: check the bucket and prefix (a dataset folder holds one "
                       "sub-folder per class)", url=root)  # fmt: skip
    classes = sorted(set(n for n in names if n))
    if not classes:
        raise EmptyDatasetError(f"Couldn't find any class folder in {root}.", url=root)
    sem = asyncio.Semaphore(concurrency)

    async def one(folder: str) -> list[_Obj]:
        async with sem:
            return await lister.below(folder)

    # "" is the folder of keys such as root//x.jpg: listed only to report them as skipped.
    folders = classes + ([""] if "" in names else [])
    tasks = [asyncio.ensure_future(one(f)) for f in folders]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    return classes, list(results)


def list_folder(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    extensions: tuple[str, ...] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    allow_empty: bool = False,
    concurrency: int = 64,
) -> Manifest:
    """List ``url`` (a folder with one sub-folder per class) into a Manifest, ImageFolder order.

    ``extensions`` defaults to :data:`IMG_EXTENSIONS` (case-insensitive); ``is_valid_file``
    receives each object's URL and excludes ``extensions``. ``concurrency``: class prefixes
    listed at once (default 64). Raises EmptyDatasetError (a FileNotFoundError) when there is no
    class folder or, unless ``allow_empty``, a class has no valid file; NotFound, AccessDenied,
    FetchError for a missing bucket/prefix, refused credentials or an unreachable endpoint.
    """
    parsed = parse_url(url)
    root = str(parsed)
    if not isinstance(concurrency, int) or concurrency < 1:
        raise ConfigError(f"concurrency must be a positive integer, got {concurrency!r}", url=root)
    check, exts = _validator(extensions, is_valid_file)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    listed_at = time.time()
    t0 = time.monotonic()
    try:
        classes, results = run(_list(parsed, opts, concurrency))
    except BlobdataError:
        raise
    except Exception as exc:
        raise translate_error(exc, root) from exc
    # Filtering (a user callable) and sorting run here, in the caller's thread, not on the I/O loop.
    prefix = root + "/"
    per_class: list[list[_Obj]] = []
    for objs in results[: len(classes)]:
        kept = [o for o in objs if check(o[0], prefix + o[0])]
        kept.sort(key=lambda o: _walk_order(o[0]))
        per_class.append(kept)
    skipped = (
        [prefix + o[0] for o in results[len(classes)] if not o[0].endswith("/")]
        if len(results) > len(classes)
        else []
    )
    if skipped:
        logger.warning(
            "%d object(s) under %s lie in a folder with an empty name and belong to no class; skipped, "
            "e.g. %s", len(skipped), root, ", ".join(skipped[:3]),
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


def load_or_list(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    refresh: bool = False,
    manifest: str | os.PathLike[str] | None = None,
    extensions: tuple[str, ...] | None = None,
    is_valid_file: Callable[[str], bool] | None = None,
    allow_empty: bool = False,
    concurrency: int = 64,
    save: bool = True,
) -> Manifest:
    """The remembered listing of ``url``.

    With ``manifest`` (a path or URL of a precomputed manifest): load it, check it is for ``url``,
    and send no listing request. Otherwise return the manifest remembered under
    :func:`~blobdata._manifest.manifest_path` when it is there and valid (no request to the store),
    else list and remember it (``save``). ``refresh=True`` always lists again. ``memory://``
    listings are never remembered (that store lives and dies with the process).
    """
    parsed = parse_url(url)
    root = str(parsed)
    _check, exts = _validator(extensions, is_valid_file)
    opts = resolve_storage_options(parsed.protocol, storage_options)
    if manifest is not None:
        source = os.fspath(manifest)
        m_proto = parse_url(source).protocol if "://" in source else "file"
        m_opts = opts if m_proto == parsed.protocol else None
        loaded = Manifest.load(source, storage_options=m_opts, expect_root=root)
        if not allow_empty:
            _check_nonempty(loaded, exts)
        return loaded
    params = listing_params(extensions, is_valid_file)
    remember = save and parsed.protocol != "memory"
    path = manifest_path(root, options_token(parsed.protocol, opts), params)
    if remember and not refresh and path.exists():
        try:
            loaded = Manifest.load(path, expect_root=root)
        except (ManifestError, NotFound) as exc:
            logger.warning("remembered listing %s is unusable (%s); listing %s again", path, exc, root)
        else:
            if not allow_empty:
                _check_nonempty(loaded, exts)
            return loaded
    listed = list_folder(
        url,
        storage_options=storage_options,
        extensions=extensions,
        is_valid_file=is_valid_file,
        allow_empty=allow_empty,
        concurrency=concurrency,
    )
    if remember:
        try:
            listed.save(path)
        except OSError as exc:
            logger.warning("could not remember the listing of %s in %s: %s", root, path, exc)
    return listed

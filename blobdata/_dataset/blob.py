"""``BlobDataset``: any folder of objects, samples of one or more objects each, as dicts.

Samples are made by webdataset's key rule from a listing of the folder (:mod:`blobdata._listing.samples`),
or from the rows of a metadata file (Hugging Face's ``imagefolder`` convention,
:mod:`blobdata._listing.metadata`), or from an index file instead of any listing
(:mod:`blobdata._listing.index`). Every member of a sample is fetched together (one look-ahead unit),
each its own cache entry, pinned to the identity listed for it, or, when an index did not say, to the
one learned at its first read (remembered in the cache, so other processes and later jobs pin the same).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch.utils.data

from .._cache import BlobCache
from .._config import DEFAULT_LISTING_MAX_AGE, FetchOptions
from .._decode import IMAGE_EXTENSIONS, Sample, decode_member, decoders_for, extension
from .._errors import BlobdataError, ConfigError, DecodeError, ManifestError, NotFound
from .._listing import Manifest, SampleTable, build_table
from .._metrics import stats as _stats
from .._peers import Peers
from .._sampling import enter_batch, leave_sample
from .._stores import list_requests, resolve_storage_options
from ..gpu._jpeg import prepare as prepare_raw
from .ahead import Stopped
from .base import BlobDatasetBase, OnError, resolve_cache
from .reads import Objects

__all__ = ["BlobDataset"]

#: The cache entry ``(LEARNED + url, LEARNED)`` remembers the identity an object had at its first read, when
#: no listing said (under a URL of its own: the cache keeps one identity per URL).
LEARNED = "blobdata-learned-identity:"
#: Bytes assumed for a member whose size no listing gave, for the look-ahead's byte budget.
_UNKNOWN_SIZE = 64 * 1024


class BlobDataset(BlobDatasetBase, torch.utils.data.Dataset[dict[str, Any]]):
    """Any folder of objects in a bucket; ``ds[i]`` is a dict, one sample of one or more objects.

    ``url`` is any supported URL (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://`` or a local
    path). Sample ``i`` is ``{"__key__": key, "__url__": url/key, <member>: value, ..., <field>: value}``:

    * **A folder** (no ``index``, no metadata file): every object below ``url`` belongs to the sample of
      its key, webdataset's rule: the path relative to ``url`` up to the first dot of the file name, the
      rest, lower-cased, being the member's name (``a/x.seg.PNG`` is member ``"seg.png"`` of sample
      ``"a/x"``; ``x.JPG`` next to ``x.jpg`` is refused, as webdataset refuses it). Objects in hidden or
      special folders (``.ipynb_checkpoints/``, ``__MACOSX/``) are skipped, as Hugging Face skips them.
      Samples are sorted by key.
    * **A metadata file** (``metadata.jsonl``, ``metadata.csv`` or ``metadata.parquet`` at ``url``,
      found by itself, or ``metadata=`` a path relative to ``url``, a local path or a URL): one sample per
      row, as Hugging Face's ``imagefolder``. ``file_name`` names the main object (its member is named
      by its extension, as in a folder), ``<name>_file_name`` another (member ``<name>``),
      ``file_names`` / ``<name>_file_names`` lists of them (members ``"files"`` / ``<name>``, lists);
      every other column is a field of the sample, typed as Hugging Face types it (a CSV column as a
      whole, as pandas does; a key a JSON Lines row lacks is None).
    * **An index** (``index=`` a CSV, JSONL or Parquet file, or an S3 Inventory ``manifest.json``): its
      rows name the objects (column ``key``, relative to ``url``; optional ``size``, ``etag``; any other
      column is a field of the row's sample), grouped by the key rule. No listing request is made;
      sizes and ETags an index lacks are learned at each object's first read and pinned from then on.

    Members are decoded by extension (:mod:`blobdata._decode.members`: images to RGB ``PIL.Image``,
    ``json`` parsed, ``txt`` to ``str``, ``cls`` to ``int``, ``npy`` to an array, the rest ``bytes``);
    ``decoders={"wav": fn}`` adds or replaces one, ``decoders=False`` leaves bytes. ``transform``
    receives the dict and returns the sample. The other keyword settings are
    :class:`~blobdata.FolderDataset`'s: ``storage_options``, ``cache``, ``manifest`` (a saved listing),
    ``refresh``, ``listing_max_age``, ``on_error``, ``fetch_options``, ``lookahead``, ``lookahead_bytes``,
    ``share_listing``, ``peers``; :meth:`dataloader`, ``state_dict``, ``PartitionedSampler``, ``stats()`` and
    ``blobdata.warm(ds)`` work as with it. On the device path (``dataloader(device=, gpu_transform=)``)
    each sample's one image member goes to the device and the rest of the dict, through ``transform``,
    is the target.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        metadata: str | os.PathLike[str] | None = None,
        index: str | os.PathLike[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        decoders: Mapping[str, Callable[[bytes], Any] | None] | bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        cache: str | os.PathLike[str] | BlobCache | None = None,
        manifest: str | os.PathLike[str] | None = None,
        refresh: bool = False,
        listing_max_age: float | str | None = DEFAULT_LISTING_MAX_AGE,
        on_error: OnError = "raise",
        fetch_options: FetchOptions | None = None,
        share_listing: bool = True,
        lookahead: int | None = None,
        lookahead_bytes: int | str | None = None,
        peers: bool | Peers | None = None,
    ) -> None:
        self.root = self._setup(
            url,
            storage_options=storage_options,
            cache=resolve_cache(cache),
            on_error=on_error,
            fetch_options=fetch_options,
            lookahead=lookahead,
            lookahead_bytes=lookahead_bytes,
            peers=peers,
        )
        self.transform = transform
        self._decoders = decoders_for(decoders)
        lists = list_requests()
        self._table: SampleTable = build_table(
            self._url,
            storage_options=resolve_storage_options(self._protocol, self._storage_options),
            metadata=os.fspath(metadata) if metadata is not None else None,
            index=os.fspath(index) if index is not None else None,
            manifest=os.fspath(manifest) if manifest is not None else None,
            refresh=refresh,
            max_age=listing_max_age,
            fetch_options=self.fetch_options,
            share=share_listing,
            skip_missing=on_error == "skip",
        )
        self.list_requests = list_requests() - lists  # LIST requests its listing took (an index: none)
        self._learned: dict[int, str] = {}  # object row -> identity learned at its first read (this process)

    @property
    def url(self) -> str:
        """The root's canonical URL (``file:///...`` for a local folder)."""
        return self._url

    @property
    def manifest(self) -> Manifest | None:
        """The folder's listing this dataset was made from (``ds.manifest.save(path)``, then
        ``BlobDataset(url, manifest=path)`` on other nodes lists nothing); None when made from an index."""
        listing: Manifest | None = self._table.listing
        return listing

    @property
    def table(self) -> SampleTable:
        """The samples and their objects (compact arrays)."""
        return self._table

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return (
            f"BlobDataset({self._url!r}, samples={len(self)}, objects={self._table.num_objects}"
            f"{self._settings_repr()}, transform={self.transform!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_learned"] = {}
        return state

    def keys(self) -> list[str]:
        """Every sample's key, in order."""
        return [self._table.key(i) for i in range(len(self))]

    def objects(self) -> list[tuple[str, int | None, str | None]]:
        """``(url, size, identity)`` of every object the dataset reads, every member of every sample
        (``None`` where the index did not say), in sample order."""
        t = self._table
        return [
            (t.url(j), int(t.sizes[j]) if t.sizes[j] >= 0 else None, t.identity(j) or None)
            for j in range(t.num_objects)
        ]

    def warm_objects(self, cache_dir: str) -> WarmObjects:
        """The objects this dataset reads, for ``blobdata.warm`` (see :mod:`blobdata._cli.warm_objects`)."""
        return WarmObjects(self._table, cache_dir)

    def object_rows(self, samples: Sequence[int]) -> np.ndarray:
        """The object rows of the samples ``samples`` (every member of each), in order."""
        t = self._table
        parts = [np.arange(t.offsets[i], t.offsets[i + 1], dtype=np.int64) for i in samples]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    # -- reading -----------------------------------------------------------------------------------
    def _size_of(self, i: int) -> int:
        t = self._table
        rows = t.members(i)
        return sum(int(t.sizes[j]) if t.sizes[j] >= 0 else _UNKNOWN_SIZE for j in rows)

    async def _load(self, i: int, *, checked: bool = False) -> list[bytes]:
        """Every member of sample ``i``, fetched together (not looked up in the cache if ``checked``)."""
        rows = self._table.members(i)
        got = await asyncio.gather(*(self._load_object(j, checked) for j in rows), return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        return [g for g in got if isinstance(g, bytes)]

    async def _load_object(self, j: int, checked: bool = False) -> bytes:
        t = self._table
        url, size, identity = t.url(j), int(t.sizes[j]), t.identity(j)
        if not identity:
            identity = self._learned.get(j) or self._remembered(url)
        try:
            # ``checked``: the look-ahead found the object missing under the identity known then.
            known = bool(t.identity(j) or self._learned.get(j))
            data, got = await self._fetch_object(
                url, size if size >= 0 else None, identity, learn=True, checked=checked and known
            )
        except NotFound as exc:
            wrapped = self._object_error(j, exc)
            if wrapped is exc:
                raise
            raise wrapped from exc
        except ManifestError as exc:  # what the index said of it is unusable (an ETag no header can carry)
            wrapped = self._object_error(j, exc)
            if wrapped is exc:
                raise
            raise wrapped from exc
        if not t.identity(j) and got and j not in self._learned:
            self._learned[j] = got
            proc = self._process()
            if proc.writer is not None and not identity:
                proc.writer.offer(LEARNED + url, LEARNED, got.encode("utf-8", "surrogatepass"))
        return data

    def _objects(self, indices: list[int]) -> Objects:
        t = self._table
        rows = self.object_rows(indices).tolist()
        offsets = t.offsets
        counts = (offsets[np.asarray(indices, dtype=np.int64) + 1] - offsets[indices]).tolist()
        starts = [0, *itertools.accumulate(counts)]
        ids = t.identities(rows)
        urls = t.urls(rows)
        if not all(ids):  # an index without ETags: the identities learned at a first read
            learned = self._learned
            unknown = [k for k, j in enumerate(rows) if not ids[k] and j not in learned]
            cache = self._process().cache if unknown else None
            if cache is not None:  # remembered in the cache, by this process or an earlier one
                got = cache.get_many([(LEARNED + urls[k], LEARNED) for k in unknown])
                for k, data in zip(unknown, got, strict=True):
                    if data:
                        learned[rows[k]] = data.decode("utf-8", "surrogatepass")
            ids = [ident or learned.get(j, "") for j, ident in zip(rows, ids, strict=True)]
        return Objects(rows, starts, urls, t.sizes[rows].tolist(), ids)

    def _object_error(self, row: int, exc: BlobdataError) -> BlobdataError:
        """``exc`` naming the index or metadata file and line that named the object, where one did."""
        where = self._table.where(row) if isinstance(exc, (NotFound, ManifestError)) else ""
        if not where:
            return exc
        wrapped: BlobdataError
        if isinstance(exc, NotFound):  # an index: what exists is known only by reading it
            wrapped = NotFound(
                f"{exc.url}, named in {where}, does not exist: {exc.message}; `blobdata warm {self._url} "
                "--index FILE --cache-dir D` reads every object once and lists all that are missing, "
                'and on_error="skip" trains past them',
                url=exc.url,
            )
        else:
            wrapped = ManifestError(f"{where}: {exc.message}", url=exc.url)
        wrapped.__cause__ = exc
        return wrapped

    def _remembered(self, url: str) -> str:
        """The identity a cache remembers for ``url`` from an earlier first read, or ""."""
        cache = self._process().cache
        if cache is None:
            return ""
        data = cache.get(LEARNED + url, LEARNED)
        return data.decode("utf-8", "surrogatepass") if data else ""

    def _make(
        self, idx: list[int], datas: list[Any], seed: int | None, stop: threading.Event | None = None
    ) -> list[Any]:
        clock = time.perf_counter
        decoding = transforming = 0.0
        out: list[Any] = []
        t = self._table
        keyed, token = enter_batch(seed)  # blobdata.sample_rng() and our transforms draw from it
        try:
            for i, data, key in zip(idx, datas, t.keys(idx), strict=True):
                if stop is not None and stop.is_set():
                    raise Stopped
                url = f"{self._url}/{key}"
                keyed.sample(url)
                try:
                    if isinstance(data, BaseException):
                        raise data
                    t0 = clock()
                    if self._raw:  # the device path: the image's bytes for the device, the rest as the target
                        out.append(self._raw_sample(i, key, url, data))
                        decoding += clock() - t0
                        continue
                    sample = self._decode(i, key, url, data)
                    t1 = clock()
                    decoding += t1 - t0
                    if self.transform is not None:
                        sample = self.transform(sample)
                        transforming += clock() - t1
                except BlobdataError as exc:
                    self._failed(url, exc, stop)
                    continue
                out.append(sample)
        finally:
            leave_sample(token)
        v = _stats.rec()
        v[_stats.DECODE_S] += decoding
        v[_stats.TRANSFORM_S] += transforming
        return out

    def _decode(self, i: int, key: str, url: str, data: list[bytes], skip: int = -1) -> dict[str, Any]:
        t = self._table
        sample = Sample({"__key__": key, "__url__": url})
        for j, body in zip(t.members(i), data, strict=True):
            if j == skip:
                continue
            name = t.name(j)
            value = decode_member(body, t.url(j), self._decoders)
            if name.endswith("[]"):
                sample.setdefault(name[:-2], []).append(value)
            else:
                sample[name] = value
        for k, v in t.fields(i).items():
            sample.setdefault(k, v)
        return sample

    def _raw_view(self) -> BlobDataset:
        """This dataset for the device path (``dataloader(device=, gpu_transform=)``): each sample's image
        member (its only ``jpg``/``jpeg``/``png``/... object) goes to the device as bytes, and the rest of
        the dict, through ``transform`` when given, is the target."""
        if self._decoders is None:
            raise ConfigError(
                "with device=, images are decoded by blobdata.gpu: build the dataset without decoders=False"
            )
        view = copy.copy(self)  # shares the table and the cache
        view.errors = self.errors  # and the skip list (copying goes through __getstate__, which empties it)
        view._raw = True
        return view

    def _raw_sample(self, i: int, key: str, url: str, data: list[bytes]) -> tuple[Any, str, Any]:
        t = self._table
        rows = list(t.members(i))
        images = [k for k, j in enumerate(rows) if extension(t.relkey(j)) in IMAGE_EXTENSIONS]
        if len(images) != 1:
            raise DecodeError(
                f"sample {url} has {len(images)} image members ({', '.join(t.name(rows[k]) for k in images)})"
                ": the device path takes samples with exactly one",
                url=url,
            )
        k = images[0]
        image_url = t.url(rows[k])
        image = prepare_raw(data[k], image_url)
        rest = self._decode(i, key, url, data, skip=rows[k])
        target = self.transform(rest) if self.transform is not None else rest
        return image, image_url, target


class WarmObjects:
    """A dataset's objects for ``blobdata.warm``: ``root``, ``len``, ``sizes`` (unknown: 0), ``url(i)``,
    ``identity(i)`` (unknown: the one remembered in the cache from a first read, else ""), and for what
    is still unknown ``known_size(i)`` and ``learn(url, identity)``; :meth:`remember` writes what was
    learned to the cache, where the dataset's reads find it."""

    def __init__(self, table: SampleTable, cache_dir: str) -> None:
        self.root = table.root
        self._t = table
        self.sizes = np.clip(table.sizes, 0, None)
        self._dir = cache_dir
        self._cache = BlobCache(cache_dir) if os.path.isdir(cache_dir) else None
        self._learned: dict[str, str] = {}

    def __len__(self) -> int:
        return self._t.num_objects

    def url(self, i: int) -> str:
        return self._t.url(i)

    def identity(self, i: int) -> str:
        ident = self._t.identity(i)
        if ident or self._cache is None:
            return ident
        data = self._cache.get(LEARNED + self._t.url(i), LEARNED)
        return data.decode("utf-8", "surrogatepass") if data else ""

    def known_size(self, i: int) -> int | None:
        size = int(self._t.sizes[i])
        return size if size >= 0 else None

    def learn(self, url: str, identity: str) -> None:
        if identity:
            self._learned[url] = identity

    def remember(self) -> None:
        if self._learned:
            cache = self._cache if self._cache is not None else BlobCache(self._dir)
            cache.put_many(
                [(LEARNED + u, LEARNED, i.encode("utf-8", "surrogatepass")) for u, i in self._learned.items()]
            )
            cache.close()
        elif self._cache is not None:
            self._cache.close()

"""A node's share of a manifest, kept alone: O(share) on the node's disk and in its page cache.

A node that reads only its share of the samples (``FolderDataset(node_share=True)`` with
:class:`~blobdata.PartitionedSampler`) maps a file of that share's entries, not the whole manifest: a
share spread over the whole dataset touches one entry in a few hundred, but on nearly every page of
the manifest's arrays (a 4 KiB page holds 512 sizes), so a mapped manifest would bring most of it
into the page cache. The share file holds the share's ``rows`` (global sample indices, increasing)
and their keys, sizes, identities and targets, in the manifest's own form (:mod:`.packed`); sample
``i`` is row ``searchsorted(rows, i)``.

The share is cut from a manifest file (local, or a URL read in ranges, so that the node never stores
the whole), a slice of rows at a time: the file is read once, in order, its CRC summed on the way
(unless this node already verified it), and each slice's pages dropped from the page cache behind the
read (``posix_fadvise(DONTNEED)``): bounded memory, the whole file never resident. Written once per node
(the first process to finish links it in place) and mapped by every process of the node.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..._config import cache_home
from ..._errors import ConfigError, ManifestError
from ..manifest import _ARRAYS as MANIFEST_ARRAYS
from ..manifest import FORMAT_VERSION, Manifest
from ..mapping import _write_temp, is_verified, mark_verified, read_source
from ..packed import PREAMBLE, unpack, write_packed

__all__ = ["ShareManifest", "cut_share", "share_in_memory", "share_path"]

_MAGIC = b"BLOBSHAR"
_ARRAYS = {**MANIFEST_ARRAYS, "rows": "<i8"}
_ROWS = 1 << 20  # rows of the manifest read at a time
_READ = 8 << 20  # bytes summed at a time


class _Global:
    """One of a share's per-sample arrays, indexed by global sample index (int or array)."""

    __slots__ = ("_of", "_values")

    def __init__(self, of: ShareManifest, values: npt.NDArray[Any]) -> None:
        self._of, self._values = of, values

    def __getitem__(self, i: Any) -> Any:
        return self._values[self._of._row(i)]

    def __len__(self) -> int:
        return self._of.total

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"node_share keeps only this node's {len(self._values)} of the {self._of.total} samples of "
            f"{self._of.root}: the whole array is not here; make the dataset without node_share for it"
        )


class ShareManifest:
    """The entries of one node's share of a manifest of ``total`` samples (see the module docstring):
    :class:`~blobdata.Manifest`'s accessors, by global sample index."""

    def __init__(
        self, local: Manifest, rows: npt.NDArray[np.int64], total: int, spec: Mapping[str, Any]
    ) -> None:
        self.local, self.rows, self.total, self.spec = local, rows, int(total), dict(spec)
        self.root, self.classes = local.root, local.classes
        self.listed_at, self.skipped, self.params = local.listed_at, local.skipped, local.params
        self.sizes = _Global(self, local.sizes)
        self.targets = _Global(self, local.targets)

    def _row(self, i: Any) -> Any:
        if isinstance(i, (int, np.integer)):  # one sample: the per-sample path
            at = int(self.rows.searchsorted(i))
            if at < len(self.rows) and int(self.rows[at]) == i:
                return at
        idx = np.asarray(i, dtype=np.int64)
        j = np.searchsorted(self.rows, idx)
        n = len(self.rows)
        if not n or not bool(np.all((j < n) & (self.rows[np.minimum(j, n - 1)] == idx))):
            raise ConfigError(
                f"sample {i} of {self.root} is not in this node's share ({self.spec}): node_share keeps only "
                "the samples PartitionedSampler gives this node with these settings (and mix=0)"
            )
        return int(j) if np.ndim(i) == 0 else j

    def __len__(self) -> int:
        return self.total

    def __repr__(self) -> str:
        return f"ShareManifest({self.root!r}, {len(self.rows)} of {self.total} samples, {self.spec})"

    def relkey(self, i: int) -> str:
        return self.local.relkey(self._row(i))

    def url(self, i: int) -> str:
        return self.local.url(self._row(i))

    def identity(self, i: int) -> str:
        return self.local.identity(self._row(i))

    def size(self, i: int) -> int:
        return self.local.size(self._row(i))

    def target(self, i: int) -> int:
        return self.local.target(self._row(i))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShareManifest:
        """A share file, mapped (its checksum and checks once per node, as a manifest's)."""
        source = os.fspath(path)
        data, mark = read_source(source, None)
        known = is_verified(mark)

        def bad(what: str) -> ManifestError:
            return ManifestError(f"share {source} is unusable: {what}; delete it", url=source)

        header, arrays = unpack(data, magic=_MAGIC, version=FORMAT_VERSION, dtypes=_ARRAYS, kind="share",
                                verified=known, bad=bad)  # fmt: skip
        rows = arrays.pop("rows")
        try:
            local = Manifest(header["root"], header["classes"], listed_at=float(header["listed_at"]),
                             skipped=header.get("skipped") or (), params=header.get("params"), _checked=known,
                             **arrays)  # fmt: skip
            total = int(header["total"])
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"corrupt header ({type(exc).__name__})") from None
        if len(rows) != len(local) or (not known and len(rows) and (
                int(rows[0]) < 0 or int(rows[-1]) >= total or bool((np.diff(rows) <= 0).any()))):  # fmt: skip
            raise bad("rows that are not increasing sample indices of the manifest")
        if not known:
            mark_verified(mark)
        return cls(local, rows, total, header.get("spec") or {})


def share_path(source_identity: str, spec: Mapping[str, Any]) -> Path:
    """Where this node keeps the share ``spec`` of the manifest ``source_identity`` names."""
    h = hashlib.sha256(f"{source_identity}\0{json.dumps(dict(spec), sort_keys=True)}".encode()).hexdigest()
    return cache_home() / "shares" / f"{h[:40]}.share"


class _Reader:
    """Ranges of a manifest file: local (``pread``, pages dropped behind) or a URL (ranged reads)."""

    def __init__(self, source: str, storage_options: Mapping[str, Any] | None) -> None:
        self.source, self.fd, self.fs, self.path = source, -1, None, source
        if "://" not in source or source.startswith("file://"):
            self.path = source[len("file://") :] if source.startswith("file://") else source
            self.fd = os.open(os.path.expanduser(self.path), os.O_RDONLY)
            with contextlib.suppress(AttributeError, OSError):  # no read-ahead: only what is read comes in
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
            st = os.fstat(self.fd)
            self.size, self.identity = st.st_size, f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        else:
            from ..._stores import get_fs, resolve_storage_options
            from ..._url import parse_url

            url = parse_url(source)
            self.fs = get_fs(url.protocol, resolve_storage_options(url.protocol, storage_options))
            self.path = url.fs_path
            info = self.fs.info(self.path)
            self.size = int(info["size"])
            version = info.get("ETag") or info.get("etag") or info.get("generation")
            self.identity = f"{source}:{self.size}:{version}"

    def read(self, offset: int, n: int) -> bytes:
        if n <= 0:
            return b""
        if self.fs is not None:
            data = bytes(self.fs.cat_file(self.path, start=offset, end=offset + n))
        else:
            data = os.pread(self.fd, n, offset)
            with contextlib.suppress(AttributeError, OSError):  # where there is no fadvise
                os.posix_fadvise(self.fd, offset, n, os.POSIX_FADV_DONTNEED)
        if len(data) != n:
            raise ManifestError(f"manifest {self.source} is truncated: {len(data)} of {n} bytes at {offset}",
                                url=self.source)  # fmt: skip
        return data

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(AttributeError, OSError):  # and nothing read stays behind
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(self.fd)


def _layout(src: _Reader) -> tuple[dict[str, Any], dict[str, tuple[int, int]], int]:
    """(header, {array: (file offset, bytes)}, declared CRC) of a manifest file, from its first bytes,
    checked against its size."""

    def bad(what: str) -> ManifestError:
        return ManifestError(f"manifest {src.source} is unusable: {what}", url=src.source)

    magic, version, head_len, crc = PREAMBLE.unpack(src.read(0, PREAMBLE.size))
    if magic != b"BLOBMANI" or version != FORMAT_VERSION:
        raise bad("not a blobdata manifest of this format version")
    if PREAMBLE.size + head_len > src.size:
        raise bad("truncated header")
    try:
        header = json.loads(src.read(PREAMBLE.size, head_len).decode("ascii"))
        layout = header["arrays"]
        start = -(-(PREAMBLE.size + head_len) // 64) * 64
        where = {n: (start + int(layout[n]["offset"]), int(layout[n]["nbytes"])) for n in MANIFEST_ARRAYS}
    except (ValueError, KeyError, TypeError) as exc:
        raise bad(f"corrupt header ({type(exc).__name__})") from None
    for name, (at, nbytes) in where.items():
        if layout[name].get("dtype") != MANIFEST_ARRAYS[name] or at + nbytes > src.size or nbytes < 0:
            raise bad(f"array {name!r} out of the {src.size}-byte file")
    return header, where, crc


def cut_share(
    source: str, rows: npt.NDArray[np.int64], spec: Mapping[str, Any], *,
    storage_options: Mapping[str, Any] | None = None, verified: Callable[[], bool] = lambda: False,
) -> ShareManifest:  # fmt: skip
    """The share ``rows`` (increasing sample indices) of the manifest at ``source``, cut once per node
    (see the module docstring) and mapped. ``verified()``: this node already checked the file."""
    src = _Reader(source, storage_options)
    try:
        spec = {**spec, "source": src.identity}
        path = share_path(src.identity, spec)
        if path.exists():
            with contextlib.suppress(ManifestError, OSError):
                got = ShareManifest.load(path)
                if got.spec.get("source") == src.identity and np.array_equal(got.rows, rows):
                    return got
        header, where, crc = _layout(src)
        if not verified():
            _check_crc(src, crc)
        local, total = _cut(src, header, where, rows)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        arrays = {**local._arrays(), "rows": rows}
        share_header = {"format": FORMAT_VERSION, "root": local.root, "classes": local.classes,
                        "count": len(rows), "total": total, "listed_at": local.listed_at,
                        "skipped": local.skipped, "params": local.params, "spec": spec}  # fmt: skip
        tmp = _write_temp(path, b"")
        try:
            with open(tmp, "r+b") as fh:
                write_packed(fh, _MAGIC, FORMAT_VERSION, share_header, arrays, _ARRAYS)
                fh.flush()
                os.fsync(fh.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # the first process of the node to get here wins; the others map its
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return ShareManifest.load(path)
    finally:
        src.close()


def share_in_memory(
    manifest: Manifest, rows: npt.NDArray[np.int64], spec: Mapping[str, Any]
) -> ShareManifest:
    """The share ``rows`` of a manifest held in memory (no file to cut it from): its rows copied."""
    from ..._stores import gather

    arrays = manifest._arrays()
    keys, key_offsets = gather(arrays["keys"], arrays["key_offsets"][rows], arrays["key_offsets"][rows + 1])
    ids, id_offsets = gather(arrays["ids"], arrays["id_offsets"][rows], arrays["id_offsets"][rows + 1])
    local = Manifest.from_arrays(
        manifest.root, manifest.classes, keys=keys, key_offsets=key_offsets, sizes=manifest.sizes[rows],
        targets=manifest.targets[rows], ids=ids, id_offsets=id_offsets, listed_at=manifest.listed_at,
        skipped=manifest.skipped, params=manifest.params,
    )  # fmt: skip
    return ShareManifest(local, rows, len(manifest), spec)


def _check_crc(src: _Reader, crc: int) -> None:
    got = 0
    for at in range(PREAMBLE.size, src.size, _READ):
        got = zlib.crc32(src.read(at, min(_READ, src.size - at)), got)
    if got != crc:
        raise ManifestError(f"manifest {src.source} is unusable: checksum mismatch", url=src.source)


def _cut(
    src: _Reader, header: dict[str, Any], where: dict[str, tuple[int, int]], rows: npt.NDArray[np.int64]
) -> tuple[Manifest, int]:
    total = int(header["count"])
    if len(rows) and (int(rows[0]) < 0 or int(rows[-1]) >= total or bool((np.diff(rows) <= 0).any())):
        raise ConfigError(f"a share of {src.source} names samples outside 0..{total - 1}")

    def array(name: str, lo: int, hi: int) -> npt.NDArray[Any]:
        at, nbytes = where[name]
        size = np.dtype(MANIFEST_ARRAYS[name]).itemsize
        if hi * size > nbytes:
            raise ManifestError(f"manifest {src.source}: array {name!r} shorter than its count",
                                url=src.source)  # fmt: skip
        return np.frombuffer(src.read(at + lo * size, (hi - lo) * size), dtype=MANIFEST_ARRAYS[name])

    from ..._stores import Columns, Growing, gather

    grow = Growing()
    targets = []
    for lo in range(0, total, _ROWS):
        hi = min(total, lo + _ROWS)
        a, b = np.searchsorted(rows, [lo, hi])
        if a == b:
            continue  # no row of the share here: nothing read
        sel = rows[a:b] - lo
        parts = []
        for buf, offs in (("keys", "key_offsets"), ("ids", "id_offsets")):
            o = array(offs, lo, hi + 1)
            base = int(o[0])
            data = np.frombuffer(src.read(where[buf][0] + base, int(o[-1]) - base), dtype=np.uint8)
            parts.append((data, o[sel] - base, o[sel + 1] - base))
        keys, key_offsets = gather(*parts[0])
        ids, id_offsets = gather(*parts[1])
        grow.add(Columns(keys, key_offsets, array("sizes", lo, hi)[sel], ids, id_offsets))
        targets.append(array("targets", lo, hi)[sel])
    got = grow.done()
    local = Manifest.from_arrays(
        header["root"], header["classes"], keys=got.keys, key_offsets=got.key_offsets, sizes=got.sizes,
        targets=np.concatenate(targets) if targets else np.zeros(0, np.int32), ids=got.ids,
        id_offsets=got.id_offsets, listed_at=float(header["listed_at"]), skipped=header.get("skipped") or (),
        params=header.get("params"),
    )  # fmt: skip
    return local, total

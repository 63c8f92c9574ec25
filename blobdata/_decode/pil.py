"""Decoding: bytes of one object to a sample, in the DataLoader worker that fetched them.

The default loader decodes with Pillow to RGB straight from memory (no temporary file), accepts only
the image formats ImageFolder's extensions name (no EPS/PDF/other plugins reached through Pillow's
content sniffing), treats Pillow's decompression-bomb guard as an error rather than a warning, and
refuses a JPEG with more scans than :data:`blobdata._decode.jpeg.MAX_SCANS` (a scan bomb) before
decoding it. A custom ``loader`` receives the same :class:`ObjectFile` (a ``BytesIO`` that is also the
object's path), so loaders written for file objects (``f.read()``) and for paths (``cv2.imread(str(p))``,
``open(p)``) both work; only a loader that asks for the path pays for a temporary copy (note that
``PIL.Image.open(f)`` asks: Pillow opens anything path-like by path).

A copy is private (mode 0600, in a 0700 directory of the process's own under ``/dev/shm/blobdata-<uid>/``)
and removed when the loader returns; a process killed meanwhile leaves it behind, so the first copy a
process makes sweeps the copy directories of this user's dead processes (:func:`sweep_dead_copies`), as
a new plan channel sweeps those of dead loaders.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing.util
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import IO, Any

from PIL import Image, UnidentifiedImageError

from .. import _node, _process
from .._errors import DecodeError
from . import jpeg as _jpeg

__all__ = [
    "IMAGE_EXTENSIONS", "IMAGE_FORMATS", "ObjectFile", "decode", "decode_with", "default_loader",
    "sweep_dead_copies",
]  # fmt: skip

# Pillow format names for ImageFolder's extensions (.jpg .jpeg .png .ppm .pgm .bmp .tif .tiff .webp).
IMAGE_FORMATS = ("JPEG", "PNG", "PPM", "BMP", "TIFF", "WEBP")
#: Extensions (lower case, no dot) of the files the default loader decodes.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff")
#: What ends every decoding error: the dataset's way past a bad sample.
_SKIP = '; on_error="skip" trains past samples that cannot be read (ds.errors lists them)'


class ObjectFile(io.BytesIO):
    """The fetched bytes of one object as a binary file; ``url`` is the object URL, ``name`` its path
    for a local folder (as in ``samples``) and its URL for a bucket.

    It is also a path, as ImageFolder's loaders expect: ``os.fspath(f)``, ``str(f)`` and ``open(f)``
    give the file itself for a local folder, and for a bucket a private temporary copy of the bytes
    (mode 0600, same file suffix as the object), made at the first such call and removed when the
    loader returns; ``str``'s methods (``f.lower()``, ``f.endswith(".png")``) act on that path. Loaders
    that read the file object (and the default loader) pay nothing for it.
    """

    def __init__(self, data: bytes, url: str, path: str | None = None) -> None:
        super().__init__(data)
        self.name = path if path is not None else url
        self.url = url
        self._local = path  # the object's own file (local folders): never removed
        self._path: str | None = None

    def __str__(self) -> str:
        return self.__fspath__()

    def __getattr__(self, name: str) -> Any:
        # str's methods (lower, endswith, split, ...) on the path, for loaders written for str paths.
        if name in _STR_ONLY:
            return getattr(self.__fspath__(), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __add__(self, other: str) -> str:
        return self.__fspath__() + other

    def __radd__(self, other: str) -> str:
        return other + self.__fspath__()

    def __fspath__(self) -> str:
        if self._local is not None:
            return self._local
        if self._path is None:
            suffix = os.path.splitext(self.url.rsplit("/", 1)[-1])[1][:16]
            fd, path = tempfile.mkstemp(prefix="object-", suffix=suffix, dir=_copies_dir())
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(self.getbuffer())
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            self._path = path
        return self._path

    def discard(self) -> None:
        """Remove the temporary copy, if one was made."""
        path, self._path = self._path, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)


_STR_ONLY = frozenset(n for n in dir(str) if not n.startswith("_")) - frozenset(dir(io.BytesIO))


# A process's copies live in its own directory of the node's shared state (``_node.shm``):
# ``copies-<pid>-<random>/`` in ``/dev/shm/blobdata-<uid>/``, made at its first copy, which first sweeps
# those of dead processes (a worker killed mid-decode cannot remove its copy).
_COPIES_KIND = "copies"
_copies: tuple[int, str] | None = None  # (the process, its directory)


def _copies_dir() -> str:
    global _copies
    pid = _process.pid()
    if _copies is None or _copies[0] != pid or not os.path.isdir(_copies[1]):  # a forked child: its own
        path = _node.make_owned_dir(_COPIES_KIND)
        # Removed when this process ends: at exit, and in a DataLoader worker, which ends by os._exit
        # after running multiprocessing's finalizers (an atexit hook would not run there).
        multiprocessing.util.Finalize(None, _remove_if_owner, args=(path, pid), exitpriority=0)
        _copies = (pid, path)
    return _copies[1]


def _remove_if_owner(path: str, pid: int) -> None:
    if _process.pid() == pid:
        _node.remove_owned_tree(path)


def sweep_dead_copies(parent: str | None = None) -> list[str]:
    """Remove the copy directories (``copies-<pid>-*``, this user's) of processes that are gone, in
    ``parent`` (the node's directory of this user by default); the paths removed. A process's first
    copy does this."""
    return _node.sweep(_COPIES_KIND, parent)


def default_loader(file: ObjectFile | IO[bytes]) -> Image.Image:
    """Decode an image object to an RGB ``PIL.Image`` (formats limited to :data:`IMAGE_FORMATS`), from
    memory; a JPEG with more than :data:`blobdata._decode.jpeg.MAX_SCANS` scans is refused first."""
    if isinstance(file, io.BytesIO):
        data = file.getvalue()  # an ObjectFile's own bytes: no copy
        url = file.url if isinstance(file, ObjectFile) else str(getattr(file, "name", "<bytes>"))
    else:
        file.seek(0)
        data, url = file.read(), str(getattr(file, "name", "<file>"))
    _jpeg.check(data, url, libjpeg=True)
    with warnings.catch_warnings():
        # Pillow warns between 1x and 2x MAX_IMAGE_PIXELS and raises above: both are refusals here.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        # A plain BytesIO: an ObjectFile is path-like, and Pillow opens those by path (a copy on disk).
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            img.load()
            rgb: Image.Image = img.convert("RGB")
            return rgb


def decode_with(transform: Any, data: bytes, url: str) -> Any:
    """Run a decode-aware transform on the bytes of ``url``; a failure is a DecodeError naming it."""
    return decode(data, url, lambda _file: transform.decode_and_apply(data, url))


def _advice(url: str, loader: Callable[[Any], Any], how: str, *, unknown: bool) -> str:
    """What to do when the default loader fails: a file named as an image is corrupt (``unknown``: or
    not an image at all); another needs the dataset's own decoder argument (``how``: ``loader`` for
    FolderDataset, ``decoders`` for BlobDataset). Nothing for a loader of the user's."""
    if loader is not default_loader:
        return ""
    ext = os.path.splitext(url.rsplit("/", 1)[-1])[1].lower()
    name = ext[1:] or "<extension>"
    other = "loader=" if how == "loader" else f'decoders={{"{name}": fn}}'
    if ext[1:] in IMAGE_EXTENSIONS:
        what = "not the image its name says" if unknown else "cut short"
        return f"; the file is corrupt or {what} (a function of your own decodes it otherwise: {other})"
    what = f"{ext} files" if ext else "files that are not images"
    if how == "loader":
        return f"; the default loader decodes images: for {what} pass loader= (a function of a file)"
    return f"; for {what} pass {other} (a function of the bytes), or decoders=False for bytes"


def decode(
    data: bytes, url: str, loader: Callable[[Any], Any], *, path: str | None = None, how: str = "loader"
) -> Any:
    """Run ``loader`` on the bytes of ``url`` (whose local file is ``path``, for a local folder); any
    failure becomes a :class:`DecodeError` naming the URL, what to do, and ``on_error="skip"``. ``how``
    names the dataset's argument for another decoder: ``loader`` (FolderDataset) or ``decoders``
    (BlobDataset)."""
    file = ObjectFile(data, url, path)
    try:
        return loader(file)
    except DecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DecodeError(
            f"refused to decode {url}: the image is larger than PIL.Image.MAX_IMAGE_PIXELS "
            f"({Image.MAX_IMAGE_PIXELS} pixels), a possible decompression bomb ({exc}); raise "
            "PIL.Image.MAX_IMAGE_PIXELS if the image is genuine",
            url=url,
        ) from exc
    except UnidentifiedImageError as exc:
        raise DecodeError(
            f"cannot decode {url} ({len(data)} bytes): not an image in one of the formats "
            f"{', '.join(IMAGE_FORMATS)}{_advice(url, loader, how, unknown=True)}{_SKIP}",
            url=url,
        ) from exc
    except Exception as exc:
        raise DecodeError(
            f"cannot decode {url} ({len(data)} bytes): {type(exc).__name__}: {exc}"
            f"{_advice(url, loader, how, unknown=False)}{_SKIP}",
            url=url,
        ) from exc
    finally:
        file.discard()

"""Many processes, one job: where this process stands, and one listing shared by every rank.

Where this process stands (:func:`dist_info`) comes from ``torch.distributed`` when a process group is
initialised, else from the variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``), read in :mod:`blobdata._config`'s one place.

Listing once per job (:func:`shared_manifest`): global rank 0 lists the bucket (or loads the
remembered or given manifest) and every other rank receives the very bytes rank 0 produced, so every
rank has an identical sample table even if the bucket changes meanwhile. A BlobDataset's index or
metadata file is read once per job the same way (:func:`shared_table`): rank 0 builds the sample table
and hands over its saved form (:mod:`blobdata._listing.tablefile`), by the same two roads.

- With an initialised process group, the manifest's bytes are broadcast as a ``uint8`` tensor (its
  length first), never pickled. Every rank must construct the dataset (a collective call); a dataset
  made on one rank only takes ``share_listing=False``. The first rank of each node to get them writes
  them once to a file named after the job, the URL and the bytes' checksum (under the directory below),
  and every rank of the node maps that file: one copy per node, in the page cache.
- Without one (``torchrun`` set ``WORLD_SIZE`` but ``init_process_group`` has not run yet), rank 0
  writes the manifest atomically to a file named after the job (``TORCHELASTIC_RUN_ID``, the master's
  address and port, the restart count) and the URL, under ``BLOBDATA_SHARED_DIR`` (default: the
  cache home), and the others wait for it (``BLOBDATA_SHARED_TIMEOUT`` seconds, default 600). With
  several nodes that directory must be shared by them; otherwise initialise the process group first.
  Only this user's own regular files are read there, and only from a directory nobody else can
  replace them in (:mod:`blobdata._node.files`); rank 0's ``.error`` file follows no link.
  Rank 0 and the others then map that file (:mod:`blobdata._listing.mapping`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from ..._config import cache_home, env, parse_duration
from ..._errors import BlobdataError, ConfigError, ManifestError
from ..._node import check_shared_dir, is_own, read_own, write_own
from ..._url import check_relkeys
from ..manifest import Manifest, load_own
from ..mapping import Buffer, publish, write_atomic
from ..samples import SampleTable
from ..tablefile import load_table, table_from_bytes, table_to_bytes
from .split import Job, file_job, group_job

__all__ = ["DistInfo", "dist_info", "env_info", "shared_file", "shared_manifest", "shared_table"]

T = TypeVar("T")

_POLL_SECONDS = 0.05
#: Hand-over files older than this are removed by the next job's rank 0 (seconds).
_KEEP_SECONDS = 24 * 3600
_ERROR_BYTES = 64 * 1024  # of rank 0's error message, read at most


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """This process's place in the job: global rank and world size, rank on its node, the node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    initialized: bool = False  # a torch.distributed process group is initialised

    @property
    def nnodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _env_int(name: str, default: int) -> int:
    raw = env(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name} must be an integer, got {raw!r}") from None


def env_info() -> DistInfo:
    """Rank and world size from torchrun's variables alone (no torch import)."""
    return _info(_env_int("RANK", 0), _env_int("WORLD_SIZE", 1), False)


def dist_info() -> DistInfo:
    """Rank and world size from ``torch.distributed`` when initialised, else from torchrun's variables."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _info(dist.get_rank(), dist.get_world_size(), True)
    return env_info()


def _info(rank: int, world: int, initialized: bool) -> DistInfo:
    local_world = _env_int("LOCAL_WORLD_SIZE", 1 if world == 1 else world)
    local_rank = _env_int("LOCAL_RANK", rank % max(1, local_world))
    node = _env_int("GROUP_RANK", rank // max(1, local_world))
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not in 0..{world - 1} (WORLD_SIZE={world})")
    return DistInfo(rank, world, local_rank, local_world, node, initialized)


@dataclasses.dataclass(frozen=True)
class _Codec(Generic[T]):
    """How one kind of thing travels from rank 0: its bytes, those bytes checked, a file of them mapped."""

    what: str  # "list": "rank 0 could not list ..."
    noun: str  # "listing": "rank 1 waited for rank 0's listing of ..."
    to_bytes: Callable[[T], bytes]
    from_bytes: Callable[[Buffer, str, str], T]  # (data, root, source)
    load: Callable[[Path, str], T]  # (path, root): mapped, checked


def _manifest_from(data: Buffer, root: str, source: str) -> Manifest:
    return Manifest.from_bytes(data, source=source)


#: What chose the directory of the hand-off files (named in messages about it).
_SHARED = "BLOBDATA_SHARED_DIR"
#: What to do with a hand-off file that is not this user's own.
_NOT_YOURS = "remove it, it is not your ranks'"


def _manifest_load(path: Path, root: str) -> Manifest:
    return load_own(path, setting=_SHARED, expect_root=root)


_MANIFESTS: _Codec[Manifest] = _Codec("list", "listing", Manifest.to_bytes, _manifest_from, _manifest_load)
_TABLES: _Codec[SampleTable] = _Codec(
    "read the samples (index or metadata file) of", "samples",
    lambda t: table_to_bytes(t, source="rank 0"),
    lambda data, root, source: table_from_bytes(data, source=source, expect_root=root),
    lambda path, root: load_table(str(path), expect_root=root, own=_SHARED),
)  # fmt: skip


def shared_manifest(
    root: str,
    make: Callable[..., Manifest],
    *,
    key: str = "",
    help: Callable[[Job], None] | None = None,
    info: DistInfo | None = None,
) -> Manifest:
    """``make()`` on global rank 0; every other rank gets rank 0's manifest (see the module docstring).

    ``key`` names what is listed beyond the URL (listing parameters), for the shared file's name. With
    ``help``, a listing is split across the job (:mod:`blobdata._listing.job.split`): rank 0 calls
    ``make(together=job)``, every other rank ``help(job)`` (its part, when rank 0 lists). ``info``: this
    process's place (default :func:`dist_info`; the command line's ``--nnodes/--node-rank``).
    """
    return _shared(root, make, key, _MANIFESTS, help, info)


def shared_table(root: str, make: Callable[[], SampleTable], *, key: str = "") -> SampleTable:
    """``make()`` on global rank 0 (it reads the index or metadata file); every other rank gets rank 0's
    sample table, in its saved form (:mod:`blobdata._listing.tablefile`), as :func:`shared_manifest`
    hands over a listing. ``key`` names what the table is made from, for the shared file's name."""
    return _shared(root, make, "table|" + key, _TABLES)


def _shared(
    root: str,
    make: Callable[..., T],
    key: str,
    codec: _Codec[T],
    help: Callable[[Job], None] | None = None,
    info: DistInfo | None = None,
) -> T:
    info = info or dist_info()
    if info.world_size == 1:
        return make()
    if help is not None and not root.startswith(("file://", "memory://")):  # a local folder is each node's
        per_node = info.local_world_size
        if info.initialized:
            job = group_job(root, key, per_node=per_node)
        else:
            job = file_job(root, key, rank=info.rank, world=info.world_size, label=_job(info.nnodes),
                           per_node=per_node)  # fmt: skip
            key += f"|{job.token}"  # this run's hand-off file: never an earlier run's
        if info.rank == 0:
            make = functools.partial(make, together=job)
        else:
            with contextlib.suppress(Exception):  # told to rank 0, which raises it for every rank
                help(job)
    if info.initialized:
        return _broadcast(root, make, info, key, codec)
    return _via_file(root, make, info, key, codec)


def _broadcast(root: str, make: Callable[[], T], info: DistInfo, key: str, codec: _Codec[T]) -> T:
    import numpy as np
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL moves only GPU tensors
        device = torch.device("cuda", torch.cuda.current_device())
    length = torch.zeros(1, dtype=torch.int64, device=device)
    if info.rank == 0:
        error: Exception | None = None
        try:
            made: Any = make()
            payload = codec.to_bytes(made)
            length[0] = len(payload)
        except Exception as exc:
            # The others must not wait for bytes that will never come: they get the error's text.
            error = exc
            payload = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
            length[0] = -len(payload)
        dist.broadcast(length, src=0)
        dist.broadcast(torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()).to(device), src=0)
        if error is not None:
            raise error
        del made
        return _mapped(root, key, info, payload, codec)
    dist.broadcast(length, src=0)
    n = int(length.item())
    buf = torch.empty(abs(n), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0)
    data = buf.cpu().numpy().tobytes()
    del buf
    if n < 0:
        raise ManifestError(
            f"rank 0 could not {codec.what} {root}: {data.decode('utf-8', 'replace')}", url=root
        )
    codec.from_bytes(data, root, f"{root} (from rank 0)")  # checked before it is written
    return _received(_mapped(root, key, info, data, codec), root, f"{root} (from rank 0)")


def _mapped(root: str, key: str, info: DistInfo, data: bytes, codec: _Codec[T]) -> T:
    """The manifest ``data`` as a file of this node (written by its first rank to get here), mapped.
    Only this user's own file is mapped, in a directory nobody else can replace it in (_node.files):
    anything else there (another user's, a link) and this rank keeps a private copy instead."""
    crc = int.from_bytes(data[20:24], "little")
    path = shared_file(root, f"{key}|{len(data)}|{crc}", info.nnodes)
    try:
        check_shared_dir(str(path.parent), setting=_SHARED)
        publish(path, data)
        if not is_own(str(path), setting=_SHARED, todo=_NOT_YOURS):
            raise ManifestError(f"{path} was not written", url=str(path))
        _forget_old(path.parent)
        return codec.load(path, root)
    except (OSError, BlobdataError) as exc:  # no usable directory: this rank keeps a copy
        import logging

        logging.getLogger("blobdata").warning(
            "could not share the %s of %s through %s (%s): this process keeps its own copy",
            codec.noun, root, path, exc,
        )  # fmt: skip
        return codec.from_bytes(data, root, f"{root} (from rank 0)")


def _job(nnodes: int) -> str:
    """What tells this job from others (torchrun's variables)."""
    names = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    job = "|".join(env(n) or "" for n in names)
    if nnodes == 1:  # one node: its launcher's pid tells this run from an earlier one with the same names
        job += f"|{os.getppid()}"
    return job


def shared_file(root: str, key: str, nnodes: int = 1) -> Path:
    """The file through which rank 0 hands this job's listing of ``root`` to the others."""
    job = _job(nnodes)
    h = hashlib.sha256(f"{job}\0{root}\0{key}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    base = env("BLOBDATA_SHARED_DIR")
    return (Path(base).expanduser() if base else cache_home() / "jobs") / f"{h}.manifest"


def _via_file(root: str, make: Callable[[], T], info: DistInfo, key: str, codec: _Codec[T]) -> T:
    path = shared_file(root, key, info.nnodes)
    failed = path.with_suffix(".error")
    # Only this user's own files are trusted, in a directory nobody else can replace them in (_node.files).
    check_shared_dir(str(path.parent), setting=_SHARED)
    if info.rank == 0:
        failed.unlink(missing_ok=True)  # an earlier run's
        try:
            made = make()
        except Exception as exc:
            failed.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_own(str(failed), f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))
            raise
        write_atomic(path, codec.to_bytes(made))  # atomic: the others never see half a file
        del made
        _forget_old(path.parent)
        return codec.load(path, root)  # mapped: the node's ranks share its pages
    timeout = parse_duration(env("BLOBDATA_SHARED_TIMEOUT") or 600, name="BLOBDATA_SHARED_TIMEOUT")
    deadline = time.monotonic() + timeout
    while True:
        check_shared_dir(str(path.parent), setting=_SHARED)  # it may appear meanwhile
        text = read_own(str(failed), setting=_SHARED, todo=_NOT_YOURS, limit=_ERROR_BYTES)
        if text is not None:
            raise ManifestError(
                f"rank 0 could not {codec.what} {root}: {text.decode('utf-8', 'replace')}", url=root
            )
        if is_own(str(path), setting=_SHARED, todo=_NOT_YOURS):  # mapped, not read: the ranks share its pages
            return _received(codec.load(path, root), root, str(path))
        if time.monotonic() > deadline:
            raise ManifestError(
                f"rank {info.rank} waited {timeout:.0f}s for rank 0's {codec.noun} of {root} in {path}: "
                "initialise the process group before making the dataset, or set BLOBDATA_SHARED_DIR "
                "to a directory every node shares, or pass manifest=",
                url=root,
            )
        time.sleep(_POLL_SECONDS)


def _received(manifest: T, root: str, source: str) -> T:
    """Rank 0's manifest, checked as ``Manifest.load(expect_root=root)`` and ``load_or_list`` check it (a
    table is checked when loaded: :func:`~blobdata._listing.tablefile.table_from_bytes`)."""
    if not isinstance(manifest, Manifest):
        return manifest
    if manifest.root != root:
        raise ManifestError(f"manifest {source} lists {manifest.root}, not {root}", url=source)
    if root.startswith("file://"):  # its keys become local paths: none may leave the root
        arrays = manifest._arrays()
        check_relkeys(arrays["keys"], arrays["key_offsets"], root=root)
    return manifest


def _forget_old(directory: Path) -> None:
    """Remove earlier jobs' hand-over files (each a full manifest) that no job can still be reading."""
    cutoff = time.time() - _KEEP_SECONDS
    for old in directory.glob("*.manifest"):
        try:
            if old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass  # another rank 0 removed it first

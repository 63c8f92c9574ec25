"""One listing split across the job: every rank lists part of the folder, rank 0 joins the parts.

The ranks meet on a key-value store (``torch.distributed``'s: the process group's own, or a ``FileStore``
in ``BLOBDATA_SHARED_DIR`` without one), under a prefix of their own for this listing:

1. rank 0 lists the root (the class folders; a flat listing has one folder) and publishes them;
2. each rank takes folders by ticket (``add("tickets")``), ``concurrency`` at once, and lists what it
   took: a folder that ends within its first two pages is listed whole by its taker (the *lead*); a
   longer one is cut into key ranges (:func:`blobdata._stores.list_part`), which every rank claims from
   the folder's board (a compare-and-set on the first key not yet claimed) once it has no ticket
   left; so no page is asked twice, and no rank waits while another has ranges to list;
3. each rank sends rank 0 its part (the ranges it listed and their keys, in the packed form: numbers
   and text, no pickle) by the process group's point-to-point sends, or as a file in the shared
   directory; rank 0 checks that the ranges of each folder make one listing (each range's first key
   is the key that stopped the one before), else lists that folder again page by page, and joins.

Then rank 0 holds the listing, as if it had listed alone, and hands it to the others as before
(:mod:`blobdata._listing.job.distributed`). A rank that fails says so on the store (``error``); the
others stop waiting and rank 0 raises it for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..._config import FetchOptions, cache_home, env, parse_duration
from ..._errors import ConfigError, ManifestError
from ..._loop import run
from ..._node import check_shared_dir, is_own, read_own
from ..._stores import (
    Columns,
    Growing,
    Lister,
    Part,
    RangeInfo,
    consistent,
    lister_for,
    resolve_storage_options,
)
from ..._url import BlobURL, parse_url
from ..mapping import write_atomic
from ..packed import pack, unpack

_SHARED = "BLOBDATA_SHARED_DIR"  # the setting that names the shared directory, in messages

__all__ = ["Job", "file_job", "group_job", "join_parts", "list_parts", "together"]

logger = logging.getLogger(__name__)

_MAGIC = b"BLOBPART"
_POLL_S = 0.02
_ERROR = b"ERROR\n"
_ARRAYS = {"keys": "uint8", "key_offsets": "<i8", "sizes": "<i8", "ids": "uint8", "id_offsets": "<i8"}
_made: dict[str, int] = {}  # listings this process split, per name: every rank makes them in one order


@dataclasses.dataclass
class Job:
    """This process's place in a split listing: ``rank`` of ``world``, the ``store`` they share (prefixed
    for this listing), and ``deliver``: every rank's part in rank order on rank 0 (None elsewhere)."""

    rank: int
    world: int
    store: Any
    deliver: Callable[[bytes], list[bytes] | None]
    timeout: float
    what: str  # the listing, for messages
    keep: Any = None  # what must live as long as the job (a FileStore under its prefix)
    announced: bool = False  # rank 0 said whether the job lists together
    per_node: int = 1  # ranks on this node: they share its requests in flight (FetchOptions.concurrency)
    token: str = ""  # this run's, where the store is a file that outlives it

    def wait(self, key: str, store: Any = None) -> bytes:
        """``key``'s value once some rank set it; the error of a rank that failed, or of the deadline."""
        where = self.store if store is None else store
        deadline = time.monotonic() + self.timeout
        while True:
            if where.check([key]):
                return bytes(where.get(key))
            if self.store.check(["error"]):
                text = bytes(self.store.get("error")).decode("utf-8", "replace")
                raise ManifestError(f"the split listing of {self.what} failed: {text}", url=self.what)
            if time.monotonic() > deadline:
                raise ManifestError(
                    f"rank {self.rank} waited {self.timeout:.0f}s for the other ranks listing {self.what} "
                    f"({key!r}); a rank is gone or late: raise BLOBDATA_SHARED_TIMEOUT, or pass manifest=",
                    url=self.what,
                )
            time.sleep(_POLL_S)

    def fail(self, exc: BaseException) -> None:
        """Tell the others that this rank failed (they stop waiting)."""
        text = f"rank {self.rank}: {type(exc).__name__}: {exc}".encode("utf-8", "replace")
        with contextlib.suppress(Exception):  # the store itself failed: the others time out
            self.store.set("error", text)

    def board(self, folder: int) -> _Board:
        from torch.distributed import PrefixStore  # type: ignore[attr-defined]

        return _Board(self, PrefixStore(f"f{folder}/", self.store))


class _Board:
    """A folder's board (:class:`blobdata._stores.Board`) on the job's store: ``get`` waits as
    :meth:`Job.wait` does."""

    def __init__(self, job: Job, store: Any) -> None:
        self.job, self.store = job, store

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        return self.job.wait(key, self.store)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self.store.compare_set(key, expected, desired))


def _name(what: str, key: str) -> str:
    """This listing's name, the same on every rank (they make their listings in one order)."""
    base = hashlib.sha256(f"{what}\0{key}".encode("utf-8", "surrogateescape")).hexdigest()[:24]
    _made[base] = _made.get(base, 0) + 1
    return f"{base}.{_made[base]}"


def _timeout() -> float:
    return parse_duration(env("BLOBDATA_SHARED_TIMEOUT") or 600, name="BLOBDATA_SHARED_TIMEOUT")


def group_job(what: str, key: str, *, per_node: int = 1) -> Job:
    """The split listing of ``what`` over the initialised process group (its store, its sends); ``per_node``
    ranks on a node share its requests in flight."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]
    from torch.distributed.distributed_c10d import _get_default_store

    rank, world = dist.get_rank(), dist.get_world_size()
    store = PrefixStore(f"blobdata/list/{_name(what, key)}/", _get_default_store())
    return Job(rank, world, store, lambda payload: _by_sends(payload, rank, world), _timeout(), what,
               per_node=per_node)  # fmt: skip


def _by_sends(payload: bytes, rank: int, world: int) -> list[bytes] | None:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL moves only GPU tensors
        device = torch.device("cuda", torch.cuda.current_device())
    if rank:
        dist.send(torch.tensor([len(payload)], dtype=torch.int64, device=device), 0)
        dist.send(torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()).to(device), 0)
        return None
    parts = [payload]
    for other in range(1, world):  # one at a time: rank 0 holds one part more than the parts joined
        length = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(length, other)
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        dist.recv(buf, other)
        parts.append(buf.cpu().numpy().tobytes())
        del buf
    return parts


def file_job(what: str, key: str, *, rank: int, world: int, label: str = "", per_node: int = 1) -> Job:
    """The split listing of ``what`` through the shared directory (``BLOBDATA_SHARED_DIR``, default the
    cache home's ``jobs``; every node must share it): a ``FileStore`` made afresh by rank 0 for each
    run (the others take it once rank 0 has marked it ready with a fresh token), and parts as files.
    ``label`` names the job beyond the listing (torchrun's run id, or the command line's)."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    base = env("BLOBDATA_SHARED_DIR")
    directory = Path(base).expanduser() if base else cache_home() / "jobs"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_shared_dir(str(directory), setting=_SHARED)
    name = hashlib.sha256(f"{label}\0{_name(what, key)}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    path, ready = directory / f"{name}.store", directory / f"{name}.ready"
    timeout = _timeout()
    if rank == 0:
        for old in (ready, path):
            old.unlink(missing_ok=True)  # an earlier run's
        token = secrets.token_hex(8)
        store = dist.FileStore(str(path), world)  # type: ignore[attr-defined]
        store.set("token", token)
        write_atomic(ready, token.encode())
    else:
        deadline = time.monotonic() + timeout
        while True:
            mark = str(ready)
            token_bytes = read_own(mark, setting=_SHARED) if is_own(mark, setting=_SHARED) else None
            if token_bytes:
                store = dist.FileStore(str(path), world)  # type: ignore[attr-defined]
                if store.check(["token"]) and bytes(store.get("token")) == token_bytes:
                    token = token_bytes.decode()
                    break
            if time.monotonic() > deadline:
                raise ManifestError(f"rank {rank} waited {timeout:.0f}s for rank 0 to start the split "
                                    f"listing of {what} in {directory}: every node must run at once and "
                                    "share BLOBDATA_SHARED_DIR", url=what)  # fmt: skip
            time.sleep(_POLL_S)
    stem = directory / f"{name}.{token}"

    def deliver(payload: bytes) -> list[bytes] | None:
        parts = _by_files(job, payload, stem)
        if parts is not None:  # rank 0 has every part: this run's ready mark may go
            ready.unlink(missing_ok=True)
        return parts

    job = Job(rank, world, PrefixStore(f"{token}/", store), deliver, timeout, what, keep=store,
              per_node=per_node, token=token)  # fmt: skip
    return job


def _by_files(job: Job, payload: bytes, stem: Path) -> list[bytes] | None:
    write_atomic(stem.with_name(f"{stem.name}.part{job.rank}"), payload)
    if job.rank:
        return None
    parts = []
    for other in range(job.world):
        path = stem.with_name(f"{stem.name}.part{other}")
        deadline = time.monotonic() + job.timeout
        while not is_own(str(path), setting=_SHARED):
            if time.monotonic() > deadline:
                raise ManifestError(f"rank 0 waited {job.timeout:.0f}s for rank {other}'s part of {job.what}",
                                    url=job.what)  # fmt: skip
            time.sleep(_POLL_S)
        data = read_own(str(path), setting=_SHARED)
        path.unlink(missing_ok=True)
        parts.append(data or b"")
    return parts


# -- listing the parts -------------------------------------------------------------------------


async def _part(lister: Lister, folder: str, board: _Board, lead: bool, nonce: str) -> Part:
    """This rank's part of ``folder`` (see the module docstring)."""
    if hasattr(lister, "below_part"):
        part: Part = await lister.below_part(folder, board, lead=lead, nonce=nonce)
        return part
    if not lead:  # a lister without ranges: the lead lists the folder whole
        return Part([], Columns.empty())
    board.set("state", b"small")
    objects = await lister.below(folder)
    first = objects.key(0) if len(objects) else None
    return Part([RangeInfo(None, None, first, None, True, len(objects))], objects, lead=True)


async def list_parts(lister: Lister, job: Job, folders: list[str], concurrency: int) -> bytes:
    """This rank's parts of ``folders`` (the same list on every rank), packed for rank 0."""
    mine: list[tuple[int, Part]] = []
    nonce = f"{job.rank}"

    async def take() -> None:
        while True:
            i = int(await asyncio.to_thread(job.store.add, "tickets", 1)) - 1
            if i >= len(folders):
                return
            mine.append((i, await _part(lister, folders[i], job.board(i), True, nonce)))

    await asyncio.gather(*(take() for _ in range(max(1, min(concurrency, len(folders))))))
    for i, folder in enumerate(folders):  # then the ranges of every long folder, with the others
        board = job.board(i)
        if await asyncio.to_thread(board.get, "state") == b"big":
            part = await _part(lister, folder, board, False, nonce)
            if part.ranges:
                mine.append((i, part))
    return _pack(mine)


def _pack(parts: list[tuple[int, Part]]) -> bytes:
    grow = Growing()
    header = []
    for folder, part in parts:
        header.append([folder, [list(r) for r in part.ranges]])
        grow.add(part.objects)
    joined = grow.done()
    arrays: dict[str, Any] = dict(zip(_ARRAYS, joined._arrays(), strict=True))
    return pack(_MAGIC, 1, {"parts": header}, arrays, _ARRAYS)


def _unpack(data: bytes, rank: int, what: str) -> list[tuple[int, RangeInfo, Columns]]:
    """Rank ``rank``'s part: (folder, range, its keys) for each range, checked."""
    if data.startswith(_ERROR):
        raise ManifestError(f"rank {rank} could not list its part of {what}: "
                            f"{data[len(_ERROR):].decode('utf-8', 'replace')}", url=what)  # fmt: skip

    def bad(reason: str) -> ManifestError:
        return ManifestError(f"rank {rank}'s part of the listing of {what} is unusable: {reason}", url=what)

    header, arrays = unpack(data, magic=_MAGIC, version=1, dtypes=_ARRAYS, kind="listing part",
                            verified=False, bad=bad)  # fmt: skip
    objects = Columns(*(arrays[name] for name in _ARRAYS))
    if objects.key_offsets[0] != 0 or objects.key_offsets[-1] != len(objects.keys) or \
            objects.id_offsets[0] != 0 or objects.id_offsets[-1] != len(objects.ids) or \
            len(objects.key_offsets) != len(objects.sizes) + 1:  # fmt: skip
        raise bad("offsets that do not describe the buffers")
    out = []
    row = 0
    try:
        for folder, ranges in header["parts"]:
            for fields in ranges:
                info = RangeInfo(*fields)
                out.append((int(folder), info, objects.rows(row, row + info.listed)))
                row += info.listed
    except (TypeError, ValueError, KeyError) as exc:
        raise bad(f"a header that is not one ({type(exc).__name__})") from None
    if row != len(objects):
        raise bad(f"ranges of {row} keys for {len(objects)} keys")
    return out


def join_parts(payloads: list[bytes], folders: list[str], what: str) -> tuple[list[Columns], list[int]]:
    """Every folder's keys from every rank's part, in the store's order; and the folders whose ranges
    did not make one listing (rank 0 lists those again page by page)."""
    ranges: list[list[tuple[RangeInfo, Columns]]] = [[] for _ in folders]
    for rank, data in enumerate(payloads):
        for folder, info, objects in _unpack(data, rank, what):
            if not 0 <= folder < len(folders):
                raise ManifestError(f"rank {rank}'s part of {what} names folder {folder}", url=what)
            ranges[folder].append((info, objects))
        payloads[rank] = b""  # let it go: the parts are joined one at a time
    out: list[Columns] = []
    again: list[int] = []
    for i, found in enumerate(ranges):
        found.sort(key=lambda r: (r[0].after is not None, r[0].after or ""))
        if not found or not consistent([info for info, _ in found]):
            again.append(i)
            out.append(Columns.empty())
            continue
        out.append(Columns.join([objects for _, objects in found]))
        ranges[i] = []
    return out, again


@contextlib.contextmanager
def leading(job: Job | None) -> Iterator[None]:
    """Rank 0's side, around what it does with the listing: a failure before it said whether the job
    lists (:func:`announce`) is told to the other ranks, who would otherwise wait for the word."""
    try:
        yield
    except BaseException as exc:
        if job is not None and not job.announced:
            job.fail(exc)
        raise


def announce(job: Job | None, *, listing: bool) -> None:
    """Rank 0 tells the others whether the job lists the folder together (else rank 0 has the listing:
    remembered, or given)."""
    if job is not None:
        job.store.set("mode", b"list" if listing else b"have")
        job.announced = True


def help_list(
    url: str, job: Job, *, storage_options: Mapping[str, Any] | None, fetch_options: FetchOptions | None,
    flat: bool = False,
) -> None:  # fmt: skip
    """A rank other than 0: list its part of ``url`` with the job when rank 0 says the job lists it. An
    error goes to rank 0 (in this rank's part, and on the store), which raises it for every rank."""
    if job.wait("mode") != b"list":
        return
    options = fetch_options if fetch_options is not None else FetchOptions()

    def where() -> tuple[BlobURL, dict[str, Any]]:
        parsed = parse_url(url)
        opts = resolve_storage_options(parsed.protocol, storage_options)
        return (parent_of(parsed)[0] if flat else parsed), opts

    together(where, options, job, _rank_zero_only)


async def _rank_zero_only(lister: Lister) -> list[str]:
    raise AssertionError("only rank 0 lists the root")


def parent_of(url: BlobURL) -> tuple[BlobURL, str]:
    """Where a flat listing of ``url`` is listed from (its parent) and the folder's name there."""
    if url.protocol in ("file", "memory"):
        head, _, name = url.prefix.rstrip("/").rpartition("/")
        if not name:
            raise ConfigError(f"{url} is a filesystem root: name a folder below it", url=str(url))
        return BlobURL(url.protocol, "", head or "/"), name
    if not url.prefix:
        raise ConfigError(
            f"{url} is a bucket's root: a BlobDataset lists a folder below it (s3://bucket/folder), or "
            "pass index= to name the objects without a listing",
            url=str(url),
        )
    head, _, name = url.prefix.rpartition("/")
    return BlobURL(url.protocol, url.bucket, head), name


def together(
    where: Callable[[], tuple[BlobURL, Mapping[str, Any]]],
    options: FetchOptions,
    job: Job,
    folders_of: Callable[[Lister], Awaitable[list[str]]],
) -> tuple[list[str], list[Columns]] | None:
    """The folders (``folders_of`` the lister of ``where()``'s URL, on rank 0) listed by the whole job:
    on rank 0, (folders, their keys); None on the others. Every rank sends rank 0 its part, or its
    error, whatever happens."""
    lister: Lister | None = None
    error: BaseException | None = None
    folders: list[str] = []
    root = job.what
    options = options.replace(concurrency=max(2, options.concurrency // max(1, job.per_node)))
    try:
        try:
            url, storage_options = where()
            lister = lister_for(url, storage_options, options)
            if job.rank == 0:
                folders = run(folders_of(lister))
                job.store.set("folders", json.dumps(folders).encode())
            else:
                folders = [str(f) for f in json.loads(job.wait("folders"))]
            payload = run(list_parts(lister, job, folders, options.concurrency))
        except Exception as exc:  # told to the others, and to rank 0 in this rank's part
            job.fail(exc)
            error = exc
            payload = _ERROR + f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        parts = job.deliver(payload)
        if parts is None:
            return None  # rank 0 joins, and hands the listing (or the error) to every rank
        if error is not None:
            raise error
        columns, again = join_parts(parts, folders, root)
        for i in again:
            logger.info("split listing of %s: the ranges of %r do not make one listing; rank 0 lists it "
                        "again alone", root, folders[i])  # fmt: skip
            columns[i] = run(lister.below(folders[i]))  # type: ignore[union-attr]
        return folders, columns
    finally:
        if lister is not None:
            run(lister.aclose())

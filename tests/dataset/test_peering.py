"""A dataset among peers (``blobdata._dataset.peering``), white-box: what its look-ahead notes for the
reads it starts."""

from __future__ import annotations

import os
import types

from blobdata._dataset.peering import note_homes
from blobdata._dataset.reads import Objects
from blobdata._peers import PeerClient, PeerTable


def test_the_look_ahead_scores_the_homes_of_what_it_will_read_as_one_batch() -> None:
    """What the look-ahead finds missing from the cache is noted with its home, scored as one batch, for
    each read to take (the same home an object scored alone gets); past the bound the notes start
    again, so reads given up leave nothing behind for long."""
    names = [f"10.0.0.{k + 1}" for k in range(30)]  # past NUMPY_FROM: one object alone costs 10 us
    client = PeerClient(PeerTable(os.urandom(32), names, [f"127.0.0.1:{9 + k}" for k in range(30)], 0, 16))
    proc = types.SimpleNamespace(peers=client, homes={}, noted={}, starts_noted=False)
    urls = [f"s3://bucket/train/c{k % 3}/{k:05d}.jpg" for k in range(40)]

    def note(part: list[str], found: list[bool] | None = None, ids: list[str] | None = None) -> None:
        objects = Objects(list(range(len(part))), None, part, [100] * len(part), ids or ["e"] * len(part))
        note_homes(proc, objects, found or [False] * len(part), limit=30)  # type: ignore[arg-type]
        assert not proc.noted  # its look-ahead does not start reads from the notes: read_from_home's

    note(urls[:20])
    assert proc.homes == {u: client.home_of(u) for u in urls[:20]}
    assert len(set(proc.homes.values())) > 5  # spread over the nodes, not one answer for all
    note(urls[20:35])
    assert len(proc.homes) == 35  # 20 noted, within the bound: kept
    note(urls[35:])
    assert proc.homes == {u: client.home_of(u) for u in urls[35:]}  # past it: started again
    # Only what will be read from a home: not what the cache has, nor an object of unknown identity
    # (read from the bucket, its note would never be taken).
    note(urls[:4], found=[True, False, True, False], ids=["e", "e", "e", ""])
    assert set(proc.homes) == {*urls[35:], urls[1]}


def test_where_the_look_ahead_starts_reads_from_its_notes_each_sample_is_noted_whole() -> None:
    """A FolderDataset's look-ahead (``starts_noted``) notes each missing sample's object whole, by
    sample: its URL, size, identity and home (the home an object scored alone gets), so that
    ``start_from_homes`` need not look in the listing again; not what the cache has, nor an object of
    unknown identity or size; past the bound the notes start again. Samples of several objects
    (BlobDataset's, ``offsets``) are still noted by URL."""
    names = [f"10.0.0.{k + 1}" for k in range(30)]
    client = PeerClient(PeerTable(os.urandom(32), names, [f"127.0.0.1:{9 + k}" for k in range(30)], 0, 16))
    proc = types.SimpleNamespace(peers=client, homes={}, noted={}, starts_noted=True)
    urls = [f"s3://bucket/train/c{k % 3}/{k:05d}.jpg" for k in range(40)]
    rows = list(range(100, 140))
    objects = Objects(rows[:20], None, urls[:20], list(range(20)), [f"e{k}" for k in range(20)])
    note_homes(proc, objects, [False] * 20, limit=30)  # type: ignore[arg-type]
    assert proc.noted == {100 + k: (urls[k], k, f"e{k}", client.home_of(urls[k])) for k in range(20)}
    assert not proc.homes
    found, ids, sizes = [False, True, False, False], ["e", "e", "", "e"], [5, 5, 5, -1]
    note_homes(proc, Objects(rows[20:24], None, urls[20:24], sizes, ids), found, limit=30)  # type: ignore[arg-type]
    assert set(proc.noted) == {*rows[:20], 120}  # 21 within the bound: kept
    objects = Objects(rows[24:36], None, urls[24:36], [1] * 12, ["e"] * 12)
    note_homes(proc, objects, [False] * 12, limit=20)  # type: ignore[arg-type]
    assert set(proc.noted) == set(rows[24:36])  # past the bound: started again
    # The homes start_from_homes leaves for the reads it hands to a task are bounded too (a task
    # given up before its read_from_home leaves its home behind).
    proc.homes.update((f"s3://b/left/{k}", 1) for k in range(31))
    note_homes(proc, Objects([1], None, urls[:1], [1], ["e"]), [False], limit=30)  # type: ignore[arg-type]
    assert not proc.homes and 1 in proc.noted
    several = Objects([7, 8], [0, 2, 3], urls[36:39], [1, 1, 1], ["e"] * 3)
    note_homes(proc, several, [False] * 3, limit=30)  # type: ignore[arg-type]
    assert proc.homes == {u: client.home_of(u) for u in urls[36:39]} and set(proc.noted) == {*rows[24:36], 1}


def test_a_read_takes_its_note_and_scores_no_home_itself() -> None:
    """A read the look-ahead noted goes to the noted home, whose note it takes; one not noted (read
    for a batch directly) scores its home itself."""
    from blobdata._dataset.peering import read_from_home
    from blobdata._loop import run

    asked: list[tuple[int, str]] = []

    async def read(home: int, url: str, size: int, identity: str, bucket: object) -> tuple[bytes, bool]:
        asked.append((home, url))
        return b"x" * size, True

    scored: list[str] = []
    peers = types.SimpleNamespace(read=read, home_of=lambda url: scored.append(url) or 5)
    engine = types.SimpleNamespace(fetch=lambda *_, **__: None)  # the bucket: not asked here
    proc = types.SimpleNamespace(engine=engine, homes={"s3://b/d/a.jpg": 3})
    assert run(read_from_home(proc, peers, "s3://b/d/a.jpg", 4, "e")) == b"xxxx"  # type: ignore[arg-type]
    assert asked == [(3, "s3://b/d/a.jpg")] and not scored and not proc.homes
    assert run(read_from_home(proc, peers, "s3://b/d/b.jpg", 2, "e")) == b"xx"  # type: ignore[arg-type]
    assert asked[1] == (5, "s3://b/d/b.jpg") and scored == ["s3://b/d/b.jpg"]


def test_the_look_ahead_starts_its_misses_from_their_noted_homes_and_the_rest_in_tasks() -> None:
    """``start_from_homes`` (the look-ahead's misses with peers on): each read starts from the sample's
    note (taken; the listing not looked in), or from the listing with its home scored alone where the
    notes started again; a read whose identity is unknown, or that the client cannot start without a
    task (its peer given up, its home this process's own service), is made by the dataset's own
    ``_load`` in a task, whose read_from_home takes the home scored here. One future per index, in
    order."""
    import asyncio

    from blobdata._dataset.peering import start_from_homes
    from blobdata._loop import run

    urls = [f"s3://b/d/{k}.jpg" for k in range(5)]
    started: list[tuple[int, str, int, str]] = []
    loaded: list[int] = []
    listed: list[list[int]] = []

    def start(home: int, url: str, size: int, identity: str, bucket: object) -> asyncio.Future[bytes] | None:
        started.append((home, url, size, identity))
        if home == 7:  # given up for now
            return None
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(b"p" * size)
        return fut

    async def load(i: int, *, checked: bool = False) -> bytes:
        assert checked  # the look-ahead found it missing: not looked up in the cache again
        loaded.append(i)
        return b"t" * (i + 1)

    def objects_of(indices: list[int]) -> Objects:
        listed.append(indices)
        at = [i - 10 for i in indices]
        return Objects(
            indices,
            None,
            [urls[k] for k in at],
            [k + 3 for k in at],
            [["e0", "e1", "", "e3", "e4"][k] for k in at],
        )

    peers = types.SimpleNamespace(start=start, home_of=lambda url: 7 if url == urls[3] else 2)
    engine = types.SimpleNamespace(fetch=lambda *_, **__: None)
    noted = {10: (urls[0], 3, "e0", 5), 14: (urls[4], 7, "e4", 7), 99: (urls[1], 1, "x", 1)}
    proc = types.SimpleNamespace(peers=peers, noted=noted, homes={}, engine=engine)
    ds = types.SimpleNamespace(_objects=objects_of, _load=load)

    async def go() -> list[bytes]:
        futs = start_from_homes(ds, proc, [10, 11, 12, 13, 14])  # type: ignore[arg-type]
        return list(await asyncio.gather(*futs))

    assert run(go(), 30) == [b"ppp", b"pppp", b"t" * 13, b"t" * 14, b"t" * 15]
    assert listed == [[11, 12, 13]]  # the noted ones are not looked up in the listing
    assert started == [
        (5, urls[0], 3, "e0"),
        (2, urls[1], 4, "e1"),
        (7, urls[3], 6, "e3"),
        (7, urls[4], 7, "e4"),
    ]
    assert loaded == [12, 13, 14] and noted == {
        99: (urls[1], 1, "x", 1)
    }  # the notes taken; no identity: never started
    assert proc.homes == {urls[3]: 7, urls[4]: 7}  # for the tasks' read_from_home, not scored again

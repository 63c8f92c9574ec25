"""Nodes that serve each other their caches, as real processes on their own loopback addresses (one
rank each, a DataLoader worker each), against a real S3 server behind a proxy that counts the bucket's
GETs between epochs; every sample's bytes are checked against what was uploaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from blobdata._peers import PEERS_LOOKAHEAD, Homes
from blobdata.testing import LatencyProxy, find_free_port
from tests.support.peer_nodes import Store, log_of, node_spec, run_nodes, upload

pytestmark = pytest.mark.timeout(420)

N = 96
#: A node's one worker's first two batches (node_spec's batches of 8): what is handed over to it.
FIRST_BATCHES = 2 * 8


def _setup(s3_bucket: Any, s3_proxy: Any) -> tuple[dict[int, str], dict[str, Any], Store]:
    digests = upload(s3_bucket, N)
    options = {**s3_bucket.storage_options, "endpoint_url": s3_proxy.endpoint_url}
    return digests, options, Store()


def _url(bucket: Any, i: int) -> str:
    return bucket.url(f"train/c{i % 3}/{i:05d}.bin")


def _homes(bucket: Any, nnodes: int) -> dict[int, int]:
    """Each sample number's home node among ``nnodes`` (names as the nodes' hosts)."""
    homes = Homes([f"127.0.0.{2 + r}" for r in range(nnodes)])
    return {i: homes.home_of(_url(bucket, i)) for i in range(N)}


def _specs(
    tmp: Path, job: str, store: Store, n: int, url: str, options: Any, **kw: Any
) -> list[dict[str, Any]]:
    """``n`` nodes' specs; ``kw`` for all, or ``rank_<r>={...}`` for node ``r`` alone."""
    common = {k: v for k, v in kw.items() if not k.startswith("rank_")}
    return [
        node_spec(
            tmp, job, store, r, n, url=url, storage_options=options, **common, **kw.get(f"rank_{r}", {})
        )
        for r in range(n)
    ]


def _bucket_reads(results: list[Any], gets: dict[str, int]) -> str:
    """What a failed count of bucket reads needs to be understood: the GETs between epochs, and each
    node's reads per epoch that went to the bucket, hedged or fallen back, and why peers were given up."""
    keys = ("samples_from_bucket", "peer_hedged", "peer_fallbacks", "peer_wrong", "peers_refused", "retries")
    per = [[{k: e["stats"].get(k) for k in keys} for e in r["epochs"]] for r in results if r is not None]
    return f"bucket GETs {gets}; per node and epoch {per}"


def _check_bytes(results: list[Any], digests: dict[int, str]) -> None:
    for r in results:
        for e in r["epochs"]:
            wrong = [i for i, d in e["samples"] if digests[i] != d]
            assert not wrong, f"epoch {e['epoch']}: wrong bytes for samples {wrong}"


def _epoch(results: list[Any], k: int) -> list[int]:
    return sorted(i for r in results for i, _ in r["epochs"][k]["samples"])


def _from_homes(results: list[Any], home: dict[int, int]) -> Iterator[dict[str, Any]]:
    """Each node's stats of each epoch after the first, once checked that the node read from its cache
    exactly the samples it is home for and everything else from the peers or the bucket: the epoch's
    workers, or, for its first two batches (each node has one worker that the loader starts again each
    epoch), the training process before it started them, counted in the epoch before."""
    for rank, r in enumerate(results):
        for e, before in zip(r["epochs"][1:], r["epochs"], strict=False):
            s = e["stats"]
            mine = sum(home[i] == rank for i, _ in e["samples"])
            assert s["samples_from_cache"] == mine  # a node keeps what it is home for
            handed = len(_handed(e, before, home, rank))
            assert before["stats"]["read_for_next_epoch"] == handed
            assert s["samples_from_peers"] + s["samples_from_bucket"] + handed == len(e["samples"]) - mine
            yield s


def _handed(e: dict[str, Any], before: dict[str, Any], home: dict[int, int], rank: int) -> list[int]:
    """The samples of epoch ``e`` that node ``rank``'s training process read for its worker during
    the epoch ``before`` (from the loader's second epoch on, what the node's cache does not keep of
    the worker's first two batches)."""
    first = e["samples"][:FIRST_BATCHES]
    return [i for i, _ in first if home[i] != rank] if before["epoch"] > 0 else []


@pytest.mark.parametrize(
    ("kind", "own_process"),
    [("folder", True), ("blob", True), ("folder", False)],
    ids=["folder", "blob", "folder-service-thread"],
)
def test_a_global_shuffle_reads_each_object_from_the_bucket_once_then_from_the_nodes(
    tmp_path: Path, s3_bucket: Any, s3_proxy: Any, kind: str, own_process: bool
) -> None:
    """Each node's service in a process of its own (the default), or on its training process's loop
    (``Peers(service_process=False)``): the same reads, the same counts."""
    digests, options, store = _setup(s3_bucket, s3_proxy)
    specs = _specs(
        tmp_path, "job", store, 3, s3_bucket.url("train"), options, epochs=[0, 1, 2], kind=kind,
        rank_2={"lookahead": 64}, service_process=own_process,
    )  # fmt: skip
    results, gets = run_nodes(tmp_path, store, specs, s3_proxy)
    assert all(r is not None for r in results), [log_of(s) for s in specs]
    _check_bytes(results, digests)
    # Peers answer in milliseconds: a shorter look-ahead than the bucket's by default, a given one kept.
    assert [r["lookahead"] for r in results] == [PEERS_LOOKAHEAD, PEERS_LOOKAHEAD, 64]
    for k in range(3):
        assert _epoch(results, k) == list(range(N))  # a global shuffle: every epoch, all of it, once
    hedged = [sum(r["epochs"][k]["stats"]["peer_hedged"] for r in results) for k in range(3)]
    why = _bucket_reads(results, gets)
    # Epoch 0 reads each object from the bucket once (a hedge may add a read); later epochs none.
    assert N <= gets["1"] <= N + hedged[0], why
    assert gets["2"] <= hedged[1] and gets["end"] <= hedged[2], why
    for s in _from_homes(results, _homes(s3_bucket, 3)):
        assert s["samples_from_bucket"] <= s["peer_hedged"]
        assert s["samples_from_peers"] > 0 and s["peer_wrong"] == 0 and s["peer_fallbacks"] == 0
    # (A node counts what it serves while it runs an epoch; the others may ask after it ended one.)
    assert sum(e["stats"]["peers_served"] for r in results for e in r["epochs"]) > 0


def test_a_mixtures_sources_share_the_nodes_caches(tmp_path: Path, s3_bucket: Any, s3_proxy: Any) -> None:
    """A Mixture of two sources (each a dataset with peers: one meeting, each root served by the node's
    service), dealt by MixtureSampler to 3 nodes: after its first epoch nothing is read from the bucket
    again, what a node is not home for comes from its home, every byte right."""
    digests, options, store = _setup(s3_bucket, s3_proxy)
    specs = _specs(
        tmp_path, "mix", store, 3, s3_bucket.url("train"), options, epochs=[0, 1, 2], kind="mixture"
    )
    results, gets = run_nodes(tmp_path, store, specs, s3_proxy)
    assert all(r is not None for r in results), [log_of(s) for s in specs]
    _check_bytes(results, digests)
    mixed = [i for i in range(N) if i % 3 in (0, 1)]  # c0 and c1, in the plan's proportions: all of each
    for k in range(3):  # each epoch all of both (padded to a multiple of 3, as DistributedSampler pads)
        read = _epoch(results, k)
        assert sorted(set(read)) == mixed and len(read) == len(mixed) + (-len(mixed) % 3)
    hedged = [sum(r["epochs"][k]["stats"]["peer_hedged"] for r in results) for k in range(3)]
    why = _bucket_reads(results, gets)
    assert len(mixed) <= gets["1"] <= len(mixed) + hedged[0], why
    assert gets["2"] <= hedged[1] and gets["end"] <= hedged[2], why
    for s in _from_homes(results, _homes(s3_bucket, 3)):
        assert s["samples_from_peers"] > 0 and s["peer_wrong"] == 0
        # Each source's own figures hold its reads from peers (counted in its record).
        assert s["a/samples_from_peers"] + s["b/samples_from_peers"] == s["samples_from_peers"]


def test_a_peer_killed_mid_epoch_costs_only_bucket_reads(
    tmp_path: Path, s3_bucket: Any, s3_proxy: Any
) -> None:
    digests, options, store = _setup(s3_bucket, s3_proxy)
    url = s3_bucket.url("train")
    specs = _specs(tmp_path, "kill", store, 3, url, options, epochs=[0, 1, 2], rank_2={"die_after": [1, 2]})
    results, gets = run_nodes(tmp_path, store, specs, s3_proxy)
    assert results[2] is None  # killed by SIGKILL after two batches of epoch 1
    live = [r for r in results if r is not None]
    assert len(live) == 2, [log_of(s) for s in specs]
    _check_bytes(live, digests)
    home = _homes(s3_bucket, 3)
    late_dead = 0  # what the live nodes read of node 2's objects in epoch 2 (not for it, in epoch 1)
    for rank, r in enumerate(live):
        for e in r["epochs"]:
            rows = [i for i, _ in e["samples"]]
            assert len(rows) == len(set(rows)) == N // 3  # its whole share of each epoch, nothing lost
            assert e["stats"]["errors_skipped"] == 0
        after = r["epochs"][2]  # an epoch wholly after the kill
        s = after["stats"]
        handed = _handed(after, r["epochs"][1], home, rank)  # read in epoch 1, for the worker
        dead = sum(home[i] == 2 for i, _ in after["samples"]) - sum(home[i] == 2 for i in handed)
        mine = sum(home[i] == rank for i, _ in after["samples"])
        assert s["samples_from_cache"] == mine
        # What node 2 was home for comes from the bucket, and only that (or a hedge's read).
        assert dead <= s["samples_from_bucket"] <= dead + s["peer_hedged"]
        from_peers = len(after["samples"]) - mine - len(handed) - s["samples_from_bucket"]
        assert s["samples_from_peers"] == from_peers
        assert r["epochs"][1]["stats"]["peer_fallbacks"] + s["peer_fallbacks"] > 0
        late_dead += dead
    assert gets["end"] >= late_dead  # read in epoch 2 from the bucket


def test_a_peer_serving_wrong_bytes_is_detected_and_bypassed(
    tmp_path: Path, s3_bucket: Any, s3_proxy: Any
) -> None:
    """Node 1's answers pass a proxy that flips a byte of what it sends: the others refuse them
    (checksum), read those objects from the bucket, and every byte they use is right."""
    digests, options, store = _setup(s3_bucket, s3_proxy)
    port = find_free_port()  # node 1's service binds it later
    with LatencyProxy("127.0.0.3", port) as bad:
        bad.corrupt_next(10**6)
        node1 = {"port": port, "advertise": f"127.0.0.1:{bad.port}"}
        specs = _specs(
            tmp_path, "wrong", store, 3, s3_bucket.url("train"), options, epochs=[0, 1], rank_1=node1
        )
        results, _ = run_nodes(tmp_path, store, specs, s3_proxy)
        assert bad.corrupted > 0
    assert all(r is not None for r in results), [log_of(s) for s in specs]
    _check_bytes(results, digests)
    home = _homes(s3_bucket, 3)
    for rank in (0, 2):
        s = results[rank]["epochs"][1]["stats"]  # type: ignore[index]
        from_1 = sum(home[i] == 1 for i, _ in results[rank]["epochs"][1]["samples"])  # type: ignore[index]
        assert s["peer_wrong"] >= 1 and s["peer_fallbacks"] >= from_1 - s["peer_wrong"]
        assert s["samples_from_bucket"] >= from_1  # every one of node 1's objects, from the bucket
    s1 = results[1]["epochs"][1]["stats"]  # type: ignore[index]
    assert s1["peer_wrong"] == 0 and s1["samples_from_peers"] > 0  # node 1 itself reads the others fine


def test_a_job_resized_from_4_to_3_nodes_resumes_exactly(
    tmp_path: Path, s3_bucket: Any, s3_proxy: Any
) -> None:
    """4 nodes read epoch 0 and two batches of epoch 1, then the job comes back on 3 of them (their
    caches as they were): epoch 1 ends with every sample read once in all, every byte right; the
    objects node 3 was home for move to the others, which read them from the bucket once."""
    digests, options, store = _setup(s3_bucket, s3_proxy)
    url = s3_bucket.url("train")
    state = tmp_path / "state.json"
    first = _specs(
        tmp_path,
        "before",
        store,
        4,
        url,
        options,
        epochs=[0, 1],
        stop_after=2,
        rank_0={"state_out": str(state)},
    )
    before, _ = run_nodes(tmp_path, store, first, s3_proxy)
    assert all(r is not None for r in before), [log_of(s) for s in first]
    second = _specs(tmp_path, "after", store, 3, url, options, epochs=[1, 2, 3], state_in=str(state))
    after, gets = run_nodes(tmp_path, store, second, s3_proxy)
    assert all(r is not None for r in after), [log_of(s) for s in second]
    _check_bytes([*before, *after], digests)  # type: ignore[list-item]
    assert _epoch(before, 0) == list(range(N))  # type: ignore[arg-type]
    epoch1 = _epoch(before, 1) + _epoch(after, 0)  # type: ignore[arg-type]
    read = 4 * 2 * 8  # 4 nodes, 2 batches of 8
    pad = -(N - read) % 3  # the rest dealt to 3 ranks, padded as DistributedSampler pads
    assert len(_epoch(before, 1)) == read and len(epoch1) == N + pad  # type: ignore[arg-type]
    assert sorted(set(epoch1)) == list(range(N))
    assert _epoch(after, 1) == list(range(N)) and _epoch(after, 2) == list(range(N))  # type: ignore[arg-type]
    old, new = _homes(s3_bucket, 4), _homes(s3_bucket, 3)
    moved = [i for i in range(N) if old[i] != new[i]]
    assert moved and all(old[i] == 3 for i in moved)  # only node 3's homes move
    resumed = [r["epochs"][0]["stats"] for r in after]  # type: ignore[index]
    assert sum(s["samples_from_peers"] for s in resumed) > 0
    hedged = [sum(r["epochs"][k]["stats"]["peer_hedged"] for r in after) for k in range(3)]  # type: ignore[index]
    # What moved is read from the bucket once (in the rest of epoch 1 or in epoch 2), then never again.
    assert gets["2"] + gets["3"] <= len(moved) + hedged[0] + hedged[1]
    assert gets["end"] <= hedged[2]

"""A cache comes back within its bound: when it is opened with a lower limit than it holds, and with
``blobdata cache trim``, evicting first what the node's current share does not need; ``cache info``
shows the bound and how far over it the cache is; ``warm --nnodes`` fills the node's fixed share."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from blobdata import BlobCache
from blobdata._cache import SLACK_BYTES, Policy
from blobdata._cli import main
from blobdata._sampling import node_share
from tests.cache.test_cache import value, value_bytes

PACKED = 40_000  # a value in a pack file
SMALL = 1_000  # inline in the index


def _fill(cache: BlobCache, urls: list[str], size: int = PACKED) -> None:
    assert all(cache.put_many([(url, "e", value(i, size)) for i, url in enumerate(urls)]))


@pytest.mark.parametrize("policy", ["admit", "lru"])
def test_a_cache_reopened_with_a_lower_limit_and_shrink_trims_itself_to_it(
    tmp_path: Path, policy: Policy, caplog: pytest.LogCaptureFixture
) -> None:
    urls = [f"s3://b/train/{i}.jpg" for i in range(150)]
    small = [f"s3://b/train/s{i}.jpg" for i in range(100)]
    with BlobCache(tmp_path, size_limit="20MB", policy=policy) as big:
        _fill(big, urls)
        _fill(big, small, SMALL)
        held = big.stats().volume_bytes
    assert held > 6_000_000
    limit = 2_000_000
    with (
        caplog.at_level(logging.INFO, logger="blobdata"),
        BlobCache(tmp_path, size_limit=limit, policy=policy, shrink=True) as c,
    ):
        after = c.stats()
        assert after.volume_bytes <= limit + SLACK_BYTES
        assert "lowered" in caplog.text
        assert value_bytes(tmp_path) <= after.volume_bytes  # the evicted values' disk space is freed
        survivors = [(i, u) for i, u in enumerate(urls) if (u, "e") in c]
        assert 0 < len(survivors) < len(urls)
        assert all(c.get(u, "e") == value(i, PACKED) for i, u in survivors)
        # New puts keep it there (admit refuses, lru evicts).
        c.put_many([(f"s3://b/new/{i}", "e", value(i, PACKED)) for i in range(60)])
        assert c.stats().volume_bytes <= limit + SLACK_BYTES


def test_trim_evicts_first_what_the_share_does_not_need(tmp_path: Path) -> None:
    train = [f"s3://b/train/c{i % 3}/{i}.jpg" for i in range(60)]
    share = {(u, "e") for i, u in enumerate(train) if i % 2 == 0}
    other = [f"s3://b/other/{i}.jpg" for i in range(20)]
    with BlobCache(tmp_path, size_limit="100MB") as c:
        _fill(c, train)
        _fill(c, other)
        volume = c.stats().volume_bytes

    def present() -> tuple[int, int, int]:
        with BlobCache.inspect(tmp_path) as look:
            return (
                sum((u, "e") in look for u in train if (u, "e") in share),
                sum((u, "e") in look for u in train if (u, "e") not in share),
                sum((u, "e") in look for u in other),
            )

    def trim_to(limit: int, room: int = 0) -> int:
        with BlobCache.inspect(tmp_path, size_limit=limit) as c:
            done = c.trim(share, prefix="s3://b/train/", room=room)
            assert done.volume_bytes <= limit and done.size_limit == limit
            return done.evicted

    assert present() == (30, 30, 20)
    trim_to(volume - 10 * PACKED)  # the dataset's samples outside the share go first
    kept_share, not_needed, others = present()
    assert (kept_share, others) == (30, 20) and 10 <= not_needed < 30
    trim_to(volume - 40 * PACKED)  # then other datasets' entries
    kept_share, not_needed, others = present()
    assert kept_share == 30 and not_needed == 0 and others < 20
    trim_to(volume - 55 * PACKED)  # the share itself only when nothing else is left
    assert present()[0] < 30 and present()[1:] == (0, 0)


def test_room_for_the_share_comes_only_from_what_it_does_not_need(tmp_path: Path) -> None:
    train = [f"s3://b/train/{i}.jpg" for i in range(20)]
    other = [f"s3://b/other/{i}.jpg" for i in range(20)]
    with BlobCache(tmp_path, size_limit="100MB") as c:
        _fill(c, train)
        _fill(c, other)
        volume = c.stats().volume_bytes
    share = [(u, "e") for u in train[:10]]
    with BlobCache.inspect(tmp_path, size_limit=volume + 5 * PACKED) as c:
        done = c.trim(share, prefix="s3://b/train/", room=100 * PACKED)  # more room than there is
        assert done.evicted == 10  # every train/ entry outside the share, nothing else
        assert all(k in c for k in share) and all((u, "e") in c for u in other)


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(list(argv)) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_cache_info_shows_the_bound_and_how_far_over_and_trim_brings_it_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two jobs share a cache: one with 20 MB, one that shrinks it to 1 MB. The second opens it
    (recording its limit), then the first keeps writing: the cache is over the recorded limit."""
    first = BlobCache(tmp_path, size_limit="20MB")
    second = BlobCache(tmp_path, size_limit="1MB", shrink=True)
    second.close()
    _fill(first, [f"s3://b/train/{i}.jpg" for i in range(75)])  # 3 MB
    first.close()
    info = _cli_json(capsys, "cache", "info", "--cache-dir", str(tmp_path), "--json")
    assert info["limit"] == 1_000_000 and info["over"] == int(info["bytes"]) - 1_000_000 > 1_900_000  # type: ignore[call-overload]
    assert main(["cache", "info", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "over:" in out and "blobdata cache trim" in out
    again = _cli_json(capsys, "cache", "info", "--cache-dir", str(tmp_path), "--json")
    assert again["bytes"] == info["bytes"]  # looking trims nothing
    assert main(["cache", "trim", "--cache-dir", str(tmp_path)]) == 0
    assert "trimmed" in capsys.readouterr().out
    info = _cli_json(capsys, "cache", "info", "--cache-dir", str(tmp_path), "--json")
    assert info["over"] == 0 and int(info["bytes"]) <= 1_000_000  # type: ignore[call-overload]
    assert main(["cache", "trim", "--cache-dir", str(tmp_path), "--cache-size", "500kB"]) == 0
    capsys.readouterr()
    with BlobCache.inspect(tmp_path) as look:
        assert look.stats().volume_bytes <= 500_000


# -- a node's share, from the command line (a local folder: no server needed) ------------------------


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    for i in range(40):
        d = root / f"c{i // 10}"  # sorted by class, as a listing is
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:02d}.png").write_bytes(value(i, 20_000))
    return root


def _cached(folder: Path, cache: Path) -> set[int]:
    """Positions in the listing (ImageFolder order) of the samples the cache holds."""
    from blobdata import list_folder

    m = list_folder(str(folder))
    with BlobCache.inspect(cache) as c:
        return {i for i in range(len(m)) if (m.url(i), m.identity(i)) in c}


def test_warm_nnodes_fills_the_nodes_fixed_share_and_says_how_much_fits(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    argv = ["warm", str(folder), "--cache-dir", str(cache), "--no-progress", "--seed", "3"]
    assert main([*argv, "--nnodes", "2", "--node-rank", "1", "--cache-size", "10MB"]) == 0
    assert "holds all of this node's share" in capsys.readouterr().out
    share = set(node_share(40, seed=3, nnodes=2, node=1).tolist())
    assert _cached(folder, cache) == share
    # The job moves to 4 nodes and this machine becomes node 0 of 4 with less disk (its user lowers
    # the bound on purpose): warm evicts what the new share does not need and fills the new one.
    new = set(node_share(40, seed=3, nnodes=4, node=0).tolist())
    BlobCache(cache, size_limit="300kB", shrink=True).close()
    assert main([*argv, "--nnodes", "4", "--node-rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "that this node's share does not need" in out and "holds all of this node's share" in out
    assert _cached(folder, cache) >= new
    # Too small a cache for the share: it says how much fits.
    small = tmp_path / "small"
    assert main(["warm", str(folder), "--cache-dir", str(small), "--no-progress", "--seed", "3",
                 "--nnodes", "2", "--node-rank", "0", "--cache-size", "250kB"]) in (0, 1)  # fmt: skip
    out = capsys.readouterr().out
    assert "of the share's 20 objects" in out and "read from the bucket every epoch" in out


def test_cache_trim_with_a_share_keeps_that_share(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    assert main(["warm", str(folder), "--cache-dir", str(cache), "--no-progress"]) == 0
    capsys.readouterr()
    assert _cached(folder, cache) == set(range(40))
    share = set(node_share(40, seed=0, nnodes=2, node=0).tolist())
    argv = ["cache", "trim", str(folder), "--cache-dir", str(cache), "--cache-size", "550kB"]
    assert main([*argv, "--nnodes", "2", "--node-rank", "0"]) == 0
    assert "trimmed" in capsys.readouterr().out
    kept = _cached(folder, cache)
    assert share <= kept and len(kept) < 40
    assert main(["cache", "trim", str(folder), "--cache-dir", str(cache), "--cache-size", "1MB"]) == 2
    assert "--nnodes" in capsys.readouterr().err


def test_inspecting_a_directory_without_a_cache_creates_nothing(tmp_path: Path) -> None:
    from blobdata import CacheError

    with pytest.raises(CacheError, match="no cache"):
        BlobCache.inspect(tmp_path / "nowhere")
    assert not (tmp_path / "nowhere").exists()

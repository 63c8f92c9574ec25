"""A node's peer service refuses what the job did not sign, and everything outside its own objects: a
real service on a loopback port, in front of a real S3 bucket whose GETs a proxy counts (a refused
request reads nothing), asked with Python's own ``http.client`` (the oracle of HTTP/1.1 framing) and
with raw bytes where a request must be malformed."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

import pytest

from blobdata import BlobCache, FetchOptions, FolderDataset
from blobdata._errors import BlobdataError
from blobdata._fetch import FetchEngine
from blobdata._loop import run
from blobdata._peers import PATH, Homes, Service, Signer, job_id
from blobdata._peers.auth import SKEW_S, WINDOW, answer_signature
from blobdata._peers.service import crc_text
from tests.support.other_user import as_other_user
from tests.support.peer_nodes import payload

pytestmark = pytest.mark.timeout(120)

SECRET = bytes(range(32))
NAMES = ("node-a", "node-b")  # this service is node-a's


class Served(NamedTuple):
    service: Service
    port: int
    objects: list[tuple[str, str, int]]  # (url, identity, size) homed here
    others: list[tuple[str, str, int]]  # homed on node-b
    proxy: Any
    cache: BlobCache


def _raw(fh: Any) -> bytes:
    return bytes(fh.read())


async def _fetch(engine: FetchEngine, url: str, size: int | None, identity: str) -> bytes:
    return (await engine.fetch(url, size=size, identity=identity))[0]


@pytest.fixture
def served(tmp_path: Path, s3_bucket: Any, s3_proxy: Any) -> Iterator[Served]:
    # At least 12 objects homed on each node, whatever the bucket's (random) name makes the homes.
    homes, keys, count = Homes(NAMES), [], [0, 0]
    for i in range(1000):
        key = f"train/c{i % 2}/{i:04d}.bin"
        home = homes.home_of(s3_bucket.url(key))
        if count[home] < 12:
            keys.append((i, key))
            count[home] += 1
        if min(count) == 12:
            break
    s3_bucket.put_many({key: payload(i) for i, key in keys})
    s3_bucket.put("secret/key.bin", b"not for peers")
    options = {**s3_bucket.storage_options, "endpoint_url": s3_proxy.endpoint_url}
    ds = FolderDataset(s3_bucket.url("train"), loader=_raw, extensions=(".bin",), storage_options=options)
    m = ds.manifest
    rows = [(m.url(i), m.identity(i), m.size(i)) for i in range(len(ds))]
    cache = BlobCache(tmp_path / "cache")
    service = Service(SECRET)
    service.homes, service.me = homes, 0
    engine = FetchEngine(FetchOptions(), "s3", options)
    service.add_source(ds._url, cache, engine, _fetch)
    port = run(service.server.start("127.0.0.1", 0))
    s3_proxy.reset_counts()
    mine = [r for r in rows if homes.home_of(r[0]) == 0]
    others = [r for r in rows if homes.home_of(r[0]) == 1]
    assert len(mine) == len(others) == 12
    try:
        yield Served(service, port, mine, others, s3_proxy, cache)
    finally:
        run(service.server.aclose())
        engine.close()


def _target(url: str, identity: str, size: int) -> str:
    return f"{PATH}?u={quote(url, safe='')}&e={quote(identity, safe='')}&n={size}"


def _ask(port: int, target: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", target, headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


def _signed(target: str, secret: bytes = SECRET, **kw: Any) -> tuple[dict[str, str], str]:
    return Signer(secret, NAMES[1], **kw).sign("GET", target)


def _gets(proxy: Any) -> int:
    return sum(1 for m, _ in proxy.requests if m == "GET")


def _answer(port: int, target: str) -> tuple[int, str, bytes]:
    """A freshly signed request's status, table and body; its signature checked where it is 200."""
    headers, sig = _signed(target)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", target, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    table = resp.getheader("X-Blobdata-Table") or ""
    if resp.status == 200:
        assert resp.getheader("X-Blobdata-Signature") == answer_signature(SECRET, sig, 200, table)
    return resp.status, table, body


def test_a_signed_request_gets_the_object_read_once_then_from_the_cache(served: Served) -> None:
    url, ident, size = served.objects[0]
    target = _target(url, ident, size)
    for origin in ("bucket", "cache"):
        status, table, body = _answer(served.port, target)
        assert status == 200 and body == payload(int(url.rsplit("/", 1)[1][:4]))
        assert table == f"{origin[0]}{size}.{crc_text(body)}"
    assert _gets(served.proxy) == 1  # read from the bucket once; cached before it was answered
    assert served.cache.get(url, ident) is not None and served.service.state()["unwritten"] == 0


def test_an_unauthenticated_request_is_refused_and_reads_nothing(served: Served) -> None:
    url, ident, size = served.objects[0]
    resp = _ask(served.port, _target(url, ident, size), {})
    assert resp.status == 403
    headers, _ = _signed(_target(url, ident, size))
    del headers["Authorization"]
    assert _ask(served.port, _target(url, ident, size), headers).status == 403
    assert _gets(served.proxy) == 0 and served.cache.get(url, ident) is None


def test_a_request_signed_with_another_jobs_secret_is_refused(served: Served) -> None:
    url, ident, size = served.objects[0]
    target = _target(url, ident, size)
    other = os.urandom(32)
    headers, _ = _signed(target, other)
    resp = _ask(served.port, target, headers)
    assert resp.status == 403
    # ... and claiming this job's id does not help: the signature is the other secret's.
    headers, _ = _signed(target, other)
    headers["X-Blobdata-Job"] = job_id(SECRET)
    assert _ask(served.port, target, headers).status == 403
    assert _gets(served.proxy) == 0
    assert served.service.refused == {
        "the request is another job's": 1,
        "the request's signature does not match": 1,
    }


def test_a_replayed_request_is_refused(served: Served) -> None:
    url, ident, size = served.objects[0]
    target = _target(url, ident, size)
    signer = Signer(SECRET, NAMES[1])
    headers, _ = signer.sign("GET", target)
    assert _ask(served.port, target, headers).status == 200
    assert _ask(served.port, target, headers).status == 403  # the very same request again
    # Requests out of order pass once each; one older than the window does not.
    early, _ = signer.sign("GET", target)
    for _ in range(5):
        signer.sign("GET", target)
    late, _ = signer.sign("GET", target)
    assert _ask(served.port, target, late).status == 200
    assert _ask(served.port, target, early).status == 200
    assert _ask(served.port, target, early).status == 403
    old, _ = signer.sign("GET", target)
    for _ in range(WINDOW):
        signer.sign("GET", target)
    assert _ask(served.port, target, signer.sign("GET", target)[0]).status == 200
    assert _ask(served.port, target, old).status == 403
    # A request made (signed) more than the allowed skew ago, or ahead, is refused as well.
    for offset in (-SKEW_S - 5, SKEW_S + 5):
        stale, _ = _signed(target, clock=lambda o=offset: time.time() + o)
        assert _ask(served.port, target, stale).status == 403
    assert _gets(served.proxy) == 1  # the first request's read, and no other


def test_a_request_changed_after_signing_is_refused(served: Served) -> None:
    (url, ident, size), (url2, ident2, size2) = served.objects[:2]
    headers, _ = _signed(_target(url, ident, size))
    for target in (
        _target(url2, ident2, size2),
        _target(url, ident + "x", size),
        _target(url, ident, size + 1),
    ):
        assert _ask(served.port, target, headers).status == 403
    headers, _ = _signed(_target(url, ident, size))
    headers["X-Blobdata-Node"] = NAMES[0]
    assert _ask(served.port, _target(url, ident, size), headers).status == 403
    assert _gets(served.proxy) == 0


def test_a_path_outside_the_cache_is_refused(served: Served, s3_bucket: Any) -> None:
    url, ident, _ = served.objects[0]
    root = url.rsplit("/", 2)[0]  # s3://bucket/train
    outside = [
        s3_bucket.url("secret/key.bin"),  # the same bucket, outside the dataset
        root + "/../secret/key.bin",  # a dot segment
        root + "/c0/./" + url.rsplit("/", 1)[1],
        root + "//c0/" + url.rsplit("/", 1)[1],
        root + "x/c0/0000.bin",  # a sibling prefix
        "file:///etc/passwd",
        "s3://other-bucket/train/c0/0000.bin",
    ]
    for bad in outside:
        target = _target(bad, ident, 13)
        resp = _ask(served.port, target, _signed(target)[0])
        assert resp.status == 404, bad
    assert _gets(served.proxy) == 0


def test_an_object_of_another_home_is_refused_never_passed_on(served: Served) -> None:
    url, ident, size = served.others[0]
    target = _target(url, ident, size)
    resp = _ask(served.port, target, _signed(target)[0])
    assert resp.status == 421
    assert _gets(served.proxy) == 0 and served.cache.get(url, ident) is None


def _raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        chunks = []
        while True:
            got = s.recv(65536)
            if not got:
                break
            chunks.append(got)
    return b"".join(chunks)


def test_malformed_requests_are_refused_and_the_connection_closed(served: Served) -> None:
    url, ident, size = served.objects[0]
    target = _target(url, ident, size)
    headers, _ = _signed(target)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    cases = {
        b"POST " + target.encode() + b" HTTP/1.1\r\n" + head.encode() + b"\r\n": b"405",
        b"GET "
        + target.encode()
        + b" HTTP/1.1\r\n"
        + head.encode()
        + b"Content-Length: 5\r\n\r\nhello": b"400",
        b"GET "
        + target.encode()
        + b" HTTP/1.1\r\n"
        + head.encode()
        + b"Transfer-Encoding: chunked\r\n\r\n": b"400",
        b"GET " + target.encode() + b" HTTP/1.1\nHost: x\n\n\r\n\r\n": b"400",  # bare LF
        b"GET " + target.encode() + b" HTTP/1.1\r\nX-A: 1\r\nx-a: 2\r\n\r\n": b"400",  # a header twice
        b"GET " + target.encode() + b" HTTP/1.1\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n": b"431",
        b"GET /blobdata/v1/object?u=x HTTP/1.1\r\n" + head.encode() + b"\r\n": b"403",  # signed for another
        b"GARBAGE\r\n\r\n": b"400",
    }
    for request, status in cases.items():
        answer = _raw_exchange(served.port, request)
        assert answer.startswith(b"HTTP/1.1 " + status), (request[:60], answer[:80])
    h2, _ = _signed(PATH + "?u=x")
    assert _ask(served.port, PATH + "?u=x", h2).status == 400  # signed, but not an object request
    assert _gets(served.proxy) == 0


def _closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Seconds until the server closes ``sock`` (sending ``trickle`` a byte per 0.05 s meanwhile)."""
    t0 = time.monotonic()
    sock.settimeout(0.05)
    sent = 0
    while time.monotonic() - t0 < 30:
        if sent < len(trickle):
            with contextlib.suppress(OSError):  # closed by the server meanwhile: read that below
                sock.sendall(trickle[sent : sent + 1])
            sent += 1
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except ConnectionResetError:  # an abort: closed all the same
            return time.monotonic() - t0
    raise AssertionError("the server kept the connection for 30 s")


def test_a_connection_that_asks_nothing_is_closed_a_job_members_idle_one_kept(served: Served) -> None:
    """Anyone who can reach the port could hold the service's connection slots by asking nothing, or
    a head a byte at a time: each gets HEAD_TIMEOUT_S for a whole head. A connection that was answered
    and waits for its next request (a job member's pool) stays open."""
    from blobdata._peers.server import HEAD_TIMEOUT_S

    assert served.service.server.head_timeout == HEAD_TIMEOUT_S
    served.service.server.head_timeout = 0.5
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as silent:
        assert 0.4 < _closed_after(silent) < 10
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as slow:
        # A byte every 0.05 s would never end a 16 KiB head: the clock runs from its first byte.
        assert 0.4 < _closed_after(slow, b"GET /blobdata/v1/object?u=" + b"x" * 400) < 10
    url, ident, size = served.objects[0]
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    socks = []
    for _ in range(2):
        target = _target(url, ident, size)
        conn.request("GET", target, headers=_signed(target)[0])
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == payload(int(url.rsplit("/", 1)[1][:4]))
        socks.append(conn.sock)
        time.sleep(1.0)  # twice the timeout between requests
    conn.close()
    assert socks[0] is not None and socks[1] is socks[0]  # one connection, kept while it waited


def test_at_the_connection_limit_the_oldest_that_never_asked_makes_room(served: Served) -> None:
    """Whoever can reach the port can open connections; at the limit, the oldest that never sent a
    head is closed for a new one, and a job member's connection, which asked, is never the one."""
    url, ident, size = served.objects[0]
    member = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)

    def ask() -> None:
        target = _target(url, ident, size)
        member.request("GET", target, headers=_signed(target)[0])
        resp = member.getresponse()
        assert resp.status == 200 and len(resp.read()) == size

    ask()
    served.service.server.max_connections = 4
    served.service.server.head_timeout = 600.0  # only the limit closes a connection here
    strangers = [socket.create_connection(("127.0.0.1", served.port), timeout=30) for _ in range(3)]
    try:
        newest = socket.create_connection(("127.0.0.1", served.port), timeout=30)
        strangers.append(newest)
        assert _closed_after(strangers[0]) < 10  # the oldest that never asked
        for s in strangers[1:]:  # the others are open: nothing to read, no end
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
        first = member.sock
        ask()  # the member's connection was kept, and still serves
        assert member.sock is first
        # Once every connection has asked, a new one is what is closed.
        for s in strangers[1:]:
            s.setblocking(True)
            target = _target(url, ident, size)
            headers = "".join(f"{k}: {v}\r\n" for k, v in _signed(target)[0].items())
            s.sendall(f"GET {target} HTTP/1.1\r\n{headers}\r\n".encode())
            assert s.recv(12).startswith(b"HTTP/1.1 200")
        late = socket.create_connection(("127.0.0.1", served.port), timeout=30)
        strangers.append(late)
        assert _closed_after(late) < 10
        ask()
    finally:
        member.close()
        for s in strangers:
            s.close()


def test_a_peer_beyond_its_bounds_is_told_busy(served: Served) -> None:
    url, ident, size = served.objects[0]
    target = _target(url, ident, size)
    served.service.per_peer = 0
    assert _ask(served.port, target, _signed(target)[0]).status == 503
    served.service.per_peer, served.service.max_bytes = 256, size - 1
    assert _ask(served.port, target, _signed(target)[0]).status == 503
    assert _gets(served.proxy) == 0


def test_another_user_of_the_node_can_neither_ask_nor_find_the_secret(served: Served, tmp_path: Path) -> None:
    url, ident, size = served.objects[0]
    target = _target(url, ident, size)

    def other() -> None:
        resp = _ask(served.port, target, {})
        assert resp.status == 403
        forged, _ = Signer(os.urandom(32), NAMES[1]).sign("GET", target)
        assert _ask(served.port, target, forged).status == 403

    as_other_user(other)
    assert _gets(served.proxy) == 0
    # Nothing the service keeps on disk holds the secret (the node's directory, the cache). Read by a
    # child process: this one holds locks on a file there (its throttle table's owner entries), and
    # where they are POSIX record locks (no OFD locks: not Linux), closing any descriptor of that file
    # drops them all; a dead owner in a slot this process then believed its own would stay unswept.
    found = subprocess.run(
        [sys.executable, "-c", _SCAN, SECRET.hex(), os.environ["BLOBDATA_NODE_DIR"], str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert found.stdout.split("\n")[0] == "scanned" and "secret in" not in found.stdout, found.stdout


_SCAN = """
import pathlib, sys
secret = bytes.fromhex(sys.argv[1])
print("scanned")
for place in sys.argv[2:]:
    for path in pathlib.Path(place).rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            if secret in data or secret.hex().encode() in data:
                print("secret in", path)
"""


# -- batches: one request for many objects ------------------------------------------------------------
def _batch(*objects: tuple[str, str, int]) -> str:
    return PATH + "?" + "&".join(_target(*o).split("?", 1)[1] for o in objects)


def _number(url: str) -> int:
    return int(url.rsplit("/", 1)[1][:4])


def test_a_batch_is_answered_in_order_each_object_from_the_cache_or_read_once(served: Served) -> None:
    a, b, c = served.objects[:3]
    target = _target(*a)
    assert _ask(served.port, target, _signed(target)[0]).status == 200  # a is cached now
    status, table, body = _answer(served.port, _batch(b, a, c, b))  # b twice: read once all the same
    assert status == 200
    want = [payload(_number(o[0])) for o in (b, a, c, b)]
    assert body == b"".join(want)
    assert [e[0] for e in table.split(" ")] == ["b", "c", "b", "b"]
    assert table.split(" ") == [
        f"{e[0]}{len(w)}.{crc_text(w)}" for e, w in zip(table.split(" "), want, strict=True)
    ]
    assert _gets(served.proxy) == 3  # a once, then b and c once each


def test_objects_read_together_are_cached_in_one_transaction_before_they_are_answered(served: Served) -> None:
    commits: list[int] = []
    put_many = served.cache.put_many

    def counted(items: Any) -> list[bool]:
        if not commits:  # the first commit waits until all eight are read (they are offered as read)
            deadline = time.monotonic() + 20.0
            while len(served.service._recent) < 8 and time.monotonic() < deadline:
                time.sleep(0.005)
        commits.append(len(items))
        return put_many(items)

    served.cache.put_many = counted  # type: ignore[method-assign]  # the real cache, its commits counted
    asked = served.objects[:8]
    status, table, body = _answer(served.port, _batch(*asked))
    assert status == 200 and [e[0] for e in table.split(" ")] == ["b"] * 8
    assert body == b"".join(payload(_number(u)) for u, _, _ in asked)
    # in the cache before the answer: no flush, no wait
    assert [served.cache.get(u, e) for u, e, _ in asked] == [payload(_number(u)) for u, _, _ in asked]
    assert served.service.state()["unwritten"] == 0
    assert sum(commits) == 8 and len(commits) <= 2, commits  # what waited went in one, not one each
    assert _gets(served.proxy) == 8


def test_a_dataset_made_again_on_the_same_cache_keeps_its_one_writer(served: Served) -> None:
    (source,) = served.service.sources
    writer = source.writer
    for _ in range(3):  # the dataset made again: the same root, cache and way to read
        served.service.add_source(source.root, served.cache, source.owner(), source.fetch)
    (again,) = served.service.sources
    assert again.writer is writer and list(served.service._writers.values()) == [writer]
    url, ident, size = served.objects[0]
    status, table, body = _answer(served.port, _target(url, ident, size))
    assert status == 200 and table[0] == "b" and served.cache.get(url, ident) == body
    other = BlobCache(Path(served.cache.directory).parent / "other")
    served.service.add_source(source.root, other, source.owner(), source.fetch)  # another cache: its own
    assert served.service.sources[0].writer is not writer and len(served.service._writers) == 2


def test_a_batch_with_one_object_outside_or_of_another_home_is_refused_whole(
    served: Served, s3_bucket: Any
) -> None:
    mine, other = served.objects[0], served.others[0]
    outside = (s3_bucket.url("secret/key.bin"), mine[1], 13)
    for objects, status in (((mine, other), 421), ((mine, outside), 404), ((other, mine), 421)):
        target = _batch(*objects)
        assert _ask(served.port, target, _signed(target)[0]).status == status
    assert _gets(served.proxy) == 0 and served.cache.get(mine[0], mine[1]) is None


def test_an_object_the_bucket_refuses_is_marked_and_the_others_served(served: Served) -> None:
    a, b = served.objects[:2]
    changed = (b[0], '"not-its-etag"', b[2])  # pinned to an identity the bucket does not have
    status, table, body = _answer(served.port, _batch(a, changed))
    assert status == 200 and table.split(" ")[1] == "-" and table.startswith("b")
    assert body == payload(_number(a[0]))
    assert served.cache.get(b[0], changed[1]) is None and served.service.refused["bucket"] == 1


def test_a_batch_beyond_the_bounds_is_refused_and_reads_nothing(served: Served) -> None:
    from blobdata._peers.service import MAX_OBJECTS, MAX_TARGET

    a = served.objects[0]
    tiny = "&".join(
        ["u=s3%3A%2F%2Fb%2Fk&e=x&n=1"] * MAX_OBJECTS
    )  # the count's bound, apart from the length's
    assert len(Service._parse(f"{PATH}?{tiny}")) == MAX_OBJECTS
    assert Service._parse(f"{PATH}?{tiny}&u=s3%3A%2F%2Fb%2Fk&e=x&n=1") == []
    for bad in ("u=s3%3A%2F%2Fb%2Fk&e=x", "u=s3%3A%2F%2Fb%2Fk&e=x&n=1&e=x&u=y&n=1", "u=&e=x&n=1",
                "u=s3%3A%2F%2Fb%2Fk&e=x&n=-1", "u=s3%3A%2F%2Fb%2Fk&e=x&n=+1"):  # fmt: skip
        assert Service._parse(f"{PATH}?{bad}") == []
    # A size is the listing's: one that is not (-1 once meant "any") would leave the answer's bytes
    # outside the service's bound, which counts what is asked.
    unsized = _target(a[0], a[1], -1)
    assert _ask(served.port, unsized, _signed(unsized)[0]).status == 400
    long = (a[0], "x" * MAX_TARGET, a[2])  # one object whose fields overflow the target
    target = _target(*long)
    assert MAX_TARGET < len(target) < 16 * 1024 - 1024
    assert _ask(served.port, target, _signed(target)[0]).status == 400
    served.service.per_peer = 2  # objects in flight per asking node: a batch of 3 is too many
    target = _batch(*served.objects[:3])
    assert _ask(served.port, target, _signed(target)[0]).status == 503
    target = _batch(*served.objects[:2])
    assert _ask(served.port, target, _signed(target)[0]).status == 200
    assert _gets(served.proxy) == 2


def _bucket_noting(asked: list[str]) -> Any:
    """A bucket read for each URL (its payload), noting the URL in ``asked`` when it is read."""

    def bucket(url: str) -> Any:
        async def read() -> tuple[bytes, str]:
            asked.append(url)
            return payload(_number(url)), "etag"

        return read

    return bucket


def _asking(served: Served, per_peer: int) -> Any:
    from blobdata._peers import PeerClient, PeerTable

    return PeerClient(PeerTable(SECRET, NAMES, (f"127.0.0.1:{served.port}", "127.0.0.1:9"), 1, per_peer))


def test_reads_started_together_go_to_their_peer_as_few_requests_never_more_in_flight_than_allowed(
    served: Served,
) -> None:
    import asyncio

    from blobdata._metrics import stats as _stats

    objects = served.objects[:10]
    client = _asking(served, per_peer=4)
    served.service.per_peer = 4  # were 5 objects of node-b in flight at once, one would be told busy

    async def bucket() -> tuple[bytes, str]:
        raise AssertionError("no read may go to the bucket")

    async def reads() -> list[tuple[bytes, bool]]:
        try:
            return await asyncio.gather(*(client.read(0, u, n, e, bucket) for u, e, n in objects))
        finally:
            await client.aclose()

    fallbacks = _stats.rec()[_stats.PEER_FALLBACK]
    got = run(reads(), 60)
    assert got == [(payload(_number(u)), True) for u, _, _ in objects]
    assert client._signer._seq == 3  # 4 + 4 + 2 objects: three requests, each signed once
    assert _stats.rec()[_stats.PEER_FALLBACK] == fallbacks and served.service.refused["busy"] == 0
    assert _gets(served.proxy) == len(objects)


def test_an_object_its_home_cannot_read_goes_to_the_bucket_the_others_come_from_the_peer(
    served: Served,
) -> None:
    import asyncio

    a, b, c = served.objects[:3]
    client = _asking(served, per_peer=16)
    asked: list[str] = []
    bucket = _bucket_noting(asked)

    async def reads() -> list[tuple[bytes, bool]]:
        try:
            wanted = ((a[0], a[1]), (b[0], '"not-its-etag"'), (c[0], c[1]))
            return await asyncio.gather(*(client.read(0, u, a[2], e, bucket(u)) for u, e in wanted))
        finally:
            await client.aclose()

    got = run(reads(), 60)
    assert got == [
        (payload(_number(a[0])), True),
        (payload(_number(b[0])), False),
        (payload(_number(c[0])), True),
    ]
    assert asked == [b[0]] and client._signer._seq == 1
    assert client._peers[0].down_until == 0.0  # the peer answered right: it stays in use


def test_reads_started_as_a_batch_go_as_few_requests_and_count_where_their_bytes_came_from(
    served: Served,
) -> None:
    """The look-ahead's way (``PeerClient.start``: no task per read): reads started in one loop turn go
    to their home as requests of at most ``per_peer`` objects, each future gets its object's bytes and
    counts as read from a peer, as the next epoch's when started for it; one the home cannot serve (its
    identity is not the bucket's) goes to the bucket alone, counted as a fallback and a bucket read."""
    import asyncio

    from blobdata._metrics import stats as _stats

    objects = served.objects[:7]
    client = _asking(served, per_peer=4)
    asked: list[str] = []
    noting = _bucket_noting(asked)

    def bucket(url: str) -> Any:
        if url == objects[2][0]:  # the object its home cannot serve
            return noting(url)

        async def refuse() -> tuple[bytes, str]:
            # A read hedged because its request was slow (a loaded machine) takes the peer's late
            # answer: the bucket's read fails here, so the counts below hold however slow the peer.
            raise BlobdataError(f"{url}: not to be read from the bucket")

        return refuse

    def slots() -> list[float]:
        v = _stats.rec()
        names = ("FROM_PEER", "N_FROM_PEER", "FROM_BUCKET", "N_FROM_BUCKET", "PEER_FALLBACK")
        answers = sum(v[_stats._PHIST0 + b] for b in range(_stats._PBUCKETS))
        return [*(v[getattr(_stats, n)] for n in names), answers, v[_stats.BYTES_PEER]]

    async def reads() -> list[bytes]:
        futs = []
        for k, (u, e, n) in enumerate(objects):
            if k == 2:
                e = '"not-its-etag"'
            if k >= 5:  # the last two: read for the next epoch
                with _stats.for_next_epoch():
                    futs.append(client.start(0, u, n, e, bucket(u)))
            else:
                futs.append(client.start(0, u, n, e, bucket(u)))
        assert all(f is not None for f in futs)
        try:
            return list(await asyncio.gather(*futs))
        finally:
            await client.aclose()

    before = slots()
    got = run(reads(), 60)
    assert got == [payload(_number(u)) for u, _, _ in objects]
    assert all(type(g) is bytes for g in got)
    assert asked == [objects[2][0]] and client._signer._seq == 2  # 4 + 3 objects: two requests
    counted = [b - a for a, b in zip(before, slots(), strict=True)]
    assert counted[:5] == [4, 2, 1, 0, 1]  # peers now / next epoch, bucket now / next epoch, fallbacks
    # Each peer answer is in the latency histogram and the peer bytes once (noted per request).
    assert counted[5:] == [6, sum(len(g) for k, g in enumerate(got) if k != 2)]
    assert not client._rests and client._peers[0].down_until == 0.0


def test_the_service_takes_a_node_of_64_processes_at_the_default_per_peer_without_refusing() -> None:
    """8 GPUs of 8 workers each, every process with ``per_peer`` objects in flight to this node: none
    of them is told busy by the per-node bound (the byte bound stays what bounds memory)."""
    from blobdata._peers import Peers

    assert Service(SECRET).per_peer >= 64 * Peers().per_peer


def test_keys_with_a_querys_own_characters_are_asked_and_answered_whole(served: Served) -> None:
    """Keys holding what separates a request's fields (``& = ?``), escapes (``% +``), a fragment
    (``#``), spaces and letters beyond ASCII go whole to their home and back, in one request; a plain
    URL travels as it is (``/`` and ``:`` need no escape in a query: quoting it costs a scan)."""
    import asyncio

    root = served.objects[0][0].rsplit("/", 2)[0]  # the dataset's root: s3://BUCKET/train
    homes = Homes(NAMES)
    names = ["a&b=c?.bin", "100% real+fake.bin", "#tag.bin", "été/日本.bin", "%2F.bin", "u=x&e=y&n=1"]
    objects = []
    for k, name in enumerate(names):
        url = next(u for j in range(200) if homes.home_of(u := f"{root}/odd{j}/{name}") == 0)
        data = f"object {k} ".encode() * 40
        assert served.cache.put(url, f'"e{k}"', data)
        objects.append((url, f'"e{k}"', data))
    plain = served.objects[0]
    targets: list[str] = []
    handler = served.service.server.handler

    async def recording(req: Any) -> Any:
        targets.append(req.target)
        return await handler(req)

    served.service.server.handler = recording
    client = _asking(served, per_peer=16)

    async def bucket() -> tuple[bytes, str]:
        raise AssertionError("no read may go to the bucket")

    async def reads() -> list[tuple[bytes, bool]]:
        try:
            wanted = [*((u, e, len(d)) for u, e, d in objects), plain]
            return await asyncio.gather(*(client.read(0, u, n, e, bucket) for u, e, n in wanted))
        finally:
            await client.aclose()

    got = run(reads(), 60)
    assert got == [*((d, True) for _, _, d in objects), (payload(_number(plain[0])), True)]
    assert len(targets) == 1 and f"u={plain[0]}&" in targets[0]
    assert _gets(served.proxy) == 1  # the plain object, not in the cache yet: read by its home

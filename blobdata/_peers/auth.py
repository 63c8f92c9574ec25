"""Who may ask a node's peer service: requests signed under the job's secret, never twice.

The job's secret (32 random bytes, drawn by global rank 0 and handed to the ranks through the job's own
store: :mod:`.rendezvous`) never travels in a request. Each request carries, in headers, the job's
public id (a keyed hash of the secret: a request of another job is told apart from a forged one), the
asking node's name, the asking process's random client id, a sequence number, the time, and
``Authorization: BLOBDATA-PEER-V1 Signature=<hex>``: an HMAC-SHA256, under the secret, of the method,
the request target (path and query: the object URL and its identity are in the query) and those
headers, in SigV4's shape. The service refuses, with 403 and without touching any other state, a
request whose job id, signature or time (more than :data:`SKEW_S` from its own clock) is wrong; then a
request whose (client, sequence) it has seen already, or that is older than the last
:data:`WINDOW` sequence numbers of that client (a sliding anti-replay window, RFC 4303 section 3.4.3):
a recorded request cannot be played again. The table of clients is bounded (:data:`MAX_CLIENTS`); a
client is forgotten only once its requests are all too old to pass the time check.

The answer is signed too (:meth:`Verifier.answer_signature`): an HMAC of the request's signature, the
status and the answer's table (each object's origin, length and checksum of its bytes). Whatever
answers on a peer's address without the secret (a process that took the port of a service that died)
cannot make an answer the asking side accepts.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Callable, Mapping

__all__ = [
    "MAX_CLIENTS",
    "SCHEME",
    "SKEW_S",
    "WINDOW",
    "Refused",
    "Signer",
    "Verifier",
    "answer_signature",
    "job_id",
]

SCHEME = "BLOBDATA-PEER-V1"
#: Seconds a request's time may differ from the service's clock (the nodes' clocks are NTP-synced).
SKEW_S = 30.0
#: Sequence numbers of one client below its highest by this many are refused as too old.
WINDOW = 4096
#: Clients (asking processes) the service remembers at once; a new one beyond is refused (503).
MAX_CLIENTS = 100_000

_H_JOB, _H_NODE, _H_CLIENT, _H_SEQ, _H_TIME = (
    "X-Blobdata-Job", "X-Blobdata-Node", "X-Blobdata-Client", "X-Blobdata-Seq", "X-Blobdata-Time",
)  # fmt: skip
_PREFIX = SCHEME + " Signature="


class Refused(Exception):
    """A request the service will not answer: ``status`` (403, 503) and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def job_id(secret: bytes) -> str:
    """The job's public id: 16 hex digits of an HMAC of a constant under its secret."""
    return hmac.new(secret, b"blobdata peer job", hashlib.sha256).hexdigest()[:16]


def _to_sign(method: str, target: str, job: str, node: str, client: str, seq: int, millis: int) -> bytes:
    text = f"{SCHEME}\n{method}\n{target}\n{job}\n{node}\n{client}\n{seq}\n{millis}"
    return text.encode("utf-8", "surrogatepass")


def _mac(secret: bytes, message: bytes) -> str:
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def answer_signature(secret: bytes, request_sig: str, status: int, table: str) -> str:
    """The signature of an answer to the request signed ``request_sig``: its status and its table (each
    object's origin, length and checksum, :mod:`.service`)."""
    text = f"{SCHEME} answer\n{request_sig}\n{status}\n{table}"
    return _mac(secret, text.encode("utf-8", "surrogatepass"))


class Signer:
    """The asking side of one process: signs each request with a fresh sequence number. Make one per
    process (a forked child must not reuse its parent's client id and numbers)."""

    def __init__(self, secret: bytes, node: str, *, clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.job = job_id(secret)
        self.node = node
        self.client = secrets.token_hex(8)
        self._seq = 0
        self._lock = threading.Lock()
        self._clock = clock

    def sign(self, method: str, target: str) -> tuple[dict[str, str], str]:
        """The headers that authenticate ``method target``, and the request's signature."""
        with self._lock:
            self._seq += 1
            seq = self._seq
        millis = int(self._clock() * 1000)
        sig = _mac(self.secret, _to_sign(method, target, self.job, self.node, self.client, seq, millis))
        headers = {
            _H_JOB: self.job, _H_NODE: self.node, _H_CLIENT: self.client, _H_SEQ: str(seq),
            _H_TIME: str(millis), "Authorization": _PREFIX + sig,
        }  # fmt: skip
        return headers, sig


class _Window:
    __slots__ = ("mask", "seen", "top")

    def __init__(self, now: float) -> None:
        self.top = 0
        self.mask = 0  # bit i: sequence number top - i was seen
        self.seen = now


class Verifier:
    """The serving side: checks a request's signature, time and freshness (see the module docstring).
    Thread-safe."""

    def __init__(
        self, secret: bytes, *, clock: Callable[[], float] = time.time, max_clients: int = MAX_CLIENTS
    ) -> None:
        self.secret = secret
        self.job = job_id(secret)
        self._clock = clock
        self._max = max_clients
        self._clients: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def check(self, method: str, target: str, headers: Mapping[str, str]) -> tuple[str, str]:
        """``(asking node, request signature)`` of an authentic, fresh request; else :class:`Refused`.
        ``headers`` by lower-case name."""
        job = headers.get(_H_JOB.lower(), "")
        auth = headers.get("authorization", "")
        if not auth:
            raise Refused(403, "the request is not signed")
        if job != self.job:
            raise Refused(403, "the request is another job's")
        node = headers.get(_H_NODE.lower(), "")
        client = headers.get(_H_CLIENT.lower(), "")
        seq_text, time_text = headers.get(_H_SEQ.lower(), ""), headers.get(_H_TIME.lower(), "")
        if not (auth.startswith(_PREFIX) and seq_text.isdigit() and time_text.isdigit() and client):
            raise Refused(403, "the request's signature headers are malformed")
        if len(seq_text) > 19 or len(time_text) > 19 or len(client) > 64 or len(node) > 256:
            raise Refused(403, "the request's signature headers are malformed")
        seq, millis = int(seq_text), int(time_text)
        sig = auth[len(_PREFIX) :]
        want = _mac(self.secret, _to_sign(method, target, job, node, client, seq, millis))
        if not hmac.compare_digest(sig.encode("ascii", "replace"), want.encode("ascii")):
            raise Refused(403, "the request's signature does not match")
        now = self._clock()
        if abs(now - millis / 1000.0) > SKEW_S:
            raise Refused(403, f"the request's time is more than {SKEW_S:.0f} s from this node's clock")
        self._fresh(client, seq, now)
        return node, sig

    def _fresh(self, client: str, seq: int, now: float) -> None:
        with self._lock:
            w = self._clients.get(client)
            if w is None:
                if len(self._clients) >= self._max:
                    self._forget(now)
                    if len(self._clients) >= self._max:
                        raise Refused(503, "too many clients")
                w = self._clients[client] = _Window(now)
            w.seen = now
            if seq > w.top:
                shift = seq - w.top
                w.mask = ((w.mask << shift) | 1) & ((1 << WINDOW) - 1) if shift < WINDOW else 1
                w.top = seq
                return
            back = w.top - seq
            if back >= WINDOW:
                raise Refused(403, "the request is too old (replayed?)")
            if w.mask >> back & 1:
                raise Refused(403, "the request was seen already (replayed)")
            w.mask |= 1 << back

    def _forget(self, now: float) -> None:
        """Drop the clients none of whose requests could pass the time check any more (locked)."""
        stale = [c for c, w in self._clients.items() if now - w.seen > 2 * SKEW_S]
        for c in stale:
            del self._clients[c]

    def answer_signature(self, request_sig: str, status: int, table: str) -> str:
        return answer_signature(self.secret, request_sig, status, table)

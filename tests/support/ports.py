"""A port for a server that another process starts later (torchrun's store, a node's peer service).

A port found by binding port 0 and closing the socket lies in the kernel's ephemeral range, which it
also hands out as the local port of every outgoing connection: between the choice and the listen, any
connection on the machine (the suite's proxies, another torchrun's ranks reaching their store) may
take it, and the server fails with EADDRINUSE (seen in CI: the resumed torchrun of
test_sigkill_then_resume_gives_the_uninterrupted_batches). Below that range the kernel never assigns a
port by itself; the port is drawn at random there, in a slice of its own for each xdist worker (two
workers never draw the same port), checked free, and never handed out twice by one process.
"""

from __future__ import annotations

import os
import random
import socket

__all__ = ["listen_port"]

_LOW = 10_000  # above the well-known and registered services' usual ports
_given: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _slice() -> range:
    """This xdist worker's ports: its own part of the range below the ephemeral one."""
    high = max(_ephemeral_low(), _LOW + 1024)
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    worker = int(name[2:]) if name[2:].isdigit() else 0
    span = (high - _LOW) // count
    start = _LOW + (worker % count) * span
    return range(start, start + span)


def listen_port() -> int:
    """A port on 127.0.0.1 that is free now, below the ephemeral range (see the module docstring)."""
    ports = _slice()
    for _ in range(200):
        port = random.choice(ports)
        if port in _given:
            continue
        with socket.socket() as s:  # no SO_REUSEADDR: a port still in TIME_WAIT is refused too
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port found in {ports.start}-{ports.stop - 1}")

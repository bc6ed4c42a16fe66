"""Free loopback ports for servers the tests and benchmarks start, picked below the
kernel's ephemeral range.

A port the kernel handed out (bind to port 0) sits in the ephemeral range, where any
outgoing connection of any process may take it as its local port between the check
and the server's bind: the server then fails with EADDRINUSE, and a readiness probe
that connects to that port can even connect to itself (TCP simultaneous open) and see
a listener that is not there. Ports below the range are only ever taken by a bind.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

__all__ = ["free_port", "free_port_range"]

_FLOOR = 10_000


def _ephemeral_start() -> int:
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_range(span: int) -> int:
    """The first of `span` consecutive free ports, all below the ephemeral range."""
    ceiling = _ephemeral_start() - span
    rng = random.Random(os.getpid() ^ random.getrandbits(32))
    for _ in range(200):
        base = rng.randrange(_FLOOR, ceiling)
        if all(_bindable(p) for p in range(base, base + span)):
            return base
    raise RuntimeError(f"no {span} free consecutive ports in {_FLOOR}-{ceiling + span}")


def free_port() -> int:
    """One free port below the ephemeral range (`free_port_range`)."""
    return free_port_range(1)

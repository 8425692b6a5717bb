"""A free port for a server this package (or a test) is about to start on 127.0.0.1.

Between choosing a port and the server binding it, the port is free for anyone. A port from
`bind(("127.0.0.1", 0))` comes from the kernel's ephemeral range (Linux: `ip_local_port_range`,
32768-60999 by default), the range every outgoing connection on the machine takes its source port
from: on a busy machine (Ray's gRPC channels, gloo, HTTP clients) one of them can take it in that
window. A server that starts a few seconds late then cannot bind it: Ray's dashboard agent retries and
exits, its raylet follows, and `ray start --block` stops the whole head. So the port is chosen below the
ephemeral range, where the kernel never puts a source port, and above Ray's default worker ports
(10002-19999, `ray start --min-worker-port/--max-worker-port`), and checked free by binding it.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_EPHEMERAL_LOW = 32768
ABOVE_RAY_WORKER_PORTS = 20000  # Ray's default --max-worker-port is 19999
TRIES = 200

_random = random.SystemRandom()  # not the `random` module's state, which forked processes share


def ephemeral_low() -> int:
    """The lowest port the kernel hands out as a source port (Linux's default where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_DEFAULT_EPHEMERAL_LOW


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(taken: Collection[int] = ()) -> int:
    """A port on 127.0.0.1 that binds now, outside the ephemeral range and `taken` (ports chosen for
    the same start-up, not bound yet); the kernel's choice where that range leaves no room."""
    low, high = ABOVE_RAY_WORKER_PORTS, ephemeral_low()
    if high - low >= 1000:
        for _ in range(TRIES):
            port = _random.randrange(low, high)
            if port not in taken and _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

"""Local networking helpers for rank processes: a free TCP port, the loopback interface."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_ifname() -> str | None:
    """The loopback interface's name ("lo" or "lo0"), or None where there is none to name."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)

"""Loopback networking helpers shared by the demo, the benches and the tests."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1, in 1–65535 (bound and released: another process could take it
    before the caller binds it; callers that start a server retry or fail loudly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

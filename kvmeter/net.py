"""Networking helpers: a free loopback port (the demo, the benches and the tests) and the
gateway's listening socket (``kvmeter serve``, one process or ``--workers N``)."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

__all__ = ["free_port", "listening_socket"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1, in 1–65535 (bound and released: another process could take it
    before the caller binds it; callers that start a server retry or fail loudly)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening_socket(uv_config: uvicorn.Config, send_buffer_bytes: int | None) -> socket.socket:
    """uvicorn's listening socket (``Config.bind_socket``) with ``SO_SNDBUF`` set to
    ``send_buffer_bytes`` (None: left to the kernel's autotuning); the connections it accepts
    inherit it (``server.send_buffer_bytes``: what a stalled reader's connection absorbs before the
    server's sends block).

    Raises:
        OSError: the address cannot be bound.
    """
    sock = uv_config.bind_socket()
    if send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    return sock

"""kvmeter.net: the gateway's listening socket bounds every connection's kernel send buffer."""

from __future__ import annotations

import socket

import uvicorn

from kvmeter.net import free_port, listening_socket
from kvmeter.serving.config import ServerSettings


def _accepted_sndbuf(send_buffer_bytes: int | None) -> tuple[int, int]:
    """(the listener's SO_SNDBUF, an accepted connection's) for a listening socket built as serve does."""
    listener = listening_socket(uvicorn.Config(app=None, host="127.0.0.1", port=free_port()), send_buffer_bytes)
    try:
        listener.listen()  # uvicorn's server listens on it when it starts
        client = socket.create_connection(listener.getsockname()[:2])
        conn, _ = listener.accept()
        try:
            return (listener.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                    conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        finally:
            conn.close()
            client.close()
    finally:
        listener.close()


def test_accepted_connections_inherit_the_configured_send_buffer():
    listener, accepted = _accepted_sndbuf(65_536)
    assert accepted == listener
    assert 65_536 <= accepted <= 2 * 65_536  # Linux doubles it for its bookkeeping


def test_without_a_setting_the_kernel_default_stays():
    with socket.socket() as fresh:
        default = fresh.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    # nothing set on the listener: its connections get the kernel's autotuned buffer (on this
    # machine's loopback ~3.9 MB at once, which a stalled reader's answer fills only after minutes)
    assert _accepted_sndbuf(None)[0] == default


def test_the_default_bounds_it_and_tiny_values_are_refused():
    import pytest
    from pydantic import ValidationError

    assert ServerSettings().send_buffer_bytes == 256 * 1024
    with pytest.raises(ValidationError):
        ServerSettings(send_buffer_bytes=100)

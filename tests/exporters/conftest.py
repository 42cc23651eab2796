"""Fixtures for the exporter tests: a fresh registry and bus, a manual clock, the shared data."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.traces import data_dir

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = data_dir()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data directory; a missing one is an error, not a skip."""
    if not SHARED_DATA.is_dir():
        raise FileNotFoundError(f"shared data not found at {SHARED_DATA} (set KVMETER_DATA_DIR)")
    return SHARED_DATA


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def bus():
    bus = StatsBus()
    yield bus
    assert bus.errors_total == 0, "a subscriber raised while handling a published stats object"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_wall=1_750_000_000.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port():
    """A function returning an unused loopback TCP port."""
    return _free_port


@pytest.fixture
def port() -> int:
    return _free_port()

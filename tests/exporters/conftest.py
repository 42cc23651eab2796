"""Fixtures for the exporter tests: a fresh registry and bus, a manual clock, free ports (the data
folder comes from ``tests/conftest.py``)."""

from __future__ import annotations


import pytest
from prometheus_client import CollectorRegistry

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.net import free_port as _free_port


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


@pytest.fixture
def free_port():
    """A function returning an unused loopback TCP port."""
    return _free_port


@pytest.fixture
def port() -> int:
    return _free_port()

"""Fixtures for the collector tests: the real captures in ../shared/data (read-only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvmeter.traces import data_dir

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = data_dir()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data directory; a missing one is an error, not a skip."""
    if not SHARED_DATA.is_dir():
        raise FileNotFoundError(f"shared data not found at {SHARED_DATA} (set KVMETER_DATA_DIR)")
    return SHARED_DATA

"""Fixtures for the ledger tests: a real embedded ClickHouse (chDB) in a temporary directory.

chDB hosts one engine path per process, so every ledger a test opens is closed at teardown
before the next test opens its own path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from ledgerkit import T0

from kvmeter.clock import ManualClock
from kvmeter.ledger import Ledger, LedgerConfig


@pytest.fixture
def clock() -> ManualClock:
    """Wall clock one hour after T0: test events (T0 + i s) are not late (late_after_s = 3600)."""
    return ManualClock(start_wall=T0 + 3600)


@pytest.fixture
def config(tmp_path: Path) -> LedgerConfig:
    """Embedded ledger in tmp_path; background rounds rare (tests drain with flush()); engine_steps
    kept forever (the tests' step rows are dated around T0, in the past, and ClickHouse's TTL
    compares with its real clock: test_engine_steps_retention.py sets the limit itself)."""
    return LedgerConfig(dsn=f"chdb://{tmp_path / 'chdb'}", spool_dir=tmp_path / "spool",
                        flush_interval_s=3600, rollup_interval_s=3600, close_timeout_s=10,
                        engine_steps_retention_days=0)


@pytest.fixture
def open_ledger(config: LedgerConfig, clock: ManualClock) -> Iterator[Callable[..., Ledger]]:
    """Opens ledgers (default: ``config`` and ``clock``) and closes them all at teardown."""
    opened: list[Ledger] = []

    def _open(cfg: LedgerConfig | None = None, **kwargs: Any) -> Ledger:
        kwargs.setdefault("clock", clock)
        ledger = Ledger.open(cfg or config, **kwargs)
        opened.append(ledger)
        return ledger

    yield _open
    for ledger in reversed(opened):
        ledger.close()


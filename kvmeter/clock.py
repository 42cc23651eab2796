"""Clocks, injected everywhere timing logic runs.

Two readings, never mixed:

* ``monotonic()`` — seconds from an arbitrary origin; use it for durations (TTFT, ITL, queue wait,
  token-bucket refill). Never compare it with a wall-clock value.
* ``wall()`` — Unix epoch seconds (UTC); use it for timestamps that leave the process (usage events,
  ClickHouse rows, Prometheus samples).

``SystemClock`` reads the OS; ``ManualClock`` is advanced by hand and is what tests and the
discrete-event simulator use, so no timing test ever sleeps.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SystemClock", "ManualClock", "SYSTEM_CLOCK"]


@runtime_checkable
class Clock(Protocol):
    """Source of time. Both methods return float seconds."""

    def monotonic(self) -> float:
        """Monotonic seconds (arbitrary origin), for durations."""

    def wall(self) -> float:
        """Wall-clock Unix epoch seconds, for timestamps."""


class SystemClock:
    """The operating system's clocks (``time.monotonic`` / ``time.time``)."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to.

    Args:
        start_wall: wall-clock epoch seconds at monotonic zero (default 1.7e9, i.e. late 2023).
        start_monotonic: initial monotonic reading in seconds.
    Raises:
        ValueError: from :meth:`advance` / :meth:`set` if asked to move backwards.
    """

    __slots__ = ("_mono", "_wall_offset")

    def __init__(self, start_wall: float = 1_700_000_000.0, start_monotonic: float = 0.0) -> None:
        self._mono = float(start_monotonic)
        self._wall_offset = float(start_wall) - float(start_monotonic)

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._mono + self._wall_offset

    def advance(self, seconds: float) -> float:
        """Move forward by ``seconds`` (≥ 0); returns the new monotonic reading."""
        if seconds < 0:
            raise ValueError(f"ManualClock cannot go backwards (advance by {seconds})")
        self._mono += seconds
        return self._mono

    def set(self, monotonic: float) -> None:
        """Jump to an absolute monotonic reading (≥ the current one)."""
        if monotonic < self._mono:
            raise ValueError(f"ManualClock cannot go backwards ({monotonic} < {self._mono})")
        self._mono = float(monotonic)


SYSTEM_CLOCK: Clock = SystemClock()

"""Small helpers shared by sources that mirror device or remote state (gauges that may become
unknown, device counters that are cumulative)."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["set_or_clear", "CumulativeMirror"]


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def set_or_clear(metric: Any, labels: tuple[str, ...], value: float | None) -> None:
    """Set the gauge child to ``value``; if ``value`` is ``None`` (unknown), drop the series so a
    stale reading does not linger (in multiprocess mode, where series cannot be dropped, it is
    set to NaN). Never writes 0 for an unknown value."""
    if value is not None:
        metric.labels(*labels).set(value)
    elif _multiprocess():
        metric.labels(*labels).set(float("nan"))
    else:
        try:
            metric.remove(*labels)
        except KeyError:
            pass


class CumulativeMirror:
    """Turn a device's cumulative reading (energy since driver load, ECC count...) into increments
    of a prometheus-client Counter.

    The first reading increments by the whole value, so the counter mirrors the device; later
    readings increment by the difference. A reading below the last one means the device counter
    restarted (driver reload, reset): the counter increments by the new value. Unknown readings
    (``None``) are skipped. ``labels=()`` updates a counter declared without labels. Used for
    devices (energy, ECC) and for producers that report running totals (scheduler, ledger).
    """

    def __init__(self) -> None:
        self._last: dict[tuple[int, tuple[str, ...]], float] = {}

    def update(self, counter: Any, labels: tuple[str, ...], value: float | None) -> None:
        if value is None:
            return
        key = (id(counter), labels)
        last = self._last.get(key)
        delta = value if last is None or value < last else value - last
        self._last[key] = value
        child = counter.labels(*labels) if labels else counter  # () → a label-less counter
        if delta > 0:
            child.inc(delta)

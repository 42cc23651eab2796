"""The time window every dashboard read takes: a half-open UTC interval cut into equal buckets.

A :class:`Window` is ``[start, end)`` with a bucket width ``step_s`` (seconds) chosen so a chart
has at most :data:`MAX_BUCKETS` points. Bucket starts are aligned to multiples of ``step_s``
since the Unix epoch (ClickHouse ``toStartOfInterval``), so two windows with the same step share
bucket boundaries and a cached read stays valid while the window slides inside one bucket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Mapping

from kvmeter.ledger.period import Period

__all__ = ["Window", "STEPS_S", "MAX_BUCKETS", "RANGES", "choose_step", "utc"]

#: Allowed bucket widths, seconds (1 s … 1 day).
STEPS_S: tuple[int, ...] = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)
#: Most buckets in one chart.
MAX_BUCKETS = 240
#: The time-range choices of the sidebar: label → span in seconds.
RANGES: dict[str, int] = {
    "last 5 min": 300, "last 15 min": 900, "last 1 h": 3600, "last 6 h": 6 * 3600, "last 24 h": 86400,
    "last 7 days": 7 * 86400,
}


def utc(value: datetime) -> datetime:
    """``value`` as a timezone-aware UTC datetime (a naive one is taken to be UTC already)."""
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def choose_step(span_s: float, max_buckets: int = MAX_BUCKETS) -> int:
    """The smallest step of :data:`STEPS_S` that cuts ``span_s`` seconds into ≤ ``max_buckets``.

    Raises:
        ValueError: if ``span_s`` is not > 0.
    """
    if not span_s > 0:
        raise ValueError(f"window span must be > 0 s, got {span_s}")
    for step in STEPS_S:
        if span_s / step <= max_buckets:
            return step
    return STEPS_S[-1]


@dataclass(frozen=True, slots=True)
class Window:
    """A half-open UTC interval ``[start, end)`` read in buckets of ``step_s`` seconds.

    Attributes:
        start, end: timezone-aware UTC datetimes, ``start < end``.
        step_s: bucket width in seconds, one of :data:`STEPS_S`.
    Raises:
        ValueError: on a naive datetime, ``start >= end`` or an unknown step.
    """

    start: datetime
    end: datetime
    step_s: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, datetime) or value.tzinfo is None:
                raise ValueError(f"Window.{name} must be a timezone-aware datetime, got {value!r}")
            object.__setattr__(self, name, value.astimezone(timezone.utc))
        if not self.start < self.end:
            raise ValueError(f"window start {self.start.isoformat()} is not before its end {self.end.isoformat()}")
        if self.step_s not in STEPS_S:
            raise ValueError(f"step_s must be one of {STEPS_S}, got {self.step_s!r}")

    @classmethod
    def last(cls, span_s: float, now: datetime, max_buckets: int = MAX_BUCKETS) -> "Window":
        """The ``span_s`` seconds up to ``now`` (live view), with the end rounded *up* to a bucket
        boundary: the newest, still-filling bucket is included, and the window — hence the cache
        key — stays the same while ``now`` moves inside one bucket. Rates of that bucket divide
        by its elapsed seconds (:func:`kvmeter.dashboards.frames.bucket_seconds`)."""
        step = choose_step(span_s, max_buckets)
        end_s = math.ceil(utc(now).timestamp() / step) * step
        end = datetime.fromtimestamp(end_s, tz=timezone.utc)
        return cls(end - timedelta(seconds=span_s), end, step)

    @classmethod
    def ending(cls, span_s: float, end: datetime, max_buckets: int = MAX_BUCKETS) -> "Window":
        """Exactly the ``span_s`` seconds before ``end`` (a pinned, reviewed period: nothing
        after ``end`` is read)."""
        end = utc(end)
        return cls(end - timedelta(seconds=span_s), end, choose_step(span_s, max_buckets))

    @classmethod
    def between(cls, start: datetime, end: datetime, max_buckets: int = MAX_BUCKETS) -> "Window":
        """``[start, end)`` with a step chosen for its span."""
        start, end = utc(start), utc(end)
        return cls(start, end, choose_step((end - start).total_seconds(), max_buckets))

    @property
    def span_s(self) -> float:
        """Length in seconds."""
        return (self.end - self.start).total_seconds()

    @property
    def period(self) -> Period:
        """The same interval as a billing :class:`~kvmeter.ledger.period.Period`."""
        label = f"{self.start.isoformat().replace('+00:00', 'Z')}/{self.end.isoformat().replace('+00:00', 'Z')}"
        return Period(self.start, self.end, label)

    def bucket_starts(self) -> list[datetime]:
        """Every bucket start that overlaps the window, oldest first (aligned to the epoch)."""
        step = self.step_s
        first = math.floor(self.start.timestamp() / step) * step
        out = []
        t = first
        end_s = self.end.timestamp()
        while t < end_s:
            out.append(datetime.fromtimestamp(t, tz=timezone.utc))
            t += step
        return out

    def to_query(self) -> dict[str, str]:
        """URL query parameters (``start``, ``end`` ISO 8601, ``step``) for the read API."""
        return {"start": self.start.isoformat(), "end": self.end.isoformat(), "step": str(self.step_s)}

    @classmethod
    def from_query(cls, params: Mapping[str, str]) -> "Window":
        """Inverse of :meth:`to_query`.

        Raises:
            ValueError: a missing or malformed parameter.
        """
        get = params.get
        try:
            start = datetime.fromisoformat(str(get("start")).replace("Z", "+00:00"))
            end = datetime.fromisoformat(str(get("end")).replace("Z", "+00:00"))
            step = int(str(get("step")))
        except (TypeError, ValueError):
            raise ValueError("window needs start and end (ISO 8601) and step (seconds)") from None
        return cls(utc(start), utc(end), step)

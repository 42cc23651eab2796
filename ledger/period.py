"""Billing periods: half-open UTC intervals ``[start, end)``.

An event belongs to the period that contains its ``finish_ts`` (an attempt: its ``ts``; an
engine record: its ``wall_ts``; an adjustment: its ``ts``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

from .errors import PeriodError

__all__ = ["Period", "parse_period", "EARLIEST", "LATEST_END"]

_MONTH = re.compile(r"^(\d{4})-(\d{2})$")
_DAY = re.compile(r"^(\d{4})-(\d{2})-(\d{2})$")
_YEAR = re.compile(r"^(\d{4})$")
_EXAMPLES = "use 2026-11 (month), 2026-11-29 (day), 2026 (year) or an ISO range such as " \
            "2026-11-01/2026-11-15 or 2026-11-01T00:00:00Z/2026-11-01T12:00:00Z (end exclusive)"

#: The range ClickHouse's ``DateTime64(6)`` holds (the ledger's timestamp type): a period outside
#: it cannot be queried (older values fail to parse, later ones saturate silently).
EARLIEST = datetime(1900, 1, 1, tzinfo=timezone.utc)
#: Exclusive end of that range: the last instant stored is 2299-12-31T23:59:59.999999Z.
LATEST_END = datetime(2300, 1, 1, tzinfo=timezone.utc)
_RANGE = "the supported range is 1900-01-01 .. 2299-12-31 (UTC; ClickHouse DateTime64)"


@dataclass(frozen=True, slots=True)
class Period:
    """A half-open interval of UTC time.

    Attributes:
        start, end: timezone-aware UTC datetimes, ``start < end``.
        label: how it was written (``2026-11``), used in file names and report titles.
    """

    start: datetime
    end: datetime
    label: str

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, datetime) or value.tzinfo is None:
                raise PeriodError(f"Period.{name} must be a timezone-aware datetime")
            try:
                object.__setattr__(self, name, value.astimezone(timezone.utc))
            except OverflowError:  # 0001-01-01T00:00+05:00 has no UTC datetime
                raise PeriodError(f"period {self.label!r} is out of range: {_RANGE}") from None
        if not self.start < self.end:
            raise PeriodError(f"period start {self.start.isoformat()} is not before its end {self.end.isoformat()}")
        if self.start < EARLIEST or self.end > LATEST_END:
            raise PeriodError(f"period {self.label!r} ({self.start.isoformat()} .. {self.end.isoformat()}) "
                              f"is out of range: {_RANGE}")

    @property
    def start_ts(self) -> float:
        """Start as Unix epoch seconds."""
        return self.start.timestamp()

    @property
    def end_ts(self) -> float:
        """End (exclusive) as Unix epoch seconds."""
        return self.end.timestamp()

    @property
    def slug(self) -> str:
        """The label made safe for a file name."""
        return re.sub(r"[^0-9A-Za-z_.-]+", "_", self.label).strip("_")

    def __str__(self) -> str:
        return f"{self.label} [{self.start.isoformat()} .. {self.end.isoformat()})"


def _utc(d: date) -> datetime:
    return datetime(d.year, d.month, d.day, tzinfo=timezone.utc)


def _endpoint(text: str) -> datetime:
    text = text.strip()
    if _DAY.match(text):
        return _utc(date.fromisoformat(text))
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise PeriodError(f"cannot read period endpoint {text!r} as an ISO date or date-time; {_EXAMPLES}") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)  # naive = UTC, stated in the help
    return value


def _in_range(start: datetime, text: str) -> datetime:
    """``start``, checked against the supported range before the end is computed from it (the
    end of ``9999-12-31`` would overflow ``datetime``)."""
    if not EARLIEST <= start < LATEST_END:
        raise PeriodError(f"period {text!r} is out of range: {_RANGE}")
    return start


def parse_period(text: str) -> Period:
    """Parse a billing period.

    Accepts ``YYYY``, ``YYYY-MM``, ``YYYY-MM-DD`` or ``START/END`` with ISO 8601 dates or
    date-times (naive ones are UTC, the end is exclusive), within 1900-01-01 .. 2299-12-31
    (:data:`EARLIEST` .. :data:`LATEST_END`, what ClickHouse ``DateTime64(6)`` holds).
    Raises:
        PeriodError: with examples of valid forms, or the supported range. Every message
            names the period.
    """
    if not isinstance(text, str) or not text.strip():
        raise PeriodError(f"empty period; {_EXAMPLES}")
    text = text.strip()
    try:
        if m := _YEAR.match(text):
            y = int(m.group(1))
            return Period(_in_range(_utc(date(y, 1, 1)), text), _utc(date(y + 1, 1, 1)), text)
        if m := _MONTH.match(text):
            y, mo = int(m.group(1)), int(m.group(2))
            start = _in_range(_utc(date(y, mo, 1)), text)
            end = _utc(date(y + (mo == 12), mo % 12 + 1, 1))
            return Period(start, end, text)
        if _DAY.match(text):
            start = _in_range(_utc(date.fromisoformat(text)), text)
            return Period(start, start + timedelta(days=1), text)
    except ValueError as exc:
        if isinstance(exc, PeriodError):
            raise
        raise PeriodError(f"period {text!r} is not a valid date ({exc}); {_EXAMPLES}") from None
    if "/" in text:
        left, _, right = text.partition("/")
        return Period(_endpoint(left), _endpoint(right), text)
    raise PeriodError(f"cannot read period {text!r}; {_EXAMPLES}")

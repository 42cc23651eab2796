"""Billing periods: half-open intervals ``[start, end)`` of UTC instants, read in a time zone.

An event belongs to the period that contains its ``finish_ts`` (an attempt: its ``ts``; an
engine record: its ``wall_ts``; an adjustment: its ``ts``).

A period is written in a tenant's billing time zone (:mod:`kvmeter.billing_calendar`; UTC unless
its org sets ``billing_timezone``): ``2026-11`` in ``America/New_York`` is
``2026-11-01T04:00Z .. 2026-12-01T05:00Z``, and ``2026-11-01`` there is 25 hours long (the clocks
fall back). Naive ISO endpoints are local times of that zone; endpoints with an offset or ``Z``
are exact instants whatever the zone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, timezone

from kvmeter.billing_calendar import UTC, check_zone, day_bounds, month_bounds, year_bounds, zone

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
        timezone: the IANA zone the label was read in (``UTC`` by default).
    """

    start: datetime
    end: datetime
    label: str
    timezone: str = UTC

    def __post_init__(self) -> None:
        problem = check_zone(self.timezone)
        if problem is not None:
            raise PeriodError(f"period {self.label!r}: {problem}")
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

    @property
    def hours(self) -> float:
        """Length in hours (a local day is 23, 24 or 25)."""
        return (self.end - self.start).total_seconds() / 3600

    def local(self, value: datetime) -> datetime:
        """``value`` (aware) as a local time of the period's zone."""
        return value.astimezone(zone(self.timezone))

    def in_zone(self, tz: str) -> "Period":
        """The same label read in ``tz`` (an explicit range with offsets keeps its instants).

        Raises:
            PeriodError: ``tz`` is not an IANA zone, or the label cannot be read there.
        """
        return self if tz == self.timezone else parse_period(self.label, tz)

    def __str__(self) -> str:
        zone_note = "" if self.timezone == UTC else f" {self.timezone}"
        return f"{self.label}{zone_note} [{self.start.isoformat()} .. {self.end.isoformat()})"


def _endpoint(text: str, tz: str) -> datetime:
    text = text.strip()
    if _DAY.match(text):
        d = date.fromisoformat(text)
        return datetime(d.year, d.month, d.day, tzinfo=zone(tz))  # local midnight; Period checks the range
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise PeriodError(f"cannot read period endpoint {text!r} as an ISO date or date-time; {_EXAMPLES}") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=zone(tz))  # naive = local time of the period's zone (UTC by default)
    return value


def _in_range(year: int, text: str) -> None:
    """Refuse a year outside the supported range before its bounds are computed (the end of
    ``9999-12-31`` would overflow ``datetime``)."""
    if not EARLIEST.year <= year < LATEST_END.year:
        raise PeriodError(f"period {text!r} is out of range: {_RANGE}")


def parse_period(text: str, tz: str = UTC) -> Period:
    """Parse a billing period in the time zone ``tz``.

    Accepts ``YYYY``, ``YYYY-MM``, ``YYYY-MM-DD`` (local calendar units of ``tz``) or ``START/END``
    with ISO 8601 dates or date-times (naive ones are local times of ``tz``, the end is
    exclusive), within 1900-01-01 .. 2299-12-31 (:data:`EARLIEST` .. :data:`LATEST_END`, what
    ClickHouse ``DateTime64(6)`` holds).

    Args:
        text: the period as written.
        tz: an IANA zone name (:mod:`kvmeter.billing_calendar`), default ``UTC``.
    Raises:
        PeriodError: with examples of valid forms, or the supported range, or an unknown zone.
            Every message names the period.
    """
    if not isinstance(text, str) or not text.strip():
        raise PeriodError(f"empty period; {_EXAMPLES}")
    problem = check_zone(tz)
    if problem is not None:
        raise PeriodError(f"period {text.strip()!r}: {problem}")
    text = text.strip()
    try:
        if m := _YEAR.match(text):
            y = int(m.group(1))
            _in_range(y, text)
            return Period(*year_bounds(y, tz), text, tz)
        if m := _MONTH.match(text):
            y, mo = int(m.group(1)), int(m.group(2))
            _in_range(y, text)
            if not 1 <= mo <= 12:
                raise ValueError("month must be in 1..12")
            return Period(*month_bounds(y, mo, tz), text, tz)
        if _DAY.match(text):
            d = date.fromisoformat(text)
            _in_range(d.year, text)
            return Period(*day_bounds(d, tz), text, tz)
    except ValueError as exc:
        if isinstance(exc, PeriodError):
            raise
        raise PeriodError(f"period {text!r} is not a valid date ({exc}); {_EXAMPLES}") from None
    except OverflowError:  # 1900-01-01 in a zone east of UTC is before the range
        raise PeriodError(f"period {text!r} is out of range: {_RANGE}") from None
    if "/" in text:
        left, _, right = text.partition("/")
        return Period(_endpoint(left, tz), _endpoint(right, tz), text, tz)
    raise PeriodError(f"cannot read period {text!r}; {_EXAMPLES}")

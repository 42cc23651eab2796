"""The billing calendar: a tenant's days and months in its own IANA time zone.

One definition, used by the ledger's billing periods (:mod:`kvmeter.ledger.period`), the quota's
spend windows (``spend_per_day`` / ``spend_per_month`` in :mod:`kvmeter.serving.quota.plan`) and
the read API. A tenant's zone is the ``billing_timezone`` of its org in the tenants config
(default :data:`UTC`).

Rules (the stdlib :mod:`zoneinfo` database, PEP 495 semantics):

* A local day ``D`` is the half-open UTC interval ``[first instant of D, first instant of D+1)``.
  Its length is whatever the zone's clock says: 23 h on a spring-forward day, 25 h on a fall-back
  day (America/New_York 2026-03-08 and 2026-11-01), 24 h otherwise. A month is its days.
* The first instant of a day whose midnight does not exist (a DST gap at 00:00) is the first
  local time after the gap; ``datetime(..., tzinfo=zone)`` with ``fold=0`` resolves to exactly
  that instant.
* Instants are compared in UTC; no local wall-clock arithmetic is ever done across a transition.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

__all__ = ["UTC", "zone", "check_zone", "day_bounds", "month_bounds", "year_bounds", "local_date",
           "whole_hour_offsets"]

#: The default billing zone (platform-wide limits and tenants that name none).
UTC = "UTC"


@lru_cache(maxsize=256)
def zone(name: str) -> ZoneInfo:
    """The :class:`~zoneinfo.ZoneInfo` of an IANA zone name (``America/New_York``, ``UTC``).

    Raises:
        ValueError: ``name`` is not a zone of the installed IANA database (the message names it).
    """
    problem = check_zone(name)
    if problem is not None:
        raise ValueError(problem)
    return ZoneInfo(name)


def check_zone(name: object) -> str | None:
    """``None`` when ``name`` is a valid IANA zone name, else why not (one sentence naming it)."""
    if not isinstance(name, str) or not name or name != name.strip():
        return f"time zone must be an IANA zone name such as America/New_York, got {name!r}"
    try:
        ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return f"unknown IANA time zone {name!r} (e.g. UTC, America/New_York, Europe/Berlin, Asia/Kathmandu)"
    return None


def _start(d: date, tz: str) -> datetime:
    """First instant of local day ``d`` in ``tz``, as an aware UTC datetime."""
    return datetime(d.year, d.month, d.day, tzinfo=zone(tz)).astimezone(timezone.utc)


def day_bounds(d: date, tz: str = UTC) -> tuple[datetime, datetime]:
    """``[start, end)`` of local day ``d`` in ``tz`` as aware UTC datetimes (23, 24 or 25 h long)."""
    return _start(d, tz), _start(d + timedelta(days=1), tz)


def month_bounds(year: int, month: int, tz: str = UTC) -> tuple[datetime, datetime]:
    """``[start, end)`` of a local calendar month in ``tz`` as aware UTC datetimes."""
    nxt = date(year + (month == 12), month % 12 + 1, 1)
    return _start(date(year, month, 1), tz), _start(nxt, tz)


def year_bounds(year: int, tz: str = UTC) -> tuple[datetime, datetime]:
    """``[start, end)`` of a local calendar year in ``tz`` as aware UTC datetimes."""
    return _start(date(year, 1, 1), tz), _start(date(year + 1, 1, 1), tz)


def local_date(wall_s: float, tz: str = UTC) -> date:
    """The local calendar date in ``tz`` of the instant ``wall_s`` (Unix epoch seconds)."""
    return datetime.fromtimestamp(wall_s, tz=zone(tz)).date()


def whole_hour_offsets(start: datetime, end: datetime, tz: str) -> bool:
    """True when every UTC offset ``tz`` uses in ``[start, end)`` is a whole number of hours, so
    the zone's local hours and days are unions of UTC hours (hourly rollups can be regrouped into
    them). False for ``Asia/Kathmandu`` (+05:45), ``Asia/Kolkata`` (+05:30), ...

    Probes the offset at ``start`` and every hour up to ``end`` (the IANA database changes offsets
    on the hour or half hour, so an hourly probe sees every offset in force). Intervals longer
    than :data:`_MAX_PROBES` hours answer False (the caller then takes its exact, slower path).
    """
    if tz == UTC:
        return True
    z = zone(tz)
    hours = (end - start) / timedelta(hours=1)
    if hours > _MAX_PROBES:
        return False
    t = start
    step = timedelta(hours=1)
    while t < end:
        offset = t.astimezone(z).utcoffset() or timedelta(0)
        if offset.total_seconds() % 3600:
            return False
        t += step
    return True


#: The longest interval (hours, ~3 years) :func:`whole_hour_offsets` probes.
_MAX_PROBES = 26_400

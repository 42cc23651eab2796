"""GCRA: the rate-limit algorithm of every ``*_per_minute`` dimension.

The Generic Cell Rate Algorithm in its *virtual scheduling* form (ITU-T Recommendation I.371,
"Traffic control and congestion control in B-ISDN", annex A; popularised for APIs by Brandur
Leach, "Rate limiting, cells, and GCRA", 2015, and redis-cell). It is a token bucket of capacity
``limit`` that refills at ``limit / period`` per second, stored as one number per key: the
*theoretical arrival time* TAT, the instant at which the bucket would be full again.

For a limit of ``L`` units per ``P`` seconds: emission interval ``T = P / L`` (seconds per unit),
tolerance ``τ = P`` (a full bucket may be spent at once). A request of ``n`` units at time ``now``:

    tat  = max(TAT, now)
    new  = tat + n·T
    admit iff new − now ≤ τ            (then TAT := new)
    else  Retry-After = new − τ − now  (the instant enough has refilled; exact, not a constant)

Derived values: remaining units = ⌊(τ − (TAT − now)) / T⌋; reset (time to full) = TAT − now.
Reconciliation returns unused units with ``TAT := max(TAT, now) − r·T`` (clamped at ``now``: a
bucket never exceeds its capacity) and charges extra units with ``+ r·T``.

The Redis Lua script (kvmeter.serving.quota.redis_store) performs the very same double-precision
operations in the same order, so both stores decide identically on identical inputs.
"""

from __future__ import annotations

import math

__all__ = ["gcra_admit", "gcra_adjust", "gcra_remaining", "gcra_reset_s"]


def gcra_admit(tat: float | None, now: float, amount: int, interval_s: float,
               tolerance_s: float) -> tuple[bool, float]:
    """One GCRA decision.

    Args:
        tat: stored theoretical arrival time (seconds, same clock as ``now``), None if absent.
        now: current time in seconds.
        amount: units asked for (≥ 0).
        interval_s: ``T`` = period / limit, seconds per unit (> 0).
        tolerance_s: ``τ`` = period, seconds.
    Returns:
        ``(True, new_tat)`` if admitted, else ``(False, retry_after_s)``.
    """
    t = tat if tat is not None and tat >= now else now
    new = t + amount * interval_s
    if new - now > tolerance_s:
        return False, new - tolerance_s - now
    return True, new


def gcra_adjust(tat: float | None, now: float, delta: int, interval_s: float) -> float | None:
    """Return (``delta`` < 0) or charge (``delta`` > 0) units; the new TAT, or None when full."""
    t = tat if tat is not None and tat >= now else now
    new = t + delta * interval_s
    return new if new > now else None


def gcra_remaining(tat: float, now: float, interval_s: float, tolerance_s: float) -> int:
    """Units that could be admitted now (≥ 0)."""
    t = tat if tat >= now else now
    return max(0, math.floor((tolerance_s - (t - now)) / interval_s + 1e-9))


def gcra_reset_s(tat: float, now: float) -> float:
    """Seconds until the bucket is full again (≥ 0)."""
    return tat - now if tat > now else 0.0

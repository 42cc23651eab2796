"""Fairness measures: Jain's index and the backlogged-service accountant behind it.

* Jain's fairness index (R. Jain, D. Chiu, W. Hawe, "A Quantitative Measure of Fairness and
  Discrimination for Resource Allocation in Shared Computer Systems", DEC-TR-301, 1984):
  ``J(x) = (Σ xᵢ)² / (n · Σ xᵢ²)``, in ``[1/n, 1]``; 1 when every ``xᵢ`` is equal.
* What ``xᵢ`` is matters. A tenant that asks for little receives little by choice, so kvmeter
  measures fairness the way VTC's guarantee is stated (Sheng et al., OSDI 2024, §4: service
  received by clients while they are *backlogged*): over the sampling intervals in which tenant
  *i* was backlogged at both ends, ``xᵢ`` = Σ (service received / the tenant's entitled share) ÷
  Σ interval length, where the entitled share is what weighted fair sharing gives it at that moment
  (``w_tier / Σ backlogged tier weights × w_tenant / Σ backlogged tenant weights in the tier``).
  Under a fair scheduler every backlogged tenant gets service in proportion to its share, so all
  ``xᵢ`` equal the drain rate and ``J → 1``; a tenant starved while backlogged pulls ``J`` down.
"""

from __future__ import annotations

import math
from typing import Iterable

__all__ = ["jain_index", "BackloggedServiceMeter"]


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index of non-negative ``values``.

    Returns:
        ``(Σx)² / (n·Σx²)`` in ``[1/n, 1]``; 1.0 for fewer than two values or all zeros.
    Raises:
        ValueError: on a negative or non-finite value.
    """
    xs = list(values)
    for x in xs:
        if x < 0 or not math.isfinite(x):
            raise ValueError(f"jain_index needs finite values ≥ 0, got {x!r}")
    if len(xs) < 2:
        return 1.0
    s = sum(xs)
    s2 = sum(x * x for x in xs)
    if s2 == 0:
        return 1.0
    return (s * s) / (len(xs) * s2)


class BackloggedServiceMeter:
    """Accumulates, per tenant, share-normalised service and time spent backlogged.

    Call :meth:`sample` periodically with each tenant's cumulative service, whether it is
    backlogged and its entitled share (0–1]; an interval counts for a tenant only when it was
    backlogged at both ends, and its service is divided by the share it had at the interval's
    start. Two accumulations run side by side: since the last :meth:`reset` (a window) and since
    construction (the whole run). :meth:`index` returns Jain's index over tenants with at least
    ``min_time_s`` of backlogged time.
    """

    __slots__ = ("_rec", "_last_t")

    # per tenant: [last service, last backlogged, last share, win served, win time, run served, run time]
    def __init__(self) -> None:
        self._rec: dict[str, list] = {}
        self._last_t: float | None = None

    def sample(self, now: float, states: Iterable[tuple[str, float, bool, float]]) -> None:
        """Record ``(tenant_id, cumulative_service, backlogged, share)`` at ``now`` for every
        tenant backlogged now or at the previous sample.

        Raises:
            ValueError: if ``now`` is before the previous sample.
        """
        dt = 0.0 if self._last_t is None else now - self._last_t
        if dt < 0:
            raise ValueError(f"sample times must not go backwards ({now} < {self._last_t})")
        rec = self._rec
        for tenant, served, backlogged, share in states:
            r = rec.get(tenant)
            if r is None:
                rec[tenant] = [served, backlogged, share, 0.0, 0.0, 0.0, 0.0]
                continue
            if backlogged and r[1] and dt > 0 and r[2] > 0:
                x = max(0.0, served - r[0]) / r[2]
                r[3] += x
                r[4] += dt
                r[5] += x
                r[6] += dt
            r[0], r[1], r[2] = served, backlogged, share
        self._last_t = now

    def rates(self, min_time_s: float = 0.0, *, whole_run: bool = False) -> dict[str, float]:
        """Share-normalised service per backlogged second, per tenant with ≥ ``min_time_s`` of
        backlogged time — in the current window, or since construction with ``whole_run``."""
        i = 5 if whole_run else 3
        return {t: r[i] / r[i + 1] for t, r in self._rec.items() if r[i + 1] > 0 and r[i + 1] >= min_time_s}

    def index(self, min_time_s: float = 0.0, *, whole_run: bool = False) -> float:
        """Jain's index of :meth:`rates` (1.0 with fewer than two tenants)."""
        return jain_index(self.rates(min_time_s, whole_run=whole_run).values())

    def reset(self) -> None:
        """Start a new window (the whole-run totals and the last sample are kept)."""
        for r in self._rec.values():
            r[3] = r[4] = 0.0

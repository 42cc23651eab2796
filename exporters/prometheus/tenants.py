"""Bounded tenant labels: the top-K tenants by active work get their own label, the rest ``other``.

Prometheus keeps one time series per label set; a ``tenant`` label with 100k tenants would sink
it. kvmeter keeps full per-tenant detail in ClickHouse and puts only a bounded set on metrics:

* **Work score.** Each tenant's score is its recent token work, decayed exponentially with a
  half-life (default 5 min): ``score ← score·2^(−Δt/half_life) + tokens``, plus the tokens it
  holds right now as the scheduler reports it (active KV + queued prompt tokens). Token work, not
  request count, because the request is not the unit of load.
* **Top-K with hysteresis.** While fewer than K tenants hold a label, any tenant seen gets one at
  once (one only ever refused too), and keeps it: an incumbent loses its label only to a
  challenger. Every ``refresh_s`` the set is recomputed: free slots go to the highest scores, and
  a challenger takes the weakest incumbent's label only if its score exceeds that incumbent's by
  more than ``hysteresis`` (20 % by default), so tenants near the edge do not flap. A tenant whose
  score fell to 0 (its requests were aborted or refused: no tokens) keeps its label while no
  challenger with work wants the slot.
* **Series never vanish.** A counter or histogram series, once exported, stays for the life of the
  process: when a tenant loses its label, its series keep their last values (frozen) and its later
  counts go to ``other``, so every series and every sum over tenants is monotonic (``rate()`` and
  ``increase()`` see no reset, and an alert on a tenant locked out by its cap does not lose its
  series at the next refresh). Only gauges are removed with a demoted tenant (their value moves
  into ``other``'s). Because frozen series stay, the number of tenant series is bounded by
  ``max_labels_per_process`` (default ``10 * k``): how many distinct tenants may ever get a label
  in this process; once that many have had one, a tenant never labelled before goes to ``other``
  until the process restarts (prometheus-client's multiprocess mode, where no series can be
  removed, has the same bound).

All timing reads the injected clock's ``monotonic()``. Not thread-safe by itself: the bus
dispatches synchronously on the producer's thread; see :class:`TenantLabels` for the lock.
"""

from __future__ import annotations

import heapq
import math
import os
import threading
from collections import defaultdict
from typing import Any

from prometheus_client import Gauge

from kvmeter.clock import SYSTEM_CLOCK, Clock

__all__ = ["TenantLabels", "OTHER"]

#: label value for every tenant outside the top K
OTHER = "other"


class TenantLabels:
    """Maps tenant ids to bounded label values and prunes the series of demoted tenants.

    Args:
        k: how many tenants get their own label (≥ 0; 0 puts everyone in ``other``).
        clock: injected clock (monotonic seconds).
        half_life_s: decay half-life of the work score, seconds (> 0).
        refresh_s: how often the top-K set is recomputed, seconds (≥ 0).
        hysteresis: a challenger must beat the weakest incumbent by this fraction (≥ 0).
        multiprocess: series cannot be removed (prometheus-client multiprocess mode: a demoted
            tenant's gauges stay too); default: whether ``PROMETHEUS_MULTIPROC_DIR`` is set.
        max_labels_per_process: how many distinct tenants may ever get a label in this process
            (default ``10 * k``): the bound on tenant series, since counter series never go.
    Raises:
        ValueError: on a negative ``k``/``refresh_s``/``hysteresis`` or a non-positive half-life.
    """

    def __init__(self, k: int = 20, *, clock: Clock = SYSTEM_CLOCK, half_life_s: float = 300.0,
                 refresh_s: float = 15.0, hysteresis: float = 0.2, multiprocess: bool | None = None,
                 max_labels_per_process: int | None = None) -> None:
        if k < 0 or refresh_s < 0 or hysteresis < 0 or half_life_s <= 0:
            raise ValueError(f"invalid TenantLabels settings: k={k}, refresh_s={refresh_s}, "
                             f"hysteresis={hysteresis}, half_life_s={half_life_s}")
        self.k = k
        self._clock = clock
        self._decay = math.log(2) / half_life_s
        self._refresh_s = refresh_s
        self._hysteresis = hysteresis
        self._multiprocess = (bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
                              if multiprocess is None else multiprocess)
        self._max_ever = 10 * k if max_labels_per_process is None else max_labels_per_process
        self._scores: dict[str, tuple[float, float]] = {}  # tenant → (score, at monotonic)
        self._active: dict[str, float] = {}  # tenant → tokens held now (e.g. active KV)
        self._labeled: set[str] = set()
        self._ever_labeled: set[str] = set()
        self._series: dict[str, set[tuple[Any, tuple[str, ...]]]] = defaultdict(set)
        self._next_refresh = clock.monotonic() + refresh_s
        self.lock = threading.RLock()
        self.demotions = 0

    # ------------------------------------------------------------------ scores
    def _score(self, tenant: str, now: float) -> float:
        score, at = self._scores.get(tenant, (0.0, now))
        return score * math.exp(-self._decay * (now - at)) + self._active.get(tenant, 0.0)

    def observe(self, tenant: str, tokens: float) -> None:
        """Add ``tokens`` (≥ 0) of finished or admitted work to ``tenant``'s score."""
        if tokens <= 0:
            return
        with self.lock:
            now = self._clock.monotonic()
            score, at = self._scores.get(tenant, (0.0, now))
            self._scores[tenant] = (score * math.exp(-self._decay * (now - at)) + tokens, now)

    def set_active(self, tenant: str, tokens: float) -> None:
        """Set the tokens ``tenant`` holds right now (e.g. active KV tokens); 0 clears it."""
        with self.lock:
            if tokens > 0:
                self._active[tenant] = float(tokens)
            else:
                self._active.pop(tenant, None)

    # ------------------------------------------------------------------ labels
    def refresh_if_due(self) -> None:
        """Recompute the top-K set if ``refresh_s`` has passed (what :meth:`label` does first).

        A source that labels many tenants from one snapshot calls it once, under :attr:`lock`,
        so the whole snapshot is labelled from one top-K set.
        """
        with self.lock:
            if self._clock.monotonic() >= self._next_refresh:
                self.refresh()

    def label(self, tenant: str) -> str:
        """The label value for ``tenant``: itself if in the top K, else ``other``."""
        with self.lock:
            now = self._clock.monotonic()
            if now >= self._next_refresh:
                self.refresh()
            if tenant in self._labeled:
                return tenant
            # a free slot goes to any tenant, work or not: a tenant that is only ever refused
            # (score 0) must still show under its own name; the next refresh gives the slot to a
            # tenant with more work if the labels are full
            if len(self._labeled) < self.k and self._may_label(tenant):
                self._labeled.add(tenant)
                self._ever_labeled.add(tenant)
                return tenant
            return OTHER

    def _may_label(self, tenant: str) -> bool:
        return tenant in self._ever_labeled or len(self._ever_labeled) < self._max_ever

    def labeled(self) -> frozenset[str]:
        """Tenants that currently hold their own label."""
        with self.lock:
            return frozenset(self._labeled)

    def refresh(self) -> list[str]:
        """Recompute the top-K set now; returns the tenants demoted (their gauges pruned, their
        counters frozen)."""
        with self.lock:
            now = self._clock.monotonic()
            self._next_refresh = now + self._refresh_s
            scores = {t: self._score(t, now) for t in set(self._scores) | set(self._active)}
            # forget tenants whose decayed work is negligible (keeps memory bounded)
            for t in [t for t, s in scores.items() if s < 1e-3 and t not in self._labeled]:
                self._scores.pop(t, None)
                scores.pop(t)
            # every incumbent keeps its label unless a challenger takes it (a tenant with score 0,
            # only aborted or refused, must not vanish while slots are free)
            new = set(self._labeled)
            challengers = [t for t, score in heapq.nlargest(self.k + len(new), scores.items(),
                                                            key=lambda kv: kv[1])
                           if t not in new and score > 0 and self._may_label(t)]
            for tenant in challengers:
                if len(new) < self.k:  # a free slot
                    new.add(tenant)
                    continue
                weakest = min(new, key=lambda t: scores.get(t, 0.0), default=None)
                if weakest is None or scores[tenant] <= scores.get(weakest, 0.0) * (1 + self._hysteresis):
                    break  # challengers are sorted: no later one can beat the margin either
                new.remove(weakest)
                new.add(tenant)
            demoted = sorted(self._labeled - new)
            self._labeled = new
            self._ever_labeled |= new
            for tenant in demoted:
                self._prune(tenant)
            self.demotions += len(demoted)
            return demoted

    # ------------------------------------------------------------------ series
    def child(self, metric: Any, tenant_index: int, values: tuple[str, ...]) -> Any:
        """``metric.labels(*values)`` with ``values[tenant_index]`` replaced by the tenant's label.

        A gauge's series is recorded under the tenant so it can be removed if the tenant is
        demoted; a counter's or histogram's is never removed (see the module docstring).
        """
        with self.lock:
            tenant = values[tenant_index]
            lab = self.label(tenant)
            if lab != tenant:
                values = values[:tenant_index] + (lab,) + values[tenant_index + 1:]
            elif not self._multiprocess and isinstance(metric, Gauge):
                self._series[tenant].add((metric, values))
            return metric.labels(*values)

    def _prune(self, tenant: str) -> None:
        for metric, values in self._series.pop(tenant, ()):
            try:
                metric.remove(*values)
            except KeyError:
                pass

"""The continuous self-check of ``kvmeter serve``: every number checked as it is published.

:class:`SelfCheckMonitor` subscribes to the bus and publishes a
:class:`~kvmeter.stats.SelfCheckViolation` for each request whose numbers cannot be true:

==========================  ==================================================================
check                       a violation
==========================  ==================================================================
``ttft_below_floor``        a request's TTFT is below its floor (:meth:`.PhysicalBounds.ttft_floor`:
                            the prefill's FLOPs ÷ the device's peak, or the configured floor)
``output_above_roofline``   a stream decoded faster than :meth:`.PhysicalBounds.output_roofline`:
                            tokens after the first chunk ÷ the time from the first chunk to the
                            last (its inter-token gaps: ``len(itls_s) / sum(itls_s)``)
``cached_over_input``       the engine reported more cached input tokens than input tokens
                            (:class:`~kvmeter.stats.EngineRequestStats`
                            ``reported_cached_input_tokens``; the counts billed are capped, as
                            :class:`~kvmeter.tokens.TokenCounts` allows no other)
``reservation_exceeded``    a request used more than its reservation holds: more output tokens
                            than reserved (the reservation is the ``max_tokens`` ceiling, so any
                            excess is a bug), or more input tokens than reserved × (1 +
                            ``input_ratio``) (:class:`~kvmeter.stats.ReservationDrift`)
==========================  ==================================================================

The exporter counts them (``kvmeter_selfcheck_*_requests_total``); the first violation of each
check is logged at WARNING (later ones only counted: the counters are the record). The other
self-checks need no monitor: the TTFT sample count against successful streams, the three-way
reconciliation (:mod:`kvmeter.ledger.reconciler`) and the spool age are compared from the exported
series (:mod:`.checks`, the rules). No clock is read: violations carry the producer's wall time.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvmeter.bus import StatsBus
from kvmeter.stats import EngineRequestStats, RequestCompletion, ReservationDrift, SelfCheckViolation

from .bounds import PhysicalBounds

__all__ = ["SelfCheckMonitor"]

log = logging.getLogger(__name__)


class SelfCheckMonitor:
    """Checks every finished request, engine record and reservation (see the module docstring).

    Args:
        bus: where it listens and publishes.
        bounds: the physical bounds of the served model on its device.
        input_ratio: how far the engine's input tokens may exceed the reserved input tokens, as a
            fraction of them (≥ 0; the gateway reserves its own tokenization of the prompt, so on
            the in-process engines the two are equal).
    Raises:
        ValueError: on a negative ``input_ratio``.

    Attributes:
        violations: violations published so far, by check.
    """

    def __init__(self, bus: StatsBus, bounds: PhysicalBounds, *, input_ratio: float = 0.1) -> None:
        if not input_ratio >= 0:
            raise ValueError(f"input_ratio must be ≥ 0, got {input_ratio!r}")
        self.bus = bus
        self.bounds = bounds
        self.input_ratio = float(input_ratio)
        self.violations: dict[str, int] = {}
        self._unsubscribe: list[Callable[[], None]] = [
            bus.subscribe(RequestCompletion, self.on_completion),
            bus.subscribe(EngineRequestStats, self.on_engine_request),
            bus.subscribe(ReservationDrift, self.on_drift),
        ]

    def close(self) -> None:
        """Stop listening."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()

    def _violation(self, v: SelfCheckViolation) -> None:
        count = self.violations.get(v.check, 0) + 1
        self.violations[v.check] = count
        if count == 1:
            log.warning("self-check %s failed (%s view, tier %r): %g against a bound of %g; later ones are "
                        "counted in kvmeter_selfcheck_* only", v.check, v.view, v.tier, v.value, v.bound)
        self.bus.publish(v)

    def on_completion(self, c: RequestCompletion) -> None:
        tokens = c.tokens
        if c.ttft_s is not None and tokens.input_tokens > 0:
            floor = self.bounds.ttft_floor(tokens.input_tokens, tokens.cached_input_tokens)
            if c.ttft_s < floor:
                self._violation(SelfCheckViolation("ttft_below_floor", c.attribution.tier, c.ttft_s, floor,
                                                   wall_ts=c.wall_ts))
        roofline = self.bounds.output_roofline()
        if roofline is not None and c.itls_s:
            decode_s = sum(c.itls_s)
            rate = len(c.itls_s) / decode_s if decode_s > 0 else float("inf")
            if rate > roofline:
                self._violation(SelfCheckViolation("output_above_roofline", c.attribution.tier, rate, roofline,
                                                   wall_ts=c.wall_ts))

    def on_engine_request(self, s: EngineRequestStats) -> None:
        # TokenCounts holds cached ≤ input; the engine's own larger count is kept beside it
        reported = s.reported_cached_input_tokens
        if reported is not None:
            self._violation(SelfCheckViolation("cached_over_input", s.attribution.tier, reported,
                                               s.tokens.input_tokens,
                                               view="engine", wall_ts=s.wall_ts))

    def on_drift(self, d: ReservationDrift) -> None:
        if d.outcome != "ran" or d.dimension not in ("input_tokens", "output_tokens"):
            return
        kind = d.dimension.removesuffix("_tokens")
        reserved = float(d.reserved)  # a token count here (an int); Decimal only in the cost dimension
        bound = reserved * (1 + self.input_ratio) if kind == "input" else reserved
        if d.actual > bound:
            self._violation(SelfCheckViolation("reservation_exceeded", d.attribution.tier, float(d.actual), bound,
                                               view=kind, wall_ts=d.wall_ts))

"""Self-check violations, published by ``kvmeter serve``'s plausibility monitor
(:class:`kvmeter.serving.selfcheck.monitor.SelfCheckMonitor`) for every request whose numbers
cannot be true: faster than physics allows, more cached than input tokens, more used than reserved.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SelfCheckViolation", "VIOLATION_CHECKS"]

#: The per-request checks (the ``check`` field); each is a ``kvmeter_selfcheck_*`` counter.
VIOLATION_CHECKS = ("ttft_below_floor", "output_above_roofline", "cached_over_input", "reservation_exceeded")


@dataclass(frozen=True, slots=True)
class SelfCheckViolation:
    """One request that failed a plausibility check.

    Attributes:
        check: one of :data:`VIOLATION_CHECKS`.
        tier: the request's tier (``""`` when the producer does not know it).
        value: what was measured, in the check's unit: TTFT seconds, output tokens per second,
            cached input tokens, or tokens used.
        bound: the bound it broke, same unit: the TTFT floor, the roofline, the input tokens, or
            the tokens reserved (times the allowed ratio for input).
        view: where the numbers came from: ``gateway`` (RequestCompletion), ``engine``
            (EngineRequestStats) or ``quota`` (ReservationDrift); for ``reservation_exceeded``
            the token type (``input``, ``output``).
        wall_ts: wall-clock epoch seconds.
    """

    check: str
    tier: str
    value: float
    bound: float
    view: str = "gateway"
    wall_ts: float = 0.0

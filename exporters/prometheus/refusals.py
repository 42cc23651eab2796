"""Refusal metrics from the gateway's :class:`~kvmeter.stats.RequestRefused`:
requests answered with an error before any admission decision, by HTTP status and error code.

Both labels come from fixed sets, never from request text: ``status`` is the answered status
(``400``–``599``, anything else ``other``), ``code`` one of the gateway's
:data:`~kvmeter.stats.REFUSAL_CODES` (a code outside it ``other``, no code
``none``). Refusals by the quota or the scheduler are counted by :mod:`.admission` instead.
"""

from __future__ import annotations

from kvmeter.bus import StatsBus
from kvmeter.stats import REFUSAL_CODES, RequestRefused

from .base import MetricSource, SourceContext

__all__ = ["RefusalMetrics", "refusal_labels"]


def refusal_labels(r: RequestRefused) -> tuple[str, str]:
    """The ``(status, code)`` label values of ``r``, bounded as the module docstring says."""
    status = str(r.status_code) if type(r.status_code) is int and 400 <= r.status_code <= 599 else "other"
    code = "none" if not r.code else r.code if r.code in REFUSAL_CODES else "other"
    return status, code


class RefusalMetrics(MetricSource):
    """Maps :class:`RequestRefused` to ``kvmeter_gateway_refused_requests_total``."""

    def __init__(self, ctx: SourceContext) -> None:
        super().__init__(ctx)
        self.refused = self.metric("kvmeter_gateway_refused_requests_total")

    def attach(self, bus: StatsBus):
        return [bus.subscribe(RequestRefused, self.on_refused)]

    def on_refused(self, r: RequestRefused) -> None:
        self.refused.labels(*refusal_labels(r)).inc()

"""The checks ``kvmeter check`` runs on a running serve's ``/metrics`` page, one line each.

What it reads: the Prometheus exposition of one ``kvmeter serve`` (``--server URL`` →
``URL/metrics``), nothing else — the continuous checks run inside serve (its
:class:`~.monitor.SelfCheckMonitor` and periodic reconciliation), so their counters and gauges on
that page are the whole record since the process started; the ledger is read by serve's
reconciliation, whose result is on the page too (``kvmeter billing reconcile`` reconciles a
period on demand). Each check here has the alert of the same meaning in
``exporters/prometheus/rules/`` (:attr:`Check.alert`); the alerts judge a recent window
(``increase(...[15m])``), ``kvmeter check`` the process's lifetime totals.

=====================  ======================================================================
check                  fails when
=====================  ======================================================================
ttft_floor             a request's TTFT was below its physical floor (any)
ttft_samples           fewer TTFT samples than streams that ended ok with output
output_roofline        a stream was decoded faster than the roofline (any)
cached_input           a request had more cached than input tokens (any view)
reservation            a request used more tokens than reserved (any type)
reconciliation         the last reconciliation's unexplained drift > 0.1 % (either view), or
                       none finished for 2 h (from the last run, or the process start)
spool_age              the oldest spooled usage event is older than 300 s
=====================  ======================================================================

A check whose series the page does not have (an older serve, a ledger not open yet) is reported
``SKIP`` and does not fail.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Check", "CheckResult", "CHECKS", "Samples", "parse_exposition", "run_checks",
           "RECONCILIATION_DRIFT_MAX_RATIO", "RECONCILIATION_STALE_S", "SPOOL_AGE_MAX_S"]

#: the thresholds, shared with the alert rules (a test compares them)
RECONCILIATION_DRIFT_MAX_RATIO = 0.001
RECONCILIATION_STALE_S = 7200.0
SPOOL_AGE_MAX_S = 300.0


class Samples:
    """The samples of one exposition: name → list of (labels, value)."""

    def __init__(self, by_name: Mapping[str, list[tuple[dict[str, str], float]]]) -> None:
        self._by_name = dict(by_name)

    def has(self, name: str) -> bool:
        return name in self._by_name

    def total(self, name: str) -> float | None:
        """The sum over every series of ``name``, or ``None`` when there is none."""
        rows = self._by_name.get(name)
        return None if rows is None else sum(v for _, v in rows)

    def maximum(self, name: str) -> float | None:
        rows = self._by_name.get(name)
        return None if not rows else max(v for _, v in rows)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, value in self._by_name.get(name, ()):
            out[labels.get(label, "")] += value
        return dict(out)


def parse_exposition(text: str) -> Samples:
    """Parse the Prometheus text exposition (prometheus-client's parser).

    Raises:
        ValueError: on text that is not an exposition.
    """
    by_name: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            by_name[sample.name].append((dict(sample.labels), float(sample.value)))
    return Samples(by_name)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One line of ``kvmeter check``: ``status`` is ``PASS``, ``FAIL`` or ``SKIP``."""

    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<15} {self.detail}"


@dataclass(frozen=True, slots=True)
class Check:
    """A named check: what it reads, the alert of the same meaning, how it judges."""

    name: str
    metrics: tuple[str, ...]
    alert: str
    judge: Callable[[Samples, float], CheckResult]


def _count_check(name: str, metric: str, what: str) -> Callable[[Samples, float], CheckResult]:
    def judge(s: Samples, now: float) -> CheckResult:
        total = s.total(metric)
        if total is None:
            return CheckResult(name, "SKIP", f"no {metric} on the page")
        return CheckResult(name, "FAIL" if total > 0 else "PASS", f"{total:g} {what} since start")
    return judge


def _ttft_samples(s: Samples, now: float) -> CheckResult:
    streams = s.total("kvmeter_selfcheck_streamed_ok_requests_total")
    if streams is None and not s.has("kvmeter_request_ttft_seconds_count"):
        return CheckResult("ttft_samples", "SKIP", "no streamed request yet")
    samples = s.total("kvmeter_request_ttft_seconds_count") or 0.0
    streams = streams or 0.0
    ok = samples >= streams
    return CheckResult("ttft_samples", "PASS" if ok else "FAIL",
                       f"{samples:g} TTFT samples for {streams:g} streams that ended ok with output")


def _reconciliation(s: Samples, now: float) -> CheckResult:
    drift = s.by_label("kvmeter_reconciliation_drift_ratio", "view")
    last = s.maximum("kvmeter_reconciliation_last_run_timestamp_seconds")
    if last is None:
        return CheckResult("reconciliation", "SKIP", "no reconciliation series on the page")
    since = last if last > 0 else (s.maximum("process_start_time_seconds") or now)
    problems = [f"{view} drift {ratio:.4%}" for view, ratio in sorted(drift.items())
                if ratio > RECONCILIATION_DRIFT_MAX_RATIO]
    age = now - since
    if age > RECONCILIATION_STALE_S:
        problems.append(f"none finished for {age:.0f} s" if last > 0 else f"none finished in {age:.0f} s since start")
    if problems:
        return CheckResult("reconciliation", "FAIL", "; ".join(problems))
    if last <= 0:
        return CheckResult("reconciliation", "PASS", "no run finished yet (the first comes after start)")
    views = ", ".join(f"{v} {r:.4%}" for v, r in sorted(drift.items()))
    return CheckResult("reconciliation", "PASS", f"last run {age:.0f} s ago, drift {views}")


def _spool_age(s: Samples, now: float) -> CheckResult:
    age = s.maximum("kvmeter_ledger_spool_oldest_age_seconds")
    if age is None:
        return CheckResult("spool_age", "SKIP", "no spool series on the page")
    return CheckResult("spool_age", "FAIL" if age > SPOOL_AGE_MAX_S else "PASS",
                       f"oldest spooled event {age:.0f} s old (bound {SPOOL_AGE_MAX_S:.0f} s)")


CHECKS: tuple[Check, ...] = (
    Check("ttft_floor", ("kvmeter_selfcheck_ttft_below_floor_requests_total",), "KvmeterTtftBelowPhysicalFloor",
          _count_check("ttft_floor", "kvmeter_selfcheck_ttft_below_floor_requests_total",
                       "requests with a TTFT below the physical floor")),
    Check("ttft_samples", ("kvmeter_request_ttft_seconds_count", "kvmeter_selfcheck_streamed_ok_requests_total"),
          "KvmeterTtftSamplesMissing", _ttft_samples),
    Check("output_roofline", ("kvmeter_selfcheck_output_above_roofline_requests_total",),
          "KvmeterOutputAboveRoofline",
          _count_check("output_roofline", "kvmeter_selfcheck_output_above_roofline_requests_total",
                       "streams decoded faster than the roofline")),
    Check("cached_input", ("kvmeter_selfcheck_cached_over_input_requests_total",), "KvmeterCachedOverInput",
          _count_check("cached_input", "kvmeter_selfcheck_cached_over_input_requests_total",
                       "requests with more cached than input tokens")),
    Check("reservation", ("kvmeter_selfcheck_reservation_exceeded_requests_total",), "KvmeterReservationExceeded",
          _count_check("reservation", "kvmeter_selfcheck_reservation_exceeded_requests_total",
                       "requests that used more tokens than reserved")),
    Check("reconciliation", ("kvmeter_reconciliation_drift_ratio", "kvmeter_reconciliation_last_run_timestamp_seconds"),
          "KvmeterReconciliationDrift", _reconciliation),
    Check("spool_age", ("kvmeter_ledger_spool_oldest_age_seconds",), "KvmeterLedgerSpoolLag", _spool_age),
)


def run_checks(samples: Samples, now: float) -> list[CheckResult]:
    """Every check of :data:`CHECKS` on one page's samples; ``now`` is wall-clock epoch seconds."""
    return [check.judge(samples, now) for check in CHECKS]

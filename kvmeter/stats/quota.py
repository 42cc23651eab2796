"""Stats of the quota: reservation drift at reconciliation, the shared store's health,
Idempotency-Key attempts and agent-run tool-call reports.

Admission decisions themselves are :class:`~kvmeter.stats.gateway.AdmissionDecision` (admitted, or
rejected with level / dimension / reason / status). The types below add what is specific to quota.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from kvmeter.attribution import Attribution

__all__ = ["ReservationDrift", "QuotaStoreState", "IdempotencyAttempt", "ToolCallReported"]


@dataclass(slots=True)
class ReservationDrift:
    """Reservation vs engine-true actual of one reconciled request, per dimension.

    Published three times per reconciliation: ``dimension`` is ``input_tokens``,
    ``output_tokens`` (units: tokens, ints) or ``cost`` (units: pricing currency, Decimal).
    ``actual - reserved`` is the drift: ≤ 0 for output (reserved at ``max_tokens``), ≈ 0 for input,
    ≤ 0 for cost (reserved without cache discounts, at ``max_tokens``).

    Attributes:
        attribution: the reconciled request's.
        dimension: ``input_tokens``, ``output_tokens`` or ``cost``.
        reserved, actual: amounts in the dimension's unit.
        outcome: ``ran`` (the engine did work) or ``released`` (nothing ran: all given back).
        wall_ts: wall-clock epoch seconds.
    """

    attribution: Attribution
    dimension: str
    reserved: int | Decimal
    actual: int | Decimal
    outcome: str = "ran"
    wall_ts: float = 0.0


@dataclass(slots=True)
class QuotaStoreState:
    """The shared quota store became unreachable (``degraded``) or reachable again.

    Attributes:
        store: the shared store's name (``redis``).
        degraded: True while admission runs on the outage policy (local limits / fail closed).
        reason: the error that caused it, or ``recovered``.
        pending_settles: reconciliations queued for replay.
        wall_ts: wall-clock epoch seconds.
    """

    store: str
    degraded: bool
    reason: str = ""
    pending_settles: int = 0
    wall_ts: float = 0.0


@dataclass(slots=True)
class IdempotencyAttempt:
    """One attempt of a request that carried an ``Idempotency-Key``.

    Attributes:
        tenant_id: the tenant the key is scoped to.
        outcome: ``first`` (this attempt runs), ``joined`` (waited for a running first attempt and
            got its result), ``replayed`` (got the stored result of a finished attempt),
            ``conflict`` (same key, different request body: refused), ``in_progress`` (gave up
            waiting for the running attempt: refused).
        attempt: which attempt of the logical request did the work this answer comes from (1 for
            the first; a retry after an abandoned attempt counts up).
        replayed: True when the answer was not produced by this attempt (never billed again).
        wall_ts: wall-clock epoch seconds.
    """

    tenant_id: str
    outcome: str
    attempt: int
    replayed: bool
    wall_ts: float = 0.0


@dataclass(slots=True)
class ToolCallReported:
    """Tool calls reported for an agent run.

    Attributes:
        attribution: the reporting key's, with the run's ``agent_run_id`` and the endpoint
            ``agent_runs.tool_calls``.
        tool_calls: the run's total after this report.
        max_tool_calls: the run's budget, or None.
        exceeded: True if the total is over the budget (the run's next model call is refused).
        wall_ts: wall-clock epoch seconds.
    """

    attribution: Attribution
    tool_calls: int
    max_tool_calls: int | None
    exceeded: bool
    wall_ts: float = 0.0

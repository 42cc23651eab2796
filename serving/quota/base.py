"""The quota boundary: estimate → reserve → admit (or reject early) → reconcile.

The gateway calls, per request, after authentication and tokenization and before any engine work::

    reservation = await quota.reserve(principal, estimate)   # raises QuotaRejected
    try:
        ... schedule and run ...
    finally:
        await quota.reconcile(reservation, actual)           # engine-true TokenCounts; releases the rest

``reconcile`` with :data:`~kvmeter.tokens.NO_TOKENS` is how a failure before any engine work
releases everything.
:class:`UnlimitedQuota` admits everything and is the default until limits are configured;
:class:`kvmeter.serving.quota.gate.HierarchicalQuota` is the real implementation.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from decimal import Decimal

from kvmeter.attribution import Attribution
from kvmeter.errors import Refusal
from kvmeter.serving.tenancy.principal import Principal
from kvmeter.tokens import NO_TOKENS, TokenCounts

__all__ = ["UsageEstimate", "Reservation", "QuotaRejected", "QuotaGate", "UnlimitedQuota"]


@dataclass(slots=True, frozen=True)
class UsageEstimate:
    """What admission knows before the engine runs.

    Attributes:
        attribution: the request's (its ``model`` is priced, its ``agent_run_id`` selects the run
            budget, ``""`` for none).
        tokens: ``input_tokens`` counted with the model's tokenizer after the chat template and
            ``output_tokens`` = the output reservation (the request's ``max_tokens``); the parts
            (cached, reasoning) are unknown before the engine runs and left 0.
        request_id: kvmeter request id.
        attempt: which attempt of the logical request this is (1 = first; the idempotency
            manager's ``IdempotencyTicket.attempt``); an attempt > 1 counts against an agent
            run's ``max_retries``.
        sequence: the longest single sequence of the request — one prompt's ``input_tokens`` and
            its ``output_tokens`` ceiling (``max_tokens``), the prompt + ceiling pair with the
            largest sum — which is what ``max_context_tokens`` limits (a request with ``n``
            choices or several prompts reserves all of them in ``tokens``, but each sequence
            lives in its own context). ``None``: ``tokens`` is one sequence.
    """

    attribution: Attribution
    tokens: TokenCounts
    request_id: str = ""
    attempt: int = 1
    sequence: TokenCounts | None = None


@dataclass(slots=True)
class Reservation:
    """An admitted request's hold on every level and dimension.

    Attributes:
        request_id: kvmeter request id.
        reserved: what was held (``input_tokens``, ``output_tokens``).
        reserved_cost: money held (Decimal, pricing currency), ``Decimal(0)`` if unpriced.
        headers: response headers to send (``x-ratelimit-*``).
        handle: implementation-specific state (keys, amounts) needed to reconcile.
    """

    request_id: str
    reserved: TokenCounts = NO_TOKENS
    reserved_cost: Decimal = Decimal(0)
    headers: dict[str, str] = field(default_factory=dict)
    handle: object = None


class QuotaRejected(Refusal):
    """Admission refused before the engine is touched (a :class:`~kvmeter.errors.Refusal`).

    Attributes:
        status_code: 429 (rate/concurrency/KV/run budget), 402 (spend budget exhausted; see the
            quota package docs), 400 (context length over the node's limit, or a request that
            alone exceeds a limit: ``request_exceeds_limit``, never retried by OpenAI's SDKs),
            503 (store down).
        code: machine-readable reason, e.g. ``rate_limited``, ``spend_exhausted``,
            ``context_length_exceeded``, ``run_budget_exceeded`` (also readable as ``reason``,
            the word the admission decisions use).
        level: the principal level that bound (``org``, ``workspace``, ``project``, ``api_key``,
            ``agent_run``).
        dimension: the dimension that bound (``requests_per_minute``, ``input_tokens_per_minute``,
            ``output_tokens_per_minute``, ``concurrent_requests``, ``max_context_tokens``,
            ``active_kv_tokens``, ``spend_per_day``, ``spend_per_month``, ...).
        retry_after_s: seconds until the binding limit has refilled enough, or ``None``.
        headers: extra response headers (``Retry-After``, ``x-ratelimit-*``).
    The error body names ``level`` and ``dimension`` (:meth:`body_fields`).
    """

    status_code = 429
    code = "rate_limited"

    def __init__(self, message: str, *, status_code: int = 429, reason: str = "rate_limited",
                 level: str = "", dimension: str = "", retry_after_s: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message, status_code=status_code, code=reason, retry_after_s=retry_after_s,
                         level=level, dimension=dimension, headers=headers)

    @property
    def reason(self) -> str:
        """The same as :attr:`code`."""
        return self.code or ""

    def body_fields(self) -> dict[str, str]:
        return {"level": self.level, "dimension": self.dimension}


class QuotaGate(abc.ABC):
    """Admission against quotas."""

    @abc.abstractmethod
    async def reserve(self, principal: Principal, estimate: UsageEstimate) -> Reservation:
        """Reserve the estimate on every level and dimension, all or nothing.

        Raises:
            QuotaRejected: some limit would be exceeded; nothing is held.
        """

    @abc.abstractmethod
    async def reconcile(self, reservation: Reservation, actual: TokenCounts) -> None:
        """Replace the reservation with the engine-true ``actual`` counts and release the rest.
        Never raises into the serving path (failures are logged and published on the bus)."""

    def context_limit(self, principal: Principal, agent_run_id: str = "") -> int | None:
        """Tightest ``max_context_tokens`` (prompt + ``max_tokens`` of one sequence) the caller may
        ask for, or None (no quota limit). The gateway bounds the output reservation of a request without
        ``max_tokens`` by it. The default has none."""
        return None


class UnlimitedQuota(QuotaGate):
    """Admits everything; counts what it saw (for tests and the no-limits default)."""

    def __init__(self) -> None:
        self.reserved = 0
        self.reconciled = 0

    async def reserve(self, principal: Principal, estimate: UsageEstimate) -> Reservation:
        self.reserved += 1
        return Reservation(request_id=estimate.request_id, reserved=estimate.tokens)

    async def reconcile(self, reservation: Reservation, actual: TokenCounts) -> None:
        self.reconciled += 1

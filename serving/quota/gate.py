"""Hierarchical, multi-dimensional admission: estimate → reserve → admit (or reject early) → reconcile.

:class:`HierarchicalQuota` implements :class:`~kvmeter.serving.quota.base.QuotaGate`. Per request
the gateway, after authentication and tokenization and before any engine work, calls::

    estimate = UsageEstimate(attribution, TokenCounts(input_tokens=n, output_tokens=max_tokens),
                             request_id, attempt)
    reservation = await quota.reserve(principal, estimate)
    # raises QuotaRejected → answer e.status_code with e.headers and a body naming
    # e.reason / e.level / e.dimension; nothing is held
    try:
        ... schedule, run, stream (send reservation.headers with the response) ...
    finally:
        await quota.reconcile(reservation, actual)  # engine-true TokenCounts; never raises

What one reservation holds, on every level of the key's chain (global → org → workspace → project
→ api_key, plus the agent run when the call names one) and every limited dimension, all or nothing:

===========================  ==================================  ================================
dimension                    reserved                            at reconciliation
===========================  ==================================  ================================
requests_per_minute          1                                   kept (given back if nothing ran)
input_tokens_per_minute      input tokens                        moved to the engine's input count
output_tokens_per_minute     ``max_tokens``                      moved to the engine's output count
concurrent_requests          1                                   released
active_kv_tokens             input + ``max_tokens``              released
spend_per_day / _per_month   cost(input, max_tokens), dearest    moved to cost(actual counts)
agent run: model_calls       1                                   kept
agent run: retries           1 if ``attempt`` > 1                kept
agent run: parallel_branches 1                                   released
agent run: cost              as spend                            moved to actual cost
agent run: tool_calls        checked only (reported separately)  —
agent run: runtime_seconds   checked only (clock starts at the   —
                             run's first model call)
===========================  ==================================  ================================

Rejections (:class:`~kvmeter.serving.quota.base.QuotaRejected`):

* **429** ``rate_limited`` — a ``*_per_minute`` limit. ``Retry-After`` is when the binding GCRA
  bucket will have refilled enough for this very request (see :mod:`.gcra`), with the
  ``x-ratelimit-*`` headers of that limit.
* **429** ``concurrency_limited`` / ``kv_budget_exceeded`` — ``concurrent_requests`` /
  ``active_kv_tokens``. Nothing refills these; ``Retry-After`` is an estimate by Little's law:
  the node's holds end at about ``held / D`` per second, ``D`` being the moving average of this
  gate's reservation lifetimes, so ``retry ≈ D · (held + asked − limit) / held``.
* **400** ``request_exceeds_limit`` — the request alone exceeds a limit (``max_tokens`` above an
  output-tokens-per-minute limit, a reserved cost above the whole ``spend_per_day`` cap, ...): it
  can never fit, so waiting cannot help; no ``Retry-After``. 400, not 429: OpenAI's SDKs retry
  408, 409, 429 and every 5xx, so a 429 would be retried until the client's retry budget ran out.
  Over only this replica's share of a limit while the shared store is down (see :mod:`.failover`)
  it may fit once the store is back: **503** ``quota_store_unavailable`` with ``Retry-After``.
* **402** ``spend_exhausted`` — a ``spend_per_day`` / ``spend_per_month`` budget cannot hold the
  request's reserved cost. 402 (not 429) because retrying soon cannot help and OpenAI-compatible
  SDKs retry 429s automatically; ``Retry-After`` is the time to the start of the next UTC day /
  month. ``spend_status_code=429`` selects OpenAI's own convention (429 ``insufficient_quota``).
* **429** ``run_budget_exceeded`` (level ``agent_run``) — a run budget (model calls, tool calls,
  runtime, cost, retries, parallel branches). Only ``parallel_branches`` gets a ``Retry-After``;
  every other one carries ``x-should-retry: false`` (a spent budget is not given back by waiting,
  and OpenAI's SDKs would otherwise retry the 429 twice by default).
  A run's own 7-dimension limits (``agent_run_limits``) answer like any level's limits
  (``rate_limited``, ``concurrency_limited``, ... with level ``agent_run``).
* **400** ``context_length_exceeded`` — one sequence's prompt + ``max_tokens`` (the estimate's
  ``sequence``: ``n`` choices and several prompts are not summed) over the tightest
  ``max_context_tokens`` of the chain (refused, never truncated); ``invalid_request`` for
  malformed estimates or run ids.
* **401** ``invalid_api_key`` — the key was removed by a config reload after authentication.
* **503** ``quota_store_unavailable`` — the shared store is down and the dimension fails closed
  (see :mod:`.failover`), or the store failed unexpectedly.

Money is Decimal in and out; the store counts nano-units (see :mod:`.money`). Costs come from the
one price function, :meth:`kvmeter.ledger.prices.PriceList.cost` (``kvmeter serve`` passes it as
``price``): the reservation holds the dearest cost the request can turn out to have (no cache
discount, the whole ``max_tokens`` at the dearer of the output and reasoning prices), and
reconciliation moves it to the cost of the engine-true counts, reasoning tokens at their price.

Why this module is longer than ~600 lines: reserve, reconcile and release are one all-or-nothing
transaction over the same chain of levels × dimensions; kept together, the invariant "a
reservation is held on every level or on none" is checked in one place. The stores (memory,
Redis), the GCRA arithmetic, the plan of limits and the idempotency store already live in their
own modules beside it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Sequence

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import SYSTEM_CLOCK, Clock
from kvmeter.errors import NO_RETRY_HEADERS
from kvmeter.money import format_money
from kvmeter.serving.quota.base import QuotaGate, QuotaRejected, Reservation, UsageEstimate
from kvmeter.serving.quota.headers import rate_item_headers, ratelimit_headers, retry_after_headers
from kvmeter.serving.quota.memory import MemoryQuotaStore
from kvmeter.serving.quota.money import from_units, to_units
from kvmeter.serving.quota.plan import (
    DEADLINE,
    RATE,
    RUN_TTL_S,
    SETTLE_RELEASE,
    SRC_KV,
    SRC_OUTPUT,
    SRC_INPUT,
    SRC_RETRY,
    PlanItem,
    QuotaPlan,
    build_plan,
    period_end_s,
)
from kvmeter.serving.quota.store import QuotaStore, ReserveResult, StoreUnavailable
from kvmeter.serving.tenancy.directory import TenantDirectory
from kvmeter.serving.tenancy.limits import RUN_DIMENSIONS
from kvmeter.serving.tenancy.principal import Principal
from kvmeter.stats import AdmissionDecision, ReservationDrift, ToolCallReported
from kvmeter.tokens import TokenCounts

__all__ = ["HierarchicalQuota", "PriceFn", "ToolCallReport", "RunUsage", "MAX_RUN_ID_CHARS"]

log = logging.getLogger(__name__)

#: ``price(model, tier, tokens) -> Decimal`` in the pricing currency: the ledger's price function
#: :meth:`kvmeter.ledger.prices.PriceList.cost`. Must raise (any exception) for an unknown model.
PriceFn = Callable[[str, str, TokenCounts], Decimal]

#: Longest accepted agent run id.
MAX_RUN_ID_CHARS = 256

_EWMA_ALPHA = 0.05


@dataclass(slots=True)
class _Hold:
    """What a reservation holds (``Reservation.handle``); everything reconcile needs, independent
    of later config reloads."""

    items: Sequence[PlanItem]
    keys: Sequence[bytes]
    src: tuple[int, ...]
    token: Any
    reserved_cost: Decimal
    started_mono: float
    principal: Principal
    attribution: Attribution
    settled: bool = False


@dataclass(frozen=True, slots=True)
class ToolCallReport:
    """Answer to :meth:`HierarchicalQuota.report_tool_call`.

    Attributes:
        agent_run_id: the run.
        tool_calls: the run's reported tool calls so far (this report included).
        max_tool_calls: the run's budget, or None.
        exceeded: True if ``tool_calls > max_tool_calls``: the run's next model call is refused.
    """

    agent_run_id: str
    tool_calls: int
    max_tool_calls: int | None
    exceeded: bool


@dataclass(frozen=True, slots=True)
class RunUsage:
    """An agent run's counters (None = not tracked: no budget set for it).

    Attributes:
        model_calls, tool_calls, retries: counts so far.
        parallel_branches: model calls in flight now.
        cost: money held or spent (Decimal, pricing currency).
        started_wall: wall-clock epoch seconds of the run's first model call.
    """

    agent_run_id: str
    model_calls: int | None
    tool_calls: int | None
    retries: int | None
    parallel_branches: int | None
    cost: Decimal | None
    started_wall: float | None


def _bad_int(v: object) -> bool:
    return not isinstance(v, int) or isinstance(v, bool) or v < 0


class HierarchicalQuota(QuotaGate):
    """Quota admission over a :class:`TenantDirectory` (see module docstring).

    Args:
        directory: principals, tiers and limits (reloadable).
        store: counters; default a fresh :class:`MemoryQuotaStore`. For several replicas use a
            ``FailoverQuotaStore(RedisQuotaStore(...))``.
        price: the price function (see :data:`PriceFn`); required when any spend / run cost limit
            is configured.
        clock: injected clock (wall seconds drive the store; monotonic times reservation life).
        bus: where :class:`~kvmeter.stats.AdmissionDecision`, :class:`ReservationDrift` and
            :class:`ToolCallReported` go (optional).
        spend_status_code: 402 (default) or 429 for an exhausted spend budget.
        default_hold_s: reservation lifetime assumed before any was observed (> 0), for the
            concurrency / KV ``Retry-After`` estimate.
        publish_decisions: publish :class:`~kvmeter.stats.AdmissionDecision` for each reserve
            (set False when the gateway publishes its own decisions, to avoid counting twice).
    Raises:
        ValueError: spend limits configured without ``price``; bad ``spend_status_code`` or
            ``default_hold_s``.
    """

    def __init__(self, directory: TenantDirectory, store: QuotaStore | None = None, *,
                 price: PriceFn | None = None, clock: Clock = SYSTEM_CLOCK, bus: StatsBus | None = None,
                 spend_status_code: int = 402, default_hold_s: float = 1.0,
                 publish_decisions: bool = True) -> None:
        if spend_status_code not in (402, 429):
            raise ValueError(f"spend_status_code must be 402 or 429, got {spend_status_code}")
        if default_hold_s <= 0:
            raise ValueError(f"default_hold_s must be > 0, got {default_hold_s}")
        if price is None and directory.snapshot.has_spend_limits:
            raise ValueError("the tenancy config limits spend (spend_per_day / spend_per_month / "
                             "run_budget.max_cost) but no price function was given")
        self._directory = directory
        self._store = store if store is not None else MemoryQuotaStore()
        self._price = price
        self._clock = clock
        self._bus = bus
        self._decisions = publish_decisions
        self.spend_status_code = spend_status_code
        self._hold_s = default_hold_s
        self._plans: dict[str, QuotaPlan] = {}
        self._plans_version = -1
        self._warned_unpriced_version = -1
        self.reconcile_errors = 0

    @property
    def store(self) -> QuotaStore:
        """The counter store."""
        return self._store

    @property
    def directory(self) -> TenantDirectory:
        """The tenant directory."""
        return self._directory

    # -- plans -------------------------------------------------------------------------------

    def _plan(self, principal: Principal) -> QuotaPlan:
        snap = self._directory.snapshot
        if snap.version != self._plans_version:
            self._plans = {}
            self._plans_version = snap.version
            if self._price is None and snap.has_spend_limits and self._warned_unpriced_version != snap.version:
                self._warned_unpriced_version = snap.version
                log.error("tenancy config version %d limits spend but the quota gate has no price "
                          "function: spend is counted as 0", snap.version)
        plan = self._plans.get(principal.api_key_id)
        if plan is None:
            entry = snap.keys.get(principal.api_key_id)
            if entry is None or entry.principal.tenant_id != principal.tenant_id:
                raise QuotaRejected("API key is no longer configured", status_code=401,
                                    reason="invalid_api_key", level="api_key")
            plan = build_plan(entry, self._store.key_prefix)
            self._plans[principal.api_key_id] = plan
        return plan

    def context_limit(self, principal: Principal, agent_run_id: str = "") -> int | None:
        """Tightest ``max_context_tokens`` (prompt + ``max_tokens`` of one sequence) for this
        caller, or None.

        The gateway uses it to choose a bounded output reservation when a request omits
        ``max_tokens``: ``min(engine max length, this) − input tokens``.
        """
        plan = self._plan(principal)
        ctx = plan.max_context_tokens
        if agent_run_id and plan.run_max_context_tokens is not None:
            ctx = plan.run_max_context_tokens if ctx is None else min(ctx, plan.run_max_context_tokens)
        return ctx

    # -- reserve -----------------------------------------------------------------------------

    def _price_of(self, model: str, tier: str, tokens: TokenCounts) -> Decimal:
        assert self._price is not None
        value = self._price(model, tier, tokens)
        if not isinstance(value, Decimal) or not value.is_finite() or value < 0:
            raise TypeError(f"price function returned {value!r}; need a finite Decimal >= 0")
        return value

    def _reserved_cost(self, model: str, tier: str, tokens: TokenCounts) -> Decimal:
        """The most ``tokens`` can cost: nothing from the prefix cache, and the output reservation
        all plain output or all reasoning, whichever the price list prices dearer (the price is
        linear in the split, so one of the two ends is the maximum)."""
        plain = self._price_of(model, tier, tokens)
        reasoning = self._price_of(model, tier, TokenCounts(input_tokens=tokens.input_tokens,
                                                            output_tokens=tokens.output_tokens,
                                                            reasoning_tokens=tokens.output_tokens))
        return max(plain, reasoning)

    async def reserve(self, principal: Principal, estimate: UsageEstimate) -> Reservation:
        """Reserve ``estimate`` on every level and dimension, all or nothing.

        Args:
            principal: from the directory's ``authenticate``.
            estimate: the attribution (model, run id), the tokens (input after the chat
                template, ``max_tokens`` as output), request id, attempt.
        Returns:
            The :class:`Reservation` (``headers``: ``x-ratelimit-*`` to send; ``reserved_cost``:
            Decimal).
        Raises:
            QuotaRejected: see the module docstring; nothing is held.
            TypeError: ``principal`` is not a :class:`Principal`.
        """
        if not isinstance(principal, Principal):
            raise TypeError(f"reserve() needs a Principal, got {type(principal).__name__}")
        attribution = estimate.attribution
        try:
            plan = self._plan(principal)
        except QuotaRejected as e:
            raise self._reject(attribution, e) from None
        tier = plan.entry.principal.tier  # the live tier (a reload may have changed it)
        seq = estimate.tokens if estimate.sequence is None else estimate.sequence
        if (type(estimate.tokens) is not TokenCounts or type(seq) is not TokenCounts
                or _bad_int(estimate.attempt) or estimate.attempt < 1):
            raise self._reject(attribution, QuotaRejected(
                "the estimate needs TokenCounts and an attempt >= 1", status_code=400, reason="invalid_request"))
        p, m = estimate.tokens.input_tokens, estimate.tokens.output_tokens
        run_id = attribution.agent_run_id
        if run_id and (not isinstance(run_id, str) or len(run_id) > MAX_RUN_ID_CHARS
                       or not run_id.isprintable() or any(c.isspace() for c in run_id)):
            raise self._reject(attribution, QuotaRejected(
                f"agent run id must be 1-{MAX_RUN_ID_CHARS} printable characters without spaces",
                status_code=400, reason="invalid_request", level="agent_run"))

        ctx, ctx_level = plan.max_context_tokens, plan.max_context_level
        if run_id and plan.run_max_context_tokens is not None and (ctx is None or plan.run_max_context_tokens < ctx):
            ctx, ctx_level = plan.run_max_context_tokens, "agent_run"
        # per sequence (one prompt + its max_tokens): n choices or several prompts each have
        # their own context; every sequence is still reserved below
        sp, sm = seq.input_tokens, seq.output_tokens
        if ctx is not None and sp + sm > ctx:
            what = (f"the prompt has {sp} tokens" if sp > ctx
                    else f"you requested {sp + sm} tokens ({sp} in the prompt, {sm} for the completion)")
            raise self._reject(attribution, QuotaRejected(
                f"This request exceeds the maximum context length of {ctx} tokens at the {ctx_level} "
                f"level: {what}. Shorten the prompt or lower max_tokens.",
                status_code=400, reason="context_length_exceeded", level=ctx_level,
                dimension="max_context_tokens"))

        cost = Decimal(0)
        if self._price is not None:
            try:
                cost = self._reserved_cost(attribution.model, tier, TokenCounts(input_tokens=p, output_tokens=m))
            except Exception as e:  # noqa: BLE001 — an unpriced model is the caller's error
                raise self._reject(attribution, QuotaRejected(
                    f"no price for model {attribution.model!r}: {e}", status_code=400,
                    reason="unpriced_model", dimension="spend")) from None
        units = to_units(cost) if cost else 0
        src = (1, p, m, p + m, units, 0, 1 if estimate.attempt > 1 else 0)

        wall = self._clock.wall()
        items: Sequence[PlanItem] = plan.items
        keys = plan.keys(wall)
        if run_id:
            items = plan.items + plan.run_items
            keys = keys + plan.run_keys(run_id)
            self._check_fits(attribution, items, src, plan.run_min_limit)
        self._check_fits(attribution, plan.items, src, plan.min_limit)

        try:
            res = await self._store.reserve(items, keys, src, wall)
        except StoreUnavailable as e:
            raise self._reject(attribution, QuotaRejected(
                f"quota store unavailable: {e}", status_code=503, reason="quota_store_unavailable",
                retry_after_s=1.0, headers=retry_after_headers(1.0))) from None
        except Exception:  # noqa: BLE001 — never crash the serving path
            log.exception("quota store failed during reserve")
            raise self._reject(attribution, QuotaRejected(
                "quota store error", status_code=503, reason="quota_store_unavailable",
                retry_after_s=1.0, headers=retry_after_headers(1.0))) from None
        if not res.admitted:
            raise self._reject(attribution, self._rejection(res.item or items[res.index], res, src, wall))

        headers = ratelimit_headers(items, res.states, res.now)
        hold = _Hold(items, keys, src, res.token, cost, self._clock.monotonic(), plan.entry.principal,
                     attribution)
        bus = self._bus
        if bus is not None and self._decisions and bus.has_subscribers(AdmissionDecision):
            bus.publish(AdmissionDecision(attribution=attribution, admitted=True, wall_ts=wall))
        return Reservation(request_id=estimate.request_id, reserved=TokenCounts(input_tokens=p, output_tokens=m),
                           reserved_cost=cost, headers=headers, handle=hold)

    def _check_fits(self, attribution: Attribution, items: Sequence[PlanItem], src: tuple[int, ...],
                    mins: tuple[int | None, ...]) -> None:
        """Refuse at once a request that exceeds some limit on its own (it can never fit)."""
        for s, lim in enumerate(mins):
            if lim is not None and src[s] > lim:
                break
        else:
            return
        for it in items:
            if it.kind != DEADLINE and src[it.source] > it.limit:
                raise self._reject(attribution, self._too_large(it, src))

    @staticmethod
    def _too_large(it: PlanItem, src: tuple[int, ...]) -> QuotaRejected:
        if it.dimension in RUN_DIMENSIONS:
            return QuotaRejected(
                f"agent run budget {it.dimension} ({_fmt_limit(it)}) cannot hold this call",
                reason="run_budget_exceeded", level="agent_run", dimension=it.dimension)
        return QuotaRejected(
            f"request too large for the {it.dimension} limit at the {it.level} level: it needs "
            f"{_fmt_amount(it, src[it.source])}, the limit is {_fmt_limit(it)}. Lower max_tokens "
            "or shorten the prompt.", status_code=400, reason="request_exceeds_limit", level=it.level,
            dimension=it.dimension)

    def _rejection(self, it: PlanItem, res: ReserveResult, src: tuple[int, ...], wall: float) -> QuotaRejected:
        now = res.now or wall
        if not res.unavailable and it.kind != DEADLINE and src[it.source] > it.limit:
            # over this replica's share of a limit (failover): it may fit once the store is back
            return QuotaRejected(
                f"quota store unavailable and this request ({_fmt_amount(it, src[it.source])}) exceeds "
                f"this replica's share of the {it.dimension} limit at the {it.level} level ({_fmt_limit(it)})",
                status_code=503, reason="quota_store_unavailable", level=it.level, dimension=it.dimension,
                retry_after_s=1.0, headers=retry_after_headers(1.0))
        if res.unavailable:
            retry = res.retry_after_s
            return QuotaRejected(
                f"quota store unavailable and {it.dimension} fails closed at the {it.level} level",
                status_code=503, reason="quota_store_unavailable", level=it.level, dimension=it.dimension,
                retry_after_s=retry, headers=retry_after_headers(retry))
        if it.kind == RATE:
            retry = res.retry_after_s
            headers = retry_after_headers(retry)
            if res.value is not None:
                headers.update(rate_item_headers(it, float(res.value), now))
            return QuotaRejected(
                f"Rate limit reached for {it.dimension} at the {it.level} level: limit {it.limit} per "
                f"{it.period_s:g} s. Retry after {retry:.3f} s.", reason="rate_limited", level=it.level,
                dimension=it.dimension, retry_after_s=retry, headers=headers)
        if it.kind == DEADLINE:
            return QuotaRejected(
                f"agent run exceeded its maximum runtime of {it.period_s:g} s",
                reason="run_budget_exceeded", level="agent_run", dimension=it.dimension)
        held = int(res.value or 0)
        asked = src[it.source]
        if it.money and it.dimension not in RUN_DIMENSIONS:
            retry = period_end_s(wall, it.period, it.timezone)
            return QuotaRejected(
                f"{it.dimension} budget at the {it.level} level is exhausted: {_money(held)} of "
                f"{_money(it.limit)} spent or reserved, this request reserves {_money(asked)}.",
                status_code=self.spend_status_code, reason="spend_exhausted", level=it.level,
                dimension=it.dimension, retry_after_s=retry, headers=retry_after_headers(retry))
        if it.dimension in RUN_DIMENSIONS:
            retry = None
            if it.settle == SETTLE_RELEASE:
                retry = self._drain_estimate(held, asked, it.limit)
            return QuotaRejected(
                f"agent run budget exceeded: {it.dimension} is at {_fmt_amount(it, held)} of "
                f"{_fmt_limit(it)}", reason="run_budget_exceeded", level="agent_run", dimension=it.dimension,
                retry_after_s=retry, headers=retry_after_headers(retry))
        retry = self._drain_estimate(held, asked, it.limit)
        reason = "kv_budget_exceeded" if it.source == SRC_KV else "concurrency_limited"
        return QuotaRejected(
            f"{it.dimension} limit reached at the {it.level} level: {held} held, this request needs "
            f"{asked}, limit {it.limit}. Retry after about {retry:.3f} s.", reason=reason, level=it.level,
            dimension=it.dimension, retry_after_s=retry, headers=retry_after_headers(retry))

    def _drain_estimate(self, held: int, asked: int, limit: int) -> float:
        """Little's-law estimate of the wait until ``asked`` fits under ``limit`` (seconds)."""
        if held <= 0:
            return self._hold_s
        need = held + asked - limit
        return max(0.001, self._hold_s * need / held)

    def _reject(self, attribution: Attribution, err: QuotaRejected) -> QuotaRejected:
        bus = self._bus
        if bus is not None and self._decisions and bus.has_subscribers(AdmissionDecision):
            bus.publish(AdmissionDecision(attribution=attribution, admitted=False,
                                          reason=err.reason, level=err.level, dimension=err.dimension,
                                          status_code=err.status_code, wall_ts=self._clock.wall()))
        if err.level:
            err.headers.setdefault("x-kvmeter-quota-level", err.level)
        if err.dimension:
            err.headers.setdefault("x-kvmeter-quota-dimension", err.dimension)
        if err.reason == "run_budget_exceeded" and err.retry_after_s is None:
            # a spent run budget comes back by no wait (only parallel_branches, released as calls
            # end, has a Retry-After): the 429 is kept, and OpenAI's SDKs are told not to retry it
            for name, value in NO_RETRY_HEADERS.items():
                err.headers.setdefault(name, value)
        return err

    # -- reconcile ---------------------------------------------------------------------------

    async def reconcile(self, reservation: Reservation, actual: TokenCounts) -> None:
        """Move the reservation to the engine-true ``actual`` counts and release the rest.

        :data:`~kvmeter.tokens.NO_TOKENS` (all zero) means nothing ran: everything is given back (the request
        count too; agent-run call counters stay). Calling it twice for one reservation is a
        no-op the second time. Never raises: failures are logged and counted in
        :attr:`reconcile_errors` (a ``FailoverQuotaStore`` queues them for replay instead).
        """
        try:
            await self._reconcile(reservation, actual)
        except Exception:  # noqa: BLE001 — never raise into the serving path
            self.reconcile_errors += 1
            log.exception("quota reconciliation failed for request %s", getattr(reservation, "request_id", "?"))

    async def _reconcile(self, reservation: Reservation, actual: TokenCounts) -> None:
        hold = reservation.handle
        if not isinstance(hold, _Hold):
            self.reconcile_errors += 1
            log.error("reconcile() got a reservation this gate did not make (request %s)", reservation.request_id)
            return
        if hold.settled:
            return
        hold.settled = True
        if type(actual) is not TokenCounts:
            log.error("reconcile(): actual usage %r for request %s is not TokenCounts; treating it as 0",
                      actual, reservation.request_id)
            actual = TokenCounts()
        ap, ac = actual.input_tokens, actual.output_tokens
        ran = not actual.empty
        actual_cost = Decimal(0)
        if ran and self._price is not None:
            try:
                actual_cost = self._price_of(hold.attribution.model, hold.principal.tier, actual)
            except Exception:  # noqa: BLE001
                log.exception("price failed at reconciliation; keeping the reserved cost")
                actual_cost = hold.reserved_cost
        src = hold.src
        act = (1 if ran else 0, ap, ac, 0, to_units(actual_cost) if actual_cost else 0, 0, src[SRC_RETRY])
        await self._store.settle(hold.items, hold.keys, src, act, self._clock.wall(), hold.token)
        lifetime = self._clock.monotonic() - hold.started_mono
        if lifetime >= 0:
            self._hold_s += _EWMA_ALPHA * (lifetime - self._hold_s)
            self._hold_s = max(self._hold_s, 1e-3)
        bus = self._bus
        if bus is not None and bus.has_subscribers(ReservationDrift):
            outcome = "ran" if ran else "released"
            wall = self._clock.wall()
            for dim, reserved, got in (("input_tokens", src[SRC_INPUT], ap),
                                       ("output_tokens", src[SRC_OUTPUT], ac),
                                       ("cost", hold.reserved_cost, actual_cost)):
                bus.publish(ReservationDrift(attribution=hold.attribution, dimension=dim, reserved=reserved,
                                             actual=got, outcome=outcome, wall_ts=wall))

    # -- agent runs --------------------------------------------------------------------------

    async def report_tool_call(self, principal: Principal, agent_run_id: str, count: int = 1) -> ToolCallReport:
        """Record ``count`` tool calls of an agent run (what the gateway's tool-call endpoint calls).

        Returns:
            The run's total and whether it is now over ``max_tool_calls`` (then its next model
            call is refused with ``run_budget_exceeded`` / ``tool_calls``).
        Raises:
            QuotaRejected: 400 for a bad run id or count (1–10,000); 401 for a removed key;
                503 if the store is unreachable and has no fallback.
        """
        plan = self._plan(principal)
        if (not isinstance(agent_run_id, str) or not agent_run_id or len(agent_run_id) > MAX_RUN_ID_CHARS
                or not agent_run_id.isprintable() or any(c.isspace() for c in agent_run_id)):
            raise QuotaRejected("agent run id must be 1-256 printable characters without spaces",
                                status_code=400, reason="invalid_request", level="agent_run")
        if _bad_int(count) or not 1 <= count <= 10_000:
            raise QuotaRejected("tool call count must be an integer from 1 to 10000", status_code=400,
                                reason="invalid_request", level="agent_run", dimension="tool_calls")
        wall = self._clock.wall()
        try:
            total = await self._store.add(plan.tool_calls_key(agent_run_id), count, RUN_TTL_S, wall)
        except StoreUnavailable as e:
            raise QuotaRejected(f"quota store unavailable: {e}", status_code=503,
                                reason="quota_store_unavailable", retry_after_s=1.0,
                                headers=retry_after_headers(1.0)) from None
        mx = plan.entry.run_budget.max_tool_calls
        report = ToolCallReport(agent_run_id, int(total), mx, mx is not None and total > mx)
        if self._bus is not None:
            attribution = principal.attribution(endpoint="agent_runs.tool_calls", agent_run_id=agent_run_id)
            self._bus.publish(ToolCallReported(attribution, report.tool_calls, mx, report.exceeded, wall))
        return report

    def tool_calls_key(self, principal: Principal, agent_run_id: str) -> bytes:
        """The store key counting ``agent_run_id``'s tool calls — what ``max_tool_calls`` is checked
        against at the run's next model call (the agent-run store counts permits in it).

        Raises:
            QuotaRejected: 401 for a key removed by a reload.
        """
        return self._plan(principal).tool_calls_key(agent_run_id)

    async def run_usage(self, principal: Principal, agent_run_id: str) -> RunUsage:
        """The run's counters (for a run-status endpoint).

        Raises:
            QuotaRejected: 401 for a removed key; 503 if the store is unreachable.
        """
        plan = self._plan(principal)
        b = plan.entry.run_budget
        base = plan.tool_calls_key(agent_run_id)[:-2]
        codes = (b"mc", b"tc", b"rt", b"pb", b"cost", b"start")
        try:
            vals = await self._store.get_values([base + c for c in codes])
        except StoreUnavailable as e:
            raise QuotaRejected(f"quota store unavailable: {e}", status_code=503,
                                reason="quota_store_unavailable") from None
        mc, tc, rt, pb, cost, start = vals

        def count(v: Any, tracked: bool) -> int | None:
            return (int(v) if v is not None else 0) if tracked else None

        return RunUsage(
            agent_run_id=agent_run_id,
            model_calls=count(mc, b.max_model_calls is not None),
            tool_calls=int(tc) if tc is not None else 0,
            retries=count(rt, b.max_retries is not None),
            parallel_branches=count(pb, b.max_parallel_branches is not None),
            cost=(from_units(int(cost)) if cost is not None else Decimal(0)) if b.max_cost is not None else None,
            started_wall=float(start) if start is not None else None,
        )


def _money(units: int) -> str:
    return format_money(from_units(units), 0)


def _fmt_limit(it: PlanItem) -> str:
    return _money(it.limit) if it.money else str(it.limit)


def _fmt_amount(it: PlanItem, amount: int) -> str:
    return _money(amount) if it.money else str(amount)

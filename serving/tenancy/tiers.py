"""The tier policy: the one definition of what a tier is, read by tenancy, gateway, scheduler and
simulator alike.

A tier is a class of tenants (``enterprise``, ``paid_interactive``, ``batch``, ``free`` or one a
config file adds). Its :class:`TierPolicy` says

* how it shares capacity: ``weight`` (weighted VTC) and the engine ``priority``;
* what it is promised: ``ttft_slo_s`` and ``itl_slo_s`` (goodput: :meth:`TierPolicy.meets_slo`);
* how long its requests may wait: the deadline rule, :meth:`TierPolicy.deadline_s` — the one
  function the gateway (``kvmeter serve``), the simulator and the scheduler core call;
* how it behaves under overload: ``pause_at``, ``shed_new_at``, ``shed_queued_at`` (pressure levels
  :data:`PRESSURE_ELEVATED` and :data:`PRESSURE_OVERLOAD`, which the scheduler sets);
* what its tenants may use by default: ``limits`` per node level and the agent ``run_budget``;
* when an agent run is stopped as a loop: ``loop_stops``;
* who pays for engine work that reached no client: ``undelivered_billing`` (each of
  :data:`~kvmeter.events.UNDELIVERED_CAUSES` → ``billed`` to the tenant or ``absorbed`` by the
  platform; default :data:`~kvmeter.events.DEFAULT_UNDELIVERED_BILLING`).

Where it lives, and why here: tenancy owns the tiers (it maps every tenant to one, and a config
file sets their fields), and this module imports nothing but :mod:`.limits` and the usage
event's cause list (:mod:`kvmeter.events`, which imports no serving code). The scheduler
(:mod:`kvmeter.serving.scheduler.config`) imports the policy from here — an edge from the
scheduler to tenancy only, never back — so no package imports the gateway or the scheduler to learn
a tier, and there is no import cycle.

The defaults (:data:`DEFAULT_TIERS`) are the numbers the scheduler documented and the simulator and
``bench/fairness`` were measured with (bench/fairness/RESULTS.md): weights 8:4:1:1, priorities in
the order tiers are shed (the tier shed first runs last in the engine and is preempted first),
interactive SLOs of 1–2 s TTFT and 100–150 ms ITL (the range of the serving literature's chat SLOs,
e.g. DistServe, OSDI 2024), a first token due within 3 × the TTFT SLO, batch allowed an hour's wait.
They are starting points for a small deployment, not any vendor's published numbers; a tenants
config file overrides any field of any tier and may add tiers
(``serving/quota/examples/principals.yaml`` lists the fields).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from kvmeter.events import DEFAULT_UNDELIVERED_BILLING, UNDELIVERED_BILLING, UNDELIVERED_CAUSES
from kvmeter.serving.tenancy.limits import DEFAULT_LOOP_STOPS, NO_LIMITS, NO_RUN_BUDGET, Limits, LoopStops, RunBudget

__all__ = ["TierPolicy", "DEFAULT_TIERS", "TIER_FIELDS", "tier_field_problem", "undelivered_billing_problem",
           "PRESSURE_NORMAL", "PRESSURE_ELEVATED", "PRESSURE_OVERLOAD"]

#: Pressure levels the scheduler sets (thresholds in :class:`~kvmeter.serving.scheduler.SchedulerConfig`);
#: a tier's ``pause_at`` / ``shed_new_at`` / ``shed_queued_at`` name one of the last two.
PRESSURE_NORMAL = 0
PRESSURE_ELEVATED = 1
PRESSURE_OVERLOAD = 2

#: The scalar fields of a tier a config file may set (``limits``, ``run_budget`` and ``loop_stops`` besides).
TIER_FIELDS = ("weight", "priority", "ttft_slo_s", "itl_slo_s", "deadline_slo_factor",
               "max_queue_wait_s", "pause_at", "shed_new_at", "shed_queued_at")

_POSITIVE_OR_NONE = ("ttft_slo_s", "itl_slo_s", "max_queue_wait_s")
_LEVEL_OR_NONE = ("pause_at", "shed_new_at", "shed_queued_at")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def tier_field_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not valid for the tier field ``name``, or ``None`` when it is.

    The one statement of the rules: :class:`TierPolicy` raises with it and the tenants config
    reports it under the field's path (``tiers.free.weight: ...``). The message never repeats the
    value.

    Args:
        name: one of :data:`TIER_FIELDS`.
        value: the candidate value.
    Raises:
        KeyError: for a name outside :data:`TIER_FIELDS`.
    """
    if name == "weight":
        ok = _number(value) and value > 0 and math.isfinite(value)
        return None if ok else "weight must be a positive finite number"
    if name == "priority":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        return None if ok else "priority must be an integer ≥ 0 (lower runs first)"
    if name == "deadline_slo_factor":
        ok = _number(value) and value >= 1 and math.isfinite(value)
        return None if ok else "deadline_slo_factor must be a finite number ≥ 1"
    if name in _POSITIVE_OR_NONE:
        ok = value is None or (_number(value) and value > 0 and math.isfinite(value))
        return None if ok else f"{name} must be a positive finite number of seconds, or null"
    if name in _LEVEL_OR_NONE:
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool)
                               and value in (PRESSURE_ELEVATED, PRESSURE_OVERLOAD))
        return None if ok else f"{name} must be 1 (elevated), 2 (overload) or null (never)"
    raise KeyError(name)


def undelivered_billing_problem(value: Any) -> str | None:
    """Why ``value`` is not a valid ``undelivered_billing`` mapping, or ``None`` when it is: a
    mapping from causes of :data:`~kvmeter.events.UNDELIVERED_CAUSES` (not necessarily all: the
    others keep the default) to ``billed`` or ``absorbed``. The message names the bad cause."""
    if not isinstance(value, Mapping):
        return "undelivered_billing must map causes to 'billed' or 'absorbed'"
    for cause, billing in value.items():
        if cause not in UNDELIVERED_CAUSES:
            return f"undelivered_billing.{cause}: unknown cause; expected one of {', '.join(UNDELIVERED_CAUSES)}"
        if billing not in UNDELIVERED_BILLING:
            return f"undelivered_billing.{cause} must be 'billed' or 'absorbed'"
    return None


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """One tier: how it is weighted, prioritised, promised, given a deadline, shed and limited.

    Attributes:
        name: tier name (``enterprise``, ``paid_interactive``, ``batch``, ``free`` or any other).
        weight: fairness weight (> 0). Tiers share capacity in proportion to their weights;
            tenants inside a tier share the tier's part in proportion to their own weights
            (hierarchical VTC, Sheng et al., OSDI 2024; see :mod:`kvmeter.serving.scheduler.core`).
        priority: engine priority submitted with the tier's requests (vLLM ``priority``
            scheduling: lower runs first and is preempted last); an integer ≥ 0.
        ttft_slo_s: time-to-first-token objective in seconds (> 0), or ``None`` (no promise).
        itl_slo_s: mean inter-token latency (TPOT) objective in seconds (> 0), or ``None``.
        deadline_slo_factor: a request's first token is due within this multiple of
            ``ttft_slo_s`` of its arrival (≥ 1; default 3: a first token later than that is taken as
            abandoned). Unused when ``max_queue_wait_s`` is set or there is no TTFT SLO.
        max_queue_wait_s: an explicit deadline in seconds from arrival (> 0), or ``None`` (the
            deadline follows from the TTFT SLO). See :meth:`deadline_s`.
        pause_at: pressure level (1 elevated, 2 overload) from which the tier is paused: its queued
            work stays queued (deadlines still apply) and is not dispatched until the level falls
            below it. ``None``: never paused.
        shed_new_at: pressure level from which new requests of the tier are refused at admission
            (reason ``shed``). ``None``: never.
        shed_queued_at: pressure level from which already-queued requests of the tier are dropped
            (reason ``shed``). ``None``: never.
        limits: default :class:`~kvmeter.serving.tenancy.limits.Limits` per node level (``org``,
            ``workspace``, ``project``, ``api_key``, ``agent_run``); a level not present has none.
        run_budget: default :class:`~kvmeter.serving.tenancy.limits.RunBudget` of an agent run.
        loop_stops: when an agent run of the tier is stopped as a loop or a retry storm
            (:class:`~kvmeter.serving.tenancy.limits.LoopStops`).
        undelivered_billing: for each cause of :data:`~kvmeter.events.UNDELIVERED_CAUSES`, whether
            engine work that reached no client for that cause is ``billed`` to the tenant or
            ``absorbed`` by the platform (it is recorded either way). Causes not given keep
            :data:`~kvmeter.events.DEFAULT_UNDELIVERED_BILLING` (client abandoned: billed; server
            failure, shutdown, deadline: absorbed). See :meth:`undelivered`.
    Raises:
        ValueError: naming the field, for an empty name or any value :func:`tier_field_problem`
            or :func:`undelivered_billing_problem` refuses.
    """

    name: str
    weight: float = 1.0
    priority: int = 0
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    deadline_slo_factor: float = 3.0
    max_queue_wait_s: float | None = None
    pause_at: int | None = None
    shed_new_at: int | None = None
    shed_queued_at: int | None = None
    limits: Mapping[str, Limits] = field(default_factory=lambda: MappingProxyType({}))
    run_budget: RunBudget = NO_RUN_BUDGET
    loop_stops: LoopStops = DEFAULT_LOOP_STOPS
    undelivered_billing: Mapping[str, str] = field(default_factory=lambda: DEFAULT_UNDELIVERED_BILLING)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TierPolicy needs a non-empty name")
        for label in TIER_FIELDS:
            value = getattr(self, label)
            problem = tier_field_problem(label, value)
            if problem is not None:
                raise ValueError(f"tier {self.name!r}: {problem}, got {value!r}")
        problem = undelivered_billing_problem(self.undelivered_billing)
        if problem is not None:
            raise ValueError(f"tier {self.name!r}: {problem}")
        if self.undelivered_billing is not DEFAULT_UNDELIVERED_BILLING:  # every cause, in the list's order
            merged = {c: self.undelivered_billing.get(c, DEFAULT_UNDELIVERED_BILLING[c]) for c in UNDELIVERED_CAUSES}
            object.__setattr__(self, "undelivered_billing", MappingProxyType(merged))

    def undelivered(self, cause: str) -> str:
        """``billed`` or ``absorbed``: what becomes of this tier's engine work that reached no
        client for ``cause`` (one of :data:`~kvmeter.events.UNDELIVERED_CAUSES`).

        Raises:
            KeyError: an unknown cause.
        """
        return self.undelivered_billing[cause]

    # -- the rules every reader shares --------------------------------------------------------
    def deadline_s(self, arrival_s: float) -> float | None:
        """The deadline rule: when a request of this tier that arrived at ``arrival_s`` (monotonic
        seconds) must have been dispatched, or ``None`` for no deadline.

        ``arrival_s + max_queue_wait_s`` when the tier sets one, else ``arrival_s +
        deadline_slo_factor × ttft_slo_s`` when it has a TTFT SLO, else ``None``. A queued request
        past its deadline is dropped (reason ``deadline``); one that cannot make it is refused at
        admission (``projected_wait``). Serve's gateway and the simulator put this on the
        scheduler's ``Job``; the scheduler core applies it to a job that carries no deadline.
        """
        if self.max_queue_wait_s is not None:
            return arrival_s + self.max_queue_wait_s
        if self.ttft_slo_s is not None:
            return arrival_s + self.deadline_slo_factor * self.ttft_slo_s
        return None

    @property
    def has_slo(self) -> bool:
        """True when the tier promises a TTFT or an ITL (goodput counts its requests)."""
        return self.ttft_slo_s is not None or self.itl_slo_s is not None

    def meets_slo(self, ttft_s: float, itl_s: float | None) -> bool:
        """Goodput test of one completed request: its TTFT (seconds) within ``ttft_slo_s`` and its
        mean ITL / TPOT (seconds; ``None`` or 0 for a one-token output) within ``itl_slo_s``,
        each when set (DistServe's SLO attainment, Zhong et al., OSDI 2024)."""
        if self.ttft_slo_s is not None and ttft_s > self.ttft_slo_s:
            return False
        return self.itl_slo_s is None or itl_s is None or itl_s <= self.itl_slo_s

    @property
    def protected(self) -> bool:
        """True when the tier is never paused nor shed (its projected wait drives pressure)."""
        return self.pause_at is None and self.shed_new_at is None and self.shed_queued_at is None

    def limits_for(self, level: str) -> Limits:
        """Default limits of a node at ``level`` (``NO_LIMITS`` when the tier sets none)."""
        return self.limits.get(level, NO_LIMITS)


def _tier(name: str, *, limits: dict[str, Limits], run_budget: RunBudget, **fields_: Any) -> TierPolicy:
    return TierPolicy(name=name, limits=MappingProxyType(dict(limits)), run_budget=run_budget, **fields_)


#: kvmeter's built-in tiers, most protected first (reasons for the numbers in the module
#: docstring). Enterprise and paid_interactive are never paused nor shed; batch is paused at
#: elevated pressure and refused at overload; free is shed first (new work refused at elevated
#: pressure, queued work dropped at overload).
DEFAULT_TIERS: Mapping[str, TierPolicy] = MappingProxyType({
    "enterprise": _tier(
        "enterprise", weight=8.0, priority=0, ttft_slo_s=1.0, itl_slo_s=0.10,
        limits={"org": Limits(requests_per_minute=10_000, input_tokens_per_minute=10_000_000,
                              output_tokens_per_minute=2_000_000, concurrent_requests=512,
                              max_context_tokens=131_072, active_kv_tokens=4_000_000),
                "api_key": Limits(requests_per_minute=3_000, concurrent_requests=256)},
        run_budget=RunBudget(max_model_calls=1_000, max_tool_calls=2_000, max_runtime_s=3_600.0,
                             max_retries=50, max_parallel_branches=32)),
    "paid_interactive": _tier(
        "paid_interactive", weight=4.0, priority=1, ttft_slo_s=2.0, itl_slo_s=0.15,
        limits={"org": Limits(requests_per_minute=3_000, input_tokens_per_minute=2_000_000,
                              output_tokens_per_minute=400_000, concurrent_requests=128,
                              max_context_tokens=32_768, active_kv_tokens=1_000_000),
                "api_key": Limits(requests_per_minute=1_000, concurrent_requests=64)},
        run_budget=RunBudget(max_model_calls=200, max_tool_calls=400, max_runtime_s=1_800.0,
                             max_retries=20, max_parallel_branches=8)),
    "batch": _tier(
        "batch", weight=1.0, priority=2, ttft_slo_s=None, itl_slo_s=None, max_queue_wait_s=3_600.0,
        pause_at=PRESSURE_ELEVATED, shed_new_at=PRESSURE_OVERLOAD,
        limits={"org": Limits(requests_per_minute=1_000, input_tokens_per_minute=5_000_000,
                              output_tokens_per_minute=1_000_000, concurrent_requests=64,
                              max_context_tokens=32_768, active_kv_tokens=2_000_000)},
        run_budget=RunBudget(max_model_calls=10_000, max_retries=100, max_parallel_branches=64)),
    "free": _tier(
        "free", weight=1.0, priority=3, ttft_slo_s=5.0, itl_slo_s=0.25,
        shed_new_at=PRESSURE_ELEVATED, shed_queued_at=PRESSURE_OVERLOAD,
        limits={"org": Limits(requests_per_minute=60, input_tokens_per_minute=100_000,
                              output_tokens_per_minute=20_000, concurrent_requests=4,
                              max_context_tokens=8_192, active_kv_tokens=64_000),
                "api_key": Limits(requests_per_minute=20, concurrent_requests=2)},
        run_budget=RunBudget(max_model_calls=50, max_tool_calls=100, max_runtime_s=600.0,
                             max_retries=5, max_parallel_branches=4)),
})

"""Tiers: default limits, fairness weight, latency SLOs and engine priority per class of tenant.

A tier is what the scheduler and the goodput metrics read (``weight``, ``ttft_slo_s``,
``itl_slo_s``, ``priority``) and what gives every node of the principal tree its default limits
(``limits`` per level; a node's own ``limits`` override them field by field).

The built-in values below are starting points for a small deployment, not any vendor's published
numbers; a config file overrides any field of any tier and may add tiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from kvmeter.serving.tenancy.limits import NO_LIMITS, NO_RUN_BUDGET, Limits, RunBudget

__all__ = ["TierPolicy", "DEFAULT_TIERS"]


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """One tier.

    Attributes:
        name: tier name (``enterprise``, ``paid_interactive``, ``batch``, ``free``, or a custom one).
        weight: fairness weight (> 0); a tenant's share of service is proportional to it
            (weighted VTC, Sheng et al., OSDI 2024).
        ttft_slo_s: time-to-first-token promise in seconds (> 0), or ``None`` for no promise.
        itl_slo_s: mean inter-token-latency promise in seconds (> 0), or ``None``.
        priority: engine priority, lower runs first (vLLM's ``priority`` scheduling convention).
        limits: default :class:`Limits` per node level (``org``, ``workspace``, ``project``,
            ``api_key``, ``agent_run``); a level not present has no default limits.
        run_budget: default :class:`RunBudget` of an agent run.
    """

    name: str
    weight: float = 1.0
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    priority: int = 0
    limits: Mapping[str, Limits] = field(default_factory=lambda: MappingProxyType({}))
    run_budget: RunBudget = NO_RUN_BUDGET

    def limits_for(self, level: str) -> Limits:
        """Default limits of a node at ``level`` (``NO_LIMITS`` when the tier sets none)."""
        return self.limits.get(level, NO_LIMITS)


def _tier(name: str, weight: float, ttft: float | None, itl: float | None, priority: int,
          limits: dict[str, Limits], run_budget: RunBudget) -> TierPolicy:
    return TierPolicy(name=name, weight=weight, ttft_slo_s=ttft, itl_slo_s=itl, priority=priority,
                      limits=MappingProxyType(dict(limits)), run_budget=run_budget)


#: Built-in tiers, most protected first. Shedding order under overload (scheduler's job):
#: protect enterprise and paid_interactive, pause batch, shed free.
DEFAULT_TIERS: Mapping[str, TierPolicy] = MappingProxyType({
    "enterprise": _tier(
        "enterprise", 8.0, 1.0, 0.05, 0,
        {"org": Limits(requests_per_minute=10_000, input_tokens_per_minute=10_000_000,
                       output_tokens_per_minute=2_000_000, concurrent_requests=512,
                       max_context_tokens=131_072, active_kv_tokens=4_000_000),
         "api_key": Limits(requests_per_minute=3_000, concurrent_requests=256)},
        RunBudget(max_model_calls=1_000, max_tool_calls=2_000, max_runtime_s=3_600.0,
                  max_retries=50, max_parallel_branches=32)),
    "paid_interactive": _tier(
        "paid_interactive", 4.0, 2.0, 0.1, 1,
        {"org": Limits(requests_per_minute=3_000, input_tokens_per_minute=2_000_000,
                       output_tokens_per_minute=400_000, concurrent_requests=128,
                       max_context_tokens=32_768, active_kv_tokens=1_000_000),
         "api_key": Limits(requests_per_minute=1_000, concurrent_requests=64)},
        RunBudget(max_model_calls=200, max_tool_calls=400, max_runtime_s=1_800.0,
                  max_retries=20, max_parallel_branches=8)),
    "batch": _tier(
        "batch", 1.0, 600.0, None, 3,
        {"org": Limits(requests_per_minute=1_000, input_tokens_per_minute=5_000_000,
                       output_tokens_per_minute=1_000_000, concurrent_requests=64,
                       max_context_tokens=32_768, active_kv_tokens=2_000_000)},
        RunBudget(max_model_calls=10_000, max_retries=100, max_parallel_branches=64)),
    "free": _tier(
        "free", 0.5, 5.0, 0.25, 2,
        {"org": Limits(requests_per_minute=60, input_tokens_per_minute=100_000,
                       output_tokens_per_minute=20_000, concurrent_requests=4,
                       max_context_tokens=8_192, active_kv_tokens=64_000),
         "api_key": Limits(requests_per_minute=20, concurrent_requests=2)},
        RunBudget(max_model_calls=50, max_tool_calls=100, max_runtime_s=600.0,
                  max_retries=5, max_parallel_branches=4)),
})

"""Limit values: what a node of the principal hierarchy may use, and what an agent run may do.

These are plain frozen dataclasses (the runtime form); the YAML schema that produces them lives in
:mod:`kvmeter.serving.tenancy.config`. Every field is optional: ``None`` means "no limit at this
node". A node is bound by all of its ancestors — enforcement checks every level of the chain.

Dimension names are the field names below; they are the ``dimension`` of a
:class:`~kvmeter.serving.quota.base.QuotaRejected` and of an
:class:`~kvmeter.stats.AdmissionDecision`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from decimal import Decimal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "LEVELS",
    "NODE_LEVELS",
    "RATE_DIMENSIONS",
    "GAUGE_DIMENSIONS",
    "SPEND_DIMENSIONS",
    "DIMENSIONS",
    "RUN_DIMENSIONS",
    "Limits",
    "RunBudget",
    "NO_LIMITS",
    "NO_RUN_BUDGET",
    "LoopStops",
    "DEFAULT_LOOP_STOPS",
]

#: Principal levels, outermost first. ``global`` is the whole platform; ``agent_run`` is a run id
#: sent with each model call (its limits come from the key's chain, see ``agent_run_limits``).
LEVELS = ("global", "org", "workspace", "project", "api_key", "agent_run")

#: Levels that are nodes of the configuration tree (tiers give defaults per level).
NODE_LEVELS = ("org", "workspace", "project", "api_key", "agent_run")

#: Rate dimensions: refilling budgets per minute (GCRA, see kvmeter.serving.quota.gcra).
RATE_DIMENSIONS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute")
#: Gauge dimensions: held while a request runs, released at reconciliation.
GAUGE_DIMENSIONS = ("concurrent_requests", "active_kv_tokens")
#: Spend dimensions: money per UTC calendar day / month (Decimal, pricing currency).
SPEND_DIMENSIONS = ("spend_per_day", "spend_per_month")
#: Every limit dimension of :class:`Limits`, in its field order.
DIMENSIONS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute",
              "concurrent_requests", "max_context_tokens", "active_kv_tokens",
              "spend_per_day", "spend_per_month")

#: Dimensions of an agent run's budget (the ``dimension`` of a level ``agent_run`` rejection).
RUN_DIMENSIONS = ("model_calls", "tool_calls", "runtime_seconds", "cost", "retries", "parallel_branches")


@dataclass(frozen=True, slots=True)
class Limits:
    """Limits of one node; ``None`` = unlimited at this node.

    Attributes:
        requests_per_minute: admitted requests per 60 s (refilling, ≥ 0).
        input_tokens_per_minute: prompt tokens (after the chat template, cached ones included)
            per 60 s (≥ 0).
        output_tokens_per_minute: completion tokens per 60 s, reserved at ``max_tokens`` and
            reconciled to the engine's count (≥ 0).
        concurrent_requests: requests admitted and not yet reconciled (≥ 0).
        max_context_tokens: largest prompt + ``max_tokens`` one sequence may ask for (≥ 1; per
            prompt and choice, not × ``n``); a request over it is refused with 400, never truncated.
        active_kv_tokens: KV-cache tokens the node's running requests may grow to, counted as
            prompt + ``max_tokens`` per request while it runs (≥ 0).
        spend_per_day, spend_per_month: money per UTC calendar day / month in the pricing
            currency (Decimal ≥ 0, at most 9 decimal places — the quota store's resolution).
    """

    requests_per_minute: int | None = None
    input_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    max_context_tokens: int | None = None
    active_kv_tokens: int | None = None
    spend_per_day: Decimal | None = None
    spend_per_month: Decimal | None = None

    def is_empty(self) -> bool:
        """True when no dimension is limited."""
        return all(getattr(self, f.name) is None for f in fields(self))

    def tightest(self, other: "Limits") -> "Limits":
        """Field-wise minimum of two limit sets (``None`` loses to any value)."""
        return Limits(**_fieldwise_min(self, other))


def _fieldwise_min(a: DataclassInstance, b: DataclassInstance) -> dict[str, Any]:
    out = {}
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        out[f.name] = x if y is None else y if x is None else min(x, y)
    return out


@dataclass(frozen=True, slots=True)
class RunBudget:
    """Budget of one agent run (all calls that carry the same run id); ``None`` = unlimited.

    Attributes:
        max_model_calls: model calls admitted for the run (≥ 0); the call that would be number
            ``max_model_calls + 1`` is refused.
        max_tool_calls: tool calls reported for the run (≥ 0); once more than this many were
            reported, the run's next model call is refused.
        max_runtime_s: seconds since the run's first model call (> 0); a later call is refused.
        max_cost: money the run may spend, reserved then reconciled like spend (Decimal ≥ 0).
        max_retries: model calls that are retries (``UsageEstimate.attempt`` > 1) (≥ 0).
        max_parallel_branches: model calls of the run in flight at once (≥ 1).
    """

    max_model_calls: int | None = None
    max_tool_calls: int | None = None
    max_runtime_s: float | None = None
    max_cost: Decimal | None = None
    max_retries: int | None = None
    max_parallel_branches: int | None = None

    def is_empty(self) -> bool:
        """True when nothing is limited."""
        return all(getattr(self, f.name) is None for f in fields(self))

    def tightest(self, other: "RunBudget") -> "RunBudget":
        """Field-wise minimum of two budgets (``None`` loses to any value)."""
        return RunBudget(**_fieldwise_min(self, other))


NO_LIMITS = Limits()
NO_RUN_BUDGET = RunBudget()


@dataclass(frozen=True, slots=True)
class LoopStops:
    """When an agent run is stopped as a loop or a retry storm (per tier; ``None`` = never).

    Counted by :mod:`kvmeter.serving.agents` per run; the call that crosses a threshold is refused
    and the run is stopped (every later tool call and model call of it is refused).

    Attributes:
        max_identical_tool_calls: permitted calls of the same tool with the same arguments
            (argument digest) in one run (≥ 1); the next one stops the run
            (reason ``identical_tool_calls``).
        max_cycle_repeats: back-to-back calls that repeat the call ``p`` places before them, for a
            block of 2–``max_cycle_length`` calls that are not all the same (A → B → A is one
            repeat, A → B → A → B two) (≥ 1); one more stops the run (reason ``tool_cycle``).
        max_cycle_length: the longest block a cycle is looked for in (2–16).
        max_repeated_prompts: model calls in a row with the same prompt digest (the rendered
            prompt's token ids) and no permitted tool call between them (≥ 1); the next one stops
            the run (reason ``repeated_prompt``). Only calls the quota admitted count: a call
            refused 429 and retried is not a loop.
    """

    max_identical_tool_calls: int | None = 5
    max_cycle_repeats: int | None = 4
    max_cycle_length: int = 4
    max_repeated_prompts: int | None = 3

    def __post_init__(self) -> None:
        for name in ("max_identical_tool_calls", "max_cycle_repeats", "max_repeated_prompts"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
        m = self.max_cycle_length
        if not isinstance(m, int) or isinstance(m, bool) or not 2 <= m <= 16:
            raise ValueError(f"max_cycle_length must be an integer in 2..16, got {m!r}")

    @property
    def history_calls(self) -> int:
        """Permitted tool calls a run's history must keep to detect its cycles."""
        return (self.max_cycle_repeats or 0) + 2 * self.max_cycle_length + 2


DEFAULT_LOOP_STOPS = LoopStops()

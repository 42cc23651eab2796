"""Turning a real trace into a multi-tenant replay plan for a small model.

The public traces carry token counts and arrival times, not text, and come from far larger models
than the embedded SmolLM2-135M on two CPU cores. The plan keeps the trace's *shape* (arrival
pattern, the spread of prompt and output lengths, their correlation) and scales its *size* by one
documented rule:

* **Time**: ``arrival' = arrival / time_compression`` (default 2: twice the trace's request rate).
* **Tokens**: ``n' = clamp(round(n × token_scale), 1, cap)``, the same ``token_scale`` (default 1/8)
  for prompts and outputs, with prompts capped at ``max_input_tokens`` and outputs at
  ``max_output_tokens`` (defaults: a quarter and an eighth of the 8,192-token context window), so
  every request fits the context and the replay fits the demo's time budget.
* **Tenants**: each request goes to a tenant drawn with probability ∝ its ``share`` from a seeded
  generator (deterministic for a seed). ServeGen's per-client data shows real traffic is skewed;
  the default shares are skewed too.
* **Noisy neighbour**: requests drawn for a tenant marked ``noisy`` keep their arrival and output
  length but carry a long prompt of ``noisy_input_tokens`` (default 4,096, half the window): the
  tenant of docs/ARCHITECTURE.md, "Why tokens, not requests" (twenty 150,000-token prompts a
  minute) scaled to this model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvmeter.traces import TraceRequest

__all__ = ["ReplayTenant", "ReplayRequest", "ScalingRule", "build_plan", "DEMO_TENANTS"]

#: (name, API key, share of the trace's requests, noisy) — the keys match serving/defaults/demo-tenants.yaml.
DEMO_TENANTS = [
    ("acme", "sk-demo-acme-0001", 3.0, False),          # enterprise
    ("globex", "sk-demo-globex-0001", 2.0, False),      # paid interactive
    ("initech", "sk-demo-initech-0001", 2.0, False),    # batch
    ("hobbyist", "sk-demo-hobbyist-0001", 1.0, False),  # free: 20 requests/min, 2 at a time
    ("umbrella", "sk-demo-umbrella-0001", 0.7, True),   # paid interactive, long prompts
]


@dataclass(frozen=True, slots=True)
class ReplayTenant:
    """A tenant in the replay: its name (for reports), API key, traffic share and whether it is
    the noisy neighbour."""

    name: str
    api_key: str
    share: float = 1.0
    noisy: bool = False

    def __repr__(self) -> str:  # never print the key
        return f"ReplayTenant(name={self.name!r}, share={self.share}, noisy={self.noisy})"


@dataclass(frozen=True, slots=True)
class ScalingRule:
    """The trace → replay scaling rule (see module docstring). All values > 0."""

    time_compression: float = 2.0
    token_scale: float = 1 / 8
    max_input_tokens: int = 2048
    max_output_tokens: int = 1024
    noisy_input_tokens: int = 4096
    min_input_tokens: int = 1

    def __post_init__(self) -> None:
        for name in ("time_compression", "token_scale", "max_input_tokens", "max_output_tokens",
                     "noisy_input_tokens", "min_input_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ScalingRule.{name} must be > 0, got {getattr(self, name)}")

    def scale(self, n: int, cap: int, floor: int = 1) -> int:
        return max(floor, min(cap, round(n * self.token_scale)))


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request to send: when (seconds from replay start), as whom, and how many tokens."""

    index: int
    tenant: ReplayTenant
    arrival_s: float
    input_tokens: int
    output_tokens: int
    trace_input_tokens: int
    trace_output_tokens: int


def build_plan(trace: list[TraceRequest], tenants: list[ReplayTenant], rule: ScalingRule,
               *, seed: int = 0) -> list[ReplayRequest]:
    """Apply ``rule`` to ``trace`` and assign tenants.

    Raises:
        ValueError: no tenants, or a non-positive share.
    """
    if not tenants:
        raise ValueError("a replay needs at least one tenant")
    if any(t.share <= 0 for t in tenants):
        raise ValueError("tenant shares must be > 0")
    rng = random.Random(seed)
    weights = [t.share for t in tenants]
    plan: list[ReplayRequest] = []
    for i, req in enumerate(trace):
        tenant = rng.choices(tenants, weights)[0]
        prompt = (rule.noisy_input_tokens if tenant.noisy
                  else rule.scale(req.input_tokens, rule.max_input_tokens, rule.min_input_tokens))
        plan.append(ReplayRequest(
            index=i, tenant=tenant, arrival_s=req.arrival_s / rule.time_compression,
            input_tokens=prompt, output_tokens=rule.scale(req.output_tokens, rule.max_output_tokens),
            trace_input_tokens=req.input_tokens, trace_output_tokens=req.output_tokens))
    return plan

"""A hand-stepped engine for driving :class:`SchedulerCore` in unit tests.

Like vLLM's own scheduler tests (which feed hand-made model outputs), each ``step`` gives every
dispatched request one output token, releases the requests that reached ``max_tokens``, reports the
engine's KV use and dispatches again — all on a :class:`ManualClock`. The simulator's replica is the
full engine model; these tests isolate the scheduler.
"""

from __future__ import annotations

from kvmeter.attribution import Attribution
from kvmeter.clock import ManualClock
from kvmeter.serving.scheduler import Job, SchedulerConfig, SchedulerCore
from kvmeter.stats import EngineLoad


def make_core(policy: str = "vtc", *, capacity: int = 1_000_000, num_engines: int = 1,
              **cfg) -> tuple[SchedulerCore, ManualClock]:
    clock = ManualClock()
    core = SchedulerCore(SchedulerConfig(**cfg), policy=policy, clock=clock, num_engines=num_engines)
    for i in range(num_engines):
        core.on_engine_load(EngineLoad(0.0, capacity, 0, 0), i)
    return core, clock


def job(rid: str, tenant: str, prompt: int = 100, max_tokens: int = 10, *, tier: str = "paid_interactive",
        arrival: float = 0.0, deadline: float | None = None) -> Job:
    return Job(request_id=rid, attribution=Attribution(tenant, tier=tier), input_tokens=prompt, max_tokens=max_tokens,
               arrival_s=arrival, deadline_s=deadline)


class StepEngine:
    """Each step: one token per running grant; finished grants released; load reported."""

    def __init__(self, core: SchedulerCore, clock: ManualClock, capacity: int = 1_000_000,
                 step_s: float = 0.01) -> None:
        self.core, self.clock, self.capacity, self.step_s = core, clock, capacity, step_s
        self.running = []
        self.finished = []

    def dispatch(self) -> list:
        grants = self.core.dispatch()
        self.running.extend(grants)
        return grants

    def step(self) -> None:
        self.clock.advance(self.step_s)
        still = []
        for g in self.running:
            self.core.charge_output(g, 1)
            if g.output_tokens >= g.job.max_tokens:
                self.core.release(g)
                self.finished.append(g)
            else:
                still.append(g)
        self.running = still
        used = sum(g.job.input_tokens + g.output_tokens for g in self.running)
        self.core.on_engine_load(EngineLoad(min(1.0, used / self.capacity), self.capacity,
                                            len(self.running), 0))
        self.dispatch()

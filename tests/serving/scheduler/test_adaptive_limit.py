"""The adaptive engine limit (AIMD on the engine's step latencies) on a ManualClock.

The hand-stepped engine here has a latency model like a CPU engine's — each step takes
``base + per_request × running`` seconds — and reports each step's ITLs through the same call the
gateway's step-stats subscriber and the simulator use (``observe_engine_latency``).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.serving.scheduler import FairScheduler, SchedulerConfig, SchedulerCore
from kvmeter.serving.scheduler.gating import latency_targets
from kvmeter.serving.simulator import SimConfig, Simulation
from kvmeter.stats import EngineLoad, EngineStepStats
from kvmeter.traces import TraceRequest, load_trace

from .helpers import job


class LatencyEngine:
    """Each step: one token per running grant; the step lasts ``base + per_req × running`` s and
    reports one ITL of that length per decoding request; finished grants are released."""

    def __init__(self, core: SchedulerCore, clock: ManualClock, base: float = 0.02, per_req: float = 0.005):
        self.core, self.clock, self.base, self.per_req = core, clock, base, per_req
        self.running: list = []
        self.max_running = 0
        self.itls: list[float] = []

    def step(self) -> None:
        self.core.tick()
        self.running += self.core.dispatch()
        self.max_running = max(self.max_running, len(self.running))
        dt = self.base + self.per_req * len(self.running)
        self.clock.advance(dt)
        decoding = [g for g in self.running if g.output_tokens > 0]
        first = [g for g in self.running if g.output_tokens == 0]
        self.core.observe_engine_latency(0, itl_sum_s=dt * len(decoding), itl_count=len(decoding),
                                         ttfts_s=[self.clock.monotonic() - g.dispatched_s for g in first])
        self.itls += [dt] * len(decoding)
        still = []
        for g in self.running:
            self.core.charge_output(g, 1)
            if g.output_tokens >= g.job.max_tokens:
                self.core.release(g)
            else:
                still.append(g)
        self.running = still
        self.core.on_engine_load(EngineLoad(0.1, 1_000_000, len(self.running), 0))


def _core(**cfg) -> tuple[SchedulerCore, ManualClock]:
    clock = ManualClock()
    base = dict(overload_control=False, max_queued_per_tenant=10_000, max_queued_total=10_000,
                max_engine_waiting=10_000, tenant_kv_budget_ratio=None)
    base.update(cfg)
    core = SchedulerCore(SchedulerConfig(**base), clock=clock)
    core.on_engine_load(EngineLoad(0.0, 1_000_000, 0, 0))
    return core, clock


def test_no_latency_reports_no_adaptive_limit_only_the_static_cap():
    core, _ = _core(max_engine_running=50)
    for i in range(80):
        core.submit(job(f"r{i}", f"t{i % 4}", max_tokens=100))
    assert len(core.dispatch()) == 50            # engines without step latencies: static cap only
    assert core.engine_limits() == [None]
    off, _ = _core(adaptive_engine_limit=False)
    off.observe_engine_latency(0, itl_sum_s=5.0, itl_count=1)
    assert off.engine_limits() == [None]


def test_limit_converges_where_the_itl_meets_the_tightest_protected_target():
    # paid ITL SLO 150 ms → target 0.8 × 0.15 = 0.12 s; the model's ITL reaches it at 20 running
    core, clock = _core(max_engine_running=256)
    eng = LatencyEngine(core, clock, base=0.02, per_req=0.005)
    n = 0
    while clock.monotonic() < 120.0:
        while core.queued_total < 50:   # always backlogged: the limit is what decides the batch
            core.submit(job(f"r{n}", f"t{n % 5}", prompt=50, max_tokens=20 + (n * 37) % 41))
            n += 1
        eng.step()
    lim = core.engine_limits()[0]
    assert 12 <= lim <= 22                      # AIMD sawtooth below ITL*: (0.12 − 0.02)/0.005 = 20
    late = eng.itls[len(eng.itls) // 2:]
    assert sum(late) / len(late) <= 0.12 * 1.1  # the mean ITL holds the target once converged
    assert core.engine_gates[0].adaptive.decreases >= 1 and core.engine_gates[0].adaptive.increases >= 3


def test_without_the_adaptive_limit_the_same_load_fills_the_static_cap_and_misses_the_target():
    core, clock = _core(max_engine_running=256, adaptive_engine_limit=False)
    eng = LatencyEngine(core, clock, base=0.02, per_req=0.005)
    n = 0
    while clock.monotonic() < 60.0:
        while core.queued_total < 50:
            core.submit(job(f"r{n}", f"t{n % 5}", prompt=50, max_tokens=40))
            n += 1
        eng.step()
    late = eng.itls[len(eng.itls) // 2:]
    assert eng.max_running > 200 and sum(late) / len(late) > 1.0


def _start_at(core, clock, limit: int) -> list:
    """Activate the limit at ``limit`` with ``limit`` requests running (300 queued behind)."""
    for i in range(300):
        core.submit(job(f"r{i}", f"t{i % 3}", max_tokens=1_000))
    grants = core.dispatch()
    assert len(grants) == 256 and core.engine_limits() == [None]   # no report yet: static cap
    for g in grants[limit:]:
        core.release(g)
    core.observe_engine_latency(0, itl_sum_s=0.05 * limit, itl_count=limit)   # first report
    core.tick()                                                 # its first interval starts
    return grants[:limit]


def test_slow_start_doubles_then_a_congested_interval_cuts_and_holds_until_the_batch_drains():
    core, clock = _core(max_engine_running=256, engine_limit_initial=4)
    grants = _start_at(core, clock, 4)
    assert core.engine_limits() == [4]
    assert core.dispatch() == []                                # at the limit: held back ("limited")
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.05 * 4, itl_count=4)
    core.tick()                                                 # r = 0.05/0.12 < 1, limited: 4 → 8
    assert core.engine_limits() == [8]
    grants += core.dispatch()
    assert len(grants) == 8
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.3 * 8, itl_count=8)   # congested: r = 2.5
    core.tick()
    assert core.engine_limits() == [6]                          # 8 × 0.85 = 6.8
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.3 * 8, itl_count=8)   # the old batch still runs
    core.tick()
    assert core.engine_limits() == [6]                          # held: one cut per round trip
    assert core.dispatch() == []                                # 8 running > 6
    for g in grants[:2]:
        core.release(g)
    grants = grants[2:]
    clock.advance(1.0)
    core.tick()                                                 # drained to 6: the cut is judged next
    for _ in range(3):                                          # the smaller batch is faster: r = 0.92
        clock.advance(1.0)
        core.observe_engine_latency(0, itl_sum_s=0.11 * 6, itl_count=6)
        core.tick()
    gate = core.engine_gates[0].adaptive
    assert core.engine_limits() == [6] and gate.undone == 0 and gate.decreases == 1
    assert core.dispatch() == []
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.05 * 6, itl_count=6)
    core.tick()
    assert core.engine_limits() == [7]                          # additive now (slow start is over)


def test_a_cut_that_does_not_lower_the_latency_is_undone_and_the_next_cut_waits_longer():
    # e.g. a long prefill makes every step slow whatever the batch: cutting only costs throughput
    core, clock = _core(max_engine_running=256, engine_limit_initial=20)
    grants = _start_at(core, clock, 20)
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.3 * 20, itl_count=20)   # r = 2.5
    core.tick()
    assert core.engine_limits() == [17]
    for g in grants[:3]:
        core.release(g)
    clock.advance(1.0)
    core.tick()                                                 # drained: judged on 3 intervals
    for _ in range(3):
        clock.advance(1.0)
        core.observe_engine_latency(0, itl_sum_s=0.3 * 17, itl_count=17)   # just as slow
        core.tick()
    gate = core.engine_gates[0].adaptive
    assert core.engine_limits() == [20] and gate.undone == 1    # undone
    for _ in range(19):                                         # no cut for 4 windows (20 s)
        clock.advance(1.0)
        core.observe_engine_latency(0, itl_sum_s=0.3 * 17, itl_count=17)
        core.tick()
        assert core.engine_limits()[0] >= 20
    clock.advance(2.0)
    core.observe_engine_latency(0, itl_sum_s=0.3 * 17, itl_count=17)
    core.tick()
    assert gate.decreases == 2                                  # then it tries again


def test_a_cut_the_batch_cannot_drain_to_in_time_is_undone():
    core, clock = _core(max_engine_running=256, engine_limit_initial=20)
    _start_at(core, clock, 20)
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.3 * 20, itl_count=20)
    core.tick()
    assert core.engine_limits() == [17]
    for _ in range(4):                                          # nothing finishes for 4 intervals
        clock.advance(1.0)
        core.tick()
    assert core.engine_limits() == [20] and core.engine_gates[0].adaptive.undone == 1


def test_a_limit_that_does_not_bind_does_not_grow():
    core, clock = _core(engine_limit_initial=4)
    core.submit(job("r0", "a", max_tokens=1_000))
    [g] = core.dispatch()
    for _ in range(10):
        core.observe_engine_latency(0, itl_sum_s=0.01, itl_count=1)
        clock.advance(1.0)
        core.tick()
        assert core.dispatch() == []   # nothing queued: the limit never held anything back
    assert core.engine_limits() == [4]


def test_engine_side_ttft_over_its_target_also_cuts_the_limit():
    core, clock = _core(engine_limit_initial=10)
    core.submit(job("p", "a"))                 # a paid tenant: the targets are paid's
    # paid TTFT SLO 2 s → TTFT* = 0.5 × 2 = 1 s; median of these is 3 s
    core.observe_engine_latency(0, itl_sum_s=0.01, itl_count=1)
    core.tick()                                # (the limit is on; its first interval starts)
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.01, itl_count=1, ttfts_s=[3.0, 3.0, 0.1])
    core.tick()
    assert core.engine_limits() == [8]     # 10 × 0.85


def test_targets_follow_the_tightest_protected_tier_seen():
    cfg = SchedulerConfig()
    tiers = cfg.tiers
    assert latency_targets([tiers["paid_interactive"]], cfg) == pytest.approx((0.12, 1.0))
    assert latency_targets([tiers["paid_interactive"], tiers["enterprise"]], cfg) == pytest.approx((0.08, 0.5))
    assert latency_targets([tiers["batch"], tiers["free"]], cfg) == (None, None)   # not protected
    core, clock = _core(engine_limit_initial=10)
    core.submit(job("e", "acme", tier="enterprise"))
    core.observe_engine_latency(0, itl_sum_s=0.01, itl_count=1)
    core.tick()
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.1, itl_count=1)   # 0.1 s: under paid's, over enterprise's
    core.tick()
    assert core.engine_limits() == [8]


def test_bad_latency_reports_are_refused_and_config_is_validated():
    core, _ = _core()
    with pytest.raises(ValueError):
        core.observe_engine_latency(3, itl_sum_s=0.1, itl_count=1)
    with pytest.raises(ValueError):
        core.observe_engine_latency(0, itl_sum_s=-1.0, itl_count=1)
    with pytest.raises(ValueError):
        core.observe_engine_latency(0, ttfts_s=[float("nan")])
    for bad in (dict(engine_limit_decrease=1.0), dict(engine_itl_target_ratio=0.0), dict(engine_limit_min=0),
                dict(engine_limit_interval_s=0.0)):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


async def test_step_stats_on_the_bus_drive_the_limit_through_the_fair_scheduler():
    bus = StatsBus()
    clock = ManualClock()
    sched = FairScheduler(SchedulerConfig(engine_limit_initial=6), clock=clock, bus=bus)
    bus.subscribe(EngineStepStats, sched.on_step_stats)
    sched.check_admission(job("p", "a"))      # (admission creates the paid tier: its targets apply)
    bus.publish(EngineStepStats(wall_ts=0.0, kv_blocks_total=1000, kv_block_size_tokens=16,
                                itls_s=[0.5, 0.5], ttfts_s=[0.2]))
    assert sched.core.engine_limits() == [6]  # on at the first report; its first interval starts
    clock.advance(1.0)
    bus.publish(EngineStepStats(wall_ts=1.0, kv_blocks_total=1000, kv_block_size_tokens=16,
                                itls_s=[0.5, 0.5]))   # 0.5 s ≫ paid's 0.12 s target: cut
    assert sched.core.engine_limits() == [5]   # 6 × 0.85
    assert sched.snapshot().engines_running_limit == [5]


def test_baselines_submit_at_engine_priority_zero_and_vtc_at_the_tier_priority():
    for policy, want in (("vtc", 3), ("fcfs", 0), ("rpm", 0)):
        core = SchedulerCore(SchedulerConfig(), policy=policy, clock=ManualClock())
        core.submit(job("f", "hob", tier="free"))
        [g] = core.dispatch()
        assert g.priority == want


def test_in_the_simulator_the_limit_trades_a_little_throughput_for_the_protected_itl():
    # SmolLM2 on the CPU profile with the demo's step budget, the demo's slice of the Azure trace
    # (lengths ÷ 8, twice the rate), half enterprise, half paid: far over capacity
    trace = load_trace("azure-conv", limit=400)
    reqs = [TraceRequest(r.arrival_s / 2, max(1, round(r.input_tokens / 8)), max(2, round(r.output_tokens / 8)),
                         tenant_id=f"t{i % 10}", tier="enterprise" if i % 2 else "paid_interactive")
            for i, r in enumerate(trace)]
    sim = SimConfig(model="smollm2-135m", gpu="cpu", tp=1, max_num_batched_tokens=256)
    base = dict(overload_control=False, tenant_kv_budget_ratio=None, max_queued_per_tenant=10 ** 6,
                max_queued_total=10 ** 6)
    tpot, end = {}, {}
    for adaptive in (False, True):
        res = Simulation(reqs, policy="vtc", sim=sim,
                         scheduler_config=SchedulerConfig(adaptive_engine_limit=adaptive, **base)).run()
        ok = [r for r in res.records if r.outcome == "ok"]
        assert len(ok) == len(reqs)
        tpot[adaptive] = float(np.median([(r.finish_s - r.first_token_s) / (r.generated - 1) for r in ok]))
        end[adaptive] = res.sim_end_s
    target = 0.8 * SchedulerConfig().tier("enterprise").itl_slo_s   # the tightest protected ITL × 0.8
    assert tpot[False] > 3 * target             # the open gate lets the batch grow far past it
    assert tpot[True] <= 1.25 * target          # the limit holds the median TPOT near it
    assert end[True] < 1.25 * end[False]        # at a small cost in throughput (all 400 done)


def test_a_high_first_token_estimate_expires_once_the_engine_is_idle():
    """A window of slow first tokens (long prefills) must not outlive its requests: the estimate
    refuses new requests at admission, so no new first token would ever correct it."""
    from kvmeter.serving.scheduler import SchedulerRejected

    core, clock = _core(overload_control=True)
    core.submit(job("long", "a", max_tokens=10))     # paid: deadline 3 × 2 s after arrival
    [g] = core.dispatch()
    core.observe_engine_latency(0, itl_sum_s=0.01, itl_count=1)
    core.tick()
    clock.advance(1.0)
    core.observe_engine_latency(0, itl_sum_s=0.01, itl_count=1, ttfts_s=[30.0])
    core.tick()
    with pytest.raises(SchedulerRejected) as refused:    # 30 s to a first token > the 6 s deadline
        core.check_admission(job("next", "a", arrival=clock.monotonic()))
    assert refused.value.reason == "projected_wait"
    for _ in range(8):                                   # the window passes; the long request runs
        clock.advance(1.0)
        core.tick()
    with pytest.raises(SchedulerRejected):               # still busy: the estimate stands
        core.check_admission(job("next", "a", arrival=clock.monotonic()))
    core.release(g)                                      # the engine is idle now
    for _ in range(8):
        clock.advance(1.0)
        core.tick()
    core.check_admission(job("next", "a", arrival=clock.monotonic()))  # admitted: an idle engine starts it at once
    core.submit(job("next", "a", arrival=clock.monotonic()))
    assert [x.job.request_id for x in core.dispatch()] == ["next"]


def test_without_a_protected_tier_a_binding_limit_grows_to_the_demand():
    """Only batch traffic, 48 requests kept in flight (a closed loop): there is no latency promise
    to keep, so the limit must not hold the engine at ``engine_limit_initial`` (the
    engine-overhead benchmark found kvmeter running 8 of 16 concurrent batch requests)."""
    core, clock = _core(engine_limit_initial=8, max_engine_running=256)
    engine = LatencyEngine(core, clock)
    core.submit(job("b0", "t0", max_tokens=50, tier="batch"))
    engine.step()                                   # the first latency report turns the limit on
    n = 0
    for _ in range(100):
        while len(engine.running) + core.snapshot(include_tenants=False).queued_total < 48:
            n += 1
            core.submit(job(f"b{n}", f"t{n % 4}", max_tokens=50, tier="batch"))
        engine.step()
    assert core.engine_limits()[0] >= 48
    assert engine.max_running == 48

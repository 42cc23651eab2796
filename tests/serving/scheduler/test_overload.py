"""Bounded queues, projected wait, deadlines, shedding by tier and cancellation."""

from __future__ import annotations

import pytest

from kvmeter.serving.scheduler import SchedulerRejected
from kvmeter.serving.scheduler.config import PRESSURE_ELEVATED, PRESSURE_NORMAL, PRESSURE_OVERLOAD
from kvmeter.stats import EngineLoad

from .helpers import job, make_core


def _gate_closed(core):
    core.on_engine_load(EngineLoad(0.99, 1_000_000, 10, 0))


def test_per_tenant_and_global_queue_bounds_refuse_with_retry_after():
    core, _ = make_core(max_queued_per_tenant=3, max_queued_total=5)
    _gate_closed(core)
    for i in range(3):
        core.submit(job(f"a{i}", "a"))
    with pytest.raises(SchedulerRejected) as err:
        core.submit(job("a3", "a"))
    assert err.value.reason == "queue_full" and err.value.status_code == 429
    assert err.value.retry_after_s is not None and err.value.retry_after_s >= 0
    core.submit(job("b0", "b"))
    core.submit(job("c0", "c"))
    with pytest.raises(SchedulerRejected, match="limit 5"):
        core.submit(job("d0", "d"))
    assert core.queued_total == 5 and core.rejected_total["queue_full"] == 2


def test_queued_request_past_its_deadline_is_dropped_not_dispatched():
    core, clock = make_core()
    _gate_closed(core)
    core.submit(job("r", "a", deadline=5.0))
    clock.set(6.0)
    core.on_engine_load(EngineLoad(0.0, 1_000_000, 0, 0))
    assert core.dispatch() == []
    [(dropped, err)] = core.take_dropped()
    assert dropped.request_id == "r" and err.reason == "deadline"
    assert core.queued_total == 0 and core.dropped_total["deadline"] == 1


def test_default_deadline_is_a_multiple_of_the_tier_ttft_slo_or_its_max_queue_wait():
    core, clock = make_core()                            # the built-in tiers: deadline_slo_factor 3
    _gate_closed(core)
    core.submit(job("p", "b", tier="paid_interactive"))  # TTFT SLO 2 s → 6 s
    core.submit(job("f", "a", tier="free"))              # TTFT SLO 5 s → 15 s
    core.submit(job("bt", "c", tier="batch"))            # no SLO, max_queue_wait_s 3600 s
    clock.set(6.5)
    core.tick()
    assert [j.request_id for j, _ in core.take_dropped()] == ["p"]
    clock.set(15.5)
    core.tick()
    assert [j.request_id for j, _ in core.take_dropped()] == ["f"]
    clock.set(3599.0)
    core.tick()
    assert core.take_dropped() == [] and core.tenant_queue_depth("c") == 1


def test_a_request_whose_deadline_already_passed_is_refused_at_admission():
    core, clock = make_core()
    clock.set(10.0)
    with pytest.raises(SchedulerRejected) as err:
        core.submit(job("late", "a", arrival=0.0, deadline=9.0))
    assert err.value.reason == "deadline"


def test_projected_wait_refuses_early_for_a_deep_queue_and_admits_a_light_tenant():
    core, clock = make_core(max_engine_running=1, max_engine_waiting=1)
    for i in range(30):
        core.submit(job(f"a{i}", "a", prompt=100, max_tokens=50, arrival=0.0, deadline=1e6))
    # serve a backlog for 10 s: one request at a time, 10 tokens per 0.1 s
    running = core.dispatch()
    for _ in range(100):
        clock.advance(0.1)
        g = running[0]
        core.charge_output(g, 10)
        if g.output_tokens >= g.job.max_tokens:
            core.release(g)
            core.on_engine_load(EngineLoad(0.0, 1_000_000, 0, 0))
            running = core.dispatch()
    rate = core.service_rate()
    assert rate == pytest.approx((100 + 2 * 50) / 0.5, rel=0.1)   # 200 service per 0.5 s request
    now = clock.monotonic()
    wait_a = core.projected_wait("a")
    assert wait_a == pytest.approx(core.tenant_queue_depth("a") * 200 / rate, rel=0.2)
    with pytest.raises(SchedulerRejected) as err:
        core.submit(job("a-late", "a", arrival=now, deadline=now + 2.0))
    assert err.value.reason == "projected_wait"
    assert err.value.retry_after_s == pytest.approx(wait_a, rel=0.01)
    assert core.projected_wait("b") == 0.0                          # b has nothing queued: no lag
    core.submit(job("b0", "b", arrival=now, deadline=now + 2.0))
    core.cancel("b0")
    # batch work queued beside it takes its weighted share (paid 4 : batch 1) — unless batch is
    # paused, when paid gets the whole drain rate
    for i in range(10):
        core.submit(job(f"bt{i}", "bt", tier="batch", prompt=5_000, max_tokens=10, arrival=now))
    with_batch = core.projected_wait("a")
    assert with_batch == pytest.approx(wait_a / 0.8, rel=0.05)
    core.set_pressure_level(PRESSURE_ELEVATED)
    assert core.projected_wait("a") == pytest.approx(wait_a, rel=0.05)


def test_elevated_pressure_refuses_free_and_pauses_batch_until_the_level_falls():
    core, _ = make_core(max_engine_waiting=1)
    core.submit(job("batch0", "bt", tier="batch"))
    core.set_pressure_level(PRESSURE_ELEVATED)
    assert core.tier_paused("batch")
    with pytest.raises(SchedulerRejected) as err:
        core.submit(job("free0", "fr", tier="free"))
    assert err.value.reason == "shed" and err.value.retry_after_s >= 1.0
    core.submit(job("paid0", "pd", tier="paid_interactive"))
    [g] = core.dispatch()
    assert g.job.request_id == "paid0"       # batch is paused although its counter is lower
    core.on_engine_load(EngineLoad(0.0, 1_000_000, 1, 0))
    assert core.dispatch() == []              # paused means paused: its prefills would cost ITL
    core.set_pressure_level(PRESSURE_NORMAL)
    assert not core.tier_paused("batch")
    core.on_engine_load(EngineLoad(0.0, 1_000_000, 1, 0))   # the engine took paid0 in
    assert [x.job.request_id for x in core.dispatch()] == ["batch0"]


def test_overload_drops_queued_free_and_refuses_new_batch_but_protects_paid():
    core, _ = make_core()
    _gate_closed(core)
    core.submit(job("free0", "fr", tier="free"))
    core.submit(job("free1", "fr", tier="free"))
    core.submit(job("batch0", "bt", tier="batch"))
    core.set_pressure_level(PRESSURE_OVERLOAD)
    assert sorted(j.request_id for j, e in core.take_dropped() if e.reason == "shed") == ["free0", "free1"]
    with pytest.raises(SchedulerRejected, match="batch"):
        core.submit(job("batch1", "bt", tier="batch"))
    core.submit(job("paid0", "pd", tier="paid_interactive"))
    core.submit(job("ent0", "en", tier="enterprise"))
    assert core.tenant_queue_depth("bt") == 1   # queued batch stays queued (paused), not dropped
    with pytest.raises(ValueError):
        core.set_pressure_level(3)


def test_pressure_rises_with_protected_waits_and_falls_back_with_hysteresis():
    core, clock = make_core()
    _gate_closed(core)
    core.submit(job("p", "pd", tier="paid_interactive", deadline=1e6))  # TTFT SLO 2 s
    levels = []
    for _ in range(40):                                    # 20 s of a stuck protected request
        clock.advance(0.5)
        core.tick()
        levels.append(core.pressure_level)
    assert levels[0] == PRESSURE_NORMAL                    # a momentary wait sheds nobody
    assert PRESSURE_ELEVATED in levels and levels[-1] == PRESSURE_OVERLOAD
    core.on_engine_load(EngineLoad(0.0, 1_000_000, 0, 0))
    core.dispatch()                                        # the queue drains
    after = []
    for _ in range(60):
        clock.advance(0.5)
        core.tick()
        after.append(core.pressure_level)
    assert after[0] == PRESSURE_OVERLOAD                   # hysteresis: not immediately normal
    assert after[-1] == PRESSURE_NORMAL


def test_cancel_removes_a_queued_job_and_idles_its_tenant():
    core, _ = make_core()
    _gate_closed(core)
    core.submit(job("r0", "a"))
    core.submit(job("r1", "a"))
    assert core.cancel("r0") and not core.cancel("r0") and not core.cancel("nope")
    assert core.tenant_queue_depth("a") == 1
    assert core.cancel("r1")
    assert core.queued_total == 0 and core.backlogged_count == 0
    core.on_engine_load(EngineLoad(0.0, 1_000_000, 0, 0))
    assert core.dispatch() == [] and core.dropped_total["cancelled"] == 2


def test_release_is_idempotent_and_unknown_grants_are_ignored():
    core, _ = make_core()
    core.submit(job("r", "a", prompt=10))
    [g] = core.dispatch()
    core.charge_output(g, 3)
    core.release(g)
    core.release(g)
    core.charge_output(g, 5)   # after release: ignored
    assert core.running_total == 0 and core.tenant_active_kv("a") == 0
    assert core.tenant_service("a") == 10 + 2 * 3


def test_pressure_set_by_slow_protected_streams_falls_once_protected_traffic_is_gone():
    # (a stale TPOT signal must not hold the level — and the paused batch tier — forever)
    core, clock = make_core(elevated_wait_ratio=0.5, overload_wait_ratio=5.0, pressure_min_dwell_s=5.0)
    for i in range(20):   # enterprise streams at 3 × their 100 ms ITL SLO
        core.submit(job(f"e{i}", "acme", tier="enterprise", max_tokens=11, arrival=clock.monotonic()))
        [g] = core.dispatch()
        core.charge_output(g, 1)
        clock.advance(3.0)   # 10 more tokens over 3 s: TPOT 0.3 s
        core.charge_output(g, 10)
        core.release(g)
        core.on_engine_load(EngineLoad(0.0, 1_000_000, 0, 0))
        core.tick()
    assert core.pressure_level >= PRESSURE_ELEVATED
    core.submit(job("b", "initech", tier="batch", arrival=clock.monotonic()))
    assert core.tier_paused("batch") and core.dispatch() == []   # batch is paused under pressure
    for _ in range(120):                               # no protected request queued or running
        clock.advance(0.5)
        core.tick()
    assert core.pressure_level == PRESSURE_NORMAL and core.protected_itl_ratio < 0.1
    assert [g.job.request_id for g in core.dispatch()] == ["b"]

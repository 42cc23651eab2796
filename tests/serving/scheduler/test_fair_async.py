"""The asyncio adapter the gateway calls: acquire/charge/release, cancellation, drops, bus wiring,
and one scheduler in front of the simulated engine."""

from __future__ import annotations

import asyncio

import pytest

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.serving.engines.base import EngineRequest
from kvmeter.serving.scheduler import FairScheduler, SchedulerConfig, SchedulerRejected
from kvmeter.serving.simulator import RooflineCostModel, SimEngine, get_accelerator, get_model
from kvmeter.stats import EngineLoad, EngineStepStats, SchedulerStats

from .helpers import job


def _sched(clock=None, bus=None, **cfg):
    clock = clock or ManualClock()
    s = FairScheduler(SchedulerConfig(**cfg), clock=clock, bus=bus)
    s.on_engine_load(EngineLoad(0.0, 100_000, 0, 0))
    return s, clock


async def test_acquire_waits_for_room_and_release_hands_the_slot_on():
    sched, _ = _sched(max_engine_running=1)
    g1 = await sched.acquire(job("r1", "a"))
    waiter = asyncio.create_task(sched.acquire(job("r2", "b")))
    await asyncio.sleep(0)
    assert not waiter.done() and sched.core.queued_total == 1
    sched.charge_output(g1, 4)
    assert g1.output_tokens == 4
    sched.release(g1)
    g2 = await asyncio.wait_for(waiter, 1)
    assert g2.job.request_id == "r2" and g2.priority == 1


async def test_cancelling_a_blocked_acquire_removes_its_job():
    sched, _ = _sched(max_engine_running=1)
    g1 = await sched.acquire(job("r1", "a"))
    waiter = asyncio.create_task(sched.acquire(job("r2", "b")))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert sched.core.queued_total == 0 and sched.core.dropped_total["cancelled"] == 1
    sched.release(g1)
    assert sched.core.running_total == 0   # nothing was dispatched for the cancelled job


async def test_a_job_dropped_while_queued_raises_in_acquire():
    sched, clock = _sched(max_engine_running=1)
    g1 = await sched.acquire(job("r1", "a"))
    waiter = asyncio.create_task(sched.acquire(job("r2", "b", deadline=5.0)))
    await asyncio.sleep(0)
    clock.set(6.0)
    sched.tick()
    with pytest.raises(SchedulerRejected) as err:
        await asyncio.wait_for(waiter, 1)
    assert err.value.reason == "deadline"
    sched.release(g1)


async def test_admission_refusals_surface_from_check_admission_and_acquire():
    sched, _ = _sched(max_queued_per_tenant=1, max_engine_running=1)
    g = await sched.acquire(job("r1", "a"))
    t = asyncio.create_task(sched.acquire(job("r2", "a")))
    await asyncio.sleep(0)
    with pytest.raises(SchedulerRejected) as err:
        sched.check_admission(job("r3", "a"))
    assert err.value.reason == "queue_full"
    with pytest.raises(SchedulerRejected):
        await sched.acquire(job("r3", "a"))
    with pytest.raises(ValueError):
        sched.charge_output(g, -1)
    sched.release(g)
    sched.release(await t)


async def test_engine_step_stats_on_the_bus_gate_dispatch():
    bus = StatsBus()
    sched, _ = _sched(bus=bus, kv_watermark_high=0.9)
    bus.subscribe(EngineStepStats, sched.on_step_stats)
    bus.publish(EngineStepStats(wall_ts=0.0, kv_watermark_ratio=0.95, kv_blocks_total=1000,
                                kv_block_size_tokens=16))
    waiter = asyncio.create_task(sched.acquire(job("r", "a")))
    await asyncio.sleep(0)
    assert not waiter.done()
    bus.publish(EngineStepStats(wall_ts=0.0, kv_watermark_ratio=0.2, kv_blocks_total=1000,
                                kv_block_size_tokens=16))
    g = await asyncio.wait_for(waiter, 1)
    sched.release(g)


async def test_scheduler_stats_are_published_on_the_bus():
    bus = StatsBus()
    got: list[SchedulerStats] = []
    bus.subscribe(SchedulerStats, got.append)
    sched, clock = _sched(bus=bus)
    g = await sched.acquire(job("r", "a", prompt=40))
    sched.charge_output(g, 5)
    clock.advance(2.0)
    sched.tick()
    snap = got[-1]
    assert snap.policy == "vtc" and snap.running_total == 1
    [t] = snap.tenants
    assert (t.tenant_id, t.input_tokens_total, t.output_tokens_total, t.active_kv_tokens) == ("a", 40, 5, 45)
    assert t.service_total == 40 + 2 * 5
    sched.release(g)


async def test_fair_scheduler_in_front_of_the_simulated_engine_on_a_manual_clock():
    clock = ManualClock()
    bus = StatsBus()
    cost = RooflineCostModel(get_model("llama-3.1-70b"), get_accelerator("h200"), tp=4)
    engine = SimEngine(cost, clock=clock, bus=bus)
    sched = FairScheduler(SchedulerConfig(max_engine_waiting=2), clock=clock, bus=bus)
    bus.subscribe(EngineStepStats, sched.on_step_stats)
    sched.on_engine_load(engine.load())
    await engine.start()

    async def one(rid: str, tenant: str, tier: str) -> tuple[int, float]:
        j = job(rid, tenant, prompt=500, max_tokens=20, tier=tier, arrival=clock.monotonic())
        sched.check_admission(j)
        grant = await sched.acquire(j)
        n = 0
        try:
            req = EngineRequest(
                rid, [1] * 500, max_tokens=20, priority=grant.priority, attribution=grant.job.attribution
            )
            async for out in engine.generate(req):
                sched.charge_output(grant, len(out.new_token_ids))
                n = out.num_output_tokens
        finally:
            sched.release(grant)
        return n, clock.monotonic()

    results = await asyncio.wait_for(asyncio.gather(
        *(one(f"r{i}", f"t{i % 3}", ("enterprise", "paid_interactive", "free")[i % 3]) for i in range(9))), 30)
    await engine.shutdown()
    assert [n for n, _ in results] == [20] * 9
    assert clock.monotonic() > 0                 # virtual time advanced by the roofline step times
    snap = sched.snapshot()
    assert snap.running_total == 0 and snap.queued_total == 0
    assert sum(t.output_tokens_total for t in snap.tenants) == 9 * 20

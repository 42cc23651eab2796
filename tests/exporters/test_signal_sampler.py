"""Signal history into ClickHouse: the sampler turns the current signal set into ``signals`` rows,
written through a real embedded ledger (chDB in a temporary directory), timed by a ManualClock.

chDB hosts one engine path per process: each test's ledger is closed at teardown before the next
one opens its own.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvmeter.attribution import Attribution
from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.collectors.gpu import CaptureNvml, NvmlCollector
from kvmeter.exporters.prometheus.names import SIGNAL_SERIES, rate_series, signal_series
from kvmeter.exporters.signals import SignalRecorder, SignalSampler, SignalSamplerConfig
from kvmeter.ledger import Ledger, LedgerConfig
from kvmeter.ledger.records import SignalSample
from kvmeter.stats import (EngineStepShares, EngineStepStats, GpuSample, LedgerStats, MigSample, QuotaStoreState,
                           RemoteEngineStats, ReplicaHealth, RequestCompletion, RoutingDecision, SchedulerStats,
                           StreamSendStats, TenantSchedulerStats, TenantStepShare)
from kvmeter.tokens import TokenCounts

MIB = 1024 * 1024
T0 = 1_790_000_000.0  # 2026-09-21 UTC
H200 = "linux-x86_64__nvidia-h200__590.48.01.txt"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_wall=T0)


@pytest.fixture
def bus():
    bus = StatsBus()
    yield bus
    assert bus.errors_total == 0


@pytest.fixture
def ledger(tmp_path: Path, clock: ManualClock):
    """A real embedded ledger; background rounds rare (the tests drain with flush())."""
    led = Ledger.open(LedgerConfig(dsn=f"chdb://{tmp_path / 'chdb'}", spool_dir=tmp_path / "spool",
                                   flush_interval_s=3600, rollup_interval_s=3600, close_timeout_s=10),
                      clock=clock)
    yield led
    led.close()


def stored(ledger: Ledger) -> dict[tuple[str, tuple], list[tuple[float, float]]]:
    """Every row of ``signals``: (name, sorted labels) → [(ts, value), ...] in time order."""
    assert ledger.flush(30.0), "ledger did not drain"
    result = ledger.query_client().query("SELECT name, labels, ts, value FROM signals ORDER BY ts")
    out: dict[tuple[str, tuple], list[tuple[float, float]]] = {}
    for name, labels, ts, value in result.result_rows:
        ts = ts.replace(tzinfo=timezone.utc).timestamp() if isinstance(ts, datetime) else float(ts)
        out.setdefault((name, tuple(sorted(labels.items()))), []).append((ts, value))
    return out


def one(rows, name, **labels) -> float:
    points = rows[(name, tuple(sorted(labels.items())))]
    assert len(points) == 1, points
    return points[0][1]


def tenant(tid, tier, *, depth=0, kv=0, running=0, oldest=0.0) -> TenantSchedulerStats:
    return TenantSchedulerStats(
        tenant_id=tid, tier=tier, weight=1.0, queue_depth=depth, queued_input_tokens=depth * 100,
        queue_wait_oldest_s=oldest, queue_wait_mean_s=0.0, projected_wait_s=0.0, running=running,
        active_kv_tokens=kv, kv_budget_tokens=0, service_total=0.0, input_tokens_total=0,
        output_tokens_total=0, vtc_counter=0.0, dispatched_total=0, completed_total=0)


def sched(tenants, **kw) -> SchedulerStats:
    fields = dict(wall_ts=T0, policy="vtc", pressure_level=0, queued_total=sum(t.queue_depth for t in tenants),
                  running_total=sum(t.running for t in tenants), service_rate_per_s=0.0, jain_index=0.9,
                  max_service_gap=0.0, service_gap=12.0)
    fields.update(kw)
    return SchedulerStats(tenants=list(tenants), **fields)


def completion(tenant_id, tier, prompt, output, *, outcome="ok", slo_met=True, reprefill=0) -> RequestCompletion:
    return RequestCompletion(
        attribution=Attribution(tenant_id, tier=tier, model="m"),
        tokens=TokenCounts(input_tokens=prompt, output_tokens=output),
        outcome=outcome,
        slo_met=slo_met,
        reprefill_input_tokens=reprefill,
    )


def test_one_interval_lands_in_the_signals_table(bus, clock, ledger, data_dir):
    sampler = SignalSampler(bus, clock=clock, model="smollm2", config=SignalSamplerConfig())
    recorder = SignalRecorder(sampler, ledger.write_signals, clock=clock, interval_s=10)
    bus.publish(EngineStepStats(wall_ts=T0, kv_watermark_ratio=0.5, kv_blocks_total=4000, num_running=7,
                                num_waiting=2, output_tokens=100, num_preempted=1,
                                prefix_cache_queries_tokens=800, prefix_cache_hits_tokens=200))
    bus.publish(EngineStepStats(wall_ts=T0 + 1, kv_watermark_ratio=0.75, kv_blocks_total=4000, num_running=9,
                                num_waiting=1, output_tokens=50))
    for _ in range(2):  # two engine steps of 0.5 s: acme prefills, hob decodes
        bus.publish(EngineStepShares(wall_ts=T0 + 1, duration_s=0.5, tenants=(
            TenantStepShare("acme", "enterprise", 256, 0, 1000, 1), TenantStepShare("hob", "free", 0, 3, 600, 3))))
    bus.publish(sched([tenant("acme", "enterprise", depth=2, kv=3000, running=1, oldest=1.5),
                       tenant("hob", "free", depth=5, oldest=40.0),
                       tenant("idle", "free")], pressure_level=1))
    for c in (completion("acme", "enterprise", 1000, 200),
              completion("acme", "enterprise", 500, 100, slo_met=False),   # missed its SLO
              completion("hob", "free", 40, 60, outcome="aborted"),
              completion("hob", "free", 10, 20)):
        bus.publish(c)
    gpu = NvmlCollector(CaptureNvml.from_file(data_dir / "gpu" / "nvidia_smi" / H200), bus=bus, clock=clock)
    gpu.collect()
    bus.publish(ledger.stats())  # the real ledger's own stats
    bus.publish(QuotaStoreState(store="redis", degraded=True))

    clock.advance(9.9)
    assert recorder.tick() == 0  # not due yet
    clock.advance(0.1)
    written = recorder.tick()
    rows = stored(ledger)
    assert written == sum(len(p) for p in rows.values()) > 0
    assert {ts for points in rows.values() for ts, _ in points} == {T0 + 10}  # stamped clock.wall()

    e = {"engine": "0", "model": "smollm2"}
    assert one(rows, "kvmeter_engine_kv_watermark_ratio", **e) == 0.75  # the latest step
    assert one(rows, "kvmeter_engine_kv_used_blocks", **e) == 3000
    assert one(rows, "kvmeter_engine_running_requests", **e) == 9
    assert one(rows, "kvmeter_engine_output_tokens_per_second", **e) == pytest.approx(15.0)  # 150 / 10 s
    assert one(rows, "kvmeter_engine_preemptions_per_second", **e) == pytest.approx(0.1)
    assert one(rows, "kvmeter_engine_prefix_cache_hit_ratio", **e) == pytest.approx(0.25)
    assert one(rows, "kvmeter_scheduler_pressure_level") == 1
    assert one(rows, "kvmeter_scheduler_jain_index_ratio") == 0.9
    assert one(rows, "kvmeter_scheduler_queued_requests") == 7
    # every tenant with work, unbounded; the idle one has no rows
    assert one(rows, "kvmeter_tenant_active_kv_tokens", tier="enterprise", tenant="acme") == 3000
    assert one(rows, "kvmeter_scheduler_queue_depth_requests", tier="free", tenant="hob") == 5
    assert one(rows, "kvmeter_scheduler_queue_oldest_wait_seconds", tier="free", tenant="hob") == 40.0
    assert not [k for k in rows if ("tenant", "idle") in k[1]]
    # the engine's work per tenant over the interval (EngineStepShares), every tenant
    acme = {**e, "tier": "enterprise", "tenant": "acme"}
    hob = {**e, "tier": "free", "tenant": "hob"}
    assert one(rows, "kvmeter_engine_tenant_scheduled_prefill_tokens_per_second", **acme) == pytest.approx(51.2)
    assert one(rows, "kvmeter_engine_tenant_scheduled_decode_tokens_per_second", **hob) == pytest.approx(0.6)
    assert one(rows, "kvmeter_engine_tenant_kv_token_seconds_per_second", **acme) == pytest.approx(100.0)
    assert one(rows, "kvmeter_engine_tenant_kv_token_seconds_per_second", **hob) == pytest.approx(60.0)
    # tokens/s by tier over the 10 s interval; goodput = ok and inside the SLO
    assert one(rows, "kvmeter_throughput_tokens_per_second", tier="enterprise", type="output") == pytest.approx(30.0)
    assert one(rows, "kvmeter_goodput_tokens_per_second", tier="enterprise", type="output") == pytest.approx(20.0)
    assert one(rows, "kvmeter_goodput_ratio", tier="enterprise") == pytest.approx(200 / 300)
    assert one(rows, "kvmeter_goodput_ratio", tier="free") == pytest.approx(20 / 80)  # the abort is not goodput
    assert one(rows, "kvmeter_requests_per_second", tier="free", outcome="aborted") == pytest.approx(0.1)
    # GPU from the real H200 capture; what the capture lacks has no row (never a 0)
    assert one(rows, "kvmeter_gpu_memory_used_bytes", gpu="0") == 32362 * MIB
    assert one(rows, "kvmeter_gpu_temperature_celsius", gpu="0", sensor="memory") == 41.0
    assert ("kvmeter_gpu_sm_active_ratio", (("gpu", "0"),)) not in rows
    assert one(rows, "kvmeter_ledger_spool_depth_events") == 0
    assert one(rows, "kvmeter_quota_store_degraded", store="redis") == 1


def test_every_row_is_a_declared_series_and_every_declared_series_is_written(bus, clock):
    """The sampler's names come from the one name table (names.py): every row it writes is a
    declared SignalSeries with exactly that series' labels, and with every source publishing, every
    declared series gets rows — the table is what the history holds, no more, no less."""
    written: list[list[SignalSample]] = []
    sampler = SignalSampler(bus, clock=clock, model="m", config=SignalSamplerConfig())
    recorder = SignalRecorder(sampler, written.append, clock=clock, interval_s=10)
    bus.publish(EngineStepStats(wall_ts=T0, kv_watermark_ratio=0.5, kv_blocks_total=4000, num_running=3,
                                output_tokens=40, num_preempted=1, prefix_cache_queries_tokens=100,
                                prefix_cache_hits_tokens=25))
    bus.publish(RemoteEngineStats(source="http://upstream:8000/metrics", model_name="m", engine="0", wall_ts=T0,
                                  kv_cache_usage_ratio=0.3, kv_blocks_total=1000, num_running=2.0, num_waiting=0.0))
    bus.publish(sched([tenant("acme", "enterprise", depth=1, kv=300, running=1, oldest=0.5)]))
    bus.publish(completion("acme", "enterprise", 100, 20, reprefill=64))
    bus.publish(EngineStepShares(wall_ts=T0, duration_s=0.1,
                                 tenants=(TenantStepShare("acme", "enterprise", 64, 1, 300, 2),)))
    bus.publish(GpuSample(wall_ts=T0, index=0, memory_used_bytes=10 * MIB, memory_total_bytes=80 * MIB,
                          utilization_gpu_ratio=0.9, sm_active_ratio=0.6, tensor_active_ratio=0.4,
                          dram_bandwidth_ratio=0.7, power_watts=350.0, temperature_gpu_celsius=55.0,
                          temperature_memory_celsius=60.0,
                          mig=[MigSample(gpu_index=0, mig_index=0, gpu_instance_id=1, memory_used_bytes=MIB,
                                         sm_active_ratio=0.5)]))
    bus.publish(LedgerStats(wall_ts=T0, spool_depth_events=2, spool_oldest_age_seconds=1.5))
    bus.publish(QuotaStoreState(store="redis", degraded=False))
    bus.publish(ReplicaHealth(model="m", replica="http://gpu-a:8000", index=0, healthy=True))
    bus.publish(RoutingDecision(model="m", policy="prefix_aware", outcome="prefix_hit", replica="http://gpu-a:8000"))
    bus.publish(StreamSendStats(attribution=Attribution(tenant_id="acme", tier="enterprise"), send_blocked_s=31.0,
                                stall_cut=True))
    clock.advance(10)
    assert recorder.tick() > 0
    (rows,) = written
    for row in rows:
        declared = signal_series(row.name)  # KeyError: a name the table does not declare
        assert set(row.labels) == set(declared.labels), (row.name, row.labels)
    assert {row.name for row in rows} == {s.name for s in SIGNAL_SERIES}
    # a counter's history is its rate, named after it; a gauge keeps its metric's name
    assert rate_series("kvmeter_requests_total") == "kvmeter_requests_per_second"
    assert signal_series("kvmeter_engine_kv_watermark_ratio").metric == "kvmeter_engine_kv_watermark_ratio"
    with pytest.raises(KeyError):
        rate_series("kvmeter_engine_kv_watermark_ratio")  # a gauge has no rate series


def test_idle_tenants_and_tiers_get_one_zero_row_then_none(bus, clock, ledger):
    sampler = SignalSampler(bus, clock=clock, config=SignalSamplerConfig())
    recorder = SignalRecorder(sampler, ledger.write_signals, clock=clock, interval_s=10)
    bus.publish(sched([tenant("acme", "enterprise", depth=3, kv=500, running=1)]))
    bus.publish(completion("acme", "enterprise", 100, 50))
    for _ in range(3):
        clock.advance(10)
        recorder.tick()
        bus.publish(sched([tenant("acme", "enterprise")]))  # acme finished everything
    rows = stored(ledger)
    kv = rows[("kvmeter_tenant_active_kv_tokens", (("tenant", "acme"), ("tier", "enterprise")))]
    assert kv == [(T0 + 10, 500.0), (T0 + 20, 0.0)]  # drops to 0 once, then no rows
    out = rows[("kvmeter_throughput_tokens_per_second", (("tier", "enterprise"), ("type", "output")))]
    assert out == [(T0 + 10, 5.0), (T0 + 20, 0.0)]
    assert len(rows[("kvmeter_scheduler_queued_requests", ())]) == 3  # scheduler-wide rows every sample


def test_stale_gpu_readings_are_not_sampled_but_engine_state_stands(bus, clock, data_dir):
    written: list[list[SignalSample]] = []
    sampler = SignalSampler(bus, clock=clock, config=SignalSamplerConfig(stale_after_s=60))
    recorder = SignalRecorder(sampler, written.append, clock=clock, interval_s=10)
    NvmlCollector(CaptureNvml.from_file(data_dir / "gpu" / "nvidia_smi" / H200), bus=bus, clock=clock).collect()
    bus.publish(EngineStepStats(wall_ts=T0, kv_watermark_ratio=0.2, num_running=1))
    clock.advance(60)
    recorder.tick()
    clock.advance(10)  # the GPU poller stopped 70 s ago; the engine is merely idle
    recorder.tick()
    names = [{s.name for s in batch} for batch in written]
    assert "kvmeter_gpu_power_watts" in names[0] and "kvmeter_gpu_power_watts" not in names[1]
    assert "kvmeter_engine_kv_watermark_ratio" in names[1]


def test_recorder_schedule_on_the_injected_clock(bus, clock):
    written: list[list[SignalSample]] = []
    recorder = SignalRecorder(SignalSampler(bus, clock=clock), written.append, clock=clock, interval_s=10)
    bus.publish(EngineStepStats(wall_ts=T0, kv_watermark_ratio=0.2))
    due = []
    for step in (5, 5, 3, 9, 100, 5, 5):  # t = 5, 10, 13, 22, 122, 127, 132
        clock.advance(step)
        if recorder.tick():
            due.append(clock.monotonic())
    # every 10 s; a late tick keeps the schedule; after a long pause it restarts from then
    assert due == [10, 22, 122, 132]
    assert recorder.samples_total == 4 and len(written) == 4
    assert recorder.tick(force=True) > 0 and recorder.samples_total == 5


def test_a_failing_write_is_counted_not_raised(bus, clock, caplog):
    def broken(rows):
        raise ConnectionError("ClickHouse is away")

    recorder = SignalRecorder(SignalSampler(bus, clock=clock), broken, clock=clock, interval_s=1)
    bus.publish(EngineStepStats(wall_ts=T0, kv_watermark_ratio=0.2))
    clock.advance(1)
    assert recorder.tick() == 0
    assert recorder.write_errors_total == 1 and "signal sample not written" in caplog.text


async def test_recorder_task_writes_a_last_sample_on_stop(bus, clock):
    written: list[list[SignalSample]] = []
    recorder = SignalRecorder(SignalSampler(bus, clock=clock), written.append, clock=clock, interval_s=3600)
    recorder.start()
    bus.publish(EngineStepStats(wall_ts=T0, kv_watermark_ratio=0.4))
    await recorder.stop()
    assert [s.value for s in written[-1] if s.name == "kvmeter_engine_kv_watermark_ratio"] == [0.4]
    bus.publish(EngineStepStats(wall_ts=T0, kv_watermark_ratio=0.9))  # unsubscribed: not seen
    assert recorder.sampler.sample() and all(
        s.value == 0.4 for s in recorder.sampler.sample() if s.name == "kvmeter_engine_kv_watermark_ratio")


async def test_recorder_task_samples_when_the_clock_says_so(bus, clock):
    written: list[list[SignalSample]] = []
    recorder = SignalRecorder(SignalSampler(bus, clock=clock), written.append, clock=clock, interval_s=30)
    bus.publish(EngineStepStats(wall_ts=T0, kv_watermark_ratio=0.4))
    recorder.start()
    try:
        await asyncio.sleep(1.5)  # the task wakes every second of real time: nothing is due
        assert written == []
        clock.advance(30)
        for _ in range(100):  # wait for the task's next wake-up (not timing logic)
            if written:
                break
            await asyncio.sleep(0.05)
        assert len(written) == 1 and recorder.samples_total == 1
    finally:
        await recorder.stop(final_sample=False)


def test_config_from_env():
    assert SignalSamplerConfig.from_env({}) == SignalSamplerConfig(10.0, 60.0)
    cfg = SignalSamplerConfig.from_env({"KVMETER_SIGNALS_INTERVAL_S": "2.5"}, stale_after_s=30)
    assert (cfg.interval_s, cfg.stale_after_s) == (2.5, 30)
    with pytest.raises(ValueError, match="KVMETER_SIGNALS_INTERVAL_S"):
        SignalSamplerConfig.from_env({"KVMETER_SIGNALS_INTERVAL_S": "often"})
    with pytest.raises(ValueError, match="interval_s"):
        SignalSamplerConfig(interval_s=0)


def test_stream_back_pressure_is_sampled_per_tenant_then_falls_to_zero_once(bus, clock):
    written: list[list[SignalSample]] = []
    sampler = SignalSampler(bus, clock=clock, config=SignalSamplerConfig())
    recorder = SignalRecorder(sampler, written.append, clock=clock, interval_s=10)
    slow = Attribution(tenant_id="slow", tier="free")
    bus.publish(StreamSendStats(attribution=slow, send_blocked_s=31.0, stall_cut=True))
    bus.publish(StreamSendStats(attribution=slow, send_blocked_s=4.0))
    bus.publish(StreamSendStats(attribution=Attribution(tenant_id="fine", tier="free")))  # read at once: no rows
    for _ in range(3):
        clock.advance(10)
        recorder.tick()

    def values(name: str) -> list[tuple[str, float]]:
        return [(r.labels["tenant"], r.value) for rows in written for r in rows if r.name == name]

    assert values("kvmeter_stream_stall_cut_requests_per_second") == [("slow", 0.1), ("slow", 0.0)]
    assert values("kvmeter_stream_send_blocked_seconds_per_second") == [("slow", 3.5), ("slow", 0.0)]


def test_reprefill_is_sampled_per_tenant_and_model_then_falls_to_zero_once(bus, clock):
    written: list[list[SignalSample]] = []
    sampler = SignalSampler(bus, clock=clock, config=SignalSamplerConfig())
    recorder = SignalRecorder(sampler, written.append, clock=clock, interval_s=10)
    bus.publish(completion("thrasher", "free", 1000, 5, reprefill=640))
    bus.publish(completion("thrasher", "free", 1000, 5, reprefill=128))
    bus.publish(completion("cached", "free", 1000, 5))  # no re-prefill: no rows
    for _ in range(3):
        clock.advance(10)
        recorder.tick()
    name = "kvmeter_prompt_reprefill_tokens_per_second"
    got = [(r.labels, r.value) for rows in written for r in rows if r.name == name]
    assert got == [({"tenant": "thrasher", "model": "m"}, 76.8), ({"tenant": "thrasher", "model": "m"}, 0.0)]


def test_replica_health_stands_and_routing_is_sampled_per_model_and_replica_then_falls_to_zero_once(bus, clock):
    """The replicas view's history: each replica's last health (event-driven: it stands), routed
    requests per replica and decisions per outcome per second while requests are routed, then one
    row of 0."""
    written: list[list[SignalSample]] = []
    sampler = SignalSampler(bus, clock=clock, config=SignalSamplerConfig())
    recorder = SignalRecorder(sampler, written.append, clock=clock, interval_s=10)
    a, b = "http://gpu-a:8000", "http://gpu-b:8000"
    bus.publish(ReplicaHealth(model="llama", replica=a, index=0, healthy=True))
    bus.publish(ReplicaHealth(model="llama", replica=b, index=1, healthy=True, draining=True))
    for outcome, replica in (("prefix_miss", a), ("prefix_hit", a), ("prefix_hit", a), ("prefix_hit", b)):
        bus.publish(RoutingDecision(model="llama", policy="prefix_aware", outcome=outcome, replica=replica))
    for _ in range(3):
        clock.advance(10)
        recorder.tick()

    def got(name):
        return [[(tuple(sorted(r.labels.values())), r.value) for r in rows if r.name == name] for rows in written]

    assert [sorted(x) for x in got("kvmeter_replica_available")] == [[((a, "llama"), 1.0), ((b, "llama"), 0.0)]] * 3
    assert [sorted(x) for x in got("kvmeter_replica_up")] == [[((a, "llama"), 1.0), ((b, "llama"), 1.0)]] * 3
    assert [sorted(x) for x in got("kvmeter_replica_routed_requests_per_second")] == [
        [((a, "llama"), 0.3), ((b, "llama"), 0.1)], [((a, "llama"), 0.0), ((b, "llama"), 0.0)], []]
    assert [sorted(x) for x in got("kvmeter_router_decisions_requests_per_second")] == [
        [(("llama", "prefix_aware", "prefix_hit"), 0.3), (("llama", "prefix_aware", "prefix_miss"), 0.1)],
        [(("llama", "prefix_aware", "prefix_hit"), 0.0), (("llama", "prefix_aware", "prefix_miss"), 0.0)], []]

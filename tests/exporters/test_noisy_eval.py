"""The short-window noisy-neighbour evaluator on real exposition text: the exporter's own metric
classes (install_prometheus on a bus) fed real stats objects, scraped twice with generate_latest,
ranked by the predicates of NoisyThresholds."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmeter.attribution import Attribution
from kvmeter.exporters.prometheus import PrometheusConfig, install_prometheus, metric
from kvmeter.exporters.prometheus.base import make_metric
from kvmeter.exporters.prometheus.rules import noisy
from kvmeter.exporters.prometheus.rules.noisy_eval import parse, rank
from kvmeter.stats import (EngineStepShares, EngineStepStats, RequestCompletion, SchedulerStats,
                           TenantSchedulerStats, TenantStepShare)
from kvmeter.tokens import TokenCounts


@pytest.fixture
def exporter(bus, registry, clock):
    return install_prometheus(bus, registry, config=PrometheusConfig(top_k_tenants=20, model="smollm2"),
                              clock=clock)


def scrape(registry) -> str:
    return generate_latest(registry).decode()


def tenant(tid: str, *, depth: int = 0, kv: int = 0) -> TenantSchedulerStats:
    return TenantSchedulerStats(
        tenant_id=tid, tier="free", weight=1.0, queue_depth=depth, queued_input_tokens=depth * 100,
        queue_wait_oldest_s=0.0, queue_wait_mean_s=0.0, projected_wait_s=0.0, running=0, active_kv_tokens=kv,
        kv_budget_tokens=0, service_total=0.0, input_tokens_total=0, output_tokens_total=0, vtc_counter=0.0,
        dispatched_total=0, completed_total=0)


def sched(*tenants: TenantSchedulerStats) -> SchedulerStats:
    return SchedulerStats(wall_ts=0.0, policy="vtc", pressure_level=0, queued_total=sum(t.queue_depth for t in tenants),
                          running_total=0, service_rate_per_s=0.0, jain_index=1.0, max_service_gap=0.0,
                          service_gap=0.0, tenants=list(tenants))


def call(tid: str, input_tokens: int, cached: int = 0, run: str = "", reprefill: int = 0) -> RequestCompletion:
    return RequestCompletion(attribution=Attribution(tid, tier="free", model="smollm2", agent_run_id=run),
                             outcome="ok", tokens=TokenCounts(input_tokens=input_tokens, cached_input_tokens=cached,
                                                              output_tokens=5), reprefill_input_tokens=reprefill)


def normal_traffic(bus, steps: int) -> None:
    """Tenants that stay under every threshold: fair shares of a busy engine, a warm prompt cache,
    agent runs of three calls, a short queue share, a small part of the KV."""
    for _ in range(steps):
        bus.publish(EngineStepShares(wall_ts=0.0, duration_s=0.1, tenants=(
            TenantStepShare("fair", "free", 1500, 60, 500, 1), TenantStepShare("calm", "free", 1500, 60, 500, 1))))
    bus.publish(call("warm", 40_000, cached=30_000))
    for run in range(6):
        for _ in range(3):
            bus.publish(call("agent", 100, run=f"run-{run}"))


def test_the_noisy_tenant_of_each_shape_ranks_first_and_normal_tenants_not_at_all(bus, registry, exporter):
    bus.publish(EngineStepStats(wall_ts=0.0, kv_watermark_ratio=0.9, num_running=4))
    bus.publish(sched(tenant("burst", depth=30), tenant("calm", depth=5), tenant("kvhog", kv=9000),
                      tenant("fair", kv=1000)))
    bus.publish(call("looper", 10, run="loop-1"))  # the loop's run started before the window
    before = scrape(registry)

    normal_traffic(bus, steps=10)
    for _ in range(10):  # 30 s: hog prefills, chatty decodes beside fair and calm
        bus.publish(EngineStepShares(wall_ts=0.0, duration_s=0.1, tenants=(
            TenantStepShare("hog", "free", 30_000, 0, 500, 1), TenantStepShare("chatty", "free", 0, 600, 500, 1))))
    bus.publish(call("thrash", 40_000, reprefill=20_000))  # 1,333 input tokens/s, none cached, half re-prefilled
    for _ in range(60):                            # 2 calls/s, all of one run
        bus.publish(call("looper", 10, run="loop-1"))
    bus.publish(sched(tenant("burst", depth=34), tenant("calm", depth=5), tenant("kvhog", kv=9000),
                      tenant("fair", kv=1000)))
    ranked = rank(before, scrape(registry), seconds=30.0)

    assert set(ranked) == set(noisy.SHAPES)
    first = {shape: r[0][0] for shape, r in ranked.items() if r}
    assert first == {"prompt_cache_hit_low": "thrash", "prefill_pressure": "hog", "decode_pressure": "chatty",
                     "kv_pressure": "kvhog", "queue_pressure": "burst", "prompt_cache_thrash": "thrash",
                     "agent_loops": "looper"}
    assert ranked["retries"] == [] and ranked["slow_clients"] == []
    fired = {n for r in ranked.values() for n, _ in r}
    assert fired.isdisjoint({"fair", "calm", "warm", "agent"})
    # the scores are the predicates' relative excess over the threshold
    t = noisy.THRESHOLDS
    prefill = 300_000 + 10 * 3000                  # hog + fair + calm, 30 s
    assert dict(ranked["prefill_pressure"])["hog"] == pytest.approx(
        t.prefill_pressure_score(300_000, prefill, 30.0))
    assert dict(ranked["prefill_pressure"])["hog"] == pytest.approx((300_000 / prefill - 0.5) / 0.5)
    assert ranked["prompt_cache_thrash"] == [("thrash", pytest.approx((0.5 - 0.3) / 0.3))]
    assert ranked["agent_loops"] == [("looper", pytest.approx((60 / 1 - 50) / 50))]
    assert ranked["kv_pressure"] == [("kvhog", pytest.approx((0.9 - 0.5) / 0.5))]
    assert ranked["queue_pressure"] == [("burst", pytest.approx((32 / 37 - 0.5) / 0.5))]  # mean of 30 and 34


def test_ranks_by_how_far_past_the_threshold(bus, registry, exporter):
    before = scrape(registry)
    for _ in range(10):
        bus.publish(EngineStepShares(wall_ts=0.0, duration_s=0.1, tenants=(
            TenantStepShare("a", "free", 0, 700, 0, 1), TenantStepShare("b", "free", 0, 300, 0, 1))))
    bus.publish(call("miss-all", 30_000))
    bus.publish(call("miss-most", 30_000, cached=3_000))
    ranked = rank(parse(before), parse(scrape(registry)), seconds=10.0)
    assert [n for n, _ in ranked["prompt_cache_hit_low"]] == ["miss-all", "miss-most"]
    assert ranked["prompt_cache_hit_low"][0][1] == pytest.approx(1.0)   # ratio 0: all the way below
    assert ranked["decode_pressure"] == [("a", pytest.approx(0.4))]     # share 0.7 of 1,000 tokens/s


def test_quiet_traffic_ranks_nobody_and_thresholds_are_configurable(bus, registry, exporter):
    before = scrape(registry)
    normal_traffic(bus, steps=10)
    after = scrape(registry)
    assert all(r == [] for r in rank(before, after, seconds=30.0).values())
    # the same traffic under a stricter threshold: a tenant's 3 calls per run is a loop at 2
    strict = noisy.NoisyThresholds(agent_calls_per_run_above=2.0, agent_min_calls_per_s=0.1)
    assert rank(before, after, 30.0, strict)["agent_loops"] == [("agent", pytest.approx(0.5))]


def test_other_is_never_ranked_and_a_restarted_counter_counts_from_zero(registry):
    retries = make_metric(metric("kvmeter_gateway_retries_total"), registry)
    keyed = make_metric(metric("kvmeter_gateway_idempotent_requests_total"), registry)
    for tid in ("other", "loop"):
        retries.labels("free", tid).inc(1_000)
        keyed.labels("free", tid).inc(1_000)
    before = scrape(registry)
    for tid in ("other", "loop"):
        retries.labels("free", tid).inc(30)
        keyed.labels("free", tid).inc(10)
    assert rank(before, scrape(registry), 10.0)["retries"] == [("loop", pytest.approx((3 - 0.5) / 0.5))]
    # the process restarted (a fresh registry): "after" counts from 0 again, its value is the increase
    fresh = CollectorRegistry()
    make_metric(metric("kvmeter_gateway_retries_total"), fresh).labels("free", "loop").inc(30)
    make_metric(metric("kvmeter_gateway_idempotent_requests_total"), fresh).labels("free", "loop").inc(10)
    assert rank(before, scrape(fresh), 10.0)["retries"] == [("loop", pytest.approx(5.0))]
    with pytest.raises(ValueError, match="seconds"):
        rank(before, before, 0.0)

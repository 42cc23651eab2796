"""The scheduler, quota, ledger and reconciliation sources: their producers' plain stats become exactly the declared
metrics, tenant labels stay bounded (top-K by active work + ``other``) with ``other`` summing the
rest, and running totals become counters (restarts counted from 0)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kvmeter.attribution import Attribution
from kvmeter.exporters.prometheus import OTHER, PrometheusConfig, install_prometheus
from kvmeter.serving.scheduler import Job, SchedulerCore
from kvmeter.stats import (AdmissionDecision, ConfigReloaded, EngineLoad, IdempotencyAttempt, LedgerStats,
                           ReconciliationStats, QuotaStoreState, RequestCompletion, ReservationDrift, SchedulerStats,
                           TenantSchedulerStats, ToolCallReported)
from kvmeter.tokens import TokenCounts


def install(bus, registry, clock, k=2, **kw):
    return install_prometheus(bus, registry, clock=clock,
                              config=PrometheusConfig(top_k_tenants=k, tenant_refresh_s=10, **kw))


def tenant(tid, tier="free", *, depth=0, queued=0, oldest=0.0, kv=0, service=0.0) -> TenantSchedulerStats:
    return TenantSchedulerStats(
        tenant_id=tid, tier=tier, weight=1.0, queue_depth=depth, queued_input_tokens=queued,
        queue_wait_oldest_s=oldest, queue_wait_mean_s=0.0, projected_wait_s=0.0, running=1 if kv else 0,
        active_kv_tokens=kv, kv_budget_tokens=0, service_total=service, input_tokens_total=0,
        output_tokens_total=0, vtc_counter=0.0, dispatched_total=0, completed_total=0)


def snapshot(tenants, **kw) -> SchedulerStats:
    fields = dict(wall_ts=1.75e9, policy="vtc", pressure_level=0, queued_total=0, running_total=0,
                  service_rate_per_s=0.0, jain_index=1.0, max_service_gap=0.0, service_gap=0.0)
    fields.update(kw)
    return SchedulerStats(tenants=list(tenants), **fields)


def series(registry, name):
    """{labels tuple (without __name__) → value} of one sample name."""
    return {tuple(sorted(s.labels.items())): s.value for fam in registry.collect() for s in fam.samples
            if s.name == name}


def by_tenant(registry, name, tier):
    return {dict(k)["tenant"]: v for k, v in series(registry, name).items() if dict(k)["tier"] == tier}


# ---------------------------------------------------------------------------------------- scheduler

def test_scheduler_gauges_bounded_with_other_summing_the_rest(bus, registry, clock):
    exporter = install(bus, registry, clock, k=2)
    bus.publish(snapshot([
        tenant("whale", kv=60_000, depth=1, queued=8_000, oldest=4.0),      # largest active work
        tenant("flood", depth=40, queued=30_000, oldest=12.5),              # nothing running, long queue
        tenant("small1", kv=500, depth=2, queued=100, oldest=1.0),
        tenant("small2", kv=700, depth=3, queued=300, oldest=2.5),
        tenant("acme", "enterprise", kv=2_000, depth=1, queued=50, oldest=0.2),
    ], jain_index=0.62, service_gap=1234.5, max_service_gap=5000.0, pressure_level=1,
       dropped_total={"deadline": 3, "shed": 7}))
    # the two largest by active KV + queued prompt tokens hold the labels — no completion needed
    assert exporter.tenants.labeled() == {"whale", "flood"}
    depth = by_tenant(registry, "kvmeter_scheduler_queue_depth_requests", "free")
    assert depth == {"whale": 1, "flood": 40, OTHER: 5}
    assert by_tenant(registry, "kvmeter_scheduler_queue_depth_requests", "enterprise") == {OTHER: 1}
    assert by_tenant(registry, "kvmeter_scheduler_queue_depth_tokens", "free") == {
        "whale": 8_000, "flood": 30_000, OTHER: 400}
    # oldest wait of "other" is the maximum of its tenants', not a sum
    assert by_tenant(registry, "kvmeter_scheduler_queue_oldest_wait_seconds", "free") == {
        "whale": 4.0, "flood": 12.5, OTHER: 2.5}
    assert by_tenant(registry, "kvmeter_tenant_active_kv_tokens", "free") == {
        "whale": 60_000, "flood": 0, OTHER: 1_200}
    assert registry.get_sample_value("kvmeter_scheduler_jain_index_ratio") == 0.62
    # the current gap (service_gap), not the since-start high-water mark
    assert registry.get_sample_value("kvmeter_scheduler_max_service_gap_tokens") == 1234.5
    assert registry.get_sample_value("kvmeter_scheduler_pressure_level") == 1
    assert registry.get_sample_value("kvmeter_scheduler_dropped_requests_total", {"reason": "shed"}) == 7
    bus.publish(snapshot([], dropped_total={"deadline": 5, "shed": 7, "cancelled": 1}))
    assert series(registry, "kvmeter_scheduler_dropped_requests_total") == {
        (("reason", "deadline"),): 5, (("reason", "shed"),): 7, (("reason", "cancelled"),): 1}


def test_service_counter_takes_increments_and_survives_a_restart(bus, registry, clock):
    install(bus, registry, clock, k=5)
    key = {"tier": "paid_interactive", "tenant": "globex"}
    for total in (100.0, 250.0, 250.0):
        bus.publish(snapshot([tenant("globex", "paid_interactive", kv=10, service=total)]))
    assert registry.get_sample_value("kvmeter_scheduler_service_tokens_total", key) == 250
    bus.publish(snapshot([tenant("globex", "paid_interactive", kv=10, service=30.0)]))  # new scheduler
    assert registry.get_sample_value("kvmeter_scheduler_service_tokens_total", key) == 280


def test_demoted_tenant_series_go_and_other_takes_its_values(bus, registry, clock):
    exporter = install(bus, registry, clock, k=1, tenant_half_life_s=1.0)
    bus.publish(snapshot([tenant("a", kv=9_000, depth=2), tenant("b", kv=100, depth=1)]))
    assert by_tenant(registry, "kvmeter_tenant_active_kv_tokens", "free") == {"a": 9_000, OTHER: 100}
    clock.advance(11)  # refresh due; now b holds the KV
    bus.publish(snapshot([tenant("a", depth=0), tenant("b", kv=50_000, depth=4)]))
    assert exporter.tenants.labeled() == {"b"}
    assert by_tenant(registry, "kvmeter_tenant_active_kv_tokens", "free") == {"b": 50_000, OTHER: 0}
    assert by_tenant(registry, "kvmeter_scheduler_queue_depth_requests", "free") == {"b": 4, OTHER: 0}
    # every tenant leaves: the "other" group is retired, b's own series stays at 0
    bus.publish(snapshot([tenant("b")]))
    assert by_tenant(registry, "kvmeter_scheduler_queue_depth_requests", "free") == {"b": 0}


def test_real_scheduler_snapshot_sums_back_to_the_core(bus, registry, clock):
    """A snapshot of the real SchedulerCore: per-tier sums over the bounded series equal the core's."""
    install(bus, registry, clock, k=2)
    core = SchedulerCore(clock=clock)
    core.on_engine_load(EngineLoad(kv_watermark_ratio=0.1, kv_capacity_tokens=1_000_000, num_running=0,
                                   num_waiting=0))
    n = 0
    for tid, tier, count, prompt in (("acme", "enterprise", 3, 900), ("globex", "paid_interactive", 4, 300),
                                     ("umbrella", "paid_interactive", 6, 5000), ("hob", "free", 5, 50),
                                     ("hob2", "free", 2, 70)):
        for _ in range(count):
            n += 1
            core.submit(
                Job(
                    f"r{n}",
                    Attribution(tid, tier=tier),
                    input_tokens=prompt,
                    max_tokens=64,
                    arrival_s=clock.monotonic(),
                )
            )
    clock.advance(2.0)
    granted = core.dispatch(max_grants=8)
    assert 0 < len(granted) < n  # some running, some still queued
    bus.publish(core.snapshot())
    for tier, depth in core.queue_depth_by_tier().items():
        assert sum(by_tenant(registry, "kvmeter_scheduler_queue_depth_requests", tier).values()) == depth
    kv = {tier: sum(by_tenant(registry, "kvmeter_tenant_active_kv_tokens", tier).values())
          for tier in ("enterprise", "paid_interactive", "free")}
    assert sum(kv.values()) == sum(core.tenant_active_kv(t) for t in ("acme", "globex", "umbrella", "hob", "hob2"))
    assert sum(kv.values()) > 0
    labelled = {d["tenant"] for d in (dict(k) for k in series(registry, "kvmeter_tenant_active_kv_tokens"))}
    assert len(labelled - {OTHER}) <= 2


# ---------------------------------------------------------------------------------------- quota

def drift(dimension, reserved, actual, tier="paid_interactive", outcome="ran"):
    return ReservationDrift(
        attribution=Attribution("globex", tier=tier, api_key_id="k"),
        dimension=dimension,
        reserved=reserved,
        actual=actual,
        outcome=outcome,
    )


def test_reservation_drift_by_direction(bus, registry, clock):
    install(bus, registry, clock)
    bus.publish(drift("input_tokens", 120, 120))
    bus.publish(drift("output_tokens", 512, 40))                   # reserved at max_tokens: over
    bus.publish(drift("cost", Decimal("0.0012"), Decimal("0.0003")))  # money: not a token metric
    bus.publish(drift("input_tokens", 100, 130))                   # estimate too low: under
    bus.publish(drift("output_tokens", 256, 0, outcome="released"))  # nothing ran: all over
    t = {"tier": "paid_interactive"}
    assert registry.get_sample_value("kvmeter_quota_reserved_tokens_total", {**t, "type": "input"}) == 220
    assert registry.get_sample_value("kvmeter_quota_reserved_tokens_total", {**t, "type": "output"}) == 768
    drifts = series(registry, "kvmeter_quota_reservation_drift_tokens_total")
    assert {(dict(k)["type"], dict(k)["direction"]): v for k, v in drifts.items()} == {
        ("output", "over"): 472 + 256, ("input", "under"): 30}


def test_retries_and_idempotent_replays(bus, registry, clock):
    install(bus, registry, clock, k=5)
    bus.publish(AdmissionDecision(attribution=Attribution('acme', tier='enterprise'), admitted=True))
    bus.publish(
        RequestCompletion(
            attribution=Attribution("acme", tier="enterprise", model="m"),
            tokens=TokenCounts(input_tokens=40, output_tokens=10),
            outcome="ok",
        )
    )  # work: acme earns a label
    for outcome, attempt, replayed in (("first", 1, False),        # the original: not a retry
                                       ("joined", 1, True), ("replayed", 1, True),
                                       ("conflict", 1, False), ("in_progress", 1, False),
                                       ("first", 2, False)):        # re-run after an abandoned attempt
        bus.publish(IdempotencyAttempt(tenant_id="acme", outcome=outcome, attempt=attempt, replayed=replayed))
    bus.publish(IdempotencyAttempt(tenant_id="stranger", outcome="replayed", attempt=1, replayed=True))
    assert registry.get_sample_value("kvmeter_gateway_retries_total", {"tier": "enterprise", "tenant": "acme"}) == 5
    # one logical request with a key: the denominator of retries per logical request (rules/noisy.yml)
    assert registry.get_sample_value("kvmeter_gateway_idempotent_requests_total",
                                     {"tier": "enterprise", "tenant": "acme"}) == 1
    assert registry.get_sample_value("kvmeter_gateway_idempotent_replays_total", {"tier": "enterprise"}) == 2
    # a tenant with no admission decision in this process: tier unknown, never dropped
    assert registry.get_sample_value("kvmeter_gateway_idempotent_replays_total", {"tier": "unknown"}) == 1


def test_quota_store_tool_calls_and_reloads(bus, registry, clock):
    install(bus, registry, clock)
    # counters of rare events exist at 0 before the first one, so increase() sees it
    assert registry.get_sample_value("kvmeter_tenancy_config_reloads_total", {"result": "error"}) == 0
    assert registry.get_sample_value("kvmeter_agent_tool_call_reports_total", {"result": "exceeded"}) == 0
    bus.publish(QuotaStoreState(store="redis", degraded=True, reason="ConnectionError", pending_settles=3))
    assert registry.get_sample_value("kvmeter_quota_store_degraded", {"store": "redis"}) == 1
    assert registry.get_sample_value("kvmeter_quota_store_pending_settles_requests", {"store": "redis"}) == 3
    bus.publish(QuotaStoreState(store="redis", degraded=False, reason="recovered"))
    assert registry.get_sample_value("kvmeter_quota_store_degraded", {"store": "redis"}) == 0
    bus.publish(
        ToolCallReported(
            attribution=Attribution("acme", api_key_id="k", agent_run_id="run-1", endpoint="agent_runs.tool_calls"),
            tool_calls=3,
            max_tool_calls=5,
            exceeded=False,
        )
    )
    bus.publish(
        ToolCallReported(
            attribution=Attribution("acme", api_key_id="k", agent_run_id="run-1", endpoint="agent_runs.tool_calls"),
            tool_calls=6,
            max_tool_calls=5,
            exceeded=True,
        )
    )
    assert registry.get_sample_value("kvmeter_agent_tool_call_reports_total", {"result": "exceeded"}) == 1
    bus.publish(ConfigReloaded(ok=False, version=1, error="orgs.acme: bad"))
    bus.publish(ConfigReloaded(ok=True, version=2, keys=5))
    assert registry.get_sample_value("kvmeter_tenancy_config_reloads_total", {"result": "error"}) == 1
    assert registry.get_sample_value("kvmeter_tenancy_config_reloads_total", {"result": "ok"}) == 1


# ---------------------------------------------------------------------------------------- ledger

def test_ledger_stats(bus, registry, clock):
    install(bus, registry, clock)
    bus.publish(LedgerStats(wall_ts=1.75e9, spool_depth_events=1200, spool_oldest_age_seconds=42.5,
                            events_ingested_total={"new": 10, "duplicate": 2, "invalid": 1, "late": 0},
                            insert_retries_total=4, rejected_records_total=1, clickhouse_up=False))
    assert registry.get_sample_value("kvmeter_ledger_spool_depth_events") == 1200
    assert registry.get_sample_value("kvmeter_ledger_spool_oldest_age_seconds") == 42.5
    assert registry.get_sample_value("kvmeter_ledger_clickhouse_up") == 0
    assert registry.get_sample_value("kvmeter_ledger_insert_retries_total") == 4
    assert registry.get_sample_value("kvmeter_ledger_events_ingested_total", {"status": "late"}) == 0
    bus.publish(LedgerStats(wall_ts=1.75e9 + 5, spool_depth_events=0, clickhouse_up=True,
                            events_ingested_total={"new": 15, "duplicate": 2, "invalid": 1, "late": 0},
                            insert_retries_total=4))
    assert registry.get_sample_value("kvmeter_ledger_spool_depth_events") == 0
    assert registry.get_sample_value("kvmeter_ledger_clickhouse_up") == 1
    assert registry.get_sample_value("kvmeter_ledger_events_ingested_total", {"status": "new"}) == 15
    # the ledger was reopened: its totals restart, the counters go on from where they were
    bus.publish(LedgerStats(wall_ts=1.75e9 + 9, events_ingested_total={"new": 3, "duplicate": 0,
                                                                      "invalid": 0, "late": 0}))
    assert registry.get_sample_value("kvmeter_ledger_events_ingested_total", {"status": "new"}) == 18
    assert registry.get_sample_value("kvmeter_ledger_insert_retries_total") == 4


def test_reconciliation_stats(bus, registry, clock):
    install(bus, registry, clock)
    assert registry.get_sample_value("kvmeter_reconciliation_runs_total", {"result": "error"}) == 0
    # no successful run yet reads 0 (the epoch): KvmeterReconciliationStale holds until a run succeeds
    assert registry.get_sample_value("kvmeter_reconciliation_last_run_timestamp_seconds") == 0
    bus.publish(ReconciliationStats(wall_ts=1.75e9, ok=True, period_start_ts=1.7499e9, period_end_ts=1.74999e9,
                                    drift_ratio={"engine": 0.004, "gateway": 0.0}, runs_total={"ok": 1, "error": 0},
                                    last_ok_ts=1.75e9))
    assert registry.get_sample_value("kvmeter_reconciliation_drift_ratio", {"view": "engine"}) == 0.004
    assert registry.get_sample_value("kvmeter_reconciliation_drift_ratio", {"view": "gateway"}) == 0.0
    assert registry.get_sample_value("kvmeter_reconciliation_last_run_timestamp_seconds") == 1.75e9
    # a failed run: counted; the drift and the last successful run's time stay as they were
    bus.publish(ReconciliationStats(wall_ts=1.75e9 + 3600, ok=False, period_start_ts=0.0, period_end_ts=0.0,
                                    runs_total={"ok": 1, "error": 1}, last_ok_ts=1.75e9, error="down"))
    assert registry.get_sample_value("kvmeter_reconciliation_runs_total", {"result": "error"}) == 1
    assert registry.get_sample_value("kvmeter_reconciliation_runs_total", {"result": "ok"}) == 1
    assert registry.get_sample_value("kvmeter_reconciliation_last_run_timestamp_seconds") == 1.75e9
    assert registry.get_sample_value("kvmeter_reconciliation_drift_ratio", {"view": "engine"}) == 0.004


@pytest.mark.parametrize("k", [0, 3])
def test_tenant_series_never_exceed_k_per_label_combination(bus, registry, clock, k):
    install(bus, registry, clock, k=k)
    for round_ in range(3):
        bus.publish(snapshot([tenant(f"t{i}", kv=(i + 1) * (round_ + 1) * 100, depth=i % 4, service=i * 10.0)
                              for i in range(200)]))
        clock.advance(11)
    for name in ("kvmeter_scheduler_queue_depth_requests", "kvmeter_tenant_active_kv_tokens",
                 "kvmeter_scheduler_service_tokens_total"):
        tenants = set(by_tenant(registry, name, "free"))
        assert len(tenants - {OTHER}) <= k and OTHER in tenants, (name, tenants)
    total_kv = sum(by_tenant(registry, "kvmeter_tenant_active_kv_tokens", "free").values())
    assert total_kv == sum((i + 1) * 3 * 100 for i in range(200))


def test_shared_service_failures_become_a_counter(bus, registry, clock):
    install(bus, registry, clock)
    bus.publish(snapshot([]))  # no sharing (None): the label-less counter stays at 0
    assert series(registry, "kvmeter_scheduler_shared_service_sync_errors_total") == {(): 0.0}
    bus.publish(snapshot([], shared_service_failures_total=3))
    bus.publish(snapshot([], shared_service_failures_total=5))
    assert series(registry, "kvmeter_scheduler_shared_service_sync_errors_total") == {(): 5.0}

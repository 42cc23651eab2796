"""The dashboards' ClickHouse reads on a small real chDB ledger written through the ledger's own
insert path, with hand-computed expectations; and the tenant scope of the data layer."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Iterator

import pytest
from dashkit import close_dashboard_backend, stop_readers

from kvmeter.attribution import Attribution
from kvmeter.clock import ManualClock
from kvmeter.events import UsageEvent, event_id_for
from kvmeter.ledger import AttemptRecord, Ledger, LedgerConfig, SignalSample
from kvmeter.ledger.connection import ClientHolder, connect
from kvmeter.dashboards.errors import ScopeError
from kvmeter.dashboards.source import ScopedSource
from kvmeter.dashboards.sql import SqlSource
from kvmeter.dashboards.viewer import TierInfo, Viewer
from kvmeter.dashboards.window import Window
from kvmeter.stats import EngineStepShares, TenantStepShare
from kvmeter.tokens import TokenCounts

T0 = datetime(2026, 11, 27, 2, 0, tzinfo=timezone.utc)
TIERS = [TierInfo("enterprise", 8.0, ttft_slo_s=1.0, itl_slo_s=0.05), TierInfo("free", 1.0, ttft_slo_s=10.0)]
WINDOW = Window(T0, T0 + timedelta(minutes=2), 60)


def event(i: int, tenant: str, tier: str, *, at: float, prompt: int, out: int, ttft: float | None,
          itl: float | None = 0.02, queue: float = 0.1, outcome: str = "ok", reserved_out: int = 100) -> UsageEvent:
    start = T0.timestamp() + at
    return UsageEvent(
        event_id=event_id_for(tenant, f"k{i}"), request_id=f"{tenant}-{i}",
        attribution=Attribution(tenant, api_key_id=f"{tenant}-key", tier=tier, model="SmolLM2-135M-Instruct",
                                endpoint="chat.completions"),
        tokens=TokenCounts(input_tokens=prompt, output_tokens=out),
        reserved=TokenCounts(input_tokens=prompt, output_tokens=reserved_out), outcome=outcome,
        finish_reason="stop" if outcome == "ok" else "abort", arrival_ts=start, finish_ts=start + 2.0,
        queue_s=queue, ttft_s=ttft, itl_mean_s=itl, e2e_s=2.0, kv_token_seconds=float(prompt + out),
        token_source="engine_hooks" if outcome == "ok" else "frontend")


EVENTS = [
    # bucket 02:00 — acme: one inside its SLO, one with TTFT over 1 s; free: no ITL (one token)
    event(1, "acme", "enterprise", at=1, prompt=100, out=20, ttft=0.5),
    event(2, "acme", "enterprise", at=5, prompt=300, out=40, ttft=1.5),
    event(3, "hobby", "free", at=10, prompt=50, out=1, ttft=2.0, itl=None, queue=0.0),
    # bucket 02:01 — acme: ITL over 50 ms; hobby: aborted
    event(4, "acme", "enterprise", at=61, prompt=200, out=60, ttft=0.2, itl=0.08),
    event(5, "hobby", "free", at=62, prompt=40, out=10, ttft=0.3, outcome="aborted", reserved_out=50),
    # outside the window
    event(6, "acme", "enterprise", at=200, prompt=999, out=9, ttft=0.1),
]



def _step(at: float, *tenants: TenantStepShare) -> EngineStepShares:
    return EngineStepShares(wall_ts=T0.timestamp() + at, duration_s=0.5, tenants=tenants)


# engine steps (0.5 s each): acme-2 (TTFT 1.5 s > enterprise's 1 s) waited 5 → 6.5 s, acme-4 (mean
# ITL 80 ms > 50 ms) streamed 61.2 → 63 s
STEPS = [
    _step(5.5, TenantStepShare("hobby", "free", 300, 0, 300, 1)),
    _step(6.0, TenantStepShare("acme", "enterprise", 300, 0, 300, 1, ("acme-2",)),
          TenantStepShare("hobby", "free", 0, 1, 301, 1)),
    _step(61.1, TenantStepShare("acme", "enterprise", 200, 0, 200, 1, ("acme-4",))),
    _step(62.0, TenantStepShare("acme", "enterprise", 0, 1, 201, 1),
          TenantStepShare("hobby", "free", 40, 0, 40, 1, ("hobby-5",))),
]


@pytest.fixture
def source(tmp_path: Path) -> Iterator[SqlSource]:
    stop_readers()  # chDB: one embedded engine per process
    close_dashboard_backend()
    config = LedgerConfig(dsn=f"chdb://{tmp_path / 'chdb'}", spool_dir=tmp_path / "spool", flush_interval_s=3600,
                          rollup_interval_s=3600, close_timeout_s=10,
                          engine_steps_retention_days=0)  # T0 is in the past: keep its engine_steps rows
    ledger = Ledger.open(config, clock=ManualClock(start_wall=T0.timestamp() + 3600))
    try:
        for e in EVENTS:
            ledger.record_sync(e)
            ledger.record_attempt_sync(AttemptRecord(attribution=Attribution(e.tenant_id, tier=e.attribution.tier),
                                                     request_id=e.request_id, status="admitted", ts=e.arrival_ts,
                                                     event_id=e.event_id))
        limits = [("concurrency_limited", "api_key", "concurrent_requests"),
                  ("concurrency_limited", "api_key", "concurrent_requests"),
                  ("rate_limited", "org", "requests_per_minute")]
        for i, (reason, level, dimension) in enumerate(limits):
            ledger.record_attempt_sync(
                AttemptRecord(
                    attribution=Attribution("hobby", tier="free"),
                    request_id=f"x{i}",
                    status="rejected",
                    ts=T0.timestamp() + 3 + i,
                    reason=reason,
                    status_code=429,
                    level=level,
                    dimension=dimension,
                )
            )
        ts = T0.timestamp()
        ledger.write_signals(
            [SignalSample(ts + s, "kvmeter_engine_kv_watermark_ratio", s / 100, {"engine": "0", "model": "m"})
             for s in range(0, 120, 10)]
            + [SignalSample(ts + s, "kvmeter_tenant_active_kv_tokens", v, {"tier": t, "tenant": t_id})
               for s in (5, 65) for t, t_id, v in (("enterprise", "acme", 400.0), ("free", "hobby", 50.0))])
        for step in STEPS:
            ledger.record_step_shares(step, model="SmolLM2-135M-Instruct", replica="r1")
        assert ledger.flush(30)
        src = SqlSource(ClientHolder(lambda: connect(config)), ledger.prices, tiers=TIERS)
        yield src
        src.close()
    finally:
        ledger.close()


def by(rows: list[dict[str, Any]], *keys: str) -> dict[Any, dict[str, Any]]:
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in rows}


def test_traffic_per_bucket(source):
    rows = by(source.traffic(WINDOW), "ts")
    first, second = rows[T0], rows[T0 + timedelta(minutes=1)]
    assert (first["requests"], first["input_tokens"], first["output_tokens"]) == (3, 450, 61)
    assert first["kv_token_seconds"] == 511.0 and first["queue_seconds"] == pytest.approx(0.2)
    assert (second["requests"], second["aborted_requests"], second["max_input_tokens"]) == (2, 1, 200)
    assert len(rows) == 2  # event 6 is outside the window


def test_goodput_follows_the_gateways_slo_rule(source):
    rows = by(source.goodput(WINDOW), "ts", "tier")
    ent0 = rows[(T0, "enterprise")]
    assert (ent0["requests"], ent0["good_requests"], ent0["slo_missed_requests"]) == (2, 1, 1)  # TTFT 1.5 s > 1 s
    assert (ent0["good_input_tokens"], ent0["good_output_tokens"]) == (100, 20)
    ent1 = rows[(T0 + timedelta(minutes=1), "enterprise")]
    assert ent1["good_requests"] == 0  # mean ITL 80 ms > 50 ms
    free0 = rows[(T0, "free")]
    assert free0["good_requests"] == 1  # 2 s within 10 s; no ITL (one token) does not count against it
    free1 = rows[(T0 + timedelta(minutes=1), "free")]
    assert free1["good_requests"] == 0 and free1["aborted_tokens"] == 50


def test_latency_percentiles_by_tier_are_exact(source):
    rows = by(source.latency_by_tier(WINDOW), "tier")
    ent = rows["enterprise"]
    assert ent["requests"] == 3 and ent["ttft_p50_s"] == pytest.approx(0.5)
    assert ent["ttft_p99_s"] == pytest.approx(0.5 + 0.98 * (1.5 - 0.5))  # linear interpolation
    assert rows["free"]["itl_p50_s"] == pytest.approx(0.02)  # only the request that has an ITL
    assert rows["free"]["prefill_mean_s"] is None  # missing stays missing, never 0


def test_attempts_and_reservations(source):
    rej = by(source.attempts_by_tenant(WINDOW), "tenant_id", "status", "reason")
    assert rej[("hobby", "rejected", "concurrency_limited")]["attempts"] == 2
    assert rej[("hobby", "rejected", "rate_limited")]["status_code"] == 429
    limits = {(r["level"], r["dimension"], r["reason"]): r["attempts"] for r in source.rejections_by_limit(WINDOW)}
    assert limits == {("api_key", "concurrent_requests", "concurrency_limited"): 2,
                      ("org", "requests_per_minute", "rate_limited"): 1}
    res = by(source.reservation_by_tenant(WINDOW), "tenant_id")
    assert res["acme"]["reserved_output_tokens"] == 300 and res["acme"]["output_tokens"] == 120
    assert res["acme"]["over_reserved_requests"] == 3
    bins = {r["bin"]: r["requests"] for r in source.output_budget_use(WINDOW)}
    assert bins == {0: 1, 2: 2, 4: 1, 6: 1}  # 1/100, 20/100, 10/50, 40/100, 60/100 → tenths


def test_signals_by_label_and_tenant(source):
    kv = source.signal_gauge(WINDOW, "kvmeter_engine_kv_watermark_ratio", ("engine",), "max")
    assert [(r["engine"], r["value"]) for r in kv] == [("0", 0.5), ("0", 1.1)]
    last = source.signal_gauge(WINDOW, "kvmeter_engine_kv_watermark_ratio", (), "last")
    assert [r["value"] for r in last] == [0.5, 1.1]
    per_tenant = source.signal_gauge(WINDOW, "kvmeter_tenant_active_kv_tokens", ("tenant",), "avg", ["acme"])
    assert {r["tenant"] for r in per_tenant} == {"acme"}
    cat = by(source.signal_catalog(WINDOW), "name")
    assert cat["kvmeter_engine_kv_watermark_ratio"]["samples"] == 12
    assert set(by(source.signal_catalog(WINDOW, ["acme"]), "name")) == {"kvmeter_tenant_active_kv_tokens"}
    with pytest.raises(ValueError):
        source.signal_gauge(WINDOW, "x", ("value",))  # a label key may not shadow a result column
    with pytest.raises(ValueError):
        source.signal_gauge(WINDOW, "x", (), "median")


def test_user_text_is_bound_not_spliced(source):
    evil = "acme' OR 1=1 --"
    assert source.traffic(WINDOW, [evil]) == []
    assert source.signal_gauge(WINDOW, "kvmeter_engine_kv_watermark_ratio", (evil,)) != []  # a key, not SQL


def test_scoped_source_enforces_the_tenant(source):
    acme = ScopedSource(source, Viewer("acme", "enterprise", "acme-key"))
    assert {r["tenant_id"] for r in acme.read("tenant_totals", WINDOW)} == {"acme"}
    assert {r["tenant_id"] for r in acme.read("tenant_totals", WINDOW, ["acme"])} == {"acme"}
    for asked in (["hobby"], ["acme", "hobby"]):
        with pytest.raises(ScopeError):
            acme.read("tenant_totals", WINDOW, asked)
    assert acme.signal_gauge(WINDOW, "kvmeter_engine_kv_watermark_ratio") == []  # platform-wide: admin only
    assert {r["tenant"] for r in acme.signal_gauge(WINDOW, "kvmeter_tenant_active_kv_tokens", ("tenant",))} == {"acme"}
    with pytest.raises(ScopeError):
        acme.invoice(WINDOW.period, "hobby")
    assert {r["tenant_id"] for r in acme.invoice(WINDOW.period)} == {"acme"}
    admin = ScopedSource(source, Viewer("platform", "enterprise", "platform-admin", admin=True))
    assert {r["tenant_id"] for r in admin.read("tenant_totals", WINDOW)} == {"acme", "hobby"}
    assert {r["tenant_id"] for r in admin.read("tenant_totals", WINDOW, ["hobby"])} == {"hobby"}
    with pytest.raises(ValueError):
        admin.read("drop_table", WINDOW)


def test_noisy_neighbours_through_the_sql_source_and_its_scope(source):
    # events 1, 2, 4 of acme in the window (6 is outside): 600 input tokens, none cached, no key
    admin = ScopedSource(source, Viewer("platform", "enterprise", "platform-admin", admin=True))
    rows = {r["tenant_id"]: r for r in admin.read("noisy_neighbours", WINDOW)}
    assert set(rows) == {"acme", "hobby"}
    acme = rows["acme"]
    assert (acme["input_tokens"], acme["cached_input_tokens"], acme["prompt_cache_hit_ratio"]) == (600, 0, 0.0)
    assert (acme["attempts"], acme["logical_requests"], acme["retries"]) == (3, 3, 0)
    assert acme["retries_per_logical_request"] is None
    # no agent run here: no call, no ratio, no history row
    assert (acme["agent_model_calls"], acme["agent_runs"], acme["model_calls_per_agent_run"]) == (0, 0, None)
    assert admin.read("agent_calls_per_run", WINDOW) == []
    tenant = ScopedSource(source, Viewer("acme", "enterprise", "acme-key"))
    assert [r["tenant_id"] for r in tenant.read("noisy_neighbours", WINDOW)] == ["acme"]
    for read in ("noisy_neighbours", "agent_calls_per_run"):
        with pytest.raises(ScopeError):
            tenant.read(read, WINDOW, ["hobby"])


def test_interference_through_the_sql_source_names_for_an_admin_anonymized_for_a_tenant(source):
    admin = ScopedSource(source, Viewer("platform", "enterprise", "platform-admin", admin=True))
    rows = by(admin.read("interference", WINDOW), "objective", "neighbour")
    # TTFT of acme-2, steps 5.5 and 6.0: prefill hobby 300, acme 300 (its own); decode hobby 1
    ttft_hobby, ttft_acme = rows[("ttft", "hobby")], rows[("ttft", "acme")]
    assert (ttft_hobby["prefill_share"], ttft_hobby["decode_share"], ttft_acme["prefill_share"]) == (0.5, 1.0, 0.5)
    assert ttft_hobby["kv_token_seconds"] == (300 + 301) * 0.5 and ttft_acme["decode_share"] == 0.0
    # ITL of acme-4, step 62.0 (61.1 was its prefill, before its first token): prefill hobby 40, decode acme 1
    itl_hobby, itl_acme = rows[("itl", "hobby")], rows[("itl", "acme")]
    assert (itl_hobby["prefill_tokens"], itl_hobby["prefill_share"], itl_acme["decode_share"]) == (40, 1.0, 1.0)
    assert {r["tenant_id"] for r in rows.values()} == {"acme"}
    tenant = ScopedSource(source, Viewer("acme", "enterprise", "acme-key"))
    seen = tenant.read("interference", WINDOW)
    assert {r["neighbour"] for r in seen} == {"acme", "tenant-1"}
    assert [r["prefill_share"] for r in seen if r["objective"] == "ttft"] == [0.5, 0.5]


def test_the_noisy_pages_interference_bars_are_the_reads_shares(source):
    from kvmeter.dashboards import schemas
    from kvmeter.dashboards.frames import frame
    from kvmeter.dashboards.views.noisy import interference_shares

    rows = ScopedSource(source, Viewer("acme", "enterprise", "acme-key")).read("interference", WINDOW)
    long = interference_shares(frame(rows, schemas.INTERFERENCE))
    bars = {(r["bar"], r["neighbour"]): r["share"] for r in long.iter_rows(named=True)}
    assert bars[("acme · TTFT · prefill", "tenant-1")] == 0.5
    assert bars[("acme · TTFT · decode", "tenant-1")] == 1.0
    assert bars[("acme · ITL · prefill", "tenant-1")] == 1.0
    # per bar the shares of every tenant sum to 1
    for bar in {b for b, _ in bars}:
        assert sum(v for (b, _), v in bars.items() if b == bar) == 1.0

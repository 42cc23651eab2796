"""Pure transforms and the time window (no I/O)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import polars as pl
import pytest

from kvmeter.dashboards.frames import (OTHER, fill_buckets, jain_by_bucket, jain_index, reservation_drift, service,
                                       tenant_ranking, to_csv_bytes, to_parquet_bytes, top_n, traffic_rates)
from kvmeter.dashboards.schemas import TENANT_TOTALS, TRAFFIC, TRAFFIC_BY_TENANT
from kvmeter.dashboards.frames import frame
from kvmeter.dashboards.viewer import TierInfo
from kvmeter.dashboards.window import Window, choose_step

T0 = datetime(2026, 11, 27, 2, 0, tzinfo=timezone.utc)
TIERS = [TierInfo("enterprise", weight=8.0, ttft_slo_s=1.0, itl_slo_s=0.05), TierInfo("free", weight=1.0)]


def test_step_keeps_charts_under_240_points():
    assert choose_step(900) == 5        # 15 min → 180 buckets of 5 s
    assert choose_step(3600) == 15      # 1 h → 240 buckets of 15 s
    assert choose_step(86400) == 600    # 1 day → 144 buckets of 10 min
    assert choose_step(7 * 86400) == 3600
    with pytest.raises(ValueError):
        choose_step(0)


def test_live_window_includes_the_filling_bucket_and_pinned_one_stops_at_its_end():
    now = T0 + timedelta(seconds=7)
    live = Window.last(3600, now)
    assert live.step_s == 15 and live.end == T0 + timedelta(seconds=15) and live.span_s == 3600
    assert Window.last(3600, now + timedelta(seconds=3)) == live  # same bucket, same window (cache key)
    pinned = Window.ending(3600, now)
    assert pinned.end == now and pinned.start == now - timedelta(hours=1)
    assert len(live.bucket_starts()) == 240
    assert Window.from_query(live.to_query()) == live
    with pytest.raises(ValueError):
        Window(T0, T0, 15)
    with pytest.raises(ValueError):
        Window(T0, T0 + timedelta(hours=1), 7)


def test_rates_divide_by_the_seconds_each_bucket_covered():
    w = Window(T0, T0 + timedelta(seconds=60), 15)
    traffic = frame([{"ts": T0, "requests": 30, "input_tokens": 3000, "output_tokens": 600,
                      "kv_token_seconds": 1500.0, "queue_seconds": 7.5},
                     {"ts": T0 + timedelta(seconds=30), "requests": 5, "input_tokens": 500, "output_tokens": 50,
                      "kv_token_seconds": 50.0, "queue_seconds": 0.0}], TRAFFIC)
    now = T0 + timedelta(seconds=35)  # the 30 s bucket has run 5 s; the 45 s one has not started
    r = traffic_rates(traffic, w, now).sort("ts")
    assert r.get_column("requests").to_list() == [30, 0, 5, 0]  # quiet buckets are 0, not gaps
    assert r.get_column("requests_per_s").to_list() == [2.0, 0.0, 1.0, None]
    assert r.get_column("input_tokens_per_s")[0] == 200.0
    assert r.get_column("active_kv_tokens")[0] == 100.0   # 1500 token·s over 15 s
    assert r.get_column("queue_depth")[0] == 0.5          # Little: 7.5 s of waiting over 15 s
    assert r.get_column("tokens_per_request").to_list()[:3] == [120.0, None, 110.0]


def test_jain_index_known_values():
    assert jain_index([5, 5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)  # 1/n: one party gets everything
    assert jain_index([3, 1]) == pytest.approx(16 / 20)
    assert jain_index([7]) == 1.0 and jain_index([0, 0]) == 1.0 and jain_index([]) is None
    with pytest.raises(ValueError):
        jain_index([1, -1])


def test_service_is_vtc_weighted_and_normalised_by_tier_weight():
    df = pl.DataFrame({"tier": ["enterprise", "free", "nosuch"], "input_tokens": [800, 100, 10],
                       "output_tokens": [400, 50, 5]})
    s = service(df, TIERS)
    assert s.get_column("service_tokens").to_list() == [1600.0, 200.0, 20.0]   # 1 × in + 2 × out
    assert s.get_column("normalised_service").to_list() == [200.0, 200.0, 20.0]  # ÷ weight 8, 1, 1


def test_jain_counts_only_backlogged_tenants():
    rows = [{"ts": T0, "tenant_id": "a", "tier": "enterprise", "requests": 1, "input_tokens": 800,
             "output_tokens": 400, "kv_token_seconds": 1.0, "queue_seconds": 1.0, "backlogged": 1},
            {"ts": T0, "tenant_id": "b", "tier": "free", "requests": 1, "input_tokens": 100,
             "output_tokens": 50, "kv_token_seconds": 1.0, "queue_seconds": 1.0, "backlogged": 1},
            {"ts": T0, "tenant_id": "c", "tier": "free", "requests": 1, "input_tokens": 1,
             "output_tokens": 1, "kv_token_seconds": 1.0, "queue_seconds": 0.0, "backlogged": 0}]
    j = jain_by_bucket(frame(rows, TRAFFIC_BY_TENANT), TIERS)
    assert j.get_column("tenants").to_list() == [2]
    assert j.get_column("jain_index").to_list() == [pytest.approx(1.0)]  # equal normalised service
    everyone = jain_by_bucket(frame(rows, TRAFFIC_BY_TENANT), TIERS, backlogged_only=False)
    assert everyone.get_column("jain_index")[0] < 0.7


def test_ranking_puts_the_kv_holder_first_not_the_chatty_tenant():
    w = Window(T0, T0 + timedelta(seconds=100), 5)
    totals = frame([{"tenant_id": "chatty", "tier": "free", "requests": 500, "input_tokens": 150_000,
                     "output_tokens": 50_000, "kv_token_seconds": 1_000.0},
                    {"tenant_id": "noisy", "tier": "free", "requests": 20, "input_tokens": 3_000_000,
                     "output_tokens": 160_000, "kv_token_seconds": 900_000.0}], TENANT_TOTALS)
    r = tenant_ranking(totals, TIERS, w)
    top = r.row(0, named=True)
    assert top["tenant_id"] == "noisy" and top["rank_by_kv"] == 1 and top["rank_by_tokens"] == 1
    assert top["rank_by_requests"] == 2
    assert top["mean_active_kv_tokens"] == 9000.0
    assert r.get_column("kv_share").sum() == pytest.approx(1.0)


def test_top_n_folds_the_rest_and_keeps_totals():
    df = pl.DataFrame({"ts": [T0] * 4, "tenant": ["a", "b", "c", "d"], "value": [10.0, 5.0, 2.0, 1.0]})
    out = top_n(df, "tenant", "value", 2)
    assert dict(zip(out["tenant"], out["value"], strict=True)) == {"a": 10.0, "b": 5.0, OTHER: 3.0}
    assert top_n(df, "tenant", "value", 4).equals(df)


def test_reservation_drift_sign_and_ratio():
    df = pl.DataFrame({"reserved_input_tokens": [100, 0], "reserved_output_tokens": [900, 0],
                       "input_tokens": [100, 5], "output_tokens": [150, 5]})
    d = reservation_drift(df)
    assert d.get_column("drift_tokens").to_list() == [750, -10]
    assert d.get_column("drift_ratio").to_list() == [0.75, None]
    assert d.get_column("output_use_ratio").to_list() == [150 / 900, None]


def test_fill_buckets_by_group():
    w = Window(T0, T0 + timedelta(seconds=30), 15)
    df = pl.DataFrame({"ts": [T0], "tenant": ["a"], "n": [3]}, schema={"ts": pl.Datetime("us", "UTC"),
                                                                        "tenant": pl.String, "n": pl.Int64})
    out = fill_buckets(df, w, ("tenant",), ("n",))
    assert out.get_column("n").to_list() == [3, 0]


def test_downloads_round_trip_exact_decimals():
    from decimal import Decimal

    df = pl.DataFrame({"tenant_id": ["acme"], "cost": [Decimal("0.000356400000000000")]},
                      schema={"tenant_id": pl.String, "cost": pl.Decimal(38, 18)})
    assert b"0.000356400000000000" in to_csv_bytes(df)
    back = pl.read_parquet(to_parquet_bytes(df))
    assert back.schema["cost"] == pl.Decimal(38, 18) and back.item(0, "cost") == Decimal("0.0003564")


def test_noisy_neighbour_detectors_fire_on_the_rules_thresholds():
    from kvmeter.dashboards.schemas import NOISY_NEIGHBOURS
    from kvmeter.dashboards.views.noisy import CACHE, RETRIES, detector_states

    # over 900 s (thresholds: hit ratio < 0.25 at >= 500 input tokens/s; > 0.5 retries per keyed
    # logical request at >= 0.1 retries/s)
    noisy = frame([
        # thrash: 900,000 input tokens (1,000/s), 45,000 cached (0.05): fires
        {"tenant_id": "thrash", "tier": "free", "input_tokens": 900_000, "cached_input_tokens": 45_000,
         "prompt_cache_hit_ratio": 0.05, "logical_requests": 300, "keyed_logical_requests": 0, "attempts": 300,
         "retries": 0, "retries_per_logical_request": None},
        # quiet: the same ratio at 100 input tokens/s; 180 retries of 100 keyed requests (1.8, 0.2/s): fires
        {"tenant_id": "loop", "tier": "enterprise", "input_tokens": 90_000, "cached_input_tokens": 4_500,
         "prompt_cache_hit_ratio": 0.05, "logical_requests": 100, "keyed_logical_requests": 100, "attempts": 280,
         "retries": 180, "retries_per_logical_request": 1.8},
        # warm and rarely retrying: quiet on both
        {"tenant_id": "warm", "tier": "enterprise", "input_tokens": 900_000, "cached_input_tokens": 600_000,
         "prompt_cache_hit_ratio": 2 / 3, "logical_requests": 400, "keyed_logical_requests": 400, "attempts": 440,
         "retries": 40, "retries_per_logical_request": 0.1},
    ], NOISY_NEIGHBOURS)
    states = detector_states(noisy, 900.0)
    got = {(r["tenant_id"], r["detector"]): r["state"] for r in states.iter_rows(named=True)}
    assert got == {("thrash", CACHE): "firing", ("thrash", RETRIES): "quiet",
                   ("loop", CACHE): "quiet", ("loop", RETRIES): "firing",
                   ("warm", CACHE): "quiet", ("warm", RETRIES): "quiet"}
    assert states.get_column("state").to_list()[:2] == ["firing", "firing"]  # firing rows first
    loop = states.filter((pl.col("tenant_id") == "loop") & (pl.col("detector") == RETRIES)).row(0, named=True)
    assert loop["value"] == 1.8 and loop["rate_per_s"] == pytest.approx(0.2)


def test_signal_history_detectors_apply_the_rules_predicates_to_the_window():
    from kvmeter.dashboards.views.noisy import (DECODE, KV, PREFILL, QUEUE, engine_shares, level_shares,
                                                signal_detector_states)
    from kvmeter.exporters.prometheus.rules.noisy import THRESHOLDS as t

    t0 = datetime(2026, 12, 4, 12, tzinfo=timezone.utc)
    ts = [t0 + timedelta(seconds=60 * i) for i in range(10)]  # a 600 s window of 60 s buckets
    # prefill, model m1 (tokens/s per bucket): hog 3,000 on two engines (1,500 each), fair 500 → hog 6/7 of 3,500/s
    # model m2: solo 100 tokens/s alone (share 1, not busy). decode: hog 60, fair 60 → 0.5, not above
    engine = pl.DataFrame(
        [{"ts": x, "model": "m1", "engine": e, "tier": "free", "tenant": "hog", "value": 1500.0}
         for x in ts for e in ("0", "1")]
        + [{"ts": x, "model": "m1", "engine": "0", "tier": "paid", "tenant": "fair", "value": 500.0} for x in ts]
        + [{"ts": x, "model": "m2", "engine": "2", "tier": "free", "tenant": "solo", "value": 100.0} for x in ts])
    prefill = engine_shares(engine)
    assert prefill.filter((pl.col("tenant") == "hog") & (pl.col("ts") == t0)).row(0, named=True)["share"] == \
        pytest.approx(6 / 7)
    decode = engine_shares(engine.filter(pl.col("tenant") != "solo").with_columns(pl.lit(60.0).alias("value"))
                           .unique(["ts", "tenant"]))
    # queue: burst waits 30 in half the buckets (mean 15), calm 5 → 0.75 of a mean 20 waiting; KV: 0.9 of it is big's
    queue = level_shares(pl.DataFrame(
        [{"ts": x, "tier": "free", "tenant": "burst", "value": 30.0} for x in ts[:5]]
        + [{"ts": x, "tier": "paid", "tenant": "calm", "value": 5.0} for x in ts]))
    kv = level_shares(pl.DataFrame(
        [{"ts": x, "tier": "free", "tenant": "big", "value": 9000.0} for x in ts]
        + [{"ts": x, "tier": "paid", "tenant": "calm", "value": 1000.0} for x in ts]))
    states = signal_detector_states(prefill, decode, queue, kv, 0.8, 600.0, 60.0)
    got = {(r["tenant_id"], r["detector"]): r["state"] for r in states.iter_rows(named=True)}
    assert got == {("hog", PREFILL): "firing", ("fair", PREFILL): "quiet", ("solo", PREFILL): "quiet",
                   ("hog", DECODE): "quiet", ("fair", DECODE): "quiet",
                   ("burst", QUEUE): "firing", ("calm", QUEUE): "quiet",
                   ("big", KV): "firing", ("calm", KV): "quiet"}
    row = {(r["tenant_id"], r["detector"]): r for r in states.iter_rows(named=True)}
    assert row[("hog", PREFILL)]["value"] == pytest.approx(6 / 7) and row[("hog", PREFILL)]["rate_per_s"] == \
        pytest.approx(3500.0)
    assert row[("burst", QUEUE)]["value"] == pytest.approx(0.75) and row[("burst", QUEUE)]["rate_per_s"] == 20.0
    assert t.queue_pressure_score(15.0, 20.0) is not None  # the same predicate, on the window's means
    # the KV detector needs a full cache: at a 0.7 watermark nobody fires
    calm = signal_detector_states(prefill.clear(), decode.clear(), queue.clear(), kv, 0.7, 600.0, 60.0)
    assert set(calm.get_column("state")) == {"quiet"}


def test_prompt_cache_thrash_on_the_page_is_the_rules_predicate():
    from kvmeter.dashboards.schemas import NOISY_NEIGHBOURS
    from kvmeter.dashboards.views.noisy import THRASH, thrash_states

    t0 = datetime(2026, 12, 4, 12, tzinfo=timezone.utc)
    # 600 s in 60 s buckets; churn re-prefills 400 tokens/s on two models (300 + 100) in half the buckets
    reprefill = pl.DataFrame([{"ts": t0 + timedelta(seconds=60 * i), "tenant": "churn", "model": m, "value": v}
                              for i in range(5) for m, v in (("m1", 300.0), ("m2", 100.0))])
    row = {"logical_requests": 10, "keyed_logical_requests": 0, "attempts": 10, "retries": 0,
           "retries_per_logical_request": None, "cached_input_tokens": 0, "prompt_cache_hit_ratio": 0.0}
    noisy = frame([{**row, "tenant_id": "churn", "tier": "free", "input_tokens": 600_000},   # 1,000/s; 0.2 again
                   {**row, "tenant_id": "quiet", "tier": "free", "input_tokens": 60_000}], NOISY_NEIGHBOURS)
    # 5 buckets × 60 s × 400 tokens/s = 120,000 re-prefilled of 600,000: 0.2, under the 0.3 threshold
    states = thrash_states(noisy, reprefill, 600.0, 60.0)
    got = {r["tenant_id"]: (r["state"], r["value"]) for r in states.iter_rows(named=True)}
    assert got == {"churn": ("quiet", pytest.approx(0.2)), "quiet": ("quiet", 0.0)}
    assert set(states.get_column("detector")) == {THRASH}
    doubled = reprefill.with_columns(pl.col("value") * 2)  # 0.4: above
    assert thrash_states(noisy, doubled, 600.0, 60.0).row(0, named=True)["state"] == "firing"


def test_agent_loops_on_the_page_are_the_rules_predicate_on_the_ledgers_calls_and_runs():
    from kvmeter.dashboards.schemas import NOISY_NEIGHBOURS
    from kvmeter.dashboards.views.noisy import AGENT, agent_loop_states
    from kvmeter.exporters.prometheus.rules.noisy import THRESHOLDS as t

    seconds = 600.0
    above, floor = t.agent_calls_per_run_above, t.agent_min_calls_per_s
    row = {"tier": "free", "input_tokens": 0, "cached_input_tokens": 0, "prompt_cache_hit_ratio": None,
           "logical_requests": 1, "keyed_logical_requests": 0, "attempts": 1, "retries": 0,
           "retries_per_logical_request": None}

    def tenant(name: str, calls: int, runs: int) -> dict:
        return {**row, "tenant_id": name, "agent_model_calls": calls, "agent_runs": runs,
                "model_calls_per_agent_run": calls / runs if runs else None}

    busy = int(floor * seconds) * 10  # 10× the floor's calls over the window
    noisy = frame([
        tenant("looper", busy, int(busy // (above * 2))),   # twice the threshold's calls per run: fires
        tenant("at-limit", busy, int(busy // above)),        # exactly the threshold: not above, quiet
        tenant("slow-loop", int(above * 2), 1),              # one run far above it, but under the calls/s floor
        tenant("no-agents", 0, 0),                           # no agent call: no row
    ], NOISY_NEIGHBOURS)
    states = agent_loop_states(noisy, seconds)
    got = {r["tenant_id"]: r["state"] for r in states.iter_rows(named=True)}
    assert got == {"looper": "firing", "at-limit": "quiet", "slow-loop": "quiet"}
    assert set(states.get_column("detector")) == {AGENT}
    looper = states.row(0, named=True)
    assert looper["tenant_id"] == "looper" and looper["value"] == pytest.approx(above * 2)
    assert looper["rate_per_s"] == pytest.approx(busy / seconds)
    # the same predicate as the alert's scorer, on the same numbers
    assert t.agent_loop_score(busy, busy // (above * 2), seconds) is not None

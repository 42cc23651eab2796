"""The Replicas page on the signal history of two engine pools (two models, three replicas) as the
exporters' real signal sampler writes it from the pool's own stats objects (ReplicaHealth,
RoutingDecision, each replica's scraped RemoteEngineStats), in a chDB ledger read directly (mode
*b*), under AppTest; and in headless Chromium through a real ``kvmeter dashboard`` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import polars as pl
import pytest
from apptest import assert_clean, chart, charts, dataset_frames, metric_labels, run_page
from dashkit import KEYS, close_dashboard_backend, stop_readers

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.dashboards.config import ENV
from kvmeter.dashboards.views.replicas import (
    availability_title,
    hit_share,
    replica_of,
    replica_states,
    state_counts,
    state_now,
)
from kvmeter.exporters.signals import SignalSampler, SignalSamplerConfig
from kvmeter.ledger import Ledger, LedgerConfig
from kvmeter.stats import RemoteEngineStats, ReplicaHealth, RoutingDecision
from tests.conftest import free_port

T0 = datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc)
A1, A2, B1 = "http://gpu-a:8000", "http://gpu-b:8000", "http://gpu-c:8000"
POOLS = (("llama", A1, 0), ("llama", A2, 1), ("qwen", B1, 0))


@pytest.fixture
def pool_ledger(tmp_path: Path, monkeypatch) -> str:
    """Ten minutes of pool signals, a sample every 10 s: llama's A1 takes 3 requests/s (2 prefix
    hits, 1 miss) and fills its KV; A2 drains from minute 5 on; qwen's B1 goes down at minute 8."""
    stop_readers()
    close_dashboard_backend()
    config = LedgerConfig(dsn=f"chdb://{tmp_path / 'chdb'}", spool_dir=tmp_path / "spool", flush_interval_s=3600,
                          rollup_interval_s=3600)
    clock = ManualClock(start_wall=T0.timestamp())
    bus = StatsBus()
    sampler = SignalSampler(bus, clock=clock, config=SignalSamplerConfig(interval_s=10.0))
    rows = []
    for tick in range(60):
        minute = tick / 6
        for model, url, idx in POOLS:
            draining = url == A2 and minute >= 5
            healthy = not (url == B1 and minute >= 8)
            bus.publish(ReplicaHealth(model=model, replica=url, index=idx, healthy=healthy, draining=draining,
                                      reason="" if healthy else "connection refused"))
            bus.publish(RemoteEngineStats(source=f"{url}/metrics", model_name=model, engine="0",
                                          wall_ts=clock.wall(), kv_cache_usage_ratio=0.95 if url == A1 else 0.2,
                                          kv_blocks_total=1000, num_running=4.0, num_waiting=3.0 if url == A1 else 0.0))
        for outcome in ("prefix_hit", "prefix_hit", "prefix_miss"):  # 30 decisions per 10 s on A1
            for _ in range(10):
                bus.publish(RoutingDecision(model="llama", policy="prefix_aware", outcome=outcome, replica=A1))
        if minute < 8:
            bus.publish(RoutingDecision(model="qwen", policy="least_kv", outcome="no_prefix", replica=B1))
        clock.advance(10.0)
        rows += sampler.sample()
    sampler.close()
    ledger = Ledger.open(config, clock=clock)
    try:
        ledger.write_signals(rows)
        assert ledger.flush(30)
    finally:
        ledger.close()
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVMETER_LEDGER_DSN", config.dsn)
    monkeypatch.setenv("KVMETER_DASHBOARD_UNTIL", (T0 + timedelta(minutes=10)).isoformat())
    monkeypatch.setenv("KVMETER_DASHBOARD_RANGE", "last 15 min")
    monkeypatch.setenv("KVMETER_DASHBOARD_REFRESH_S", "0")
    yield config.dsn
    close_dashboard_backend()


def _rows(at, title: str) -> list[dict]:
    out: list[dict] = []
    for table in dataset_frames(at, title):
        out += table.to_pylist()
    return out


def test_the_replicas_page_per_model_and_replica(pool_ledger, monkeypatch):
    monkeypatch.setenv("KVMETER_DASHBOARD_API_KEY", KEYS["admin"])
    at = run_page("replicas")
    assert_clean(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Models served by pools"] == "2" and metrics["Replicas"] == "3"
    assert metrics["Replicas down or draining now"] == "2"  # A2 draining, B1 down
    # llama: 20 hits of 30 decisions a sample; qwen: 1 no_prefix a sample for 8 of the 10 minutes
    # (the window's buckets average the samples' rates: about 20 × 60 / (30 × 60 + 48) = 64.9 %)
    assert 64.0 < float(metrics["Prefix-hit routing share"].removesuffix(" %")) < 66.6
    for title in ("Replica takes new requests", "KV watermark per replica", "Queue depth per replica",
                  "Requests routed per replica", "Prefix-hit routing share per model"):
        assert chart(at, title)["rows"] > 0, title
    kv = [r for r in _rows(at, "KV watermark per replica") if "replica" in r]  # (not the 90 % rule's row)
    assert {r["model · replica"] for r in kv} == {f"llama · {A1}", f"llama · {A2}", f"qwen · {B1}"}
    assert max(r["value"] for r in kv if r["replica"] == A1) == pytest.approx(0.95)
    queue = _rows(at, "Queue depth per replica")
    assert {r["replica"]: r["value"] for r in queue if r["replica"] == A1}[A1] == pytest.approx(3.0)
    share = {r["model"]: r["share"] for r in _rows(at, "Prefix-hit routing share per model")}
    assert share == {"llama": pytest.approx(2 / 3), "qwen": 0.0}
    (table,) = [df.value for df in at.dataframe]
    now = {(r["model"], r["replica"]): r["state"] for r in table.to_dict("records")}
    assert now == {("llama", A1): "available", ("llama", A2): "draining", ("qwen", B1): "down"}
    assert all(c["title"] for c in charts(at))
    # the availability chart's heading counts the replicas the tile and the table count (it read
    # "1 available, 0 down or draining" whatever the state: the y encoding, taken for counts)
    assert chart(at, "Replica takes new requests")["title"].endswith("now 1 available, 2 down or draining")


def test_the_replicas_page_is_admin_only(pool_ledger, monkeypatch):
    monkeypatch.setenv("KVMETER_DASHBOARD_API_KEY", KEYS["acme"])
    at = run_page("replicas")
    assert_clean(at)
    assert not charts(at) and "admin key" in at.info[0].value
    assert "Replicas" not in metric_labels(at)


def test_the_frames_behind_the_page():
    assert replica_of("http://gpu-a:8000/metrics#0") == "http://gpu-a:8000"
    assert replica_of("http://gpu-a:8000/v1/metrics#1") == "http://gpu-a:8000/v1"
    ts = datetime(2026, 1, 1, tzinfo=timezone.utc)
    up = pl.DataFrame({"ts": [ts] * 3, "model": ["m"] * 3, "replica": ["a", "b", "c"], "value": [1.0, 1.0, 0.0]})
    avail = pl.DataFrame({"ts": [ts] * 3, "model": ["m"] * 3, "replica": ["a", "b", "c"], "value": [1.0, 0.0, 0.0]})
    got = replica_states(up, avail).sort("replica")
    assert got.get_column("state").to_list() == ["available", "draining", "down"]
    assert state_counts(state_now(got)) == (1, 2)
    decisions = pl.DataFrame({"ts": [ts] * 3, "model": ["m"] * 3, "outcome": ["prefix_hit", "prefix_miss", "failover"],
                              "value": [3.0, 1.0, 1.0]})
    assert hit_share(decisions).get_column("share").to_list() == [0.6]
    assert hit_share(decisions.with_columns(pl.lit(0.0).alias("value"))).height == 0


def test_the_availability_heading_counts_the_replicas_now():
    """Four replicas of one model, the second drained at the second bucket (what ``POST
    /v1/replicas/drain {"replica": 1, "draining": true}`` does): the heading, like the tile and the
    table, says 3 available and 1 draining now — the replica's earlier "available" bucket is not
    counted, nor is a bucket's ordering in the frame (shuffled)."""
    t0, t1 = datetime(2026, 1, 1, tzinfo=timezone.utc), datetime(2026, 1, 1, 0, 1, tzinfo=timezone.utc)
    reps = ["r0", "r1", "r2", "r3"]
    up = pl.DataFrame({"ts": [t0] * 4 + [t1] * 4, "model": ["m"] * 8, "replica": reps * 2, "value": [1.0] * 8})
    avail = up.with_columns(pl.when((pl.col("replica") == "r1") & (pl.col("ts") == t1)).then(0.0)
                            .otherwise(1.0).alias("value"))
    states = replica_states(up.sample(fraction=1.0, shuffle=True, seed=3), avail.reverse())
    now = state_now(states)
    assert dict(zip(now.get_column("replica"), now.get_column("state"), strict=True)) == {
        "r0": "available", "r1": "draining", "r2": "available", "r3": "available"}
    assert state_counts(now) == (3, 1)
    title = availability_title(now)
    assert title.endswith("now 3 available, 1 down or draining") and "1 available, 0 down" not in title


@pytest.mark.browser
@pytest.mark.slow
def test_the_replicas_page_in_headless_chromium(pool_ledger, tmp_path):
    """A real ``kvmeter dashboard --ledger-dsn`` process, the page drawn by Debian Chromium: no
    exception or error box, its charts drawn (canvas or SVG), the first one not blank."""
    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    from test_browser import FLAGS, SHOTS, _spread

    port = free_port()
    env = {**os.environ, "KVMETER_DASHBOARD_API_KEY": KEYS["admin"]}
    cmd = [sys.executable, "-m", "kvmeter.cli", "dashboard", "--ledger-dsn", pool_ledger, "--port", str(port),
           "--until", (T0 + timedelta(minutes=10)).isoformat(), "--range", "last 15 min", "--refresh", "0"]
    close_dashboard_backend()  # chDB: one process holds the path; the dashboard process opens it
    log = open(tmp_path / "streamlit.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "streamlit.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "streamlit did not come up"
            time.sleep(0.5)
        SHOTS.mkdir(parents=True, exist_ok=True)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=chromium, headless=True, args=FLAGS,
                viewport={"width": 1400, "height": 1800})
            try:
                page = browser.new_page()
                # A deep link is the fresh server's and the fresh browser's FIRST request: with a
                # ``pages/`` folder beside app.py, Streamlit's legacy multipage mode served the
                # page file on its own (no st.navigation, no sidebar sign-in) until "/" was opened.
                page.goto(f"{url}/replicas")
                page.get_by_text("admin (platform-admin)").wait_for(timeout=120_000)
                page.wait_for_selector("[data-testid=stVegaLiteChart] canvas, [data-testid=stVegaLiteChart] svg, "
                                       "[data-testid=stException], [data-testid=stAlert]", timeout=120_000)
                page.wait_for_selector("[data-testid=stStatusWidget]", state="detached", timeout=120_000)
                page.wait_for_timeout(1500)  # vega finishes drawing
                page.screenshot(path=str(SHOTS / "replicas.png"), full_page=True)
                assert page.locator("[data-testid=stException]").count() == 0
                assert page.locator("[data-testid=stAlertContentError]").count() == 0
                assert page.locator("[data-testid=stVegaLiteChart]").count() == 5
                assert page.locator("[data-testid=stVegaLiteChart] canvas, "
                                    "[data-testid=stVegaLiteChart] svg").count() >= 5
                assert _spread(page.locator("[data-testid=stVegaLiteChart]").first.screenshot()) > 5.0
                assert page.get_by_text("Prefix-hit routing share").count() >= 1
                assert page.get_by_text("Sign in with an API key").count() == 0
                assert page.title() == "kvmeter"  # app.py's set_page_config ran, not the page file alone
                assert page.locator("h1").first.inner_text().strip() == "Replicas"
                nav = [t.split()[-1] for t in page.locator("[data-testid=stSidebarNav] a").all_inner_texts()]
                assert nav[0] == "Overview" and nav[-1] == "Replicas" and "app" not in nav, nav  # titles, not files
            finally:
                browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()

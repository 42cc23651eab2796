"""The dashboards' "Agent runs" page on a real ledger filled by agent traffic through ``kvmeter
serve`` (instant engine, no vLLM): under Streamlit's AppTest (its figures and charts) and in headless
Debian Chromium (``kvmeter dashboard --server``, as tests/dashboards/test_browser.py drives the other
pages: no exception or error box, a chart drawn and not blank, a screenshot in var/screenshots/)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.serving.quota_http.conftest import T0_WALL, tenants

CFG = tenants("""
acme:
  tool_policy:
    block: ["shell_*"]
    risk: {"deploy_*": high_risk, "search_*": read_only}
  workspaces:
    ws:
      projects:
        bot:
          api_keys:
            acme-agent: {key: sk-test-agent-0001}
globex:
  workspaces:
    ws:
      projects:
        p:
          api_keys:
            globex-agent: {key: sk-test-globex-001}
platform:
  workspaces:
    ops:
      projects:
        admin:
          api_keys:
            admin: {key: sk-test-admin-0001, admin: true}
""")
AGENT, GLOBEX, ADMIN = "sk-test-agent-0001", "sk-test-globex-001", "sk-test-admin-0001"
CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[3] / "var" / "screenshots"
UNTIL = (datetime.fromtimestamp(T0_WALL, tz=timezone.utc) + timedelta(minutes=5)).isoformat()


async def agent_traffic(s) -> None:
    """Three runs: a big one (model calls, tools, a refusal, an approval pending), a small one of
    another tenant, and one stopped as a loop."""
    h = {"x-agent-run-id": "research-1"}
    for _ in range(3):
        assert (await s.complete(AGENT, n_input=200, max_tokens=20, headers=h)).status_code == 200
    tool = lambda run, body, key=AGENT: s.client.post(f"/v1/agent_runs/{run}/tool_calls",  # noqa: E731
                                                      headers={"authorization": f"Bearer {key}"}, json=body)
    assert (await tool("research-1", {"tool": "search_web", "arguments": {"q": "kv"}})).status_code == 200
    assert (await tool("research-1", {"tool": "shell_rm"})).status_code == 403
    assert (await tool("research-1", {"tool": "deploy_api", "arguments": {"v": 2}})).status_code == 202
    assert (await s.complete(GLOBEX, headers={"x-agent-run-id": "g-1"})).status_code == 200
    assert (await tool("g-1", {"tool": "send_mail", "arguments": {"to": "x"}}, GLOBEX)).status_code == 200
    for i in range(6):  # the built-in loop stop: more than 5 identical read-only calls
        resp = await tool("looping", {"tool": "search_docs", "arguments": {"id": 1}})
        assert resp.status_code == (200 if i < 5 else 409)
    assert s.ledger.flush(30)
    s.ledger.refresh_rollups()


@pytest.fixture
def dashboard_env(monkeypatch):
    """The dashboard's environment (server mode, pinned window end); caches reset around the test."""
    from kvmeter.dashboards.config import ENV
    from tests.dashboards.dashkit import close_dashboard_backend

    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)
    close_dashboard_backend()

    def configure(server: str, key: str) -> None:
        monkeypatch.setenv("KVMETER_DASHBOARD_SERVER", server)
        monkeypatch.setenv("KVMETER_DASHBOARD_API_KEY", key)
        monkeypatch.setenv("KVMETER_DASHBOARD_UNTIL", UNTIL)
        monkeypatch.setenv("KVMETER_DASHBOARD_RANGE", "last 15 min")
        monkeypatch.setenv("KVMETER_DASHBOARD_REFRESH_S", "0")

    yield configure
    close_dashboard_backend()


@pytest.mark.slow
async def test_the_agent_runs_page_shows_runs_loops_and_approvals(serve, dashboard_env):
    from tests.dashboards.apptest import assert_clean, chart, metric_labels, run_page

    s = await serve(CFG)
    await agent_traffic(s)
    dashboard_env(s.base_url, ADMIN)
    at = await asyncio.to_thread(run_page, "agent_runs")  # the serve process answers on this loop meanwhile
    assert_clean(at)
    assert {"Agent runs", "Loops stopped", "Approvals pending", "Most expensive run"} <= set(metric_labels(at))
    values = {m.label: m.value for m in at.metric}
    assert (values["Agent runs"], values["Loops stopped"], values["Approvals pending"]) == ("3", "1", "1")
    assert values["Tool calls refused"] == "2"  # the blocked call and the loop's last
    costly = chart(at, "Most expensive runs")
    assert costly["rows"] == 3
    assert chart(at, "Tool calls permitted by risk class")["rows"] == 3
    assert chart(at, "Runs stopped by reason")["rows"] == 1
    tables = [df.value for df in at.dataframe]
    assert tables[0]["agent_run_id"].tolist()[0] == "research-1"  # the most expensive first
    assert "deploy_api" in tables[-1]["tool"].tolist()  # the approval waiting
    # a tenant key sees only its own runs
    dashboard_env(s.base_url, GLOBEX)
    from tests.dashboards.dashkit import close_dashboard_backend
    close_dashboard_backend()
    at = await asyncio.to_thread(run_page, "agent_runs")
    assert_clean(at)
    assert {m.label: m.value for m in at.metric}["Agent runs"] == "1"


def _spread(png: bytes) -> float:
    from PIL import Image, ImageStat

    return ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev[0]


@pytest.mark.slow
@pytest.mark.browser
async def test_the_agent_runs_page_in_headless_chromium(serve, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    s = await serve(CFG)
    await agent_traffic(s)
    port = free_port()
    env = {**os.environ, "KVMETER_DASHBOARD_API_KEY": ADMIN}
    cmd = [sys.executable, "-m", "kvmeter.cli", "dashboard", "--server", s.base_url, "--port", str(port),
           "--until", UNTIL, "--range", "last 15 min", "--refresh", "0"]
    log = open(tmp_path / "streamlit.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def browse() -> dict:
        deadline = time.monotonic() + 120
        while True:  # waiting for Streamlit to come up, not timing logic
            assert proc.poll() is None, (tmp_path / "streamlit.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/_stcore/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "streamlit did not come up"
            time.sleep(0.5)
        SHOTS.mkdir(parents=True, exist_ok=True)
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                           headless=True, args=flags,
                                                           viewport={"width": 1400, "height": 1800})
            try:
                page = browser.new_page()
                # the app's first run (app.py: st.navigation) must come before a page's URL is
                # resolved, as test_browser.py opens the default page first
                page.goto(url)
                page.wait_for_selector("[data-testid=stVegaLiteChart]", timeout=120_000)
                page.goto(f"{url}/agent_runs")
                page.wait_for_selector("text=Most expensive runs", timeout=120_000)
                page.wait_for_selector("[data-testid=stVegaLiteChart] canvas, [data-testid=stVegaLiteChart] svg, "
                                       "[data-testid=stException], [data-testid=stAlertContentError]", timeout=120_000)
                page.wait_for_selector("[data-testid=stStatusWidget]", state="detached", timeout=120_000)
                page.wait_for_timeout(1500)  # vega finishes drawing
                page.screenshot(path=str(SHOTS / "agent_runs.png"), full_page=True)
                first = page.locator("[data-testid=stVegaLiteChart]").first
                return {"exceptions": page.locator("[data-testid=stException]").count(),
                        "errors": page.locator("[data-testid=stAlertContentError]").count(),
                        "charts": page.locator("[data-testid=stVegaLiteChart]").count(),
                        "spread": _spread(first.screenshot()),
                        "text": page.locator("[data-testid=stMain]").inner_text()}
            finally:
                browser.close()

    try:
        r = await asyncio.to_thread(browse)  # the serve process keeps answering on this loop
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert r["exceptions"] == 0 and r["errors"] == 0, r
    assert r["charts"] >= 3 and r["spread"] > 5.0, r
    assert "Agent runs" in r["text"] and "research-1" in r["text"] and "identical_tool_calls" in r["text"]
    assert (SHOTS / "agent_runs.png").stat().st_size > 20_000

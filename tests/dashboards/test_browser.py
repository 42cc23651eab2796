"""Every page in a real browser: ``kvmeter dashboard`` (a real ``streamlit run``) reading the
replay's ledger through the serve read API, driven by headless Debian Chromium (playwright with
``executable_path=/usr/bin/chromium``; ``playwright install`` is never used).

Each page is screenshotted to ``var/screenshots/<page>.png`` (gitignored) for a person to open,
and checked for: no Streamlit exception box, no error alert, at least one vega chart drawn as a
canvas or SVG, and a chart area that is not blank (pixel spread of the first chart's screenshot).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from dashkit import KEYS

from tests.conftest import free_port

pytestmark = [pytest.mark.browser, pytest.mark.engine, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
#: page file → URL path (st.navigation derives it from the file name; the default page is "/")
#: quota first: a deep link is the fresh server's first request (it was served without app.py, signed
#: out, while Streamlit's legacy pages/ mode was on: see test_config_cli's no-pages-folder test)
URLS = {"quota": "quota", "overview": "", "kv": "kv", "latency": "latency", "tenants": "tenants",
        "goodput": "goodput", "noisy": "noisy", "agent_runs": "agent_runs", "billing": "billing", "gpu": "gpu"}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def dashboard_url(reader, replay, tmp_path):
    """``kvmeter dashboard --server <reader>`` on a free port; killed (its process group) after."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium)")
    port = free_port()
    env = {**os.environ, "KVMETER_DASHBOARD_API_KEY": KEYS["admin"]}
    cmd = [sys.executable, "-m", "kvmeter.cli", "dashboard", "--server", reader.url, "--port", str(port),
           "--until", replay.until, "--range", "last 5 min", "--refresh", "0"]
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
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _spread(png: bytes) -> float:
    """Standard deviation of the grey levels of a PNG (0 for a blank area)."""
    from PIL import Image, ImageStat

    return ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev[0]


def test_every_page_in_headless_chromium(dashboard_url, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    SHOTS.mkdir(parents=True, exist_ok=True)
    results = {}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 1800})
        try:
            page = browser.new_page()
            for name, path in URLS.items():
                page.goto(f"{dashboard_url}/{path}")
                page.wait_for_selector("[data-testid=stVegaLiteChart] canvas, [data-testid=stVegaLiteChart] svg, "
                                       "[data-testid=stException], [data-testid=stAlertContentError]", timeout=120_000)
                page.wait_for_timeout(500)
                page.wait_for_selector("[data-testid=stStatusWidget]", state="detached", timeout=120_000)
                page.wait_for_timeout(1500)  # vega finishes drawing
                page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)
                first = page.locator("[data-testid=stVegaLiteChart]").first
                results[name] = {
                    "exceptions": page.locator("[data-testid=stException]").count(),
                    "errors": page.locator("[data-testid=stAlertContentError]").count(),
                    "charts": page.locator("[data-testid=stVegaLiteChart]").count(),
                    "drawn": page.locator("[data-testid=stVegaLiteChart] canvas, "
                                          "[data-testid=stVegaLiteChart] svg").count(),
                    "spread": _spread(first.screenshot()) if page.locator("[data-testid=stVegaLiteChart]").count()
                    else 0.0,
                    # the noisy page's interference panel: its heading, then its bars or its "no missed
                    # request" line (whether a request missed its TTFT depends on the machine's load)
                    "interference": page.get_by_text("Interference: whose work filled the steps").count(),
                    "interference_body": page.get_by_text("Share of the steps between arrival").count()
                    + page.get_by_text("No request missed its tier's TTFT or ITL objective").count(),
                    "text": page.inner_text("body") if name == "noisy" else "",
                    "agent_loops": page.get_by_text("No model call of an agent run").count(),
                    "signed_out": page.get_by_text("Sign in with an API key").count(),
                    "admin": page.get_by_text("admin (platform-admin)").count(),
                }
        finally:
            browser.close()
    for name, r in results.items():
        assert r["exceptions"] == 0 and r["errors"] == 0, (name, r)
        assert r["signed_out"] == 0 and r["admin"] >= 1, (name, r)
        assert r["charts"] >= 1 and r["drawn"] >= 1, (name, r)
        assert r["spread"] > 5.0, (name, r)  # a blank chart area has a spread near 0
        assert (SHOTS / f"{name}.png").stat().st_size > 20_000
    assert results["noisy"]["interference"] == 1 and results["noisy"]["interference_body"] >= 1, results["noisy"]
    # Noisy neighbours: the ledger's two shapes and the signal history's engine-work shares, each
    # detector named with the alert it mirrors (the chart titles are drawn in the canvas, not the DOM)
    noisy = results["noisy"]
    # hit ratio and calls per agent run (ledger: acme's research run) + prefill and decode shares (signals)
    assert noisy["charts"] >= 4, noisy
    assert noisy["agent_loops"] == 0, noisy  # no "no agent call" line: the calls-per-run panel is drawn
    for alert in ("KvmeterTenantPromptCacheHitLow", "KvmeterTenantPrefillShareHigh", "KvmeterTenantDecodeShareHigh",
                  "KvmeterTenantQueueShareHigh", "KvmeterTenantKvShareHigh", "KvmeterTenantAgentCallsPerRunHigh"):
        assert alert in noisy["text"], alert

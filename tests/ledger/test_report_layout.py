"""The invoice as finance reads it: money never in scientific notation (one formatting function),
the HTML report laid out for a browser (measured in headless Chromium), and ``billing report
--server`` priced with the server's price list unless ``--prices`` is given."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from ledgerkit import MODEL, fill_ledger, make_event, read_api_in_thread

from kvmeter.ledger import load_price_list
from kvmeter.money import format_money, money_places
from kvmeter.serving.tenancy import Principal

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
#: A laptop-sized window: wider than the 1,200 px page plus its margins, narrower than 1,440.
VIEWPORT_PX = 1300
#: (tenant, workspace, project, API key) of the demo tenants (serving/defaults/demo-tenants.yaml).
DEMO_LINES = (("acme", "product", "chat", "acme-chat"), ("umbrella", "research", "rag", "umbrella-rag"),
              ("initech", "etl", "nightly", "initech-nightly"), ("platform", "ops", "admin", "platform-admin"))
ADMIN = Principal("ops", "enterprise", "w", "p", "admin", admin=True)


def kvmeter(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KVMETER_LEDGER_DSN", "KVMETER_SPOOL_DIR",
                                                              "KVMETER_API_KEY", "KVMETER_TENANTS")}
    return subprocess.run([sys.executable, "-m", "kvmeter.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def _prices(tmp_path: Path, name: str, input_per_million: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"version: {name}\ncurrency: USD\nrounding: {{quantum: '0.01', mode: ROUND_HALF_EVEN}}\n"
                    f"models:\n  {MODEL}: {{input: {input_per_million}, cached_input: 0, output: 0}}\n")
    return path


@pytest.mark.parametrize("amount, places, text", [
    (Decimal("0E-18"), 2, "0.00"), (Decimal("0.000356000000000000"), 2, "0.000356"), (Decimal("1E-7"), 2, "0.0000001"),
    (Decimal("-0E-8"), 2, "0.00"), (Decimal("1234567.5"), 2, "1234567.50"), (Decimal("5E+3"), 0, "5000"),
    (Decimal("0E-8"), None, "0.00000000"), (Decimal("12"), 3, "12.000")])
def test_money_is_plain_at_least_the_display_places_and_exact(amount, places, text):
    assert format_money(amount, places) == text
    assert "E" not in format_money(amount, places, grouping=True)


def test_money_refuses_floats_and_display_places_follow_the_currency(tmp_path):
    with pytest.raises(TypeError):
        format_money(0.1)  # type: ignore[arg-type]
    assert money_places(load_price_list(_prices(tmp_path, "p", "1"))) == 2
    assert format_money(Decimal("1234.5"), 2, grouping=True) == "1,234.50"


async def test_a_zero_subtotal_is_written_0_00_in_every_report(open_ledger, config, tmp_path):
    ledger = open_ledger()
    await fill_ledger(ledger, 4, keys_per_tenant=1)
    ledger.close()
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path / "out"),
                  "--prices", str(_prices(tmp_path, "free", "0")), "--ledger-dsn", config.dsn,
                  "--spool-dir", str(config.spool_dir), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    html = (tmp_path / "out" / "billing-2026-11.html").read_text()
    csv = (tmp_path / "out" / "billing-2026-11.csv").read_text()
    assert "E-" not in html and "E-" not in csv and "E-" not in run.stderr   # today: 0E-18 on the page
    assert ">0.00<" in html and "total 0.00 USD" in run.stderr


async def test_billing_report_over_server_prices_with_the_servers_list_unless_told(open_ledger, tmp_path):
    ledger = open_ledger()
    await fill_ledger(ledger, 6, keys_per_tenant=1)          # 6 requests of 25 input tokens
    server_list = load_price_list(_prices(tmp_path, "server-list", "100000"))   # 0.10 per input token
    with read_api_in_thread(ledger, {"sk-admin-0000": ADMIN}, prices=server_list) as url:
        source = ["--server", url, "--api-key", "sk-admin-0000", "--formats", "csv"]
        run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path / "a"), *source,
                      cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert "total 15.00 USD" in run.stderr                  # 6 × 25 × 0.10: the server's list
        assert "server-list" in (tmp_path / "a" / "billing-2026-11.csv").read_text()
        run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path / "b"), *source,
                      "--prices", str(_prices(tmp_path, "mine", "200000")), cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert "total 30.00 USD" in run.stderr                  # --prices wins


async def test_the_html_invoice_reads_well_in_chromium(open_ledger, config, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    ledger = open_ledger()
    await fill_ledger(ledger, 12, keys_per_tenant=2)
    # lines as the demo tenants write them: their real identifiers, the longest priced model name
    # and six- to nine-digit token counts (the widest cells a line has)
    for i, (tenant, workspace, project, key) in enumerate(DEMO_LINES):
        e = make_event(100 + i, tenant, workspace_id=workspace, project_id=project, api_key_id=key,
                       tier="paid_interactive", model="DeepSeek-R1-Distill-Qwen-32B", input_tokens=123_456_789,
                       cached_input_tokens=98_765_432, output_tokens=12_345_678, reasoning_tokens=9_876_543)
        await ledger.record(e)
    assert ledger.flush()
    ledger.close()
    run = kvmeter("billing", "report", "--period", "2026-11", "--out", str(tmp_path / "out"), "--formats", "html",
                  "--ledger-dsn", config.dsn, "--spool-dir", str(config.spool_dir), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    page_path = tmp_path / "out" / "billing-2026-11.html"
    SHOTS.mkdir(parents=True, exist_ok=True)

    def measure() -> dict:  # playwright's sync API, off the test's event loop
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
            try:
                page = browser.new_page(viewport={"width": VIEWPORT_PX, "height": 900})
                page.goto(page_path.as_uri())
                page.screenshot(path=str(SHOTS / "billing-report.png"), full_page=True)
                m = page.evaluate("""() => ({
                    tables: [...document.querySelectorAll('table')].map(t => t.getBoundingClientRect().width),
                    // each table's right edge, measured from the left edge of the page's content column
                    edges: [...document.querySelectorAll('table')].map(t => {
                        const r = t.getBoundingClientRect(), b = document.body.getBoundingClientRect();
                        const padLeft = parseFloat(getComputedStyle(document.body).paddingLeft);
                        return {title: t.closest('section, div').previousElementSibling?.innerText ?? '',
                                right: r.right - (b.left + padLeft), width: r.width}; }),
                    // a wrapper that scrolls hides columns: none may
                    hidden: [...document.querySelectorAll('.table-wrap')].map(w => w.scrollWidth - w.clientWidth),
                    page: document.documentElement.scrollWidth,
                    meta: [...document.querySelectorAll('dl.meta dt')].map(dt => {
                        const dd = dt.nextElementSibling;
                        const a = dt.getBoundingClientRect(), b = dd.getBoundingClientRect();
                        return {dy: Math.abs(a.top - b.top), gap: b.left - a.right, ddLeft: b.left}; }),
                    numbers: [...document.querySelectorAll('td.num')].map(td => getComputedStyle(td).textAlign),
                    text: document.body.innerText})""")
            finally:
                browser.close()
        return m

    m = await asyncio.to_thread(measure)
    assert len(m["tables"]) == 2 and max(m["tables"]) <= 1200, m["tables"]       # once ~2,900 px, then 1,411.7
    assert all(e["right"] <= 1200.5 for e in m["edges"]), m["edges"]               # every table within 1,200 px
    assert max(m["hidden"]) <= 0, m["hidden"]                                      # no column scrolled out of view
    assert m["page"] <= VIEWPORT_PX, m["page"]                                     # no horizontal scroll
    assert all(r["dy"] <= 2 and 0 < r["gap"] for r in m["meta"]), m["meta"]         # each label beside its value
    assert len({round(r["ddLeft"]) for r in m["meta"]}) == 1                        # values in one column
    assert m["numbers"] and set(m["numbers"]) == {"right"}
    assert "E-1" not in m["text"] and "E-0" not in m["text"]

"""One invoice, however it is read: ``kvmeter billing report`` (through the read API and on the
ledger's path), the read API's ``/v1/usage/invoice`` and the dashboards' billing source (mode *b*
on ClickHouse, mode *a* through the serve process) return the same lines for the same ledger —
they all call :func:`kvmeter.ledger.billing.build_invoice`."""

from __future__ import annotations

import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import polars as pl
from ledgerkit import PERIOD, T0, make_attempt, make_event, read_api_in_thread

from kvmeter.attribution import Attribution
from kvmeter.dashboards.http_source import HttpSource
from kvmeter.dashboards.sql import SqlSource
from kvmeter.ledger import Adjustment, Period
from kvmeter.ledger.billing import INVOICE_COLUMNS
from kvmeter.ledger.connection import ClientHolder, connect
from kvmeter.ledger.http_client import LedgerHttpClient
from kvmeter.serving.tenancy import Principal

ADMIN_KEY = "sk-ops-admin"
ADMIN = Principal("ops", "enterprise", "", "", "ops-admin", admin=True)


def _report(tmp_path: Path, name: str, *source: str) -> list[dict[str, Any]]:
    """``kvmeter billing report`` in its own process; its Parquet lines as dicts."""
    out = tmp_path / name
    run = subprocess.run([sys.executable, "-m", "kvmeter.cli", "billing", "report", "--period", PERIOD.label,
                          "--out", str(out), "--formats", "parquet,csv", *source],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert run.returncode == 0, run.stderr
    return pl.read_parquet(out / f"billing-{PERIOD.slug}.parquet").to_dicts()


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]], what: str) -> None:
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert list(x) == list(y) == list(INVOICE_COLUMNS), what
        for column in INVOICE_COLUMNS:
            assert x[column] == y[column], f"{what}: line {i} {column}: {x[column]!r} != {y[column]!r}"


async def test_cli_read_api_and_dashboards_show_the_same_invoice(open_ledger, config, tmp_path: Path) -> None:
    ledger = open_ledger()
    for i in range(12):  # every token type, three API keys per tenant, amounts that round
        tenant = ("acme", "globex")[i % 2]
        event = make_event(i, tenant, api_key_id=f"{tenant}-key{i % 3}", input_tokens=100_000 + 7_777 * i,
                           cached_input_tokens=3_333 * i, output_tokens=20_000 + 1_111 * i,
                           reasoning_tokens=500 * i, tier="enterprise" if i % 4 == 1 else "paid_interactive")
        await ledger.record(event)
        await ledger.record_attempt(make_attempt(event))
    await ledger.record_attempt(make_attempt(make_event(50, "acme"), status="rejected"))
    assert ledger.flush()
    ledger.adjust(Adjustment(Attribution("globex"), amount=Decimal("-1.25"), ts=T0, reason="outage credit"))

    with read_api_in_thread(ledger, {ADMIN_KEY: ADMIN}) as url:
        with LedgerHttpClient(url, ADMIN_KEY) as client:
            read_api = client.invoice(PERIOD)
            # a label the server cannot parse back travels as the explicit range
            relabelled = client.invoice(Period(PERIOD.start, PERIOD.end, "November"))
        served = HttpSource(url, ADMIN_KEY)
        try:
            dashboard_server_mode = served.invoice(PERIOD)
        finally:
            served.close()
        cli_server_mode = _report(tmp_path, "via-server", "--server", url, "--api-key", ADMIN_KEY)
    dsn = SqlSource(ClientHolder(lambda: connect(config)), ledger.prices)
    try:
        dashboard_dsn_mode = dsn.invoice(PERIOD)
    finally:
        dsn.close()
    ledger.close()  # the CLI opens the embedded ledger itself only when no process holds it
    cli_dsn_mode = _report(tmp_path, "via-dsn", "--ledger-dsn", config.dsn, "--spool-dir", str(config.spool_dir))

    lines = {(r["line_type"], r["tenant_id"], r["api_key_id"], r["tier"]) for r in read_api}
    assert len(lines) == len(read_api) == 10  # acme: 3 keys × 2 tiers; globex: 3 keys; 1 adjustment
    assert {r["line_type"] for r in read_api} == {"usage", "adjustment"}
    assert all(isinstance(r["cost"], Decimal) and r["cost"] != 0 for r in read_api)
    assert sum(r["attempts"] for r in read_api) == 13 and sum(r["rejected_attempts"] for r in read_api) == 1
    assert {r["period"] for r in relabelled} == {"2026-11-01T00:00:00+00:00/2026-12-01T00:00:00+00:00"}
    assert [r["cost"] for r in relabelled] == [r["cost"] for r in read_api]
    for what, rows in (("dashboards, mode a", dashboard_server_mode), ("dashboards, mode b", dashboard_dsn_mode),
                       ("billing report --server", cli_server_mode), ("billing report --ledger-dsn", cli_dsn_mode)):
        _same(rows, read_api, what)

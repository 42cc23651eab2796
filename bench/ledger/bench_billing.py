"""Billing rollup and three-way reconciliation over 10 million usage events in chDB.

Data (generated inside ClickHouse with ``INSERT ... SELECT FROM numbers(N)``, untimed):
N usage events over November 2026 — 500 tenants, 5,000 API keys, 3 models, 4 tiers, 2 %
aborted — plus 1 % stored duplicates; the engine's record of every non-aborted request,
attributed to its tenant as the ledger does (0.1 % with a token mismatch), plus 10,000
unattributed engine records; one gateway attempt per request plus 2 % rejected attempts.

Timed (each twice; the first run reads cold parts):

* billing rollup = :func:`build_invoice`: ``invoice_usage`` + ``invoice_attempts`` +
  ``adjustments`` (ClickHouse, FINAL) + ``invoice_lines`` (polars, exact Decimal) for the month;
* reconciliation = ``reconcile_views`` (ClickHouse, FINAL, per-request join of the three
  views) + :func:`reconcile` (polars);
* for reference: ``usage_summary`` per tenant with exact percentiles, and a full hourly rollup refresh.

    .venv/bin/python bench/ledger/bench_billing.py [--events 10000000]
"""

from __future__ import annotations

import argparse
import platform
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from kvmeter.ledger import LedgerConfig, load_price_list, parse_period
from kvmeter.ledger.billing import build_invoice
from kvmeter.ledger.connection import ClientHolder, connect
from kvmeter.ledger.queries import LedgerQueries
from kvmeter.ledger.reconcile import reconcile
from kvmeter.ledger.records import USAGE_COLUMNS
from kvmeter.ledger.rollups import refresh_rollups
from kvmeter.ledger.schema import migrate

COLS = ", ".join(USAGE_COLUMNS)
START = datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp()
MONTH_S = 30 * 86400

UUID = "toUUID(concat('00000000-0000-4000-8000-', leftPad(lower(hex(number)), 12, '0')))"

USAGE = f"""
INSERT INTO usage_events (event_id, tenant_id, request_id, tier, model, endpoint, outcome, finish_reason,
    arrival_ts, finish_ts, input_tokens, output_tokens, cached_input_tokens, reasoning_tokens,
    reserved_input_tokens, reserved_output_tokens, idempotency_key, workspace_id, project_id,
    api_key_id, agent_run_id, status_code, stream, queue_s, ttft_s, prefill_s, decode_s, e2e_s, itl_mean_s,
    kv_token_seconds, token_source, attempt, preemptions, schema_version)
SELECT {UUID}, concat('tenant-', toString(k % 500)), concat('r-', toString(number)),
    ['enterprise', 'paid_interactive', 'batch', 'free'][(k % 500) % 4 + 1],
    ['SmolLM2-135M-Instruct', 'Llama-3.1-8B-Instruct', 'Llama-3.1-70B-Instruct'][number % 3 + 1],
    'chat.completions', if(number % 50 = 0, 'aborted', 'ok'), if(number % 50 = 0, 'abort', 'stop'),
    toDateTime64({START} + number * {{step:Float64}}, 6, 'UTC'),
    toDateTime64({START} + number * {{step:Float64}} + 2.5, 6, 'UTC'),
    20 + number % 4000, 1 + number % 700, intDiv(number % 4000, 3), 0, 20 + number % 4000, 1024, '',
    concat('ws-', toString(k % 3)), concat('proj-', toString(k % 7)),
    concat('key-', toString(k)), '', 200, true, 0.01, 0.05 + (number % 100) / 1000, 0.04, 2.0, 2.5,
    0.01 + (number % 37) / 1000, 5000.0, if(number % 50 = 0, 'frontend', 'engine_hooks'), 1, 0, 1
FROM (SELECT number, number % 5000 AS k FROM numbers({{n:UInt64}}))
"""


ENGINE = f"""
INSERT INTO engine_requests (request_id, finish_reason, input_tokens, output_tokens, cached_input_tokens,
    queued_s, prefill_s, decode_s, inference_s, e2e_s, mean_tpot_s, preemptions, wall_ts, tenant_id)
SELECT concat('r-', toString(number)), 'stop', 20 + number % 4000, 1 + number % 700 + (number % 1000 = 7),
    intDiv(number % 4000, 3), 0.01, 0.04, 2.0, 2.04, 2.5, 0.01, 0,
    toDateTime64({START} + number * {{step:Float64}} + 2.5, 6, 'UTC'),
    concat('tenant-', toString((number % 5000) % 500))
FROM numbers({{n:UInt64}}) WHERE number % 50 != 0
"""

GHOSTS = f"""
INSERT INTO engine_requests (request_id, finish_reason, input_tokens, output_tokens, cached_input_tokens,
    queued_s, prefill_s, decode_s, inference_s, e2e_s, mean_tpot_s, preemptions, wall_ts)
SELECT concat('ghost-', toString(number)), 'stop', 100, 10, 0, 0, 0, 0, 0, 0, 0, 0,
    toDateTime64({START} + number * 200, 6, 'UTC') FROM numbers(10000)
"""

ATTEMPTS = f"""
INSERT INTO attempts (attempt_id, event_id, tenant_id, request_id, status, reason, status_code, ts, tier, model,
    endpoint, workspace_id, project_id, api_key_id, agent_run_id, idempotency_key, reserved_input_tokens,
    reserved_output_tokens, attempt)
SELECT generateUUIDv4(number), {UUID}, concat('tenant-', toString(k % 500)), concat('r-', toString(number)),
    'admitted', 'admitted', 200, toDateTime64({START} + number * {{step:Float64}}, 6, 'UTC'),
    ['enterprise', 'paid_interactive', 'batch', 'free'][(k % 500) % 4 + 1],
    ['SmolLM2-135M-Instruct', 'Llama-3.1-8B-Instruct', 'Llama-3.1-70B-Instruct'][number % 3 + 1], 'chat.completions',
    concat('ws-', toString(k % 3)), concat('proj-', toString(k % 7)),
    concat('key-', toString(k)), '', '', 20 + number % 4000, 1024, 1
FROM (SELECT number, number % 5000 AS k FROM numbers({{n:UInt64}}))
"""

REJECTED = f"""
INSERT INTO attempts (attempt_id, event_id, tenant_id, request_id, status, reason, status_code, ts, tier, model,
    endpoint, workspace_id, project_id, api_key_id, agent_run_id, idempotency_key, reserved_input_tokens,
    reserved_output_tokens, attempt)
SELECT generateUUIDv4(number), toUUID('00000000-0000-0000-0000-000000000000'), concat('tenant-', toString(k % 500)),
    concat('rej-', toString(number)), 'rejected', 'rate_limited', 429,
    toDateTime64({START} + number * {{step:Float64}} * 50, 6, 'UTC'),
    ['enterprise', 'paid_interactive', 'batch', 'free'][(k % 500) % 4 + 1], 'SmolLM2-135M-Instruct',
    'chat.completions', concat('ws-', toString(k % 3)),
    concat('proj-', toString(k % 7)), concat('key-', toString(k)), '', '', 0, 0, 1
FROM (SELECT number, number % 5000 AS k FROM numbers(intDiv({{n:UInt64}}, 50)))
"""


def generate(client, n: int) -> None:  # noqa: ANN001
    """Fill the tables (see the module docstring); prints progress lines."""
    params = {"n": n, "step": MONTH_S / n}
    t = time.perf_counter()
    for label, sql in (("usage events", USAGE), ("engine records", ENGINE), ("unattributed engine records", GHOSTS),
                       ("attempts", ATTEMPTS), ("rejected attempts", REJECTED)):
        client.command(sql, parameters=params)
        print(f"  generated {label} ({time.perf_counter() - t:.0f} s)", flush=True)
    client.command(f"INSERT INTO usage_events ({COLS}) SELECT {COLS} FROM usage_events "
                   "WHERE toUInt64(substring(request_id, 3)) % 100 = 0")
    counts = {tbl: client.query(f"SELECT count() FROM {tbl}").result_rows[0][0]
              for tbl in ("usage_events", "engine_requests", "attempts")}
    print(f"  rows stored: {counts} ({time.perf_counter() - t:.0f} s)", flush=True)
    client.command("OPTIMIZE TABLE usage_events FINAL")  # merged parts, as a long-lived ledger has
    counts_final = client.query("SELECT count() FROM usage_events FINAL").result_rows[0][0]
    client.command(f"INSERT INTO usage_events ({COLS}) SELECT {COLS} FROM usage_events "
                   "WHERE toUInt64(substring(request_id, 3)) % 100 = 1")  # fresh, unmerged duplicates
    print(f"  billable events (FINAL): {counts_final:,}; then 1 % unmerged duplicates added", flush=True)


def timed(label: str, fn, runs: int = 2) -> list[float]:  # noqa: ANN001
    times = []
    result = None
    for _ in range(runs):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    print(f"{label:64s} " + "  ".join(f"{x:6.2f} s" for x in times), flush=True)
    return times, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--dir", default=None, help="keep the generated data here (reused when present)")
    args = ap.parse_args()
    n = args.events
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvmeter-bench-billing-"))
    print(f"# billing/reconciliation benchmark — {platform.node()} {platform.machine()}, "
          f"python {platform.python_version()}, {n:,} usage events")
    try:
        config = LedgerConfig(dsn=f"chdb://{base / 'chdb'}", spool_dir=base / "spool")
        reuse = (base / f"generated-{n}").exists()
        client = connect(config)
        migrate(client)
        if not reuse:
            generate(client, n)
            (base / f"generated-{n}").touch()
        else:
            print("  reusing generated data", flush=True)
        prices = load_price_list()
        wait = time.monotonic() + 600
        while client.query("SELECT count() FROM system.merges").result_rows[0][0] and time.monotonic() < wait:
            time.sleep(1)  # let background merges finish: a long-lived ledger is measured at rest
        queries = LedgerQueries(ClientHolder(lambda: client), prices)
        period = parse_period("2026-11")

        def billing():
            return build_invoice(queries, period, prices).lines

        def reconciliation():
            return reconcile(queries.reconcile_views(period), threshold_ratio=0.0)

        def reconciliation_per_request():
            return reconcile(queries.reconcile_views(period, detailed=True), threshold_ratio=0.0)

        bt, lines = timed("billing rollup (invoice lines, month, all tenants)", billing)
        rt, report = timed("reconciliation (three views, month, all tenants)", reconciliation)
        timed("  same, every tenant through the per-request pass", reconciliation_per_request)
        timed("usage_summary per tenant (exact TTFT/ITL p50/p95)", lambda: queries.usage_summary(period))
        timed("hourly rollup refresh (all hours)", lambda: refresh_rollups(client, full=True), runs=1)
        total = lines["cost"].sum()
        print(f"invoice lines: {lines.height:,}; month total {total} {prices.currency}; "
              f"requests billed {lines['requests'].sum():,}")
        frame = report.frame
        print(f"reconciliation: {frame.height} tenants, {len(report.failed_tenants)} with drift; "
              f"mismatched {frame['mismatched_requests'].sum():,}, aborted {frame['aborted_requests'].sum():,}, "
              f"engine-unbilled {frame['engine_unbilled_requests'].sum():,}, "
              f"duplicate rows {frame['duplicate_rows'].sum():,}")
        print(f"best: billing {min(bt):.2f} s, reconciliation {min(rt):.2f} s (target <= 2 s each)")
        client.close()
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Upgrading to the input/output vocabulary and the one tenant id: a ledger and a spool the previous
kvmeter wrote keep their data and bill to the same Decimal figures.

``data/spool_v1/`` was written by the previous kvmeter (commit a6e39d5; ``data/make_spool_v1.py``
says how): a spool of usage events (schema 1), attempts and engine records (schema 2) with the
``prompt``/``completion``/``generation`` columns and ``org_id``, and ``expected.json``, the invoice
lines, the usage summary, the engine records and the attempts that version read back after
draining it — its own figures, not ours.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec
import pytest
from ledgerkit import MODEL, PERIOD, T0

from kvmeter.clock import ManualClock
from kvmeter.ledger import Ledger, LedgerConfig
from kvmeter.ledger.agent_records import AGENT_STREAMS, TOOL_CALL_STREAM
from kvmeter.ledger.billing import build_invoice
from kvmeter.ledger.connection import connect
from kvmeter.ledger.records import ATTEMPT_STREAM, ENGINE_STREAM, STREAMS, USAGE_STREAM, attempt_id_for
from kvmeter.ledger.schema import applied_versions, migrate
from kvmeter.ledger.spool import Spool

FIXTURE = Path(__file__).parent / "data" / "spool_v1"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())
#: How the previous version named the summary's token fields (its read API's JSON).
OLD_SUMMARY_NAMES = {"prompt_tokens": "input_tokens", "cached_prompt_tokens": "cached_input_tokens",
                     "completion_tokens": "output_tokens"}
LINE_KEYS = ("tenant_id", "workspace_id", "project_id", "api_key_id", "model", "tier")


def _copy_spool(to: Path) -> Path:
    shutil.copytree(FIXTURE / "spool", to)
    return to


def _old_ledger(config: LedgerConfig, spool_dir: Path) -> None:
    """The ledger the previous kvmeter left: migrations 0001–0003 only, and the fixture's records
    drained as its writer drained them (each block inserted under the column names it was written
    with)."""
    client = connect(config)
    try:
        migrate(client, up_to=3)
        spool = Spool(spool_dir, STREAMS, clock=ManualClock(start_wall=T0))
        try:
            for stream in spool.streams.values():
                while (batch := stream.next_batch(10**6)) is not None:
                    client.raw_insert(stream.spec.table, column_names=list(stream.spec.columns_for(batch.schema)),
                                      insert_block=stream.read_batch(batch), fmt="JSONCompactEachRow")
                    stream.complete(batch)
        finally:
            spool.close()
        assert client.query("SELECT sum(prompt_tokens), count(DISTINCT org_id) FROM usage_events").result_rows == \
            [(sum(r["prompt_tokens"] for r in EXPECTED["usage_summary"]), 4)]  # the old schema, old names
    finally:
        client.close()


def _assert_billed_as_before(ledger: Ledger) -> None:
    """The new code's figures on ``ledger`` are the previous version's (``expected.json``)."""
    invoice = build_invoice(ledger.queries, PERIOD, ledger.prices)
    assert invoice.total == Decimal(EXPECTED["invoice_total"]) > 0
    assert {r["tenant_id"]: r["total"] for r in invoice.totals.to_dicts()} == \
        {t: Decimal(v) for t, v in EXPECTED["tenant_totals"].items()}
    lines = {tuple(line[k] for k in LINE_KEYS): line for line in invoice.rows()}
    assert len(lines) == len(EXPECTED["invoice_lines"])
    for old in EXPECTED["invoice_lines"]:
        new = lines[tuple(old[k] for k in LINE_KEYS)]
        for name, value in old.items():  # exact subtotals and rounded costs, token sums, attempts
            if name in ("subtotal", "cost") and value is not None:
                assert new[name] == Decimal(value), (name, old)
            else:
                assert new[name] == value, (name, old)
    summary = ledger.queries.usage_summary(PERIOD, group_by=("tenant_id", "model"))
    assert [{OLD_SUMMARY_NAMES.get(k, k): v for k, v in row.items()} for row in EXPECTED["usage_summary"]] == \
        [{k: (str(v) if isinstance(v, Decimal) else v) for k, v in row.items()} for row in summary]
    client = ledger.query_client()
    assert [list(r) for r in client.query(
        "SELECT request_id, tenant_id, input_tokens, output_tokens, cached_input_tokens FROM engine_requests FINAL "
        "ORDER BY request_id").result_rows] == EXPECTED["engine_requests"]
    assert [list(r) for r in client.query(
        "SELECT request_id, tenant_id, status, level, dimension, reserved_input_tokens, reserved_output_tokens "
        "FROM attempts FINAL ORDER BY request_id").result_rows] == EXPECTED["attempts"]
    for table in ("usage_events", "attempts", "adjustments", "usage_hourly"):
        columns = {r[0] for r in client.query(f"DESCRIBE TABLE {table}").result_rows}
        assert "org_id" not in columns and not {c for c in columns if "prompt" in c or "completion" in c}, table


def test_a_ledger_the_previous_version_wrote_migrates_and_bills_the_same(config: LedgerConfig, open_ledger,
                                                                         tmp_path: Path) -> None:
    _old_ledger(config, _copy_spool(tmp_path / "old-spool"))
    ledger = open_ledger()  # opening migrates: 0004 adds the agent tables, 0005 renames the columns,
    assert {4, 5} <= set(applied_versions(ledger.query_client()))  # drops org_id, rebuilds the rollup
    _assert_billed_as_before(ledger)
    assert ledger.refresh_rollups() >= 1  # the rebuilt rollup is recomputed from usage_events FINAL
    series = ledger.queries.usage_timeseries(PERIOD, step="day")
    assert sum(r["input_tokens"] for r in series) == sum(r["prompt_tokens"] for r in EXPECTED["usage_summary"])
    assert sum(r["requests"] for r in series) == sum(r["requests"] for r in EXPECTED["usage_summary"])


def test_a_spool_the_previous_version_wrote_drains_after_the_upgrade(config: LedgerConfig, open_ledger) -> None:
    _copy_spool(Path(config.spool_dir))
    ledger = open_ledger()
    before = ledger.stats().spool_depth_by_stream
    assert before == {"usage": sum(r["requests"] for r in EXPECTED["usage_summary"]),
                      "attempts": len(EXPECTED["attempts"]), "engine": len(EXPECTED["engine_requests"]),
                      "tool_calls": 0, "approvals": 0, "run_stops": 0, "steps": 0}
    assert ledger.flush(timeout_s=60)
    stats = ledger.stats()
    assert stats.spool_depth_events == 0 and stats.rejected_records_total == 0
    _assert_billed_as_before(ledger)


def test_old_blocks_map_to_todays_columns_in_one_place() -> None:
    old_usage = USAGE_STREAM.columns_for(1)
    row = [f"v-{c}" for c in old_usage]
    columns, payload = USAGE_STREAM.decode(1, msgspec.json.encode(row) + b"\n")
    # renamed, org_id dropped, same order (schema 2's columns), and the attempt's id derived (schema 3)
    assert columns == USAGE_STREAM.columns_for(2) + ("attempt_id",)
    assert msgspec.json.decode(payload) == [v for v in row if v != "v-org_id"] + [
        attempt_id_for("v-tenant_id", "v-request_id")]
    assert dict(zip(columns, msgspec.json.decode(payload), strict=True))["input_tokens"] == "v-prompt_tokens"
    # engine schema 2 only renames: the block passes through as written, under the new names
    payload = b'["r1","stop",5,6,2,0,0,0,0,0,0,0,1.7e9,"acme"]\n'
    columns, same = ENGINE_STREAM.decode(2, payload)
    assert same is payload and columns[2:5] == ("input_tokens", "output_tokens", "cached_input_tokens")
    current = object()
    assert ATTEMPT_STREAM.decode(ATTEMPT_STREAM.schema, current) == (ATTEMPT_STREAM.columns_for(3), current)
    with pytest.raises(KeyError):
        USAGE_STREAM.decode(9, b"")


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def test_a_ledger_at_version_4_with_agent_runs_migrates_and_old_agent_blocks_drain(
        config: LedgerConfig, open_ledger) -> None:
    """A ledger the agent-runs kvmeter left (0001–0004: agent tables with ``org_id``, the run rollup
    with prompt/completion token maps) and a spool holding its agent-record blocks (stream schema 1,
    ``org_id`` after the tenant): after the upgrade the old rollup row reads under the new names,
    the old blocks drain without ``org_id``, and the recomputed rollup counts them."""
    client = connect(config)
    try:
        migrate(client, up_to=4)
        client.insert("agent_runs", [["acme", "r-old", "acme", "ws1", "proj1", "acme-key1", "paid_interactive",
                                      _utc(T0), _utc(T0 + 60), 2, 2, {MODEL: 100}, {MODEL: 20}, {MODEL: 40},
                                      _utc(T0 + 61)]],
                      column_names=["tenant_id", "agent_run_id", "org_id", "workspace_id", "project_id",
                                    "api_key_id", "tier", "first_ts", "last_ts", "model_calls", "ok_model_calls",
                                    "prompt_tokens_by_model", "cached_prompt_tokens_by_model",
                                    "completion_tokens_by_model", "computed_at"])
    finally:
        client.close()
    old_streams = tuple(dataclasses.replace(spec, schema=1) for spec in AGENT_STREAMS)
    spool = Spool(config.spool_dir, STREAMS + old_streams, clock=ManualClock(start_wall=T0))
    try:
        columns = TOOL_CALL_STREAM.columns_for(1)
        assert columns[1:3] == ("tenant_id", "org_id")
        values = {"record_id": str(uuid.uuid4()), "tenant_id": "acme", "org_id": "acme", "workspace_id": "ws1",
                  "project_id": "proj1", "api_key_id": "acme-key1", "tier": "paid_interactive",
                  "agent_run_id": "r-new", "source": "reported", "tool": "search", "risk_class": "read_only",
                  "decision": "allowed", "status_code": 200, "ts": T0 + 5}
        line = msgspec.json.encode([values.get(c, "") for c in columns])
        spool.streams[TOOL_CALL_STREAM.name].submit(line).wait(10)
    finally:
        spool.close()

    ledger = open_ledger()
    assert 5 in applied_versions(ledger.query_client())
    (old,) = ledger.agent_runs.runs(PERIOD, ["acme"])  # the row 0004 stored, before any recompute
    assert (old["agent_run_id"], old["input_tokens"], old["cached_input_tokens"], old["output_tokens"]) == (
        "r-old", 100, 20, 40)
    assert "org_id" not in old and not {k for k in old if "prompt" in k or "completion" in k}
    assert ledger.flush(timeout_s=60) and ledger.stats().rejected_records_total == 0
    client = ledger.query_client()
    assert client.query("SELECT tenant_id, workspace_id, agent_run_id, tool FROM tool_calls FINAL").result_rows == [
        ("acme", "ws1", "r-new", "search")]
    for table in ("tool_calls", "approval_events", "agent_run_stops", "agent_runs"):
        names = {r[0] for r in client.query(f"DESCRIBE TABLE {table}").result_rows}
        assert "org_id" not in names and not {c for c in names if "prompt" in c or "completion" in c}, table
    ledger.refresh_rollups()
    runs = {r["agent_run_id"]: r for r in ledger.agent_runs.runs(PERIOD, ["acme"])}
    assert (runs["r-new"]["tool_calls"], runs["r-new"]["api_key_id"], runs["r-new"]["tier"]) == (
        1, "acme-key1", "paid_interactive")

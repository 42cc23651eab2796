"""Writes ``spool_v1/``: a spool as kvmeter wrote it before the input/output vocabulary, and what
that kvmeter billed from it (``spool_v1/expected.json``).

Run it with the *previous* kvmeter on the path (commit a6e39d5, the last one that wrote usage
schema 1, attempts schema 2 and engine schema 2 with ``prompt``/``completion``/``generation``
columns and ``org_id``)::

    git worktree add /tmp/kvmeter-v1 a6e39d5
    PYTHONPATH=/tmp/kvmeter-v1 python tests/ledger/data/make_spool_v1.py tests/ledger/data/spool_v1

It records usage events, attempts and engine stats through that version's ``Ledger`` while
ClickHouse is unreachable, so every record stays in the spool (the state a ``kvmeter serve``
leaves when it is upgraded with records not yet drained). Then it drains a copy of the spool into
a chDB ledger with the same version and writes the invoice lines, the usage summary and the
engine records' tenants it reads back: the old code's own figures, which
``tests/ledger/test_vocabulary_upgrade.py`` compares the new code's against.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

from kvmeter.bus import StatsBus
from kvmeter.clock import ManualClock
from kvmeter.events import UsageEvent, event_id_for
from kvmeter.ledger import (
    AttemptRecord,
    Ledger,
    LedgerConfig,
    LedgerUnavailable,
    parse_period,
)
from kvmeter.ledger.billing import build_invoice
from kvmeter.stats import EngineRequestStats

T0 = datetime(2026, 11, 15, tzinfo=timezone.utc).timestamp()
PERIOD = "2026-11"
#: (tenant, tier, api key, model, prompt, cached, completion, reasoning, outcome)
REQUESTS = [
    ("acme", "enterprise", "acme-k1", "SmolLM2-135M-Instruct", 12_000_000, 3_000_007, 1_500_000, 0, "ok"),
    ("acme", "enterprise", "acme-k2", "SmolLM2-135M-Instruct", 800_001, 0, 64_003, 0, "ok"),
    ("acme", "enterprise", "acme-k1", "DeepSeek-R1-Distill-Qwen-32B", 40_000_000, 10_000_000, 9_000_000,
     7_000_001, "ok"),
    ("acme", "enterprise", "acme-k2", "Llama-3.1-70B-Instruct", 3_333_333, 333_333, 777_777, 0, "aborted"),
    ("globex", "batch", "globex-k1", "Llama-3.1-70B-Instruct", 150_000_000, 120_000_000, 2_000_000, 0, "ok"),
    ("globex", "batch", "globex-k1", "Qwen2.5-Coder-1.5B-Instruct", 17_000_017, 0, 3_000_003, 0, "ok"),
    ("globex", "batch", "globex-k1", "mystery-model", 50, 0, 5, 0, "ok"),
    ("initech", "free", "initech-k1", "SmolLM2-135M-Instruct", 9_999_999, 0, 1_111_111, 0, "ok"),
    ("umbrella", "paid_interactive", "umbrella-k1", "DeepSeek-R1-Distill-Qwen-32B", 12_345_678, 2_345_678,
     6_789_012, 4_321_098, "ok"),
    ("umbrella", "paid_interactive", "umbrella-k1", "SmolLM2-135M-Instruct", 4_096_000, 4_096_000, 1, 0, "ok"),
    ("umbrella", "paid_interactive", "umbrella-k1", "SmolLM2-135M-Instruct", 4_096, 0, 0, 0, "error"),
]


def _records(i: int, spec: tuple) -> tuple[UsageEvent, list[AttemptRecord], EngineRequestStats | None]:
    tenant, tier, key, model, prompt, cached, completion, reasoning, outcome = spec
    ts = T0 + 60 * i
    event = UsageEvent(
        event_id=event_id_for(tenant, f"req-{i}"), tenant_id=tenant, request_id=f"{tenant}-r{i}", tier=tier,
        model=model, endpoint="chat.completions", outcome=outcome,
        finish_reason={"ok": "stop", "aborted": "abort", "error": "error"}[outcome], arrival_ts=ts,
        finish_ts=ts + 2.5, prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached,
        reasoning_tokens=reasoning, reserved_prompt_tokens=prompt, reserved_completion_tokens=completion + 100,
        idempotency_key=f"idem-{i}" if i % 3 == 0 else "", org_id=tenant, workspace_id="ws1",
        project_id=f"proj{i % 2}", api_key_id=key, agent_run_id="run-1" if i == 2 else "", status_code=200,
        stream=i % 2 == 0, queue_s=0.01, ttft_s=0.05 + i / 100, prefill_s=0.02, decode_s=1.0, e2e_s=2.5,
        itl_mean_s=0.01, kv_token_seconds=12.5 * (i + 1),
        token_source="engine_hooks" if outcome == "ok" else "frontend", attempt=1, preemptions=i % 2)
    common = dict(tenant_id=tenant, tier=tier, model=model, endpoint="chat.completions", org_id=tenant,
                  workspace_id="ws1", project_id=f"proj{i % 2}", api_key_id=key)
    attempts = [AttemptRecord(request_id=event.request_id, status="admitted", ts=ts, event_id=event.event_id,
                              reserved_prompt_tokens=prompt, reserved_completion_tokens=completion + 100,
                              idempotency_key=event.idempotency_key, **common)]
    if i % 4 == 1:  # a refused attempt beside it, with the limit that refused it (attempts schema 2)
        attempts.append(AttemptRecord(request_id=f"{tenant}-rejected-{i}", status="rejected", ts=ts + 1,
                                      reason="rate_limited", status_code=429, level="project",
                                      dimension="input_tokens_per_minute", **common))
    engine = None
    if outcome == "ok":  # vLLM's hooks report finished requests only
        engine = EngineRequestStats(event.request_id, "stop", prompt, completion, cached, queued_s=0.001,
                                    prefill_s=0.02, decode_s=1.0, inference_s=1.02, e2e_s=1.03,
                                    mean_tpot_s=0.01, preemptions=i % 2, wall_ts=ts + 2.4)
    return event, attempts, engine


async def _write(spool_dir: Path) -> None:
    def down():
        raise LedgerUnavailable("ClickHouse is down while these records are written")

    config = LedgerConfig(dsn=f"chdb://{spool_dir.parent / 'unused-chdb'}", spool_dir=spool_dir,
                          flush_interval_s=3600, close_timeout_s=1)
    bus = StatsBus()
    ledger = Ledger.open(config, bus=bus, clock=ManualClock(start_wall=T0 + 3600), client_factory=down)
    for i, spec in enumerate(REQUESTS):
        event, attempts, engine = _records(i, spec)
        for attempt in attempts:
            await ledger.record_attempt(attempt)
        if engine is not None:
            bus.publish(engine)  # the old ledger attributes it through the admitted attempt above
        await ledger.record(event)
    ledger.close()  # nothing drains: every record stays in the spool


def _expected(spool_copy: Path, work: Path) -> dict:
    config = LedgerConfig(dsn=f"chdb://{work / 'chdb'}", spool_dir=spool_copy, flush_interval_s=3600)
    ledger = Ledger.open(config, clock=ManualClock(start_wall=T0 + 3600))
    try:
        assert ledger.flush(60), "the old ledger did not drain the spool"
        period = parse_period(PERIOD)
        invoice = build_invoice(ledger.queries, period, ledger.prices)
        client = ledger.queries._get()  # the old kvmeter this runs on has no Ledger.query_client()
        engine = client.query("SELECT request_id, tenant_id, prompt_tokens, generation_tokens, "
                              "cached_prompt_tokens FROM engine_requests FINAL ORDER BY request_id").result_rows
        attempts = client.query("SELECT request_id, tenant_id, status, level, dimension, reserved_prompt_tokens, "
                                "reserved_completion_tokens FROM attempts FINAL ORDER BY request_id").result_rows
        keep = ("tenant_id", "workspace_id", "project_id", "api_key_id", "model", "tier", "requests",
                "attempts", "input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens",
                "subtotal", "cost", "priced")
        return {
            "written_by": "kvmeter a6e39d5 (usage schema 1, attempts schema 2, engine schema 2)",
            "period": PERIOD,
            "invoice_total": str(invoice.total),
            "tenant_totals": {r["tenant_id"]: str(r["total"]) for r in invoice.totals.to_dicts()},
            "invoice_lines": [{k: (str(v) if isinstance(v, Decimal) else v) for k, v in line.items() if k in keep}
                              for line in invoice.rows()],
            "usage_summary": [{k: (str(v) if isinstance(v, Decimal) else v) for k, v in row.items()}
                              for row in ledger.queries.usage_summary(period, group_by=("tenant_id", "model"))],
            "engine_requests": [list(r) for r in engine],
            "attempts": [list(r) for r in attempts],
        }
    finally:
        ledger.close()


def main(out: str) -> None:
    out_dir = Path(out)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        spool = Path(tmp) / "spool"
        asyncio.run(_write(spool))
        (spool / "LOCK").unlink()
        shutil.copytree(spool, out_dir / "spool")
        copy = Path(tmp) / "drained"
        shutil.copytree(spool, copy)
        expected = _expected(copy, Path(tmp))
    (out_dir / "expected.json").write_text(json.dumps(expected, indent=1, default=str) + "\n")
    print(f"wrote {out_dir}: invoice total {expected['invoice_total']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("spool_v1")))

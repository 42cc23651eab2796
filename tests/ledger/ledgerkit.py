"""Helpers shared by the ledger tests (imported as ``ledgerkit``; fixtures live in conftest.py)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from kvmeter.events import UsageEvent, event_id_for
from kvmeter.ledger import AttemptRecord, Ledger, Period, parse_period

#: 2026-11-15T00:00:00Z — events of the tests' billing period 2026-11.
T0 = datetime(2026, 11, 15, tzinfo=timezone.utc).timestamp()
PERIOD: Period = parse_period("2026-11")
MODEL = "SmolLM2-135M-Instruct"


def make_event(i: int, tenant: str = "acme", *, key: str | None = None, **overrides: Any) -> UsageEvent:
    """A realistic usage event number ``i`` of ``tenant`` (finished at T0 + i seconds)."""
    fields: dict[str, Any] = dict(
        event_id=event_id_for(tenant, key or f"req-{i}"), tenant_id=tenant, request_id=f"{tenant}-r{i}",
        tier="paid_interactive", model=MODEL, endpoint="chat.completions", outcome="ok", finish_reason="stop",
        arrival_ts=T0 + i, finish_ts=T0 + i + 0.5, prompt_tokens=25, completion_tokens=10,
        org_id=tenant, workspace_id="ws1", project_id="proj1", api_key_id=f"{tenant}-key1",
        reserved_prompt_tokens=25, reserved_completion_tokens=64, ttft_s=0.05, itl_mean_s=0.01, e2e_s=0.5,
        kv_token_seconds=12.5,
    )
    fields.update(overrides)
    return UsageEvent(**fields)


def make_attempt(event: UsageEvent, status: str = "admitted", **overrides: Any) -> AttemptRecord:
    """The gateway's attempt record for ``event``."""
    fields: dict[str, Any] = dict(
        tenant_id=event.tenant_id, request_id=event.request_id, status=status, ts=event.arrival_ts,
        event_id=event.event_id, tier=event.tier, model=event.model, endpoint=event.endpoint, org_id=event.org_id,
        workspace_id=event.workspace_id, project_id=event.project_id, api_key_id=event.api_key_id,
        reserved_prompt_tokens=event.reserved_prompt_tokens,
        reserved_completion_tokens=event.reserved_completion_tokens,
    )
    fields.update(overrides)
    return AttemptRecord(**fields)




def scalar(ledger: Ledger, sql: str, **params: Any) -> Any:
    """One value from the ledger's database (through its own query client)."""
    return ledger.queries._get().query(sql, parameters=params).result_rows[0][0]

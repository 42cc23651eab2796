"""Helpers shared by the ledger tests (imported as ``ledgerkit``; fixtures live in conftest.py)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Iterator

from kvmeter.bus import StatsBus
from kvmeter.events import UsageEvent, event_id_for
from kvmeter.ledger import AttemptRecord, Ledger, Period, parse_period
from kvmeter.stats import EngineRequestStats

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


async def fill_ledger(ledger: Ledger, n: int = 40, *, keys_per_tenant: int = 2, drift: bool = False,
                      unpriced: bool = False) -> None:
    """``n`` requests of two tenants (acme, globex) on ``keys_per_tenant`` API keys each, each
    request with its attempt, engine record and usage event, drained. ``drift``: request 3's engine record counts one token more;
    ``unpriced``: request 0 uses a model missing from the price list."""
    bus = StatsBus()
    ledger._unsubscribe = bus.subscribe(EngineRequestStats, ledger._on_engine_stats)
    for i in range(n):
        e = make_event(i, "acme" if i % 2 else "globex", api_key_id=f"key-{i % (2 * keys_per_tenant)}",
                       model="mystery-model" if unpriced and i == 0 else MODEL)
        await ledger.record_attempt(make_attempt(e))
        bus.publish(EngineRequestStats(e.request_id, "stop", e.prompt_tokens,
                                       e.completion_tokens + (1 if drift and i == 3 else 0), wall_ts=e.finish_ts))
        await ledger.record(e)
    assert ledger.flush()


@contextmanager
def read_api_in_thread(ledger: Ledger, keys: dict[str, Any], timezones: dict[str, str] | None = None,
                       prices: Any = None) -> Iterator[str]:
    """The ledger's read API (``read_routes``) under uvicorn on a free loopback port, in a thread —
    the tests block their own event loop on CLI subprocesses while it answers. ``keys``: plain API
    key → :class:`~kvmeter.serving.tenancy.Principal`; ``timezones``: tenant → billing zone;
    ``prices``: the server's price list (default the ledger's). Yields the base URL; stops the server after."""
    import uvicorn
    from starlette.applications import Starlette

    from kvmeter.ledger.read_api import read_routes
    from kvmeter.serving.tenancy import AuthError, constant_time_lookup, hash_api_key
    from tests.conftest import free_port

    hashed = {hash_api_key(key): principal for key, principal in keys.items()}

    def authenticate(key: str | None) -> Any:
        principal = constant_time_lookup(hashed, key or "")
        if principal is None:
            raise AuthError("unknown API key")
        return principal

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=read_routes(
        ledger.queries, authenticate, prices=prices, timezones=(lambda: timezones) if timezones else None)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:  # readiness wait, not timing logic
            assert thread.is_alive() and time.monotonic() < deadline, "read API did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)

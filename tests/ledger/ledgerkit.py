"""Helpers shared by the ledger tests (imported as ``ledgerkit``; fixtures live in conftest.py)."""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Iterator

from kvmeter.attribution import Attribution
from kvmeter.events import UsageEvent, event_id_for
from kvmeter.ledger import AttemptRecord, Ledger, Period, parse_period
from kvmeter.stats import EngineRequestStats
from kvmeter.tokens import TokenCounts

#: 2026-11-15T00:00:00Z — events of the tests' billing period 2026-11.
T0 = datetime(2026, 11, 15, tzinfo=timezone.utc).timestamp()
PERIOD: Period = parse_period("2026-11")
MODEL = "SmolLM2-135M-Instruct"


def make_attribution(tenant: str = "acme", **overrides: Any) -> Attribution:
    """The attribution of ``tenant``'s requests in the ledger tests (``overrides``: its fields)."""
    fields: dict[str, Any] = dict(tenant_id=tenant, workspace_id="ws1", project_id="proj1",
                                  api_key_id=f"{tenant}-key1", tier="paid_interactive", model=MODEL,
                                  endpoint="chat.completions")
    fields.update(overrides)
    return Attribution(**fields)


_ATTRIBUTION_FIELDS = {f.name for f in dataclasses.fields(Attribution)}
_TOKEN_FIELDS = {f.name for f in dataclasses.fields(TokenCounts)}


def make_event(i: int, tenant: str = "acme", *, key: str | None = None, **overrides: Any) -> UsageEvent:
    """A realistic usage event number ``i`` of ``tenant`` (finished at T0 + i seconds).

    ``overrides`` may name any field of the event, of its attribution (``tier``, ``model``,
    ``api_key_id``...) or of its token counts (``input_tokens``...)."""
    attribution = make_attribution(tenant, **{k: overrides.pop(k) for k in list(overrides) if k in _ATTRIBUTION_FIELDS})
    counts: dict[str, Any] = dict(input_tokens=25, output_tokens=10)
    counts.update({k: overrides.pop(k) for k in list(overrides) if k in _TOKEN_FIELDS})
    fields: dict[str, Any] = dict(
        event_id=event_id_for(tenant, key or f"req-{i}"), request_id=f"{tenant}-r{i}", attribution=attribution,
        outcome="ok", finish_reason="stop", arrival_ts=T0 + i, finish_ts=T0 + i + 0.5,
        tokens=TokenCounts(**counts), reserved=TokenCounts(input_tokens=25, output_tokens=64),
        ttft_s=0.05, itl_mean_s=0.01, e2e_s=0.5, kv_token_seconds=12.5,
    )
    fields.update(overrides)
    return UsageEvent(**fields)


def make_attempt(event: UsageEvent, status: str = "admitted", **overrides: Any) -> AttemptRecord:
    """The gateway's attempt record for ``event`` (same attribution, by reference)."""
    fields: dict[str, Any] = dict(
        attribution=event.attribution, request_id=event.request_id, status=status, ts=event.arrival_ts,
        event_id=event.event_id, reserved=event.reserved,
    )
    fields.update(overrides)
    return AttemptRecord(**fields)


def engine_stats(event: UsageEvent, *, extra_output: int = 0, **overrides: Any) -> EngineRequestStats:
    """The engine's account of ``event``'s request, stamped with its attribution (as the engines
    do); ``extra_output`` tokens more than the event was billed for."""
    tokens = event.tokens
    fields: dict[str, Any] = dict(
        tokens=TokenCounts(input_tokens=tokens.input_tokens, cached_input_tokens=tokens.cached_input_tokens,
                           output_tokens=tokens.output_tokens + extra_output),
        wall_ts=event.finish_ts, attribution=event.attribution)
    fields.update(overrides)
    return EngineRequestStats(event.request_id, "stop", **fields)




def scalar(ledger: Ledger, sql: str, **params: Any) -> Any:
    """One value from the ledger's database (through its own query client)."""
    return ledger.query_client().query(sql, parameters=params).result_rows[0][0]


async def fill_ledger(ledger: Ledger, n: int = 40, *, keys_per_tenant: int = 2, drift: bool = False,
                      unpriced: bool = False) -> None:
    """``n`` requests of two tenants (acme, globex) on ``keys_per_tenant`` API keys each, each
    request with its attempt, engine record and usage event, drained. ``drift``: request 3's
    engine record counts one token more; ``unpriced``: request 0 uses a model missing from the
    price list."""
    for i in range(n):
        e = make_event(i, "acme" if i % 2 else "globex", api_key_id=f"key-{i % (2 * keys_per_tenant)}",
                       model="mystery-model" if unpriced and i == 0 else MODEL)
        await ledger.record_attempt(make_attempt(e))
        ledger.record_engine(engine_stats(e, extra_output=1 if drift and i == 3 else 0))
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

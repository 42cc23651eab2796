"""The read API: tenant isolation by API key, admin scope, errors; and its HTTP client on a real
uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from decimal import Decimal

import pytest
import uvicorn
from ledgerkit import PERIOD, T0, make_attempt, make_event
from starlette.applications import Starlette
from starlette.testclient import TestClient

from kvmeter.attribution import Attribution
from kvmeter.ledger import Adjustment
from kvmeter.ledger.http_client import LedgerHttpClient, ReadApiError
from kvmeter.ledger.read_api import dumps, read_routes
from kvmeter.serving.tenancy import AuthError, Principal, constant_time_lookup, hash_api_key
from kvmeter.tokens import TokenCounts
from kvmeter.net import free_port as _free_port

KEYS = {
    hash_api_key("sk-acme"): Principal("acme", "paid_interactive", "ws1", "proj1", "acme-key1"),
    hash_api_key("sk-globex"): Principal("globex", "free", "ws1", "proj1", "globex-key1"),
    hash_api_key("sk-admin"): Principal("ops", "enterprise", "", "", "ops-admin", admin=True),
}


def authenticate(key: str | None) -> Principal:
    if not key:
        raise AuthError("missing API key", code="missing_api_key")
    principal = constant_time_lookup(KEYS, key)
    if principal is None:
        raise AuthError("unknown API key")
    return principal


@pytest.fixture
async def app(open_ledger) -> Starlette:
    ledger = open_ledger()
    for tenant, n in (("acme", 30), ("globex", 20)):
        events = [make_event(i, tenant) for i in range(n)]
        await asyncio.gather(*(ledger.record(e) for e in events))
        await asyncio.gather(*(ledger.record_attempt(make_attempt(e)) for e in events))
    assert ledger.flush()
    ledger.refresh_rollups()
    for tenant in ("acme", "globex"):
        ledger.adjust(Adjustment(Attribution(tenant), amount=Decimal("-0.50"), ts=T0, reason="credit"))
    return Starlette(routes=read_routes(ledger.queries, authenticate))


def _get(client: TestClient, path: str, key: str | None, **params: str):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.get(f"/v1/usage/{path}", params={"period": "2026-11", **params}, headers=headers)


def test_a_tenant_key_sees_only_its_own_tenant(app: Starlette) -> None:
    with TestClient(app) as client:
        for path in ("summary", "invoice_usage", "invoice_attempts", "invoice", "reconcile_views", "adjustments",
                     "timeseries"):
            response = _get(client, path, "sk-acme")
            assert response.status_code == 200, (path, response.text)
            assert {row["tenant_id"] for row in response.json()} == {"acme"}, path
        (row,) = _get(client, "summary", "sk-acme").json()
        assert row["requests"] == 30 and Decimal(row["cost"]) > 0


def test_a_tenant_key_cannot_read_another_tenant(app: Starlette) -> None:
    with TestClient(app) as client:
        response = _get(client, "summary", "sk-acme", tenant_id="globex")
        assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden_tenant"
        response = client.get("/v1/usage/invoice", params={"period": "2026-11", "tenant_id": "globex"},
                              headers={"X-API-Key": "sk-acme"})
        assert response.status_code == 403


def test_admin_sees_every_tenant_or_one(app: Starlette) -> None:
    with TestClient(app) as client:
        rows = {r["tenant_id"]: r["requests"] for r in _get(client, "summary", "sk-admin").json()}
        assert rows == {"acme": 30, "globex": 20}
        (one,) = _get(client, "summary", "sk-admin", tenant_id="globex").json()
        assert one["tenant_id"] == "globex"


@pytest.mark.parametrize("key,params,status,code", [
    (None, {}, 401, "missing_api_key"),
    ("sk-wrong", {}, 401, "invalid_api_key"),
    ("sk-acme", {"period": "November"}, 400, "invalid_parameter"),
    ("sk-acme", {"group_by": "tenant_id;DROP TABLE usage_events"}, 400, "invalid_parameter"),
])
def test_bad_requests_get_clear_errors(app: Starlette, key, params, status, code) -> None:
    with TestClient(app) as client:
        response = _get(client, "summary", key, **params)
        assert response.status_code == status and response.json()["error"]["code"] == code


@pytest.mark.parametrize("period", ["0999", "0001-01", "0001-01-01/9999-12-31", "9999-12-31", "2300",
                                    "1899-12-31T23:00:00Z/1900-01-02"])
def test_a_period_clickhouse_cannot_hold_is_a_400_naming_period(app: Starlette, period: str) -> None:
    """DateTime64(6) holds 1900-01-01 .. 2299-12-31: outside it ClickHouse failed to parse the
    bound (a 500 ``ledger_error``) or overflowed (9999-12-31 + 1 day)."""
    with TestClient(app, raise_server_exceptions=False) as client:
        for path in ("summary", "reconcile_views", "timeseries"):
            response = _get(client, path, "sk-admin", period=period)
            assert response.status_code == 400, (path, period, response.text)
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_parameter", "period")
            assert "period" in error["message"] and "1900-01-01 .. 2299-12-31" in error["message"]


def test_the_edges_of_the_supported_range_are_served(app: Starlette) -> None:
    with TestClient(app) as client:
        for period in ("1900", "2299", "1900-01-01/2300-01-01"):
            response = _get(client, "summary", "sk-admin", period=period)
            assert response.status_code == 200, (period, response.text)
        assert _get(client, "reconcile_views", "sk-admin", period="2299-12-31").status_code == 200


def test_money_is_exact_in_plain_notation_at_the_display_places() -> None:
    # README "Billing": the currency's display places, more only when the exact value needs them
    # (once the column's scale: "0.00000000", "0.0001320000")
    amounts = {"cost": Decimal("0E-8"), "subtotal": Decimal("0.0001320000"), "big": Decimal("1E+3"),
               "line": Decimal("0.000356000000000000"), "rounded": Decimal("12.300000000000000000"),
               "refund": Decimal("-0.50000000")}
    text = dumps(amounts)
    assert text == (b'{"cost":"0.00","subtotal":"0.000132","big":"1000.00","line":"0.000356",'
                    b'"rounded":"12.30","refund":"-0.50"}')
    assert {k: Decimal(v) for k, v in json.loads(text).items()} == amounts       # the exact values
    assert dumps({"cost": Decimal("5E+3"), "sub": Decimal("0.25000")}, places=0) == b'{"cost":"5000","sub":"0.25"}'


async def test_a_zero_cost_is_not_written_0e_8(open_ledger) -> None:
    ledger = open_ledger()
    await ledger.record(
        make_event(0, "zero", input_tokens=0, output_tokens=0, reserved=TokenCounts(output_tokens=64))
    )
    await ledger.record(make_event(1, "acme"))
    assert ledger.flush()
    app = Starlette(routes=read_routes(ledger.queries, authenticate))
    with TestClient(app) as client:
        response = _get(client, "summary", "sk-admin")
    assert response.status_code == 200, response.text
    assert "E-" not in response.text
    costs = {row["tenant_id"]: row["cost"] for row in response.json()}
    # the display places (USD: 2), more only where the exact value needs them; not ClickHouse's
    # Decimal(18, 8) scale ("0.00000000", "0.00001350")
    assert costs == {"zero": "0.00", "acme": "0.0000135"}
    assert Decimal(costs["zero"]) == 0


def test_tenant_text_is_bound_not_spliced(app: Starlette) -> None:
    with TestClient(app) as client:
        response = _get(client, "summary", "sk-admin", tenant_id="acme' OR '1'='1")
        assert response.status_code == 200 and response.json() == []


def test_http_client_over_a_real_loopback_server(app: Starlette) -> None:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:  # readiness wait, not timing logic
        time.sleep(0.02)
    try:
        with LedgerHttpClient(f"http://127.0.0.1:{port}", "sk-globex") as reader:
            (row,) = reader.usage_summary(PERIOD)
            assert (row["tenant_id"], row["requests"]) == ("globex", 20)
            assert isinstance(row["cost"], Decimal)
            assert reader.invoice_usage(PERIOD)[0]["input_tokens"] == 20 * 25
            assert reader.reconcile_views(PERIOD)[0]["gateway_admitted"] == 20
            with pytest.raises(ReadApiError) as err:
                reader.usage_summary(PERIOD, tenant_id="acme")
            assert err.value.status_code == 403
        with LedgerHttpClient(f"http://127.0.0.1:{port}", "sk-admin") as admin:
            assert {r["tenant_id"] for r in admin.invoice_usage(PERIOD)} == {"acme", "globex"}
    finally:
        server.should_exit = True
        thread.join(30)

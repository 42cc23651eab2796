"""The ledger's read API: Starlette routes the serve process mounts under ``/v1/usage``.

Why it exists: chDB on disk is single-process, so while ``kvmeter serve`` owns the embedded
ledger, the dashboards, ``kvmeter billing --server`` and tenants read through it. With a
ClickHouse server the same routes work (and readers may also query ClickHouse directly).

Scope: the API key (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``) is resolved by the
injected ``authenticate`` to a :class:`~kvmeter.serving.tenancy.Principal`. A tenant key sees
only its own tenant (``Principal.tenant_id``; asking for another tenant is 403); an admin key
(``Principal.admin``) sees every tenant, or one with ``tenant_id=``.

Routes (all GET, JSON; ``period`` as in :func:`~kvmeter.ledger.period.parse_period`, read in the
billing time zone of the tenant asked for — its org's ``billing_timezone`` — or in UTC for an
admin's read of every tenant; ``timezone=`` (an IANA name) overrides it. ``/invoice`` of every
tenant reads each tenant's lines in its own zone):

=================================  ===========================================================
``/v1/usage/summary``              :meth:`LedgerQueries.usage_summary` (``group_by=a,b``)
``/v1/usage/timeseries``           :meth:`LedgerQueries.usage_timeseries` (``step=hour|day``)
``/v1/usage/invoice``              :func:`~kvmeter.ledger.billing.build_invoice` lines (the server's price list)
``/v1/usage/invoice_usage``        :meth:`LedgerQueries.invoice_usage`
``/v1/usage/invoice_attempts``     :meth:`LedgerQueries.invoice_attempts`
``/v1/usage/adjustments``          :meth:`LedgerQueries.adjustments`
``/v1/usage/reconcile_views``      :meth:`LedgerQueries.reconcile_views`
``/v1/usage/agent_runs``           :meth:`AgentRunQueries.runs <kvmeter.ledger.agent_runs.AgentRunQueries.runs>`
                                   (runs active in the period; ``agent_run_id``, ``order=cost|tokens|last_ts``,
                                   ``limit`` 1–1000): when the routes are given ``agent_runs``
``/v1/usage/interference``         :meth:`~kvmeter.ledger.interference.InterferenceQueries.interference`
                                   (``objective=ttft|itl``, default ``ttft``) under the tiers'
                                   objectives: when the routes are given ``interference``; for a
                                   tenant key the other tenants are anonymized
                                   (:func:`~kvmeter.ledger.interference.anonymize`)
``/v1/usage/billing_config``       no ``period``: ``{"prices": the server's price list (file format,
                                   exact strings), "timezones": {tenant: zone}}`` (a tenant key:
                                   its own tenant only)
=================================  ===========================================================

Errors use the OpenAI error shape ``{"error": {"message", "type", "param", "code"}}``: 401 unknown
key, 403 other tenant, 400 bad parameter (``param`` names it when known, e.g. a ``period`` outside
1900-01-01 .. 2299-12-31, what ClickHouse ``DateTime64`` holds), 503 ClickHouse unavailable.

Money (``Decimal``) is sent as an exact string in plain notation (``"0.00000000"``, never
``"0E-8"``).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from decimal import Decimal
from typing import Any, Callable, Mapping, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmeter.billing_calendar import UTC, check_zone
from kvmeter.money import format_money, money_places
from kvmeter.serving.tenancy import AuthError, Principal

from .billing import build_invoice
from .errors import LedgerError, LedgerUnavailable, PeriodError
from .interference import anonymize
from .period import parse_period
from .prices import PriceList
from .queries import UsageReader
from .window_queries import TierSlo

__all__ = ["read_routes", "dumps", "presented_key", "JsonResponse", "error_response", "answer_read"]

log = logging.getLogger(__name__)


#: Display places of money in JSON when no price list says otherwise (ISO 4217's usual minor unit).
DEFAULT_MONEY_PLACES = 2


def dumps(data: Any, places: int = DEFAULT_MONEY_PLACES) -> bytes:
    """JSON with Decimals as exact strings written by :func:`kvmeter.money.format_money` (plain
    notation, at least ``places`` display places, more only when the exact value needs them:
    ``Decimal("0.000132000000000000")`` → ``"0.000132"``, ``Decimal("0E-8")`` → ``"0.00"``; the
    column's scale is not shown) and datetimes as ISO 8601.

    Raises:
        TypeError: a value JSON cannot carry (not a str, number, bool, None, list, dict, Decimal or datetime).
    """
    def default(value: Any) -> Any:
        if isinstance(value, Decimal):
            return format_money(value, places)
        if isinstance(value, datetime):
            return value.isoformat()
        raise TypeError(f"not JSON serialisable: {type(value).__name__}")

    return json.dumps(data, default=default, separators=(",", ":")).encode()


class JsonResponse(JSONResponse):
    """A JSON response rendered with :func:`dumps` (exact Decimals at ``places`` display places,
    ISO datetimes)."""

    def __init__(self, content: Any, status_code: int = 200, *, places: int = DEFAULT_MONEY_PLACES,
                 **kwargs: Any) -> None:
        self.places = places
        super().__init__(content, status_code, **kwargs)

    def render(self, content: Any) -> bytes:
        return dumps(content, self.places)


def error_response(status: int, message: str, code: str | None, param: str | None = None) -> Response:
    """An OpenAI-style JSON error: ``{"error": {"message", "type", "param", "code"}}`` (``code``
    may be null, as in OpenAI's error object)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}.get(status, "api_error")
    return JsonResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def answer_read(read: Callable[[], Any], where: str, places: int = DEFAULT_MONEY_PLACES) -> Response:
    """Run ``read`` and answer its result as JSON (money at ``places`` display places, see
    :func:`dumps`), or its failure as an error response:
    ``ValueError`` → 400 ``invalid_parameter``; :class:`LedgerUnavailable` → 503 (logged as a
    warning); any other :class:`LedgerError` → 500 (logged as an error). ``where`` names the API
    in the log line."""
    try:
        return JsonResponse(read(), places=places)
    except ValueError as exc:
        return error_response(400, str(exc), "invalid_parameter")
    except LedgerUnavailable as exc:
        log.warning("%s: %s", where, exc)
        return error_response(503, "the ledger is unavailable; retry later", "ledger_unavailable")
    except LedgerError as exc:
        log.error("%s: %s", where, exc)
        return error_response(500, "ledger error", "ledger_error")


def presented_key(request: Request) -> str | None:
    """The API key of a request: ``Authorization: Bearer KEY`` or ``X-API-Key``, else None."""
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def read_routes(queries: UsageReader, authenticate: Callable[[str | None], Principal], *,
                prices: PriceList | None = None, prefix: str = "/v1/usage", agent_runs: Any = None,
                timezones: Callable[[], Mapping[str, str]] | None = None, interference: Any = None,
                slos: Callable[[], Sequence[TierSlo]] | None = None) -> list[Route]:
    """Starlette routes of the read API.

    Args:
        queries: the reader (normally ``ledger.queries``).
        authenticate: maps the presented key (or ``None``) to a principal; raises
            :class:`~kvmeter.serving.tenancy.AuthError` for a missing/unknown key.
        prices: price list for ``/invoice`` (default: ``queries.prices`` if it has one).
        prefix: URL prefix.
        agent_runs: the per-run reads (:class:`~kvmeter.ledger.agent_runs.AgentRunQueries`, normally
            ``ledger.agent_runs``) for ``/agent_runs``; None: no such route.
        timezones: returns the current tenant → billing time zone map (normally
            ``lambda: directory.snapshot.billing_timezones``, so a reload takes effect at once);
            None: every tenant is billed in UTC.
        interference: the interference reads
            (:class:`~kvmeter.ledger.interference.InterferenceQueries`, normally
            ``ledger.interference``) for ``/interference``; None: no such route.
        slos: returns the tiers' objectives ``(tier, ttft_slo_s, itl_slo_s)`` (normally from the
            live tenancy config's :class:`~kvmeter.serving.tenancy.TierPolicy`); None: no tier has one.
    Returns:
        Routes to add to the serve app (``routes=[..., *read_routes(...)]`` or ``app.router.routes``).
    """
    price_list = prices or getattr(queries, "prices", None)
    places = money_places(price_list) if price_list is not None else DEFAULT_MONEY_PLACES

    def zones() -> Mapping[str, str]:
        return timezones() if timezones is not None else {}

    def scope(request: Request) -> tuple[Principal, str | None] | Response:
        try:
            principal = authenticate(presented_key(request))
        except AuthError as exc:
            return error_response(401, exc.message, exc.code)
        asked = request.query_params.get("tenant_id") or None
        if principal.admin:
            return principal, asked
        if asked is not None and asked != principal.tenant_id:
            return error_response(403, "this API key can read only its own tenant's usage", "forbidden_tenant")
        return principal, principal.tenant_id

    def scoped(handler: Callable[[Request, Principal, Any, str | None], Any]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            scoped_to = scope(request)
            if isinstance(scoped_to, Response):
                return scoped_to
            principal, tenant = scoped_to
            tz = request.query_params.get("timezone") or None
            if tz is not None and (problem := check_zone(tz)) is not None:
                return error_response(400, problem, "invalid_parameter", "timezone")
            if tz is None:
                tz = zones().get(tenant, UTC) if tenant is not None else UTC
            try:
                period = parse_period(request.query_params.get("period", ""), tz)
            except PeriodError as exc:  # names the period and the valid forms or range
                return error_response(400, str(exc), "invalid_parameter", "period")
            return answer_read(lambda: handler(request, principal, period, tenant), "read API", places)

        return endpoint

    def summary(request: Request, principal: Principal, period: Any, tenant: str | None) -> Any:
        group_by = [g for g in request.query_params.get("group_by", "tenant_id").split(",") if g]
        return queries.usage_summary(period, tenant, group_by=group_by)

    def timeseries(request: Request, principal: Principal, period: Any, tenant: str | None) -> Any:
        return queries.usage_timeseries(period, tenant, step=request.query_params.get("step", "hour"))

    def invoice(request: Request, principal: Principal, period: Any, tenant: str | None) -> Any:
        if price_list is None:
            raise LedgerUnavailable("no price list configured")
        # every tenant in its own zone, unless the caller fixed one with timezone=
        per_tenant = None if request.query_params.get("timezone") else zones()
        return build_invoice(queries, period, price_list, tenant, per_tenant).rows()

    def billing_config(request: Request) -> Response:
        scoped_to = scope(request)
        if isinstance(scoped_to, Response):
            return scoped_to
        _, tenant = scoped_to
        known = dict(zones())
        shown = known if tenant is None else {tenant: known.get(tenant, UTC)}
        return JsonResponse({"prices": price_list.to_mapping() if price_list is not None else None,
                             "timezones": shown}, places=places)

    simple = {
        "invoice_usage": lambda r, p, period, t: queries.invoice_usage(period, t),
        "invoice_attempts": lambda r, p, period, t: queries.invoice_attempts(period, t),
        "adjustments": lambda r, p, period, t: queries.adjustments(period, t),
        "reconcile_views": lambda r, p, period, t: queries.reconcile_views(period, t),
    }
    routes = [
        Route(f"{prefix}/summary", scoped(summary), methods=["GET"]),
        Route(f"{prefix}/timeseries", scoped(timeseries), methods=["GET"]),
        Route(f"{prefix}/invoice", scoped(invoice), methods=["GET"]),
        Route(f"{prefix}/billing_config", billing_config, methods=["GET"]),
    ]
    routes += [Route(f"{prefix}/{name}", scoped(fn), methods=["GET"]) for name, fn in simple.items()]
    if agent_runs is not None:
        def runs(request: Request, principal: Principal, period: Any, tenant: str | None) -> Any:
            q = request.query_params
            raw = q.get("limit", "100")
            if not raw.isdigit():
                raise ValueError("limit must be an integer in 1..1000")
            return agent_runs.runs(period, None if tenant is None else [tenant],
                                   agent_run_id=q.get("agent_run_id") or None, order=q.get("order", "cost"),
                                   limit=int(raw[:6]))

        routes.append(Route(f"{prefix}/agent_runs", scoped(runs), methods=["GET"]))
    if interference is not None:
        def interfered(request: Request, principal: Principal, period: Any, tenant: str | None) -> Any:
            rows = interference.interference(period, None if tenant is None else [tenant],
                                             slos=list(slos()) if slos is not None else [],
                                             objective=request.query_params.get("objective", "ttft"))
            return rows if principal.admin else anonymize(rows, principal.tenant_id)

        routes.append(Route(f"{prefix}/interference", scoped(interfered), methods=["GET"]))
    return routes

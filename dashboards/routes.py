"""Extra read-API routes for the dashboards, for the serve process to mount beside the ledger's.

While ``kvmeter serve`` holds the embedded (chDB) ledger, no other process may open it, so the
dashboards read through these routes (mode *a*). They expose the ledger's window reads
(:class:`~kvmeter.ledger.window_queries.WindowQueries`, through the same
:class:`~kvmeter.dashboards.sql.SqlSource` mode *b* uses) that the ledger's ``/v1/usage/*`` routes
lack; billing and reconciliation keep using the ledger's own ``/v1/usage/invoice``
(:func:`~kvmeter.ledger.billing.build_invoice`) and ``/v1/usage/reconcile_views``.

Scope, exactly as :mod:`kvmeter.ledger.read_api`: the API key (``Authorization: Bearer KEY`` or
``X-API-Key``) is resolved by the injected ``authenticate``; every read runs through a
:class:`~kvmeter.dashboards.source.ScopedSource` for that key, so a tenant key reads only its own
tenant (asking for another is 403) and an admin key reads all.

Routes (GET, JSON; ``start``/``end`` ISO 8601 UTC, ``step`` seconds, ``tenant`` repeatable):

======================================  =====================================================
``{prefix}/whoami``                     the key's viewer: ``tenant_id``, ``tier``, ``api_key_id``, ``admin``
``{prefix}/tiers``                      tier weights and SLOs
``{prefix}/read/{name}``                one of :data:`~kvmeter.dashboards.source.WINDOW_READS`
``{prefix}/signal_gauge``               ``name``, ``by`` (repeatable label key), ``agg``
======================================  =====================================================

Errors use the OpenAI error shape: 401 unknown key, 403 other tenant, 400 bad parameter,
503 ClickHouse unavailable, 500 ClickHouse refused.

Mounting (the lead's one-line change in :meth:`kvmeter.serving.runtime.ServeRuntime.app`)::

    dash = serve_routes(self)                  # before building the app
    routes = [*read_routes(...), *dash.routes, ...]
    # and in stop(): dash.close()
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvmeter.ledger.connection import ClientHolder, connect
from kvmeter.ledger.read_api import answer_read, error_response, presented_key
from kvmeter.serving.tenancy import AuthError, Principal

from .errors import ScopeError
from .source import WINDOW_READS, DashboardSource, ScopedSource
from .sql import SqlSource
from .viewer import TierInfo, Viewer, tiers_of
from .window import Window

__all__ = ["dashboard_routes", "serve_routes", "DashboardRoutes", "PREFIX"]

#: Default URL prefix of the routes.
PREFIX = "/v1/usage/dash"


def dashboard_routes(source: DashboardSource, authenticate: Callable[[str | None], Principal], *,
                     prefix: str = PREFIX) -> list[Route]:
    """Starlette routes of the dashboards' extra reads.

    Args:
        source: the unrestricted reads (a :class:`~kvmeter.dashboards.sql.SqlSource` on the
            serve process's ledger database).
        authenticate: maps the presented key (or ``None``) to a principal; raises
            :class:`~kvmeter.serving.tenancy.AuthError` for a missing/unknown key.
        prefix: URL prefix.
    Returns:
        Routes to add to the serve app.
    """

    def scoped(handler: Callable[[Request, ScopedSource], Any]) -> Callable[[Request], Response]:
        def endpoint(request: Request) -> Response:
            try:
                principal = authenticate(presented_key(request))
            except AuthError as exc:
                return error_response(401, exc.message, exc.code)
            reader = ScopedSource(source, Viewer.from_principal(principal))
            try:
                return answer_read(lambda: handler(request, reader), "dashboard read API")
            except ScopeError as exc:
                return error_response(403, str(exc), "forbidden_tenant")

        return endpoint

    def tenants_of(request: Request) -> list[str] | None:
        return request.query_params.getlist("tenant") or None

    def whoami(request: Request, reader: ScopedSource) -> Any:
        return reader.viewer.to_dict()

    def tiers(request: Request, reader: ScopedSource) -> Any:
        return [t.to_dict() for t in reader.tiers()]

    def read(request: Request, reader: ScopedSource) -> Any:
        name = request.path_params["name"]
        if name not in WINDOW_READS:
            raise ValueError(f"unknown read {name!r}")
        return reader.read(name, Window.from_query(request.query_params), tenants_of(request))

    def gauge(request: Request, reader: ScopedSource) -> Any:
        q = request.query_params
        return reader.signal_gauge(Window.from_query(q), _required(q, "name"), q.getlist("by"),
                                   q.get("agg", "avg"), tenants_of(request))

    return [
        Route(f"{prefix}/whoami", scoped(whoami), methods=["GET"]),
        Route(f"{prefix}/tiers", scoped(tiers), methods=["GET"]),
        Route(f"{prefix}/read/{{name}}", scoped(read), methods=["GET"]),
        Route(f"{prefix}/signal_gauge", scoped(gauge), methods=["GET"]),
    ]


def _required(params: Any, name: str) -> str:
    value = params.get(name)
    if not value:
        raise ValueError(f"missing parameter {name!r}")
    return str(value)


class DashboardRoutes:
    """The routes plus the ClickHouse connection they read through (close it at shutdown).

    Attributes:
        routes: to mount in the serve app.
        source: the :class:`~kvmeter.dashboards.sql.SqlSource` behind them.
    """

    def __init__(self, routes: list[Route], source: SqlSource) -> None:
        self.routes = routes
        self.source = source

    def close(self) -> None:
        """Close the routes' ClickHouse client (idempotent)."""
        self.source.close()


def serve_routes(runtime: Any, *, prefix: str = PREFIX) -> DashboardRoutes:
    """The dashboard routes wired to a :class:`~kvmeter.serving.runtime.ServeRuntime`.

    The routes open their own clickhouse-connect client on the serve process's ledger database
    (``connect(runtime.ledger_config())``; inside one process any number of clients share the
    embedded chDB path), lazily on the first read — after the ledger opened and migrated it in
    the lifespan. Tier SLOs come from ``runtime.directory`` on every call (a reloaded tenancy
    file shows); invoice prices from ``runtime.prices``.

    Args:
        runtime: an object with ``ledger_config()``, ``prices`` and ``directory`` (a
            :class:`~kvmeter.serving.tenancy.TenantDirectory`).
    """
    holder = ClientHolder(lambda: connect(runtime.ledger_config()))
    tiers: Callable[[], Iterable[TierInfo]] = lambda: tiers_of(runtime.directory)  # noqa: E731
    source = SqlSource(holder, runtime.prices, tiers=tiers,
                       cluster=lambda: runtime.ledger_config().cluster is not None)
    return DashboardRoutes(dashboard_routes(source, runtime.directory.authenticate, prefix=prefix), source)

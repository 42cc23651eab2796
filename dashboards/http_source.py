"""Mode *a*: the dashboards' reads through a running ``kvmeter serve`` (its read API).

The embedded chDB ledger is single-process: while ``kvmeter serve`` holds it, the dashboards
read through the serve process — the dashboard routes of :mod:`kvmeter.dashboards.routes` for
time series, and the ledger's own ``/v1/usage/invoice`` and ``/v1/usage/reconcile_views`` (via
:class:`~kvmeter.ledger.http_client.LedgerHttpClient`) for billing. The server scopes every read
to the key it is given; :class:`~kvmeter.dashboards.source.ScopedSource` scopes it again here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Sequence

import httpx

from kvmeter.ledger.http_client import LedgerHttpClient, ReadApiError, error_fields, read_api_get
from kvmeter.ledger.period import Period

from .errors import ScopeError, SignInError
from .routes import PREFIX
from .source import WINDOW_READS
from .viewer import Viewer
from .window import Window, utc

__all__ = ["HttpSource"]

_TIME_FIELDS = {"ts", "last_ts", "first_ts", "requested_ts", "expires_ts", "computed_at",
                "last_approval_expires_ts"}


class HttpSource:
    """A :class:`~kvmeter.dashboards.source.DashboardSource` over a serve process's read API.

    Args:
        base_url: the serve process, e.g. ``http://127.0.0.1:8000``.
        api_key: the signed-in key (sent as ``Authorization: Bearer``; never logged).
        timeout_s: per-request timeout, seconds.
        transport: an httpx transport (default: real HTTP).
        prefix: URL prefix of the dashboard routes.
    Raises (every read):
        SignInError: the server does not know the key (401).
        ScopeError: the server refused another tenant's data (403).
        LedgerUnavailable: the server cannot be reached or answered 5xx.
        ReadApiError: any other refusal (400...).
    """

    def __init__(self, base_url: str, api_key: str, *, timeout_s: float = 60.0,
                 transport: httpx.BaseTransport | None = None, prefix: str = PREFIX) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s, transport=transport,
                                    headers={"Authorization": f"Bearer {api_key}"})
        self._ledger = LedgerHttpClient(self.base_url, api_key, timeout_s=timeout_s, transport=transport)
        self._prefix = prefix

    def close(self) -> None:
        """Close both connection pools."""
        self._client.close()
        self._ledger.close()

    def _get(self, path: str, params: list[tuple[str, str]]) -> Any:
        response = read_api_get(self._client, f"{self._prefix}/{path}", params, self.base_url)
        if response.status_code != 200:
            message, code = error_fields(response)
            if response.status_code == 401:
                raise SignInError(message or "unknown API key")
            if response.status_code == 403:
                raise ScopeError(message or "forbidden")
            if response.status_code == 404:
                raise ReadApiError(
                    f"the server at {self.base_url} has no dashboard routes ({self._prefix}); mount "
                    "kvmeter.dashboards.routes.serve_routes in the serve app", 404, "not_found")
            raise ReadApiError(f"read API refused ({response.status_code}): {message}", response.status_code, code)
        return response.json()

    @staticmethod
    def _decode(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for row in rows:
            for key in _TIME_FIELDS & row.keys():
                if isinstance(row[key], str):
                    row[key] = utc(datetime.fromisoformat(row[key]))
        return rows

    @staticmethod
    def _window(window: Window, tenants: Sequence[str] | None) -> list[tuple[str, str]]:
        params = list(window.to_query().items())
        params += [("tenant", t) for t in (tenants or ())]
        return params

    # ------------------------------------------------------------------ reads

    def whoami(self) -> Viewer:
        """The signed-in key as the server resolves it.

        Raises:
            SignInError: unknown key.
        """
        return Viewer.from_dict(self._get("whoami", []))

    def tiers(self) -> list[dict[str, Any]]:
        """Tier weights and SLOs as the server's tenancy config has them."""
        return self._get("tiers", [])

    def read(self, name: str, window: Window, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """One of :data:`~kvmeter.dashboards.source.WINDOW_READS`."""
        if name not in WINDOW_READS:
            raise ValueError(f"unknown read {name!r}")
        return self._decode(self._get(f"read/{name}", self._window(window, tenants)))

    def signal_gauge(self, window: Window, name: str, by: Sequence[str] = (), agg: str = "avg",
                     tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """See :meth:`kvmeter.ledger.window_queries.WindowQueries.signal_gauge`."""
        params = self._window(window, tenants) + [("name", name), ("agg", agg)] + [("by", b) for b in by]
        return self._decode(self._get("signal_gauge", params))

    def invoice(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """Invoice lines priced by the server's price list (the ledger's ``/v1/usage/invoice``)."""
        return self._ledger_call(self._ledger.invoice, period, tenant_id)

    def reconcile_views(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """The ledger's ``/v1/usage/reconcile_views``."""
        return self._ledger_call(self._ledger.reconcile_views, period, tenant_id)

    @staticmethod
    def _ledger_call(fn: Any, period: Period, tenant_id: str | None) -> list[dict[str, Any]]:
        try:
            return fn(period, tenant_id)
        except ReadApiError as exc:
            if exc.status_code == 401:
                raise SignInError(str(exc)) from None
            if exc.status_code == 403:
                raise ScopeError(str(exc)) from None
            raise

    def __getattr__(self, name: str) -> Any:
        if name in WINDOW_READS:
            return lambda window, tenants=None: self.read(name, window, tenants)
        raise AttributeError(name)

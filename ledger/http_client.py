"""A small HTTP client for the ledger's read API — a :class:`~kvmeter.ledger.queries.UsageReader`.

The billing CLI and the dashboards use it (``--server URL --api-key KEY``) when the embedded
ledger is held by a running serve process; otherwise they open the chDB path or query the
ClickHouse server directly with :class:`~kvmeter.ledger.queries.LedgerQueries`.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any, Sequence

import httpx

from .errors import LedgerError, LedgerUnavailable, PeriodError
from .period import Period, parse_period
from .prices import PriceList, parse_price_list

__all__ = ["LedgerHttpClient", "ReadApiError", "read_api_get", "error_fields"]

_DECIMAL_FIELDS = {"cost", "amount", "subtotal"}
_TIME_FIELDS = {"ts", "hour", "day", "period_start", "period_end"}


class ReadApiError(LedgerError):
    """The read API refused the request (401, 403, 400, ...).

    Attributes:
        status_code: the HTTP status. code: the API's error code.
    """

    def __init__(self, message: str, status_code: int, code: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code


def read_api_get(client: httpx.Client, path: str, params: Any, base_url: object) -> httpx.Response:
    """``GET path`` on a kvmeter read API; returns the answer (200, or a 4xx for the caller to map).

    Raises:
        LedgerUnavailable: the server is unreachable or answered 5xx.
    """
    try:
        response = client.get(path, params=params)
    except httpx.HTTPError as exc:
        raise LedgerUnavailable(f"read API at {base_url} unreachable: {exc}") from None
    if response.status_code >= 500:
        raise LedgerUnavailable(f"read API answered {response.status_code}: {response.text[:200]}")
    return response


def error_fields(response: httpx.Response) -> tuple[str, str]:
    """``(message, code)`` of a read-API error answer: its OpenAI-style JSON ``error`` object,
    else the body's first 200 characters and ``""``."""
    try:
        err = response.json()["error"]
        return str(err.get("message", "")), str(err.get("code", ""))
    except (ValueError, KeyError, TypeError, AttributeError):
        return response.text[:200], ""


def _decode(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        for key, value in row.items():
            if value is None:
                continue
            if key in _DECIMAL_FIELDS:
                row[key] = Decimal(value)
            elif key in _TIME_FIELDS and isinstance(value, str):
                row[key] = datetime.fromisoformat(value)
    return rows


def _wire_period(period: Period) -> str:
    """How ``period`` travels: its label when the server parses it back (in the period's zone,
    sent as ``timezone=``) to the same interval (so rows that carry the label — invoice lines —
    read the same as on a local ledger), else the explicit ``START/END`` range."""
    try:
        parsed = parse_period(period.label, period.timezone)
    except PeriodError:
        parsed = None
    if parsed is not None and (parsed.start, parsed.end) == (period.start, period.end):
        return period.label
    return f"{period.start.isoformat()}/{period.end.isoformat()}"


class LedgerHttpClient:
    """Reads usage through a serve process's ``/v1/usage`` routes.

    Args:
        base_url: the serve process, e.g. ``http://127.0.0.1:8000``.
        api_key: a tenant key (sees its tenant) or an admin key (sees all).
        timeout_s: per-request timeout in seconds.
        transport: an httpx transport (tests pass ``httpx.ASGITransport`` or a mock-free
            loopback server; default: real HTTP).
        prefix: URL prefix of the routes.
    Raises (every method):
        ReadApiError: the API refused (bad key, other tenant, bad parameter).
        LedgerUnavailable: the server cannot be reached or answered 5xx.
    """

    def __init__(self, base_url: str, api_key: str, *, timeout_s: float = 60.0,
                 transport: httpx.BaseTransport | None = None, prefix: str = "/v1/usage") -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self._client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport,
                                    headers={"Authorization": f"Bearer {api_key}"})
        self._prefix = prefix

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> "LedgerHttpClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _get(self, name: str, period: Period, tenant_id: str | None, **params: Any) -> list[dict[str, Any]]:
        query = {"period": _wire_period(period), "timezone": period.timezone, **params}
        if tenant_id is not None:
            query["tenant_id"] = tenant_id
        response = read_api_get(self._client, f"{self._prefix}/{name}", query, self._client.base_url)
        if response.status_code != 200:
            message, code = error_fields(response)
            raise ReadApiError(f"read API refused ({response.status_code}): {message}", response.status_code, code)
        return _decode(response.json())

    def usage_summary(self, period: Period, tenant_id: str | None = None,
                      group_by: Sequence[str] = ("tenant_id",)) -> list[dict[str, Any]]:
        """See :meth:`LedgerQueries.usage_summary`."""
        return self._get("summary", period, tenant_id, group_by=",".join(group_by))

    def invoice_usage(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """See :meth:`LedgerQueries.invoice_usage`."""
        return self._get("invoice_usage", period, tenant_id)

    def invoice_attempts(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """See :meth:`LedgerQueries.invoice_attempts`."""
        return self._get("invoice_attempts", period, tenant_id)

    def adjustments(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """See :meth:`LedgerQueries.adjustments`."""
        return self._get("adjustments", period, tenant_id)

    def reconcile_views(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """See :meth:`LedgerQueries.reconcile_views`."""
        return self._get("reconcile_views", period, tenant_id)

    def usage_timeseries(self, period: Period, tenant_id: str | None = None,
                         step: str = "hour") -> list[dict[str, Any]]:
        """See :meth:`LedgerQueries.usage_timeseries`."""
        return self._get("timeseries", period, tenant_id, step=step)

    def invoice(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """Invoice lines priced by the server's price list (``/invoice``), in ``period``'s zone."""
        return self._get("invoice", period, tenant_id)

    def billing_config(self) -> tuple[PriceList | None, dict[str, str]]:
        """The server's price list (``None`` when it has none) and the tenant → billing time zone
        map this key may see (``/billing_config``).

        Raises:
            ReadApiError, LedgerUnavailable: as the other reads; PriceListError: the server's
            list does not validate here.
        """
        response = read_api_get(self._client, f"{self._prefix}/billing_config", {}, self._client.base_url)
        if response.status_code != 200:
            message, code = error_fields(response)
            raise ReadApiError(f"read API refused ({response.status_code}): {message}", response.status_code, code)
        body = response.json()
        prices = body.get("prices")
        source = f"{self._client.base_url}{self._prefix}/billing_config"
        return (parse_price_list(prices, source) if prices else None), dict(body.get("timezones") or {})

"""One interface over the two data modes, and the tenant scope enforced on it.

* :class:`DashboardSource` — every read the pages make. Two implementations:
  :class:`~kvmeter.dashboards.sql.SqlSource` (mode *b*, a ClickHouse DSN: a server, or a chDB path
  no process holds) and :class:`~kvmeter.dashboards.http_source.HttpSource` (mode *a*, through a running
  ``kvmeter serve``'s read API — the only way to read the embedded ledger while serve holds it).
* :class:`ScopedSource` — wraps a source with the signed-in :class:`~kvmeter.dashboards.viewer.Viewer`.
  The pages only ever hold a ``ScopedSource``: a tenant key is restricted to its own tenant here,
  in the data layer (asking for another tenant raises :class:`ScopeError`), not merely in the UI;
  an admin key reads every tenant. In mode *a* the serve process enforces the same rule again
  (:mod:`kvmeter.dashboards.routes` wraps its reads in a ``ScopedSource`` per request).

Signals: a tenant key sees only series labelled with its own tenant (``labels['tenant']``);
platform-wide series (engine KV, GPUs) are admin-only. Interference: a tenant key sees its own
missed requests' breakdown with every other tenant renamed ``tenant-<rank>``
(:func:`kvmeter.ledger.interference.anonymize`).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from kvmeter.ledger.interference import anonymize
from kvmeter.ledger.period import Period

from .errors import ScopeError
from .viewer import TierInfo, Viewer
from .window import Window

__all__ = ["DashboardSource", "ScopedSource", "WINDOW_READS"]

#: Reads that take ``(window, tenants)`` and return rows (the ledger's
#: :class:`~kvmeter.ledger.window_queries.WindowQueries`, where each read's columns are documented).
WINDOW_READS: tuple[str, ...] = (
    "tenants", "traffic", "traffic_by_tenant", "tenant_totals", "latency_by_tier", "latency_timeseries",
    "goodput", "attempts_timeseries", "attempts_by_tenant", "rejections_by_limit", "reservation_by_tenant",
    "reservation_timeseries", "output_budget_use", "signal_catalog",
    # agent runs (:class:`~kvmeter.ledger.agent_runs.AgentRunQueries`, flattened by the SQL source)
    "agent_runs", "agent_run_stops", "approvals_pending",
    # noisy neighbours (:class:`~kvmeter.ledger.noisy_queries.NoisyQueries`)
    "noisy_neighbours", "agent_calls_per_run",
    # who filled the steps of missed requests (:class:`~kvmeter.ledger.interference.InterferenceQueries`;
    # anonymized for a tenant key by :class:`ScopedSource`)
    "interference",
)

Rows = list[dict[str, Any]]


class DashboardSource(Protocol):
    """Every read of the dashboards. Rows are JSON-friendly dicts (see
    :class:`~kvmeter.ledger.window_queries.WindowQueries` for each read's columns)."""

    def tiers(self) -> Rows: ...
    def tenants(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def traffic(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def traffic_by_tenant(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def tenant_totals(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def latency_by_tier(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def latency_timeseries(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def goodput(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def attempts_timeseries(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def attempts_by_tenant(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def rejections_by_limit(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def reservation_by_tenant(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def reservation_timeseries(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def output_budget_use(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def signal_catalog(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def agent_runs(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def agent_run_stops(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def approvals_pending(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def noisy_neighbours(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def agent_calls_per_run(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def interference(self, window: Window, tenants: Sequence[str] | None = None) -> Rows: ...
    def signal_gauge(self, window: Window, name: str, by: Sequence[str] = (), agg: str = "avg",
                     tenants: Sequence[str] | None = None) -> Rows: ...
    def invoice(self, period: Period, tenant_id: str | None = None) -> Rows: ...
    def reconcile_views(self, period: Period, tenant_id: str | None = None) -> Rows: ...


class ScopedSource:
    """A :class:`DashboardSource` restricted to what ``viewer`` may read.

    Args:
        source: the unrestricted source.
        viewer: the signed-in key.
    Raises (every read):
        ScopeError: a tenant key asked for another tenant (or for several tenants).
        plus whatever the wrapped source raises.
    """

    def __init__(self, source: DashboardSource, viewer: Viewer) -> None:
        self._source = source
        self.viewer = viewer

    def scope(self, tenants: Sequence[str] | None) -> tuple[str, ...] | None:
        """The tenants a read may cover.

        Returns:
            For an admin, the asked tenants (sorted, deduplicated) or ``None`` (= all); for a
            tenant key, always ``(own tenant,)``.
        Raises:
            ScopeError: a tenant key asked for any other tenant.
        """
        asked = None if tenants is None else tuple(sorted(set(tenants)))
        if self.viewer.admin:
            return asked or None
        own = self.viewer.tenant_id
        if asked is not None and asked and asked != (own,):
            raise ScopeError("this API key can read only its own tenant's data")
        return (own,)

    def tenant_id(self, tenant_id: str | None) -> str | None:
        """The one tenant a billing read may cover (``None`` = all, admins only).

        Raises:
            ScopeError: a tenant key asked for another tenant.
        """
        if self.viewer.admin:
            return tenant_id
        if tenant_id is not None and tenant_id != self.viewer.tenant_id:
            raise ScopeError("this API key can read only its own tenant's data")
        return self.viewer.tenant_id

    # the reads -------------------------------------------------------------------------------

    def tiers(self) -> list[TierInfo]:
        """Every tier's weight and SLOs (not tenant data: every key may read them)."""
        return [TierInfo.from_dict(t) for t in self._source.tiers()]

    def read(self, name: str, window: Window, tenants: Sequence[str] | None = None) -> Rows:
        """One of :data:`WINDOW_READS`, scoped.

        Raises:
            ValueError: an unknown read.
        """
        if name not in WINDOW_READS:
            raise ValueError(f"unknown read {name!r}; known: {', '.join(WINDOW_READS)}")
        rows = getattr(self._source, name)(window, self.scope(tenants))
        if name == "interference" and not self.viewer.admin:
            return anonymize(rows, self.viewer.tenant_id)
        return rows

    def signal_gauge(self, window: Window, name: str, by: Sequence[str] = (), agg: str = "avg",
                     tenants: Sequence[str] | None = None) -> Rows:
        """A gauge per bucket (see :meth:`WindowQueries.signal_gauge
        <kvmeter.ledger.window_queries.WindowQueries.signal_gauge>`); a tenant key gets only its
        own tenant-labelled series."""
        return self._source.signal_gauge(window, name, tuple(by), agg, self.scope(tenants))

    def invoice(self, period: Period, tenant_id: str | None = None) -> Rows:
        """Invoice lines of a period for one tenant (or all, admins only)."""
        return self._source.invoice(period, self.tenant_id(tenant_id))

    def reconcile_views(self, period: Period, tenant_id: str | None = None) -> Rows:
        """The three-way reconciliation views of a period for one tenant (or all, admins only)."""
        return self._source.reconcile_views(period, self.tenant_id(tenant_id))

    def __getattr__(self, name: str) -> Any:
        if name in WINDOW_READS:
            return lambda window, tenants=None: self.read(name, window, tenants)
        raise AttributeError(name)

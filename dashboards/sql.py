"""The dashboards' source on the ledger's ClickHouse database (mode *b*: ``--ledger-dsn``).

No SQL lives here: every read is the ledger's own query layer —
:class:`~kvmeter.ledger.window_queries.WindowQueries` for the bucketed reads (traffic, latency,
goodput, gateway decisions, reservations, signals), :func:`~kvmeter.ledger.billing.build_invoice`
for the invoice, :meth:`~kvmeter.ledger.queries.LedgerQueries.reconcile_views` for
reconciliation, :class:`~kvmeter.ledger.agent_runs.AgentRunQueries` for agent runs and
:class:`~kvmeter.ledger.noisy_queries.NoisyQueries` for the noisy-neighbour shapes,
:class:`~kvmeter.ledger.interference.InterferenceQueries` for interference. The same
class serves the serve process's dashboard routes (:mod:`kvmeter.dashboards.routes`), so mode *a*
(through the read API) returns exactly these rows, and the billing page shows the invoice
``kvmeter billing report`` writes.

Tenant filtering is a parameter here; *who may ask for which tenant* is decided by
:class:`~kvmeter.dashboards.source.ScopedSource`, never by the caller of these methods.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from clickhouse_connect.driver.client import Client

from kvmeter.ledger.agent_runs import AgentRunQueries
from kvmeter.ledger.billing import build_invoice
from kvmeter.ledger.connection import ClientHolder
from kvmeter.ledger.interference import OBJECTIVES, InterferenceQueries
from kvmeter.ledger.noisy_queries import NoisyQueries
from kvmeter.ledger.period import Period
from kvmeter.ledger.prices import PriceList
from kvmeter.ledger.queries import LedgerQueries
from kvmeter.ledger.window_queries import WindowQueries

from .source import WINDOW_READS
from .viewer import TierInfo
from .window import Window

__all__ = ["SqlSource"]


class SqlSource:
    """Dashboard reads on the ledger's ClickHouse database, through the ledger's queries.

    The window reads of :data:`~kvmeter.dashboards.source.WINDOW_READS` are
    :class:`~kvmeter.ledger.window_queries.WindowQueries`' (see there for each read's columns);
    :meth:`goodput` adds the tiers' SLOs.

    Args:
        client: a :class:`~kvmeter.ledger.connection.ClientHolder` or a zero-argument function
            returning a connected clickhouse-connect client whose database is the ledger's.
        prices: the price list for invoice lines.
        tiers: the tier weights and SLOs (from the tenancy config), or a function returning them
            (read on every call, so a reloaded tenancy file shows), returned by :meth:`tiers`.
        cluster: the ledger is in cluster mode (Distributed tables), or a function answering that:
            the interference read is rendered with ``GLOBAL`` (:mod:`kvmeter.ledger.interference`).
    Raises (every read):
        LedgerUnavailable: ClickHouse cannot be reached.
        LedgerError: ClickHouse refused the query.
        ValueError: a bad argument (unknown aggregation, too many label keys, empty tenant id).
    """

    def __init__(self, client: ClientHolder | Callable[[], Client], prices: PriceList,
                 tiers: Iterable[TierInfo] | Callable[[], Iterable[TierInfo]] = (),
                 cluster: bool | Callable[[], bool] = False) -> None:
        self._holder = client if isinstance(client, ClientHolder) else None
        self.prices = prices
        if callable(tiers):
            self._tiers_fn: Callable[[], Iterable[TierInfo]] = tiers
        else:
            fixed = list(tiers)
            self._tiers_fn = lambda: fixed
        self._ledger = LedgerQueries(client, prices)
        self._window = WindowQueries(client)
        self._runs = AgentRunQueries(client, prices)
        self._noisy = NoisyQueries(client)
        self._interference = InterferenceQueries(client, cluster=cluster)

    def close(self) -> None:
        """Close the connection if this source holds a :class:`ClientHolder` (idempotent)."""
        if self._holder is not None:
            self._holder.close()

    def tiers(self) -> list[dict[str, Any]]:
        """Tier weights and SLOs: dicts of :class:`~kvmeter.dashboards.viewer.TierInfo` fields."""
        return [t.to_dict() for t in self._tiers_fn()]

    def goodput(self, window: Window, tenants: Sequence[str] | None = None,
                slos: Sequence[TierInfo] | None = None) -> list[dict[str, Any]]:
        """:meth:`WindowQueries.goodput <kvmeter.ledger.window_queries.WindowQueries.goodput>`
        under the tiers' SLOs (default: :meth:`tiers`)."""
        tiers = list(slos) if slos is not None else list(self._tiers_fn())
        return self._window.goodput(window, tenants, [(t.name, t.ttft_slo_s, t.itl_slo_s) for t in tiers])

    def signal_gauge(self, window: Window, name: str, by: Sequence[str] = (), agg: str = "avg",
                     tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """:meth:`WindowQueries.signal_gauge <kvmeter.ledger.window_queries.WindowQueries.signal_gauge>`."""
        return self._window.signal_gauge(window, name, by, agg, tenants)

    def invoice(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """The period's invoice lines (:func:`kvmeter.ledger.billing.build_invoice` at this
        source's price list): dicts of :data:`~kvmeter.ledger.billing.INVOICE_COLUMNS`."""
        return build_invoice(self._ledger, period, self.prices, tenant_id).rows()

    def reconcile_views(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """:meth:`kvmeter.ledger.queries.LedgerQueries.reconcile_views` of the period."""
        return self._ledger.reconcile_views(period, tenant_id)

    def agent_runs(self, window: Window, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """:meth:`AgentRunQueries.runs <kvmeter.ledger.agent_runs.AgentRunQueries.runs>` of the window
        (the 1,000 most expensive), flattened for a frame: ``tools`` (``name×n, ...``), ``models``
        joined, per-class permits ``read_only_calls`` / ``side_effect_calls`` / ``high_risk_calls``,
        ``subtotal`` and ``cost`` as exact decimal strings."""
        out = []
        for r in self._runs.runs(window, tenants, order="cost", limit=1000):
            by_tool = r.pop("tool_calls_by_tool")
            by_risk = r.pop("tool_calls_by_risk_class")
            r["tools"] = ", ".join(f"{k}×{v}" for k, v in sorted(by_tool.items(), key=lambda kv: (-kv[1], kv[0])))
            r["models"] = ", ".join(r["models"])
            for cls in ("read_only", "side_effect", "high_risk"):
                r[f"{cls}_calls"] = int(by_risk.get(cls, 0))
            out.append(r)
        return out

    def agent_run_stops(self, window: Window, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """:meth:`AgentRunQueries.run_stops <kvmeter.ledger.agent_runs.AgentRunQueries.run_stops>`."""
        return self._runs.run_stops(window, tenants, limit=1000)

    def approvals_pending(self, window: Window, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Approvals pending as of the window's end
        (:meth:`AgentRunQueries.pending_approvals <kvmeter.ledger.agent_runs.AgentRunQueries.pending_approvals>`)."""
        return self._runs.pending_approvals(window.end, tenants, limit=1000)

    def noisy_neighbours(self, window: Window, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """:meth:`NoisyQueries.noisy_neighbours <kvmeter.ledger.noisy_queries.NoisyQueries.noisy_neighbours>`."""
        return self._noisy.noisy_neighbours(window, tenants)

    def agent_calls_per_run(self, window: Window, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """:meth:`NoisyQueries.agent_calls_per_run <kvmeter.ledger.noisy_queries.NoisyQueries.agent_calls_per_run>`."""
        return self._noisy.agent_calls_per_run(window, tenants)

    def interference(self, window: Window, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """:meth:`InterferenceQueries.interference <kvmeter.ledger.interference.InterferenceQueries.interference>`
        under the tiers' objectives (:meth:`tiers`), the rows of every objective (``ttft``, then ``itl``)."""
        slos = [(t.name, t.ttft_slo_s, t.itl_slo_s) for t in self._tiers_fn()]
        return [r for objective in OBJECTIVES
                for r in self._interference.interference(window, tenants, slos, objective)]

    def __getattr__(self, name: str) -> Any:
        if name in WINDOW_READS:  # the ledger's window read of that name (goodput is above)
            return getattr(self._window, name)
        raise AttributeError(name)

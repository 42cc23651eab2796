"""kvmeter.dashboards — token-centric Streamlit views of the ledger: what QPS hides.

Where a token is drawn: ``kvmeter dashboard`` (:mod:`.cli`) runs ``streamlit run`` on
:mod:`.app`, whose eleven pages (:mod:`.views`) read through a
:class:`~kvmeter.dashboards.source.ScopedSource` — the signed-in key's tenant scope, enforced in
the data layer — over one of two sources: :class:`~kvmeter.dashboards.sql.SqlSource` (ClickHouse
directly: a server, or a chDB path no process holds) or :class:`~kvmeter.dashboards.http_source.HttpSource`
(a running ``kvmeter serve``'s read API, whose extra routes are :mod:`.routes`). Rows become
frames in :mod:`.frames` (polars) and charts in :mod:`.charts` (altair); :mod:`.ui` holds the
Streamlit plumbing (sign-in, filters, cache, auto-refresh).

Dashboards only read, and hold no SQL: both sources end in the ledger's query layer
(:mod:`kvmeter.ledger.window_queries`, :mod:`kvmeter.ledger.queries`) and its one invoice
assembly (:func:`kvmeter.ledger.billing.build_invoice`).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .config import DashboardConfig
from .errors import ConfigError, DashboardError, ScopeError, SignInError
from .source import DashboardSource, ScopedSource
from .viewer import TierInfo, Viewer
from .window import Window

__all__ = [
    "DashboardConfig", "DashboardError", "ConfigError", "ScopeError", "SignInError", "DashboardSource",
    "ScopedSource", "TierInfo", "Viewer", "Window", "SqlSource", "HttpSource", "Backend", "dashboard_routes",
    "serve_routes",
]

#: Names imported on first use (they pull in ClickHouse, httpx and Starlette).
_LAZY = {"SqlSource": ".sql", "HttpSource": ".http_source", "Backend": ".backend", "dashboard_routes": ".routes",
         "serve_routes": ".routes"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Streamlit plumbing shared by the pages: the backend, sign-in, filters, cached reads, refresh.

Flow of one script run: ``app.py`` calls :func:`sidebar` (sign-in, time range, tenant filter,
refresh controls), then the chosen page calls :func:`run_page` with its render function. The
render function runs inside ``st.fragment(run_every=...)``, so auto-refresh redraws the page body
only; the window slides with "now" on every refresh. Reads go through :class:`PageContext`,
whose results are cached with ``st.cache_data`` for ``cache_ttl_s`` seconds, partitioned by the
signed-in key's digest and viewer — one tenant's cached rows can never serve another key.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta, timezone
from typing import Any, Callable, Sequence

import polars as pl
import streamlit as st

from kvmeter.ledger.errors import LedgerError, LedgerLocked, LedgerUnavailable
from kvmeter.ledger.period import Period

from .backend import Backend, Session
from .config import DashboardConfig
from .errors import DashboardError, ScopeError, SignInError
from .frames import frame
from .viewer import TierInfo
from .window import RANGES, Window

__all__ = ["backend", "sidebar", "run_page", "PageContext", "current_session", "CUSTOM_RANGE"]

log = logging.getLogger(__name__)

CUSTOM_RANGE = "custom…"
_SESSION = "kvmeter_session"
_AUTO_SIGNED = "kvmeter_auto_signed_in"


@st.cache_resource(show_spinner=False)
def backend() -> Backend:
    """The process-wide backend, from :meth:`DashboardConfig.from_env` (the CLI sets the env)."""
    return Backend(DashboardConfig.from_env())


def current_session() -> Session | None:
    """The signed-in session of this browser tab, or ``None``."""
    return st.session_state.get(_SESSION)


def _sign_in(key: str) -> None:
    try:
        st.session_state[_SESSION] = backend().sign_in(key.strip())
    except SignInError as exc:
        st.session_state["sign_in_error"] = str(exc)
    except (LedgerError, DashboardError) as exc:
        st.session_state["sign_in_error"] = f"cannot reach the ledger: {exc}"
    else:
        st.session_state.pop("sign_in_error", None)


def _sign_out() -> None:
    session = st.session_state.pop(_SESSION, None)
    if session is not None:
        session.close()
    st.session_state.pop("tenant_filter", None)


def _on_sign_in_submit() -> None:
    _sign_in(st.session_state.get("api_key_input", ""))
    st.session_state["api_key_input"] = ""  # never keep the key in a widget


def sidebar() -> None:
    """Sign-in, time range, tenant filter and refresh controls (runs before every page)."""
    cfg = backend().config
    with st.sidebar:
        st.markdown("### kvmeter")
        st.caption(f"data: {'serve read API' if cfg.mode == 'server' else 'ClickHouse'} · `{cfg.target}`")
        if current_session() is None and cfg.api_key and not st.session_state.get(_AUTO_SIGNED):
            st.session_state[_AUTO_SIGNED] = True
            _sign_in(cfg.api_key)
        session = current_session()
        if session is None:
            with st.form("sign_in", border=False):
                st.text_input("API key", type="password", key="api_key_input",
                              help="A tenant key shows that tenant only; an admin key shows every tenant.")
                st.form_submit_button("Sign in", on_click=_on_sign_in_submit)
            if st.session_state.get("sign_in_error"):
                st.error(st.session_state["sign_in_error"])
            return
        st.markdown(f"**{session.viewer.label}**")
        st.button("Sign out", on_click=_sign_out)
        st.divider()
        options = [*RANGES, CUSTOM_RANGE]
        if "range" not in st.session_state:
            st.session_state["range"] = cfg.default_range
        choice = st.selectbox("Time range", options, key="range")
        if choice == CUSTOM_RANGE:
            end_default = _now(cfg)
            start_default = end_default - timedelta(hours=1)
            st.date_input("from (UTC)", value=start_default.date(), key="range_start_date")
            st.time_input("at", value=start_default.time().replace(microsecond=0), key="range_start_time", step=60)
            st.date_input("to (UTC)", value=end_default.date(), key="range_end_date")
            st.time_input("at ", value=end_default.time().replace(microsecond=0), key="range_end_time", step=60)
        if cfg.until is not None:
            st.caption(f"window end pinned at {cfg.until.isoformat()}")
        if session.viewer.admin:
            try:
                window = window_now(cfg)
                known = sorted({r["tenant_id"] for r in _cached_read(session, cfg, "tenants", window, None)})
            except (LedgerError, DashboardError, ValueError) as exc:  # ValueError: a custom range backwards
                known = []
                st.warning(f"tenant list unavailable: {exc}")
            selected = [t for t in st.session_state.get("tenant_filter", []) if t]
            st.multiselect("Tenants", sorted(set(known) | set(selected)), key="tenant_filter",
                           placeholder="all tenants", help="Empty = every tenant.")
        else:
            st.caption(f"Tenant: **{session.viewer.tenant_id}** (a tenant key reads only its own data)")
        st.divider()
        if "auto_refresh" not in st.session_state:
            st.session_state["auto_refresh"] = cfg.refresh_s > 0
        st.toggle(f"Auto-refresh every {cfg.refresh_s:g} s" if cfg.refresh_s else "Auto-refresh (off in config)",
                  key="auto_refresh", disabled=cfg.refresh_s == 0)
        if st.button("Refresh now", help="Drop the cached query results (for every viewer of this process)."):
            st.cache_data.clear()
        st.caption(f"queries cached {cfg.cache_ttl_s:g} s")


def _now(cfg: DashboardConfig) -> datetime:
    return cfg.until or datetime.now(timezone.utc)


def window_now(cfg: DashboardConfig) -> Window:
    """The window the sidebar's range selects, as of now (or the pinned end).

    Raises:
        ValueError: a custom range whose start is not before its end.
    """
    choice = st.session_state.get("range", cfg.default_range)
    if choice == CUSTOM_RANGE:
        def at(d_key: str, t_key: str) -> datetime:
            d: date = st.session_state[d_key]
            t: time = st.session_state[t_key]
            return datetime.combine(d, t, tzinfo=timezone.utc)

        return Window.between(at("range_start_date", "range_start_time"), at("range_end_date", "range_end_time"))
    span = RANGES.get(choice, RANGES[cfg.default_range])
    if cfg.until is not None:
        return Window.ending(span, cfg.until)
    return Window.last(span, _now(cfg))


# --------------------------------------------------------------------------- cached reads

_FETCHERS: dict[float, Callable[..., Any]] = {}


def _fetcher(ttl_s: float) -> Callable[..., Any]:
    fn = _FETCHERS.get(ttl_s)
    if fn is None:
        @st.cache_data(ttl=ttl_s, show_spinner=False, max_entries=2048)
        def fetch(partition: str, read: str, args: str, _call: Callable[[], Any]) -> Any:
            return _call()

        fn = _FETCHERS[ttl_s] = fetch
    return fn


def _partition(session: Session, cfg: DashboardConfig) -> str:
    v = session.viewer
    return f"{cfg.mode}|{cfg.target}|{session.key_id}|{v.tenant_id}|{int(v.admin)}"


def _cached(session: Session, cfg: DashboardConfig, read: str, args: dict[str, Any],
            call: Callable[[], Any]) -> Any:
    key = json.dumps(args, sort_keys=True, default=str)
    return _fetcher(cfg.cache_ttl_s)(_partition(session, cfg), read, key, call)


def _cached_read(session: Session, cfg: DashboardConfig, name: str, window: Window,
                 tenants: Sequence[str] | None) -> list[dict[str, Any]]:
    return _cached(session, cfg, name, {"w": window.to_query(), "t": tenants},
                   lambda: session.source.read(name, window, tenants))


@dataclass
class PageContext:
    """Everything a page's render function needs.

    Attributes:
        session: the signed-in key (``session.viewer``: who; ``session.source``: scoped reads).
        config: the dashboard settings.
        window: the selected time window.
        tenants: the tenant filter (``None`` = all the viewer may see).
        now: the wall-clock "now" of this render (UTC).
    """

    session: Session
    config: DashboardConfig
    window: Window
    tenants: tuple[str, ...] | None
    now: datetime
    _tiers: list[TierInfo] | None = field(default=None, repr=False)

    @property
    def viewer(self):
        return self.session.viewer

    @property
    def admin(self) -> bool:
        return self.session.viewer.admin

    def rows(self, name: str) -> list[dict[str, Any]]:
        """One of the window reads (cached)."""
        return _cached_read(self.session, self.config, name, self.window, self.tenants)

    def read(self, name: str, schema: dict[str, Any]) -> pl.DataFrame:
        """One of the window reads as a frame with at least ``schema``'s columns (cached as the
        frame: a cache hit costs an Arrow unpickle, not a rebuild from row dicts)."""
        return _cached(self.session, self.config, f"{name}:frame",
                       {"w": self.window.to_query(), "t": self.tenants, "s": sorted(schema)},
                       lambda: frame(self.session.source.read(name, self.window, self.tenants), schema))

    @property
    def tiers(self) -> list[TierInfo]:
        """Tier weights and SLOs (cached)."""
        if self._tiers is None:
            rows = _cached(self.session, self.config, "tiers", {},
                           lambda: [t.to_dict() for t in self.session.source.tiers()])
            self._tiers = [TierInfo.from_dict(r) for r in rows]
        return self._tiers

    def gauge(self, name: str, by: Sequence[str] = (), agg: str = "avg", *, per_tenant: bool = False,
              schema: dict[str, Any] | None = None) -> pl.DataFrame:
        """A gauge signal per bucket (cached); ``per_tenant`` applies the tenant filter to the
        series' ``tenant`` label (a tenant key always gets only its own series)."""
        tenants = self.tenants if per_tenant else None
        full = {"ts": pl.Datetime("us", "UTC"), **{k: pl.String for k in by}, "value": pl.Float64, **(schema or {})}
        return _cached(self.session, self.config, "signal_gauge",
                       {"w": self.window.to_query(), "n": name, "by": list(by), "agg": agg, "t": tenants,
                        "s": sorted(full)},
                       lambda: frame(self.session.source.signal_gauge(self.window, name, by, agg, tenants), full))

    def signal_names(self) -> set[str]:
        """Signal names with samples in the window that this viewer may read."""
        return {r["name"] for r in self.rows("signal_catalog")}

    def billing_tenant(self) -> str | None:
        """The one tenant a billing read asks for: the filter's single tenant, or ``None``."""
        if self.tenants is not None and len(self.tenants) == 1:
            return self.tenants[0]
        return None if self.admin else self.viewer.tenant_id

    def invoice(self, period: Period) -> list[dict[str, Any]]:
        """Invoice lines of ``period`` (cached), narrowed to the tenant filter."""
        tenant = self.billing_tenant()
        rows = _cached(self.session, self.config, "invoice", {"p": [period.start.isoformat(), period.end.isoformat()],
                                                              "t": tenant},
                       lambda: self.session.source.invoice(period, tenant))
        return self._filter(rows)

    def reconcile_views(self, period: Period) -> list[dict[str, Any]]:
        """Reconciliation views of ``period`` (cached), narrowed to the tenant filter."""
        tenant = self.billing_tenant()
        rows = _cached(self.session, self.config, "reconcile_views",
                       {"p": [period.start.isoformat(), period.end.isoformat()], "t": tenant},
                       lambda: self.session.source.reconcile_views(period, tenant))
        return self._filter(rows)

    def _filter(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.tenants is None:
            return rows
        allowed = set(self.tenants)
        return [r for r in rows if r.get("tenant_id") in allowed]


def _context(session: Session, cfg: DashboardConfig) -> PageContext:
    window = window_now(cfg)
    selected = st.session_state.get("tenant_filter") or None
    tenants = tuple(sorted(selected)) if (selected and session.viewer.admin) else None
    return PageContext(session=session, config=cfg, window=window, tenants=tenants,
                       now=min(_now(cfg), window.end))


def run_page(title: str, caption: str, render: Callable[[PageContext], None]) -> None:
    """Draw a page: title, then ``render`` inside an auto-refreshing fragment.

    Expected failures are shown as one message, never a traceback: the ledger unreachable or
    locked, a refused key, a refused tenant.
    """
    st.title(title)
    st.caption(caption)
    session = current_session()
    if session is None:
        st.info("Sign in with an API key in the sidebar to see this page.")
        return
    cfg = backend().config
    every = cfg.refresh_s if (cfg.refresh_s and st.session_state.get("auto_refresh", True)) else None

    @st.fragment(run_every=every)
    def body() -> None:
        try:
            ctx = _context(session, cfg)
        except ValueError as exc:
            st.warning(f"time range: {exc}")
            return
        scope = ("all tenants" if ctx.tenants is None and ctx.admin
                 else ", ".join(ctx.tenants or (ctx.viewer.tenant_id,)))
        st.caption(f"{ctx.window.start:%Y-%m-%d %H:%M:%S} → {ctx.window.end:%Y-%m-%d %H:%M:%S} UTC · "
                   f"buckets of {ctx.window.step_s:,} s · {scope}")
        try:
            render(ctx)
        except ScopeError as exc:
            st.error(f"not allowed: {exc}")
        except SignInError as exc:
            st.error(f"sign-in no longer valid: {exc}")
        except LedgerLocked as exc:
            st.error(f"{exc}")
        except LedgerUnavailable as exc:
            st.error(f"ledger unavailable: {exc}")

    body()

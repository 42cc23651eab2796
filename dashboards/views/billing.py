"""Billing and reconciliation: the invoice lines of a period (exact decimals, rounded once per
line) and the three-way reconciliation — engine counters vs gateway records vs ledger totals —
with CSV and Parquet downloads."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

import polars as pl
import streamlit as st

from kvmeter.ledger.billing import INVOICE_COLUMNS, invoice_totals
from kvmeter.money import currency_places, format_money
from kvmeter.ledger.period import Period
from kvmeter.ledger.reconcile import reconcile

from .. import charts
from ..frames import long, to_csv_bytes, to_parquet_bytes
from ..ui import PageContext
from .common import chart, pct, si

TITLE = "Billing & reconciliation"
CAPTION = ("Money is exact: one billable record per logical request, engine-true tokens, Decimal prices, "
           "rounded once per invoice line. Reconciliation explains every difference between the engine, "
           "the gateway and the ledger.")

PERIODS = ("time range", "this month", "last month")
#: Tenants drawn in the per-tenant charts (the tables hold all of them).
TOP_TENANTS = 15


def period_for(choice: str, ctx: PageContext) -> Period:
    """The billing period: the page's time range, or a calendar month (UTC) of ``ctx.now``."""
    if choice == "time range":
        return ctx.window.period
    now = ctx.now.astimezone(timezone.utc)
    first = datetime(now.year, now.month, 1, tzinfo=timezone.utc)
    if choice == "last month":
        end = first
        first = datetime(end.year - (end.month == 1), (end.month - 2) % 12 + 1, 1, tzinfo=timezone.utc)
        return Period(first, end, f"{first:%Y-%m}")
    end = datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=timezone.utc)
    return Period(first, end, f"{first:%Y-%m}")


def money(amount: Decimal, currency: str | None = None) -> str:
    """An exact amount at the currency's display places (more only when the value needs them),
    with thousands separators: ``Decimal('136.150000000000000000')`` → ``136.15``,
    ``Decimal('0.000356')`` → ``0.000356`` (:func:`kvmeter.money.format_money`)."""
    return format_money(amount, currency_places(currency), grouping=True)


def invoice_frame(rows: list[dict]) -> pl.DataFrame:
    """Invoice line dicts (ledger or read API) as a frame in :data:`INVOICE_COLUMNS` order, money
    as exact ``Decimal(38, 18)``."""
    if not rows:
        return pl.DataFrame(schema={c: pl.String for c in INVOICE_COLUMNS})
    df = pl.DataFrame(rows, infer_schema_length=None)
    money = [pl.col(c).cast(pl.Decimal(38, 18)) for c in ("subtotal", "cost") if c in df.columns]
    return df.with_columns(money).select([c for c in INVOICE_COLUMNS if c in df.columns])


def render(ctx: PageContext) -> None:
    choice = st.segmented_control("Billing period", PERIODS, default=PERIODS[0], key="billing_period") or PERIODS[0]
    period = period_for(choice, ctx)
    st.caption(f"Period {period.start:%Y-%m-%d %H:%M:%S} → {period.end:%Y-%m-%d %H:%M:%S} UTC (end exclusive)")
    lines = invoice_frame(ctx.invoice(period))
    report = reconcile(ctx.reconcile_views(period))
    recon = report.frame

    totals = invoice_totals(lines) if lines.height else pl.DataFrame()
    currency = lines.get_column("currency")[0] if lines.height and "currency" in lines.columns else ""
    total = money(sum(totals.get_column("total").to_list(), start=Decimal(0)) if totals.height else Decimal(0))
    c = st.columns(4)
    c[0].metric("Invoice total", f"{total} {currency}".strip(), help="Σ of every line's rounded cost.")
    c[1].metric("Invoice lines", f"{lines.height:,}")
    c[2].metric("Tenants reconciled", f"{recon.height:,}", help="Tenants present in any of the three views.")
    c[3].metric("Tenants with drift", f"{len(report.failed_tenants):,}",
                delta="all explained" if not report.failed_tenants else "unexplained difference",
                delta_color="normal" if not report.failed_tenants else "inverse",
                help="Unexplained drift = matched token differences + ledger-only + engine-unbilled + "
                     "duplicate-billed tokens (threshold 0).")

    st.subheader("Invoice lines")
    if lines.height:
        exact = (lines.group_by("tenant_id").agg(pl.col("subtotal").sum().cast(pl.Float64).alias("subtotal"))
                 .sort("subtotal", descending=True).head(TOP_TENANTS))
        chart(charts.bars(exact, "tenant_id", "subtotal",
                          title=f"Amount per tenant before rounding ({currency}; top {TOP_TENANTS})",
                          value_title=f"exact subtotal ({currency})", category_title="tenant", value_format=",.4~g"))
        st.dataframe(lines, hide_index=True, width="stretch")
        d0, d1, d2, _ = st.columns([2, 1, 1, 3], vertical_alignment="center")
        d0.caption("Download the invoice lines:")
        d1.download_button("CSV", to_csv_bytes(lines), f"invoice-{period.slug}.csv", "text/csv",
                           icon=":material/download:", key="invoice_csv")
        d2.download_button("Parquet", to_parquet_bytes(lines), f"invoice-{period.slug}.parquet",
                           "application/vnd.apache.parquet", icon=":material/download:", key="invoice_parquet")
    else:
        st.info("No billable usage in this period.")

    st.subheader("Three-way reconciliation")
    if recon.height:
        views = long(recon, {"engine_tokens": "engine counters", "ledger_tokens": "ledger (billed)"},
                     index=("tenant_id",), name="view")
        top = recon.sort("ledger_tokens", descending=True).head(TOP_TENANTS).get_column("tenant_id")
        views = views.filter(pl.col("tenant_id").is_in(top.implode()))
        chart(charts.grouped_bars(views, "tenant_id", "view", "value",
                                  title=f"Engine vs ledger tokens per tenant (top {TOP_TENANTS})",
                                  value_title="tokens", category_title="tenant", group_title="view"))
        explained = long(recon, {"matched_requests": "matched", "aborted_requests": "aborted (explained)",
                                 "frontend_only_requests": "frontend-only (explained)",
                                 "superseded_requests": "superseded retry (explained)",
                                 "unexplained_requests": "unexplained"}, index=("tenant_id",), name="class")
        chart(charts.bars(explained.filter((pl.col("value") > 0) & pl.col("tenant_id").is_in(top.implode())),
                          "tenant_id", "value",
                          title="Requests by reconciliation class", value_title="requests", category_title="tenant",
                          color="class", color_title="class"))
        st.dataframe(recon, hide_index=True, width="stretch",
                     column_config={"unexplained_drift_ratio": st.column_config.NumberColumn(format="percent"),
                                    "reservation_drift_ratio": st.column_config.NumberColumn(format="percent")})
        d0, d1, d2, _ = st.columns([2, 1, 1, 3], vertical_alignment="center")
        d0.caption("Download the reconciliation:")
        d1.download_button("CSV", to_csv_bytes(recon), f"reconciliation-{period.slug}.csv", "text/csv",
                           icon=":material/download:", key="recon_csv")
        d2.download_button("Parquet", to_parquet_bytes(recon), f"reconciliation-{period.slug}.parquet",
                           "application/vnd.apache.parquet", icon=":material/download:", key="recon_parquet")
        gw = recon.select(pl.col("gateway_attempts").sum(), pl.col("rejected_attempts").sum(),
                          pl.col("replayed_attempts").sum()).row(0, named=True)
        st.caption(f"Gateway view: {si(gw['gateway_attempts'], 'attempts')}, {gw['rejected_attempts']:,} rejected, "
                   f"{gw['replayed_attempts']:,} idempotent replays. Worst unexplained drift: "
                   f"{pct(recon.get_column('unexplained_drift_ratio').max())}.")
    else:
        st.info("Nothing to reconcile in this period.")

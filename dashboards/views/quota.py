"""Quota: who was refused, by which reason and which limit (level × dimension), and how far
admission's reservations drift from what requests actually used."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvmeter.ledger.window_queries import OUTPUT_USE_BINS

from .. import charts, schemas
from ..frames import fill_buckets, long, reservation_drift
from ..ui import PageContext
from .common import PER_ATTEMPT, chart, pct, si

TITLE = "Quota"
CAPTION = ("Admission estimates a request's cost before knowing its output (max_tokens is a ceiling), "
           "reserves it, and reconciles to engine-true tokens at the end. Refusals should be early, cheap "
           "and explained. " + PER_ATTEMPT)


#: Tenants drawn in the refusal heatmap (the table below holds all of them).
TOP_TENANTS = 20


def use_bins(df: pl.DataFrame) -> pl.DataFrame:
    """Label the output-budget bins: ``0–10 %`` … ``90–100 %``, ``100 %`` (bin 10 = all of it)."""
    labels = {b: f"{10 * b}–{10 * b + 10} %" for b in range(OUTPUT_USE_BINS)}
    labels[OUTPUT_USE_BINS] = "100 %"
    return df.with_columns(pl.col("bin").replace_strict(labels, default="?", return_dtype=pl.String).alias("used"))


def render(ctx: PageContext) -> None:
    w = ctx.window
    by_tenant = ctx.read("attempts_by_tenant", schemas.ATTEMPTS_BY_TENANT)
    refused = by_tenant.filter(pl.col("status").is_in(["rejected", "invalid", "error"]))
    drift = reservation_drift(ctx.read("reservation_by_tenant", schemas.RESERVATION_BY_TENANT))
    all_attempts = int(by_tenant.get_column("attempts").sum())
    n_refused = int(refused.filter(pl.col("status") == "rejected").get_column("attempts").sum())
    reserved = int(drift.get_column("reserved_tokens").sum()) if drift.height else 0
    actual = int(drift.get_column("actual_tokens").sum()) if drift.height else 0

    c = st.columns(4)
    c[0].metric("Rejected attempts", f"{n_refused:,}", help="Quota and scheduler refusals (429/402/503) — "
                "nothing was billed for them.")
    c[1].metric("Rejection rate", pct(n_refused / all_attempts) if all_attempts else "—",
                help="Rejected ÷ all HTTP attempts with a known tenant.")
    c[2].metric("Reserved vs used", pct((reserved - actual) / reserved) if reserved else "—",
                help="(reserved − engine-true tokens) ÷ reserved: capacity admission held back that the "
                     "requests never used. Positive = over-reservation.")
    c[3].metric("Tokens reserved", si(reserved, "tokens"), help=f"Used: {si(actual, 'tokens')}.")

    if refused.height:
        cells = refused.group_by(["tenant_id", "reason"]).agg(pl.col("attempts").sum())
        top = (cells.group_by("tenant_id").agg(pl.col("attempts").sum()).sort(["attempts", "tenant_id"],
               descending=[True, False]).head(TOP_TENANTS).get_column("tenant_id"))
        chart(charts.heatmap(cells.filter(pl.col("tenant_id").is_in(top.implode())), "reason", "tenant_id", "attempts",
                             title=f"Refusals by tenant and reason (top {min(TOP_TENANTS, top.len())} tenants)",
                             x_title="reason", y_title="tenant", value_title="attempts"))
        limits = ctx.read("rejections_by_limit", schemas.REJECTIONS_BY_LIMIT)
        if limits.height:
            chart(charts.heatmap(limits.group_by(["level", "dimension"]).agg(pl.col("attempts").sum()),
                                 "dimension", "level", "attempts", title="Rejections by the limit that bound",
                                 x_title="dimension", y_title="level", value_title="attempts"))
        else:
            st.caption("Level × dimension of each rejection: not recorded by this ledger (its `attempts` table "
                       "has no `level`/`dimension` columns yet); the reason code is shown above.")
        st.dataframe(refused.sort("attempts", descending=True), hide_index=True, width="stretch",
                     column_config={"tenant_id": "tenant", "status_code": st.column_config.NumberColumn("HTTP",
                                                                                                       format="%d")})
    else:
        st.caption("No attempt was refused in this window.")

    st.subheader("Reservation vs actual")
    if drift.height == 0:
        st.info("No finished requests in this window.")
        return
    series = ctx.read("reservation_timeseries", schemas.RESERVATION_TIMESERIES)
    series = fill_buckets(series, w, zero=("reserved_tokens", "actual_tokens"))
    chart(charts.timeseries(long(series, {"reserved_tokens": "reserved at admission", "actual_tokens": "engine-true"},
                                 name="measure"), "value", title="Tokens reserved at admission vs used (per bucket)",
                            y_title="tokens (input + output)", window=w, color="measure", color_title="measure"))
    left, right = st.columns(2)
    with left:
        chart(charts.bars(drift.drop_nulls("drift_ratio").sort("drift_ratio", descending=True).head(15), "tenant_id",
                          "drift_ratio", title="Reservation drift per tenant",
                          value_title="(reserved − used) ÷ reserved",
                          category_title="tenant", color="tier", color_title="tier", value_format=".0%"))
    with right:
        bins = use_bins(ctx.read("output_budget_use", schemas.OUTPUT_BUDGET_USE))
        order = [f"{10 * b}–{10 * b + 10} %" for b in range(OUTPUT_USE_BINS)] + ["100 %"]
        chart(charts.histogram(bins, "used", "requests", title="Share of max_tokens a request used",
                               x_title="output used ÷ output reserved", y_title="requests", order=order))

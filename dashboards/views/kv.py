"""KV cache: the real concurrency limit — KV watermark over time, per-tenant active KV, top
consumers by KV held (not by requests)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from .. import charts, schemas
from ..frames import fill_buckets, per_bucket_rate, tenant_ranking, top_n
from ..signals import ENGINE, TENANT
from ..ui import PageContext
from .common import PER_ATTEMPT, chart, empty, note_fallback, pct, si

TITLE = "KV cache"
CAPTION = ("Every running request holds its prompt and output in KV memory. A tenant under every "
           "request limit can still fill the cache with long sessions — and shrink everyone's batch. " + PER_ATTEMPT)

#: Tenants drawn individually in the per-tenant charts (the rest are folded into "(other)").
TOP_TENANTS = 10


def render(ctx: PageContext) -> None:
    w = ctx.window
    signals = ctx.signal_names()
    totals = tenant_ranking(ctx.read("tenant_totals", schemas.TENANT_TOTALS), ctx.tiers, w)

    kv = ctx.gauge(ENGINE["kv_watermark"], ("engine",), "max") if ENGINE["kv_watermark"] in signals else None
    c = st.columns(4)
    c[0].metric("Peak KV watermark", pct(kv.get_column("value").max()) if kv is not None and kv.height else "—",
                help="Highest used ÷ total KV blocks of any engine in the window (engine step stats; "
                     "platform-wide, admin keys only).")
    c[1].metric("Mean active KV", si(totals.get_column("mean_active_kv_tokens").sum() if totals.height else 0,
                                     "tok"),
                help="∫ KV tokens held dt ÷ window seconds, summed over tenants (ledger).")
    top = totals.row(0, named=True) if totals.height else None
    c[2].metric("Largest KV holder", top["tenant_id"] if top else "—",
                help="Tenant with the most KV token-seconds in the window.")
    c[3].metric("Its share of KV held", pct(top["kv_share"]) if top else "—",
                help=f"Its request share is {pct(top['request_share'])}." if top else None)

    if kv is not None and kv.height:
        chart(charts.with_rules(
            charts.timeseries(kv, "value", title="KV watermark — used ÷ total KV blocks (platform, max per bucket)",
                              y_title="KV blocks used (%)", window=w, color="engine",
                              color_title="engine",
                              y_format=".0%"),
            pl.DataFrame({"value": [0.9], "label": ["90 %"]})))
        if ENGINE["running"] in signals:
            batch = pl.concat([
                ctx.gauge(ENGINE["running"], (), "avg").with_columns(pl.lit("running (batch)").alias("state")),
                ctx.gauge(ENGINE["waiting"], (), "avg").with_columns(pl.lit("waiting in engine").alias("state")),
            ], how="diagonal_relaxed")
            chart(charts.timeseries(batch, "value", title="Engine batch: running vs waiting requests (mean per bucket)",
                                    y_title="requests", window=w, color="state", color_title="state",
                                    y_format=".1~f"))
    elif ctx.admin:
        st.caption(f"No `{ENGINE['kv_watermark']}` samples in this window: the engine's KV watermark appears "
                   "when the serve process's signal recorder runs with an engine that reports step stats.")

    if TENANT["active_kv"] in signals:
        per_tenant = ctx.gauge(TENANT["active_kv"], ("tenant",), "avg", per_tenant=True)
        per_tenant = top_n(per_tenant, "tenant", "value", TOP_TENANTS)
        chart(charts.timeseries(per_tenant, "value", title="Active KV tokens per tenant (scheduler, mean per bucket)",
                                y_title="KV tokens held", window=w, color="tenant", color_title="tenant",
                                mark="area"))
    else:
        by_tenant = ctx.read("traffic_by_tenant", schemas.TRAFFIC_BY_TENANT)
        if by_tenant.height:
            est = top_n(by_tenant.rename({"tenant_id": "tenant"}), "tenant", "kv_token_seconds", TOP_TENANTS)
            est = per_bucket_rate(fill_buckets(est, w, ("tenant",), ("kv_token_seconds",)), "kv_token_seconds", w,
                                  ctx.now, alias="active_kv_tokens")
            chart(charts.timeseries(est, "active_kv_tokens", title="Active KV tokens per tenant (mean per bucket)",
                                    y_title="KV tokens held", window=w, color="tenant", color_title="tenant",
                                    mark="area"))
            note_fallback("Per-tenant active KV", TENANT["active_kv"])

    if not totals.height:
        empty("usage")
        return
    shown = totals.head(15)
    if totals.height > 15:
        st.caption(f"Top 15 of {totals.height} tenants by KV held.")
    chart(charts.bars(shown, "tenant_id", "mean_active_kv_tokens", title="Top KV consumers — mean KV tokens held",
                      value_title="mean active KV tokens", category_title="tenant", color="tier", color_title="tier"))
    st.dataframe(
        shown.select("tenant_id", "tier", "mean_active_kv_tokens", "kv_share", "request_share", "token_share",
                     "requests", "max_input_tokens", "preemptions"),
        hide_index=True, width="stretch",
        column_config={
            "tenant_id": "tenant",
            "mean_active_kv_tokens": st.column_config.NumberColumn("mean KV held (tokens)", format="compact"),
            "kv_share": st.column_config.ProgressColumn("share of KV held", format="percent", min_value=0, max_value=1),
            "request_share": st.column_config.NumberColumn("share of requests", format="percent"),
            "token_share": st.column_config.NumberColumn("share of tokens", format="percent"),
            "max_input_tokens": st.column_config.NumberColumn("longest input (tokens)", format="localized"),
            "preemptions": st.column_config.NumberColumn("preemptions", format="localized"),
        })

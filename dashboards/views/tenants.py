"""Tenants and fairness: who gets the service, how fair it is (Jain's index), and the noisy
neighbour ranked by the tokens and KV it holds — not by its request count."""

from __future__ import annotations

import altair as alt
import polars as pl
import streamlit as st

from kvmeter.ledger.window_queries import BACKLOG_QUEUE_S
from kvmeter.scalars import number

from .. import charts, schemas
from ..frames import fill_buckets, jain_by_bucket, per_bucket_rate, tenant_ranking, top_n
from ..signals import SCHEDULER, TENANT
from ..ui import PageContext
from .common import PER_ATTEMPT, chart, empty, note_fallback, pct, si

TITLE = "Tenants & fairness"
CAPTION = ("Fairness is measured in consumed work — service = 1 × input + 2 × output tokens (VTC, "
           "Sheng et al., OSDI 2024) ÷ the tier's weight — not in requests. " + PER_ATTEMPT)

TOP_TENANTS = 10


def _index(value: object) -> str:
    """A mean Jain's index (a polars reduction) with three decimals; ``—`` when there is none."""
    x = number(value)
    return "—" if x is None else f"{x:.3f}"


def fair_shares(ranking: pl.DataFrame, tiers) -> pl.DataFrame:
    """Each tenant's weighted fair share if every tenant of the window were backlogged:
    wᵢ ÷ Σw over the tenants present (``fair_share``, 0–1)."""
    weights = {t.name: t.weight for t in tiers}
    w = ranking.get_column("tier").replace_strict(weights, default=1.0, return_dtype=pl.Float64)
    return ranking.with_columns((w / w.sum()).alias("fair_share"))


def render(ctx: PageContext) -> None:
    w = ctx.window
    totals = ctx.read("tenant_totals", schemas.TENANT_TOTALS)
    if totals.height == 0:
        empty("usage")
        return
    ranking = fair_shares(tenant_ranking(totals, ctx.tiers, w), ctx.tiers)
    signals = ctx.signal_names()
    fallback = not (SCHEDULER["jain"] in signals and TENANT["queue_depth"] in signals)
    by_tenant = ctx.read("traffic_by_tenant", schemas.TRAFFIC_BY_TENANT) if fallback else None

    sched_jain = ctx.gauge(SCHEDULER["jain"], (), "avg") if SCHEDULER["jain"] in signals else None
    ledger_jain = None
    if sched_jain is None or not sched_jain.height:
        by_tenant = by_tenant if by_tenant is not None else ctx.read("traffic_by_tenant", schemas.TRAFFIC_BY_TENANT)
        ledger_jain = jain_by_bucket(by_tenant, ctx.tiers)
    n_backlogged = ranking.filter(pl.col("queued_requests") > 0).height

    c = st.columns(4)
    # (exactly one of the two is read: the ledger's estimate when the scheduler has no samples)
    if ledger_jain is not None:
        c[0].metric("Jain's index (ledger estimate, mean)",
                    _index(ledger_jain.get_column("jain_index").mean()) if ledger_jain.height else "—",
                    help=f"Per bucket, over the weight-normalised service of tenants with a request that waited "
                         f"≥ {BACKLOG_QUEUE_S * 1000:.0f} ms in the queue (the ledger's stand-in for 'backlogged'). "
                         "'—' = no contention in this window.")
    elif sched_jain is not None:
        c[0].metric("Jain's index (mean)", _index(sched_jain.get_column("value").mean()),
                    help="The fair scheduler's own index over backlogged tenants' weight-normalised service rate "
                         "(1 = perfectly fair, 1/n = one tenant gets everything), averaged over the window.")
    c[1].metric("Tenants with traffic", f"{ranking.height:,}")
    c[2].metric("Tenants that queued", f"{n_backlogged:,}",
                help=f"Had a request wait ≥ {BACKLOG_QUEUE_S * 1000:.0f} ms in the queue in some bucket.")
    top = ranking.sort("service_share", descending=True).row(0, named=True)
    c[3].metric(f"Largest service share: {top['tenant_id']}", pct(top["service_share"]),
                help=f"Its weighted fair share would be {pct(top['fair_share'])} if every tenant were backlogged.")

    shown = ranking.sort("service_share", descending=True).head(15)
    bars = charts.bars(shown, "tenant_id", "service_share", title="Service share per tenant (black tick = weighted "
                       "fair share if all were backlogged)", value_title="share of service (weighted tokens)",
                       category_title="tenant", color="tier", color_title="tier", value_format=".0%")
    ticks = alt.Chart(shown).mark_tick(color="black", thickness=2).encode(
        y=alt.Y("tenant_id:N", sort="-x"), x="fair_share:Q",
        tooltip=[alt.Tooltip("tenant_id:N", title="tenant"), alt.Tooltip("fair_share:Q", title="fair share",
                                                                        format=".1%")])
    chart(charts.layer(bars, ticks))

    if ledger_jain is not None:
        if ledger_jain.height:
            chart(charts.timeseries(ledger_jain, "jain_index", title="Jain's index per bucket (tenants that queued)",
                                    y_title="Jain's index (1 = fair)", window=w, y_format=".2f"))
            note_fallback("Jain's index", SCHEDULER["jain"])
        else:
            st.caption("No tenant queued in this window: fairness was not at stake.")
    elif sched_jain is not None:
        chart(charts.timeseries(sched_jain, "value", title="Jain's index over time (scheduler, backlogged tenants)",
                                y_title="Jain's index (1 = fair)", window=w, y_format=".2f"))

    chart(charts.scatter(ranking.filter(pl.col("total_tokens") > 0), "requests", "total_tokens",
                         title="Noisy neighbours: requests sent vs tokens "
                         "carried (size = KV held)", x_title="requests", y_title="tokens (input + output)",
                         size="mean_active_kv_tokens", size_title="mean KV tokens held", color="tier",
                         color_title="tier", label="tenant_id"))
    st.markdown("**Noisy-neighbour ranking** — by KV held and tokens; the request rank is shown to "
                "see how misleading it is")
    st.dataframe(
        ranking.select("rank_by_kv", "rank_by_tokens", "rank_by_requests", "tenant_id", "tier",
                       "mean_active_kv_tokens", "total_tokens", "requests", "mean_input_tokens",
                       "queue_p95_s").head(25),
        hide_index=True, width="stretch",
        column_config={
            "rank_by_kv": "KV rank", "rank_by_tokens": "token rank", "rank_by_requests": "request rank",
            "tenant_id": "tenant",
            "mean_active_kv_tokens": st.column_config.NumberColumn("mean KV held (tokens)", format="compact"),
            "total_tokens": st.column_config.NumberColumn("tokens", format="compact"),
            "mean_input_tokens": st.column_config.NumberColumn("mean input (tokens)", format="%.0f"),
            "queue_p95_s": st.column_config.NumberColumn("queue wait p95 (s)", format="%.3f"),
        })

    if TENANT["queue_depth"] in signals:
        depth = top_n(ctx.gauge(TENANT["queue_depth"], ("tenant",), "avg", per_tenant=True), "tenant", "value",
                      TOP_TENANTS)
        chart(charts.timeseries(depth, "value", title="Queue depth per tenant (scheduler, mean per bucket)",
                                y_title="queued requests", window=w, color="tenant", color_title="tenant",
                                mark="area", y_format=".2~f"))
    elif by_tenant is not None and by_tenant.height:
        est = top_n(by_tenant.rename({"tenant_id": "tenant"}), "tenant", "queue_seconds", TOP_TENANTS)
        est = per_bucket_rate(fill_buckets(est, w, ("tenant",), ("queue_seconds",)), "queue_seconds", w, ctx.now,
                              alias="queue_depth")
        chart(charts.timeseries(est, "queue_depth", title="Queue depth per tenant (mean, Little's law)",
                                y_title="queued requests", window=w, color="tenant", color_title="tenant",
                                mark="area", y_format=".2~f"))
        note_fallback("Per-tenant queue depth", TENANT["queue_depth"])
    st.caption(f"Service in the window: {si(ranking.get_column('service_tokens').sum())} weighted tokens.")

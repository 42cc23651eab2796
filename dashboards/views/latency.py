"""Latency against each tier's promise: TTFT and ITL percentiles by tier beside the tier SLOs,
and where the time goes — queue, prefill (sets TTFT) and decode (sets streaming speed)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from .. import charts, schemas
from ..frames import long, slo_table
from ..ui import PageContext
from .common import PER_ATTEMPT, chart, empty, secs

TITLE = "Latency vs SLO"
CAPTION = ("Prefill decides time to first token (TTFT); decode decides inter-token latency (ITL). A long "
           "prompt hurts the first, a long output the second — each tier is held to its own promise. " + PER_ATTEMPT)


def _slos(tiers, attr: str) -> pl.DataFrame:
    return pl.DataFrame([{"tier": t.name, "slo": getattr(t, attr)} for t in tiers
                         if getattr(t, attr) is not None and getattr(t, attr) > 0],
                        schema={"tier": pl.String, "slo": pl.Float64})


def _positive(df: pl.DataFrame, column: str) -> pl.DataFrame:
    """Rows with a value > 0 (the latency axes are logarithmic)."""
    return df.filter(pl.col(column).is_not_null() & (pl.col(column) > 0))


def render(ctx: PageContext) -> None:
    w = ctx.window
    table = slo_table(ctx.read("latency_by_tier", schemas.LATENCY_BY_TIER), ctx.tiers)
    if table.height == 0:
        empty("requests")
        return
    cols = st.columns(max(1, table.height))
    for col, row in zip(cols, table.iter_rows(named=True), strict=True):
        ok = row["ttft_p95_within_slo"]
        col.metric(f"{row['tier']} · TTFT p95", secs(row["ttft_p95_s"]),
                   delta=None if ok is None else ("within SLO " if ok else "over SLO ") + secs(row["ttft_slo_s"]),
                   delta_color="normal" if ok else "inverse",
                   help=f"{row['requests']:,} requests; ITL p95 {secs(row['itl_p95_s'])} "
                        f"(SLO {secs(row['itl_slo_s'])}).")

    ttft = _positive(long(table, {"ttft_p50_s": "p50", "ttft_p95_s": "p95", "ttft_p99_s": "p99"}, index=("tier",),
                          name="percentile"), "value")
    itl = _positive(long(table, {"itl_p50_s": "p50", "itl_p95_s": "p95", "itl_p99_s": "p99"}, index=("tier",),
                         name="percentile"), "value")
    left, right = st.columns(2)
    with left:
        chart(charts.percentiles_vs_slo(ttft, _slos(ctx.tiers, "ttft_slo_s"),
                                        title="TTFT by tier (red tick = tier SLO; log axis)",
                                        y_title="time to first token (s)"))
    with right:
        chart(charts.percentiles_vs_slo(itl, _slos(ctx.tiers, "itl_slo_s"),
                                        title="ITL by tier (mean per request; red tick = SLO; log axis)",
                                        y_title="inter-token latency (s)"))

    series = ctx.read("latency_timeseries", schemas.LATENCY_TIMESERIES)
    chart(charts.series_vs_slo(_positive(series, "ttft_p95_s"), _slos(ctx.tiers, "ttft_slo_s"), "ttft_p95_s",
                               title="TTFT p95 per bucket (dashed = tier SLO; log axis)", y_title="TTFT p95 (s)",
                               window=w))
    chart(charts.series_vs_slo(_positive(series, "itl_p95_s"), _slos(ctx.tiers, "itl_slo_s"), "itl_p95_s",
                               title="ITL p95 per bucket (dashed = tier SLO; log axis)", y_title="ITL p95 (s)",
                               window=w))

    split = long(table, {"queue_mean_s": "queue", "prefill_mean_s": "prefill", "decode_mean_s": "decode"},
                 index=("tier",), name="phase").drop_nulls("value")
    chart(charts.bars(split, "tier", "value", title="Where a request's time goes — mean seconds per phase",
                      value_title="seconds (mean per request)", category_title="tier", color="phase",
                      color_title="phase", value_format="~s", sort_desc=False))
    st.dataframe(
        table.select("tier", "requests", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_slo_s", "itl_p50_s",
                     "itl_p95_s", "itl_p99_s", "itl_slo_s", "e2e_p95_s"),
        hide_index=True, width="stretch",
        column_config={c: st.column_config.NumberColumn(f"{c[:-2].replace('_', ' ')} (s)", format="%.3f")
                       for c in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_slo_s", "itl_p50_s", "itl_p95_s",
                                 "itl_p99_s", "itl_slo_s", "e2e_p95_s")})

"""Goodput: work completed inside its tier's promise, beside raw throughput — and the work that
was shed, rejected or abandoned, by reason."""

from __future__ import annotations

import polars as pl
import streamlit as st

from .. import charts, schemas
from ..frames import fill_buckets, goodput_by_tier, long, per_bucket_rate
from ..ui import PageContext
from .common import PER_ATTEMPT, chart, pct, si

TITLE = "Goodput"
CAPTION = ("Throughput counts every token, including answers that missed their deadline and that nobody "
           "used. Goodput counts only requests that finished inside their tier's TTFT and ITL SLOs. " + PER_ATTEMPT)


def render(ctx: PageContext) -> None:
    w = ctx.window
    series = ctx.read("goodput", schemas.GOODPUT)
    tiers = goodput_by_tier(series)
    attempts = ctx.read("attempts_timeseries", schemas.ATTEMPTS_TIMESERIES)
    refused = attempts.filter(pl.col("status") != "admitted")

    total = tiers.select(pl.col("throughput_tokens").sum(), pl.col("goodput_tokens").sum(),
                         pl.col("wasted_tokens").sum(), pl.col("requests").sum(),
                         pl.col("good_requests").sum()).row(0, named=True) if tiers.height else None
    c = st.columns(4)
    c[0].metric("Goodput ratio (tokens)", pct(total["goodput_tokens"] / total["throughput_tokens"])
                if total and total["throughput_tokens"] else "—",
                help="Tokens of good requests ÷ tokens of every request that ended.")
    c[1].metric("Requests inside SLO", pct(total["good_requests"] / total["requests"]) if total and total["requests"]
                else "—")
    c[2].metric("Work abandoned", si(total["wasted_tokens"] if total else 0, "tokens"),
                help="Input + output tokens of aborted and failed requests — engine work nobody received.")
    c[3].metric("Attempts refused", f"{int(refused.get_column('attempts').sum()):,}",
                help="Rejected (quota, shed, queue full), invalid or failed before any engine work.")

    if tiers.height:
        bars = long(tiers, {"throughput_tokens": "throughput", "goodput_tokens": "goodput"}, index=("tier",),
                    name="measure")
        left, right = st.columns(2)
        with left:
            chart(charts.grouped_bars(bars, "tier", "measure", "value", title="Throughput vs goodput by tier",
                                      value_title="tokens (input + output)", category_title="tier",
                                      group_title="measure"))
        with right:
            chart(charts.bars(tiers, "tier", "goodput_ratio", title="Goodput ratio by tier",
                              value_title="goodput ÷ throughput tokens", category_title="tier", value_format=".0%",
                              color="tier", color_title="tier"))
        per = series.with_columns(
            (pl.col("input_tokens") + pl.col("output_tokens")).alias("throughput"),
            (pl.col("good_input_tokens") + pl.col("good_output_tokens")).alias("goodput"))
        ratio = per.filter(pl.col("throughput") > 0).with_columns(
            (pl.col("goodput") / pl.col("throughput")).alias("goodput_ratio"))
        chart(charts.timeseries(ratio, "goodput_ratio", title="Goodput ratio per bucket by tier",
                                y_title="goodput ÷ throughput", window=w, color="tier", color_title="tier",
                                y_format=".0%"))
        flow = per.group_by("ts").agg(pl.col("throughput").sum(), pl.col("goodput").sum())
        flow = fill_buckets(flow, w, zero=("throughput", "goodput"))
        flow = per_bucket_rate(per_bucket_rate(flow, "throughput", w, ctx.now, alias="throughput_per_s"),
                               "goodput", w, ctx.now, alias="goodput_per_s")
        chart(charts.timeseries(long(flow, {"throughput_per_s": "throughput", "goodput_per_s": "goodput"},
                                     name="measure"), "value", title="Tokens / s: throughput vs goodput",
                                y_title="tokens / s", window=w, color="measure", color_title="measure"))

    st.subheader("Shed, rejected and abandoned work")
    if refused.height:
        by_reason = refused.group_by(["status", "reason"]).agg(pl.col("attempts").sum())
        chart(charts.bars(by_reason, "reason", "attempts", title="Refused attempts by reason",
                          value_title="attempts", category_title="reason", color="status", color_title="decision"))
        chart(charts.timeseries(refused.group_by(["ts", "reason"]).agg(pl.col("attempts").sum()), "attempts",
                                title="Refused attempts per bucket", y_title="attempts", window=w, color="reason",
                                color_title="reason", mark="bar"))
    else:
        st.caption("No attempt was refused in this window.")
    if tiers.height and tiers.get_column("wasted_tokens").sum() > 0:
        wasted = long(series.group_by("tier").agg(pl.col("aborted_tokens").sum(), pl.col("error_tokens").sum()),
                      {"aborted_tokens": "aborted", "error_tokens": "failed"}, index=("tier",), name="outcome")
        chart(charts.bars(wasted, "tier", "value", title="Engine work abandoned (aborted or failed requests)",
                          value_title="tokens", category_title="tier", color="outcome", color_title="outcome"))

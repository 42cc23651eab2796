"""Overview: the misleading view (requests/s) beside the true units of load — input and output
tokens/s, active KV and queue wait — on one time axis, so calm QPS over choking GPUs is obvious."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvmeter.scalars import number

from .. import charts, schemas
from ..frames import long, traffic_rates
from ..signals import ENGINE, SCHEDULER
from ..ui import PageContext
from .common import PER_ATTEMPT, chart, note_fallback, secs, si

TITLE = "Overview"
CAPTION = ("Requests per second is what a normal API dashboard watches. The GPUs feel tokens, KV "
           "memory and queueing — drawn here on the same time axis. " + PER_ATTEMPT)


def hidden_load(rates: pl.DataFrame) -> pl.DataFrame:
    """Peak ÷ median of each series over buckets with traffic: a flat requests/s beside a tall
    tokens/s or KV peak is the 2 a.m. case.

    Returns:
        ``series``, ``median``, ``peak``, ``peak_over_median`` (``None`` when the median is 0).
    """
    busy = rates.filter(pl.col("requests") > 0)
    rows = []
    for col, label in (("requests_per_s", "requests / s"), ("input_tokens_per_s", "input tokens / s"),
                       ("output_tokens_per_s", "output tokens / s"), ("active_kv_tokens", "active KV tokens"),
                       ("queue_p95_s", "queue wait p95 (s)")):
        values = busy.get_column(col).drop_nulls() if busy.height else pl.Series([], dtype=pl.Float64)
        median = number(values.median()) if values.len() else None
        peak = number(values.max()) if values.len() else None
        ratio = peak / median if (median and peak is not None) else None
        rows.append({"series": label, "median": median, "peak": peak, "peak_over_median": ratio})
    return pl.DataFrame(rows, schema={"series": pl.String, "median": pl.Float64, "peak": pl.Float64,
                                      "peak_over_median": pl.Float64})


def render(ctx: PageContext) -> None:
    w = ctx.window
    rates = traffic_rates(ctx.read("traffic", schemas.TRAFFIC), w, ctx.now)
    elapsed = max(1.0, (min(ctx.now, w.end) - w.start).total_seconds())
    total = rates.select(pl.col("requests").sum(), pl.col("input_tokens").sum(), pl.col("output_tokens").sum(),
                         pl.col("kv_token_seconds").sum()).row(0, named=True)
    signals = ctx.signal_names()

    c = st.columns(5)
    c[0].metric("Requests / s (mean)", si(total["requests"] / elapsed),
                help="Attempts that finished in the window ÷ its elapsed seconds (a retried request counts "
                     "once per attempt).")
    c[1].metric("Input tokens / s", si(total["input_tokens"] / elapsed),
                help="Engine-true input tokens (cached included) of every attempt, billed or not, ÷ elapsed "
                     "seconds — prefill work.")
    c[2].metric("Output tokens / s", si(total["output_tokens"] / elapsed),
                help="Engine-true generated tokens of every attempt, billed or not, ÷ elapsed seconds — decode "
                     "work.")
    c[3].metric("Mean active KV (tokens)", si(total["kv_token_seconds"] / elapsed),
                help="∫ KV tokens held dt ÷ elapsed seconds, from the ledger's per-request KV token-seconds.")
    worst = rates.get_column("queue_p95_s").drop_nulls()
    c[4].metric("Worst queue wait p95", secs(worst.max() if worst.len() else None),
                help="The highest per-bucket 95th percentile of gateway + engine queue time.")

    if total["requests"] == 0:
        st.info("No requests finished in this window — widen the time range.")
        return

    hidden = hidden_load(rates)
    with st.container(border=True):
        st.markdown("**What QPS hides** — peak ÷ median over buckets with traffic")
        cols = st.columns(len(hidden))
        for col, row in zip(cols, hidden.iter_rows(named=True), strict=True):
            ratio = row["peak_over_median"]
            col.metric(row["series"], "—" if ratio is None else f"{ratio:.1f}×", help=f"median {si(row['median'])}, "
                       f"peak {si(row['peak'])}")

    chart(charts.timeseries(rates, "requests_per_s", title="Requests / s — the view a normal API dashboard shows",
                            y_title="requests / s", window=w))
    tokens = long(rates, {"input_tokens_per_s": "input (prefill)", "output_tokens_per_s": "output (decode)"},
                  name="type")
    chart(charts.timeseries(tokens, "value", title="Tokens / s — the work the GPUs do", y_title="tokens / s",
                            window=w, color="type", color_title="token type"))
    if ENGINE["kv_watermark"] in signals:
        kv = ctx.gauge(ENGINE["kv_watermark"], ("engine",), "max")
        chart(charts.with_rules(
            charts.timeseries(kv, "value", title="KV watermark — used ÷ total KV blocks (max per bucket)",
                              y_title="KV blocks used (%)", window=w, color="engine",
                              color_title="engine",
                              y_format=".0%"),
            pl.DataFrame({"value": [0.9], "label": ["90 % — admission tightens"]})))
    chart(charts.timeseries(rates, "active_kv_tokens", title="Active KV tokens (mean per bucket, ledger)",
                            y_title="KV tokens held", window=w, mark="area"))
    queue = long(rates, {"queue_p95_s": "p95", "queue_p50_s": "p50"}, name="percentile")
    chart(charts.timeseries(queue, "value", title="Queue wait (requests finished in the bucket)",
                            y_title="queue wait (s)", window=w, color="percentile", color_title="percentile",
                            y_format=".2~f"))
    if SCHEDULER["queued"] in signals:
        depth = ctx.gauge(SCHEDULER["queued"], (), "max")
        chart(charts.timeseries(depth, "value", title="Requests waiting in the fair scheduler (max per bucket)",
                                y_title="queued requests", window=w, mark="area"))
    else:
        chart(charts.timeseries(rates, "queue_depth", title="Requests waiting (mean, Little's law: Σ wait ÷ bucket)",
                                y_title="queued requests", window=w, mark="area", y_format=".2~f"))
        note_fallback("Queue depth", SCHEDULER["queued"])

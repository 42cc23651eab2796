"""Replicas: each engine pool's replicas, per model — health and drain state, KV watermark, queue
depth, routed requests and the prefix-hit routing share over time, from the signal history
(``kvmeter_replica_*{model,replica}``, ``kvmeter_router_decisions_requests_per_second``, and each
replica's scraped engine series, whose ``engine`` label is ``<replica URL>/metrics#<engine>``). It
names the platform's replicas: admin keys only."""

from __future__ import annotations

import polars as pl
import streamlit as st

from .. import charts
from ..signals import ENGINE, REPLICA
from ..ui import PageContext
from .common import chart, pct

__all__ = ["TITLE", "CAPTION", "render", "replica_of", "replica_states", "state_now", "state_counts", "hit_share",
           "availability_title"]

TITLE = "Replicas"
CAPTION = ("An engine pool serves one model from several vLLM servers: the router sends each request to an open "
           "replica, the one that holds its prompt's prefix when it can. A replica that is down or draining "
           "takes nothing new; one whose KV fills up or whose queue grows is passed over.")

_KEY = ("model", "replica")


def replica_of(engine: str) -> str:
    """The replica URL of a scraped engine's ``engine`` label (``<url>/metrics#<engine>`` →
    ``<url>``; what :func:`kvmeter.serving.engines.remote.default_metrics_url` scrapes)."""
    return engine.rsplit("#", 1)[0].removesuffix("/metrics")


def replica_states(up: pl.DataFrame, available: pl.DataFrame) -> pl.DataFrame:
    """Per bucket and replica (``ts``, ``model``, ``replica``): ``state`` — ``down`` (not up),
    ``draining`` (up, not taking new requests), ``available`` — and ``available`` (1/0), from the
    last ``kvmeter_replica_up`` and ``kvmeter_replica_available`` samples of the bucket."""
    joined = up.select("ts", *_KEY, pl.col("value").alias("up")).join(
        available.select("ts", *_KEY, pl.col("value").alias("available")), on=["ts", *_KEY], how="full",
        coalesce=True)
    return joined.with_columns(
        pl.when(pl.col("up").fill_null(1.0) < 0.5).then(pl.lit("down"))
        .when(pl.col("available").fill_null(1.0) < 0.5).then(pl.lit("draining"))
        .otherwise(pl.lit("available")).alias("state"),
        pl.col("available").fill_null(0.0)).sort("ts")


def state_now(states: pl.DataFrame) -> pl.DataFrame:
    """Each replica's ``state`` (``model``, ``replica``, ``state``) at its last bucket of
    :func:`replica_states` (``states`` sorted by ``ts``, as that function returns it)."""
    return states.sort("ts").group_by(*_KEY).agg(pl.col("state").last())


def state_counts(now: pl.DataFrame) -> tuple[int, int]:
    """``(available, down or draining)`` replicas of :func:`state_now`'s frame: the page's
    "Replicas down or draining now" tile and its availability chart's heading both count here."""
    out = now.filter(pl.col("state") != "available").height
    return now.height - out, out


def availability_title(now: pl.DataFrame) -> str:
    """The availability chart's heading: the y encoding (1 = takes new requests, 0 = down or
    draining) and, from :func:`state_counts`, how many replicas are in each state now."""
    available, out = state_counts(now)
    return (f"Replica takes new requests (1 = yes, 0 = down or draining; last per bucket) — now {available} "
            f"available, {out} down or draining")


def hit_share(decisions: pl.DataFrame) -> pl.DataFrame:
    """Per bucket and model (``ts``, ``model``): ``share`` — ``prefix_hit`` decisions ÷ all the
    router's decisions (every outcome: ``prefix_miss``, ``no_prefix``, ``failover`` included);
    buckets without decisions are absent. ``decisions`` has ``ts``, ``model``, ``outcome``,
    ``value`` (decisions per second)."""
    grouped = decisions.group_by("ts", "model").agg(
        pl.col("value").filter(pl.col("outcome") == "prefix_hit").sum().alias("hits"),
        pl.col("value").sum().alias("all"))
    return grouped.filter(pl.col("all") > 0).with_columns((pl.col("hits") / pl.col("all")).alias("share")).sort("ts")


def _per_replica(frame: pl.DataFrame, pools: set[tuple[str, str]], agg: str) -> pl.DataFrame:
    """An engine gauge (``ts``, ``engine``, ``model``, ``value``) per pool replica: its engines'
    ``max`` or ``sum`` per bucket; engines of no pool replica are left out."""
    if not frame.height:
        return frame
    rows = frame.with_columns(pl.col("engine").map_elements(replica_of, return_dtype=pl.String).alias("replica"))
    rows = rows.filter(pl.struct(*_KEY).map_elements(lambda k: (k["model"], k["replica"]) in pools,
                                                     return_dtype=pl.Boolean))
    value = pl.col("value").max() if agg == "max" else pl.col("value").sum()
    return rows.group_by("ts", *_KEY).agg(value.alias("value")).sort("ts")


def _labelled(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.with_columns((pl.col("model") + " · " + pl.col("replica")).alias("model · replica"))


def render(ctx: PageContext) -> None:
    if not ctx.admin:
        st.info("The replicas view names the platform's serving hosts, not a tenant's own data: sign in with an "
                "admin key to see it.")
        return
    w = ctx.window
    names = ctx.signal_names()
    if REPLICA["up"] not in names and REPLICA["routed_rate"] not in names:
        st.info("No engine pool in this window: the serve process runs no `engine.replicas` or `engine.models` "
                "pool, or its signal recorder was not running.")
        return
    empty_state = pl.DataFrame(schema={"ts": pl.Datetime("us", "UTC"), "model": pl.String, "replica": pl.String,
                                       "value": pl.Float64})
    up = ctx.gauge(REPLICA["up"], _KEY, "last") if REPLICA["up"] in names else empty_state
    avail = ctx.gauge(REPLICA["available"], _KEY, "last") if REPLICA["available"] in names else empty_state
    states = replica_states(up, avail)
    routed = ctx.gauge(REPLICA["routed_rate"], _KEY, "avg") if REPLICA["routed_rate"] in names else empty_state
    decisions = (ctx.gauge(REPLICA["decision_rate"], ("model", "outcome"), "avg")
                 if REPLICA["decision_rate"] in names else pl.DataFrame())
    pools = {(m, r) for m, r in states.select(*_KEY).unique().iter_rows()} | \
        {(m, r) for m, r in routed.select(*_KEY).unique().iter_rows()}
    latest = state_now(states) if states.height else None

    share = hit_share(decisions) if decisions.height else pl.DataFrame()
    total = float(decisions.get_column("value").sum()) if decisions.height else 0.0
    hits = float(decisions.filter(pl.col("outcome") == "prefix_hit").get_column("value").sum()) \
        if decisions.height else 0.0
    c = st.columns(4)
    c[0].metric("Models served by pools", f"{len({m for m, _ in pools})}")
    c[1].metric("Replicas", f"{len(pools)}")
    c[2].metric("Replicas down or draining now",
                f"{state_counts(latest)[1]}" if latest is not None else "—",
                help="At the last sample of the window: down (its scrape, connections or probe fail) or draining "
                     "(an operator took it out: POST /v1/replicas/drain).")
    c[3].metric("Prefix-hit routing share", pct(hits / total) if total else "—",
                help="Routing decisions that sent a request to a replica which recently prefilled its prompt's "
                     "first block, ÷ all decisions in the window (every model).")

    if latest is not None:
        chart(charts.timeseries(_labelled(states), "available", title=availability_title(latest),
                                y_title="available (1/0)", window=w, color="model · replica",
                                color_title="model · replica", y_format="d"))
    kv = _per_replica(ctx.gauge(ENGINE["kv_watermark"], ("engine", "model"), "max"), pools, "max") \
        if ENGINE["kv_watermark"] in names else pl.DataFrame()
    if kv.height:
        chart(charts.with_rules(
            charts.timeseries(_labelled(kv), "value", title="KV watermark per replica — used ÷ total KV blocks "
                              "(max per bucket)", y_title="KV blocks used (%)", window=w, color="model · replica",
                              color_title="model · replica", y_format=".0%"),
            pl.DataFrame({"value": [0.9], "label": ["90 %"]})))
    queue = _per_replica(ctx.gauge(ENGINE["waiting"], ("engine", "model"), "avg"), pools, "sum") \
        if ENGINE["waiting"] in names else pl.DataFrame()
    if queue.height:
        chart(charts.timeseries(_labelled(queue), "value", title="Queue depth per replica — requests waiting in its "
                                "engine (mean per bucket)", y_title="requests", window=w, color="model · replica",
                                color_title="model · replica", y_format=".1~f"))
    if not (kv.height or queue.height):
        st.caption(f"No `{ENGINE['kv_watermark']}` samples of the replicas in this window: a replica's KV watermark "
                   "and queue come from its scraped /metrics (off with `engine.remote_metrics_url: off`).")
    if routed.height:
        chart(charts.timeseries(_labelled(routed), "value", title="Requests routed per replica (mean per bucket)",
                                y_title="requests / s", window=w, color="model · replica",
                                color_title="model · replica", y_format="~s"))
    if share.height:
        chart(charts.timeseries(share, "share", title="Prefix-hit routing share per model — prefix_hit ÷ all routing "
                                "decisions (per bucket)", y_title="prefix hits (%)", window=w, color="model",
                                color_title="model", y_format=".0%"))

    if latest is None:
        return
    summary = latest.join(routed.group_by(*_KEY).agg(pl.col("value").mean().alias("routed_per_s")), on=_KEY,
                          how="left")
    if kv.height:
        summary = summary.join(kv.group_by(*_KEY).agg(pl.col("value").max().alias("peak_kv")), on=_KEY, how="left")
    st.dataframe(summary.sort(*_KEY), hide_index=True, width="stretch", column_config={
        "state": "state now",
        "routed_per_s": st.column_config.NumberColumn("routed requests / s (mean)", format="%.3f"),
        "peak_kv": st.column_config.NumberColumn("peak KV watermark", format="percent"),
    })
    st.caption(f"A replica's state is its last `{REPLICA['up']}` / `{REPLICA['available']}` sample.")

"""Noisy neighbours: per tenant, the shapes of issue 14 the ledger and the signal history can show,
and the state of each shape's detector over the window.

* From the ledger (every attempt's engine work): prompt-cache hit ratio and retries per logical
  request (``KvmeterTenantPromptCacheHitLow``, ``KvmeterTenantRetriesHigh``), and model calls per
  agent run (``KvmeterTenantAgentCallsPerRunHigh``): usage rows with an agent run id ÷ the distinct
  run ids among them, over the window for the detector and per bucket for the history
  (:mod:`kvmeter.ledger.noisy_queries`: the ledger counts every run with a call in the span once,
  where Prometheus' counters divide by the runs first seen in its window).
* From the signal history (``signals`` table, admin keys: a share compares tenants): the tenant's
  share of the prefill and decode tokens the engines scheduled for a model
  (``KvmeterTenantPrefillShareHigh``, ``KvmeterTenantDecodeShareHigh``), of the requests waiting
  in the fair queues (``KvmeterTenantQueueShareHigh``) and of the active KV
  (``KvmeterTenantKvShareHigh``, tenants.yml); and, for every viewer (its own data), the share of
  its input the gateway saw prefilled again after eviction (``KvmeterTenantPromptCacheThrash``:
  ``kvmeter_prompt_reprefill_tokens_per_second`` ÷ the ledger's input tokens).

Every detector applies the alerts' thresholds and predicates
(:class:`kvmeter.exporters.prometheus.rules.noisy.NoisyThresholds`) to totals over the page's
window instead of Prometheus' rate window: a rate signal's total is Σ bucket mean × bucket width; a
level's (queue depth, KV held) is its mean over the window's buckets, and the KV detector reads the
window's highest watermark (the alert: an instant's, held 10 minutes).

Below them, :func:`render_interference`: whose work filled the engine steps of requests that
missed their objective (:mod:`kvmeter.ledger.interference`)."""

from __future__ import annotations

from typing import Any

import polars as pl
import streamlit as st

from kvmeter.exporters.prometheus.rules.noisy import THRESHOLDS, NoisyThresholds

from .. import charts, schemas
from ..frames import top_n
from ..signals import ENGINE, ENGINE_TENANT, PROMPT_CACHE, TENANT
from ..ui import PageContext
from .common import chart, empty, pct

TITLE = "Noisy neighbours"
CAPTION = ("Each shape of noisy neighbour per tenant: from every attempt's engine work in the ledger (not the "
           "bill), how much of its input the prefix cache served, how often it retries a logical request and how "
           "many model calls its agent runs make; from "
           "the signal history, its share of the engines' scheduled prefill and decode tokens, of the fair queues "
           "and of the KV held.")

#: detector names as the page shows them, and the alert each one mirrors
CACHE, RETRIES = "prompt-cache hit ratio", "retries per logical request"
PREFILL, DECODE, QUEUE, KV = "prefill share", "decode share", "queue share", "active-KV share"
THRASH = "re-prefilled share of input"
AGENT = "model calls per agent run"
ALERTS = {CACHE: "KvmeterTenantPromptCacheHitLow", RETRIES: "KvmeterTenantRetriesHigh",
          AGENT: "KvmeterTenantAgentCallsPerRunHigh",
          PREFILL: "KvmeterTenantPrefillShareHigh", DECODE: "KvmeterTenantDecodeShareHigh",
          QUEUE: "KvmeterTenantQueueShareHigh", KV: "KvmeterTenantKvShareHigh",
          THRASH: "KvmeterTenantPromptCacheThrash"}
TOP_TENANTS = 10

_STATE = {"tenant_id": pl.String, "tier": pl.String, "detector": pl.String, "value": pl.Float64,
          "rate_per_s": pl.Float64, "state": pl.String}


def detector_states(noisy: pl.DataFrame, seconds: float, t: NoisyThresholds = THRESHOLDS) -> pl.DataFrame:
    """One row per tenant and detector: ``tenant_id``, ``tier``, ``detector`` (:data:`CACHE`,
    :data:`RETRIES`), ``value`` (the ratio, null when it has none), ``rate_per_s`` (input tokens/s
    or retries/s over ``seconds``, the window's length), ``state`` (``firing`` or ``quiet``, by
    :meth:`NoisyThresholds.cache_hit_low` / :meth:`NoisyThresholds.retrying`). Firing rows first."""
    rows = []
    for r in noisy.iter_rows(named=True):
        rows.append({"tenant_id": r["tenant_id"], "tier": r["tier"], "detector": CACHE,
                     "value": r["prompt_cache_hit_ratio"], "rate_per_s": r["input_tokens"] / seconds,
                     "state": "firing" if t.cache_hit_low(r["input_tokens"], r["cached_input_tokens"], seconds)
                     else "quiet"})
        rows.append({"tenant_id": r["tenant_id"], "tier": r["tier"], "detector": RETRIES,
                     "value": r["retries_per_logical_request"], "rate_per_s": r["retries"] / seconds,
                     "state": "firing" if t.retrying(r["retries"], r["keyed_logical_requests"], seconds)
                     else "quiet"})
    return pl.DataFrame(rows, schema=_STATE).sort(["state", "detector", "tenant_id"])


def agent_loop_states(noisy: pl.DataFrame, seconds: float, t: NoisyThresholds = THRESHOLDS) -> pl.DataFrame:
    """The agent-loop detector's rows (:data:`AGENT`, in :func:`detector_states`' columns), one per
    tenant of the ledger's ``noisy`` table with an agent model call in the window: ``value`` = model
    calls per agent run (``model_calls_per_agent_run``), ``rate_per_s`` = agent model calls ÷
    ``seconds``; the state by :meth:`NoisyThresholds.agent_loop_score` (calls, distinct runs)."""
    rows = []
    for r in noisy.iter_rows(named=True):
        calls, runs = r["agent_model_calls"] or 0, r["agent_runs"] or 0
        if calls <= 0:
            continue
        rows.append({"tenant_id": r["tenant_id"], "tier": r["tier"], "detector": AGENT,
                     "value": r["model_calls_per_agent_run"], "rate_per_s": calls / seconds,
                     "state": "quiet" if t.agent_loop_score(calls, runs, seconds) is None else "firing"})
    return pl.DataFrame(rows, schema=_STATE).sort(["state", "detector", "tenant_id"])


_ENGINE_SHARES: dict[str, Any] = {"ts": pl.Datetime("us", "UTC"), "model": pl.String, "tier": pl.String,
                                  "tenant": pl.String,
                                  "rate": pl.Float64, "share": pl.Float64}
_LEVELS: dict[str, Any] = {"ts": pl.Datetime("us", "UTC"), "tier": pl.String, "tenant": pl.String, "level": pl.Float64,
           "share": pl.Float64}


def engine_shares(rates: pl.DataFrame) -> pl.DataFrame:
    """Per bucket, model and tenant, from a per-tenant engine rate signal read by (``model``,
    ``engine``, ``tier``, ``tenant``): ``rate`` (tokens/s, summed over engines) and ``share`` (0–1)
    of all tenants' rate for the model in the bucket (null when that is 0)."""
    if rates.height == 0:
        return pl.DataFrame(schema=_ENGINE_SHARES)
    per = rates.group_by(["ts", "model", "tier", "tenant"]).agg(pl.col("value").sum().alias("rate"))
    total = pl.col("rate").sum().over(["ts", "model"])
    return (per.with_columns(pl.when(total > 0).then(pl.col("rate") / total).alias("share"))
            .select(list(_ENGINE_SHARES)).sort(["ts", "model", "tenant"]))


def level_shares(levels: pl.DataFrame) -> pl.DataFrame:
    """Per bucket and tenant, from a per-tenant gauge read by (``tier``, ``tenant``): ``level`` (the
    bucket's mean) and ``share`` (0–1) of all tenants' level in the bucket (null when that is 0)."""
    if levels.height == 0:
        return pl.DataFrame(schema=_LEVELS)
    per = levels.group_by(["ts", "tier", "tenant"]).agg(pl.col("value").sum().alias("level"))
    total = pl.col("level").sum().over("ts")
    return (per.with_columns(pl.when(total > 0).then(pl.col("level") / total).alias("share"))
            .select(list(_LEVELS)).sort(["ts", "tenant"]))


def signal_detector_states(prefill: pl.DataFrame, decode: pl.DataFrame, queue: pl.DataFrame, kv: pl.DataFrame,
                           kv_watermark_max: float, seconds: float, bucket_s: float,
                           t: NoisyThresholds = THRESHOLDS) -> pl.DataFrame:
    """The signal-history detectors' rows, in :func:`detector_states`' columns: per tenant
    :data:`PREFILL` / :data:`DECODE` (``value``: its share of its busiest model's scheduled tokens,
    ``rate_per_s``: that model's tokens/s), :data:`QUEUE` (share of the waiting requests, all
    tenants' mean waiting), :data:`KV` (share of the active KV, its mean KV tokens held).

    Args:
        prefill, decode: :func:`engine_shares` frames; queue, kv: :func:`level_shares` frames.
        kv_watermark_max: the highest KV watermark (0–1) of the window.
        seconds: the window's length; bucket_s: its bucket width (both > 0).
    """
    rows: list[dict[str, object]] = []
    for name, df, score in ((PREFILL, prefill, t.prefill_pressure_score), (DECODE, decode, t.decode_pressure_score)):
        if df.height == 0:
            continue
        tokens = df.group_by(["model", "tier", "tenant"]).agg((pl.col("rate").sum() * bucket_s).alias("tokens"))
        tokens = tokens.with_columns(pl.col("tokens").sum().over("model").alias("model_tokens"))
        best: dict[str, tuple[float, dict[str, object]]] = {}  # a tenant's row of its highest-scoring model
        for r in tokens.sort(["tenant", "model"]).iter_rows(named=True):
            x = score(r["tokens"], r["model_tokens"], seconds)
            row = {"tenant_id": r["tenant"], "tier": r["tier"], "detector": name,
                   "value": r["tokens"] / r["model_tokens"] if r["model_tokens"] > 0 else None,
                   "rate_per_s": r["model_tokens"] / seconds, "state": "quiet" if x is None else "firing"}
            rank = -1.0 if x is None else x
            if r["tenant"] not in best or rank > best[r["tenant"]][0]:
                best[r["tenant"]] = (rank, row)
        rows += [row for _, row in best.values()]
    buckets = max(seconds / bucket_s, 1.0)
    for name, df in ((QUEUE, queue), (KV, kv)):
        if df.height == 0:
            continue
        means = df.group_by(["tier", "tenant"]).agg((pl.col("level").sum() / buckets).alias("mean"))
        total = float(means.get_column("mean").sum())
        for r in means.sort("tenant").iter_rows(named=True):
            x = (t.queue_pressure_score(r["mean"], total) if name == QUEUE
                 else t.kv_pressure_score(r["mean"], total, kv_watermark_max))
            rows.append({"tenant_id": r["tenant"], "tier": r["tier"], "detector": name,
                         "value": r["mean"] / total if total > 0 else None,
                         "rate_per_s": total if name == QUEUE else r["mean"],
                         "state": "quiet" if x is None else "firing"})
    return pl.DataFrame(rows, schema=_STATE).sort(["state", "detector", "tenant_id"])


def thrash_states(noisy: pl.DataFrame, reprefill: pl.DataFrame, seconds: float, bucket_s: float,
                  t: NoisyThresholds = THRESHOLDS) -> pl.DataFrame:
    """The prompt-cache thrash detector's rows (:data:`THRASH`, in :func:`detector_states`' columns),
    one per tenant of the ledger's ``noisy`` table: ``value`` = re-prefilled ÷ input tokens, where
    re-prefilled tokens are Σ bucket mean × ``bucket_s`` of the
    ``kvmeter_prompt_reprefill_tokens_per_second`` signal read by (``tenant``, ``model``) in
    ``reprefill`` (missing buckets: none), input tokens the ledger's; ``rate_per_s`` = input tokens/s;
    the state by :meth:`NoisyThresholds.thrash_score`."""
    tokens: dict[str, float] = {}
    if reprefill.height:
        per = reprefill.group_by("tenant").agg((pl.col("value").sum() * bucket_s).alias("tokens"))
        tokens = {r["tenant"]: r["tokens"] for r in per.iter_rows(named=True)}
    rows = []
    for r in noisy.iter_rows(named=True):
        again, inputs = tokens.get(r["tenant_id"], 0.0), r["input_tokens"]
        rows.append({"tenant_id": r["tenant_id"], "tier": r["tier"], "detector": THRASH,
                     "value": again / inputs if inputs > 0 else None, "rate_per_s": inputs / seconds,
                     "state": "quiet" if t.thrash_score(again, inputs, seconds) is None else "firing"})
    return pl.DataFrame(rows, schema=_STATE).sort(["state", "detector", "tenant_id"])


def _share_chart(df: pl.DataFrame, key: str, value: str, by: tuple[str, ...], title: str, y_title: str, w) -> None:
    """A share-per-tenant time series, the top tenants by ``value`` and the rest folded."""
    shown = top_n(df, key, value, TOP_TENANTS, by=by)
    total = pl.col(value).sum().over(list(by))
    shown = shown.with_columns(pl.when(total > 0).then(pl.col(value) / total).alias("share"))
    chart(charts.timeseries(shown, "share", title=title, y_title=y_title, window=w, color=key, color_title="tenant",
                            y_format=".0%"))


def _signal_states(ctx: PageContext, seconds: float, t: NoisyThresholds) -> pl.DataFrame | None:
    """The signal-history panels (admins: a share compares tenants) and their detectors' rows."""
    if not ctx.admin:
        st.caption("Shares of engine work, of the queues and of the KV compare tenants: shown to admin keys only.")
        return None
    w, names = ctx.window, ctx.signal_names()
    engine_by = ("model", "engine", "tier", "tenant")
    prefill = (engine_shares(ctx.gauge(ENGINE_TENANT["prefill_rate"], engine_by, "avg"))
               if ENGINE_TENANT["prefill_rate"] in names else engine_shares(pl.DataFrame()))
    decode = (engine_shares(ctx.gauge(ENGINE_TENANT["decode_rate"], engine_by, "avg"))
              if ENGINE_TENANT["decode_rate"] in names else engine_shares(pl.DataFrame()))
    queue = (level_shares(ctx.gauge(TENANT["queue_depth"], ("tier", "tenant"), "avg"))
             if TENANT["queue_depth"] in names else level_shares(pl.DataFrame()))
    kv = (level_shares(ctx.gauge(TENANT["active_kv"], ("tier", "tenant"), "avg"))
          if TENANT["active_kv"] in names else level_shares(pl.DataFrame()))
    marks = ctx.gauge(ENGINE["kv_watermark"], (), "max") if ENGINE["kv_watermark"] in names else pl.DataFrame()
    watermark = float(marks.get_column("value").max() or 0.0) if marks.height else 0.0  # type: ignore[arg-type]
    for name, df, above, floor in ((PREFILL, prefill, t.prefill_share_above, t.prefill_min_tokens_per_s),
                                   (DECODE, decode, t.decode_share_above, t.decode_min_tokens_per_s)):
        kind = name.split()[0]
        if df.height:
            _share_chart(df, "tenant", "rate", ("ts", "model"),
                         f"Share of scheduled {kind} tokens per tenant (detector: above {above:.0%} while the model "
                         f"gets ≥ {floor:g} tokens/s)", f"share of {kind} tokens", w)
        else:
            st.caption(f"No `{ENGINE_TENANT[kind + '_rate']}` samples in this window: per-tenant engine work needs "
                       "the in-process vLLM engine's step shares.")
    if queue.height and queue.get_column("level").sum() > 0:
        _share_chart(queue, "tenant", "level", ("ts",),
                     f"Share of the fair queues per tenant (detector: above {t.queue_share_above:.0%} while ≥ "
                     f"{t.queue_min_requests:g} wait)", "share of waiting requests", w)
    if kv.height and kv.get_column("level").sum() > 0:
        _share_chart(kv, "tenant", "level", ("ts",),
                     f"Share of active KV per tenant (detector: above {t.kv_share_above:.0%} while the KV cache is "
                     f"over {t.kv_watermark_above:.0%} full)", "share of KV tokens held", w)
    states = signal_detector_states(prefill, decode, queue, kv, watermark, seconds, float(w.step_s), t)
    if ctx.tenants is not None:
        states = states.filter(pl.col("tenant_id").is_in(list(ctx.tenants)))
    return states


def _agent_loops(ctx: PageContext, noisy: pl.DataFrame, seconds: float, t: NoisyThresholds) -> pl.DataFrame:
    """The agent-loop panel (model calls per agent run per tenant and bucket, the detector's
    threshold drawn) and the detector's rows."""
    history = ctx.read("agent_calls_per_run", schemas.AGENT_CALLS_PER_RUN)
    if history.height == 0:
        st.caption("No model call of an agent run (`X-Agent-Run-Id`) finished in this window.")
        return agent_loop_states(noisy, seconds, t)
    busiest = (history.group_by("tenant_id").agg(pl.col("model_calls").sum())
               .sort(["model_calls", "tenant_id"], descending=[True, False]).head(TOP_TENANTS).get_column("tenant_id"))
    shown = history.filter(pl.col("tenant_id").is_in(busiest.implode()))
    above = t.agent_calls_per_run_above
    line = charts.timeseries(shown, "model_calls_per_agent_run",
                             title=f"Model calls per agent run per tenant (detector: above {above:g} while the runs "
                                   f"make ≥ {t.agent_min_calls_per_s:g} calls/s)",
                             y_title="calls ÷ runs", window=ctx.window, color="tenant_id", color_title="tenant",
                             y_format="~s").mark_line(point=True, strokeWidth=1.8)  # (a run in one bucket is a point)
    chart(charts.with_rules(line, pl.DataFrame({"value": [above], "label": [f"detector: {above:g} calls per run"]})))
    if history.get_column("tenant_id").n_unique() > TOP_TENANTS:
        st.caption(f"The {TOP_TENANTS} tenants with the most agent model calls in this window.")
    return agent_loop_states(noisy, seconds, t)


def render(ctx: PageContext) -> None:
    w = ctx.window
    noisy = ctx.read("noisy_neighbours", schemas.NOISY_NEIGHBOURS)
    if noisy.height == 0:
        empty("usage")
        return
    seconds = (w.end - w.start).total_seconds()
    states = detector_states(noisy, seconds)
    firing = states.filter(pl.col("state") == "firing")
    t = THRESHOLDS
    inputs, cached = int(noisy.get_column("input_tokens").sum()), int(noisy.get_column("cached_input_tokens").sum())
    retries, keyed = int(noisy.get_column("retries").sum()), int(noisy.get_column("keyed_logical_requests").sum())

    c = st.columns(4)
    c[0].metric("Prompt-cache hit ratio", pct(cached / inputs) if inputs else "—",
                help="Cached input tokens ÷ input tokens, every tenant, every attempt in the window.")
    c[1].metric("Retries per logical request", f"{retries / keyed:.2f}" if keyed else "—",
                help="Retries (attempts after a logical request's first that did engine work) ÷ logical requests "
                     "sent with an Idempotency-Key (only those can be retried).")
    c[2].metric("Tenants thrashing the cache", f"{firing.filter(pl.col('detector') == CACHE).height:,}",
                help=f"Hit ratio below {t.cache_hit_ratio_below:.0%} while sending at least "
                     f"{t.cache_min_input_tokens_per_s:g} input tokens/s over the window.")
    c[3].metric("Tenants retrying", f"{firing.filter(pl.col('detector') == RETRIES).height:,}",
                help=f"Above {t.retries_per_request_above:g} retries per logical request while retrying at least "
                     f"{t.retries_min_per_s:g} times per second over the window.")

    hits = noisy.drop_nulls("prompt_cache_hit_ratio").sort("prompt_cache_hit_ratio").head(25)
    chart(charts.bars(hits, "tenant_id", "prompt_cache_hit_ratio",
                      title=f"Prompt-cache hit ratio per tenant (detector: below {t.cache_hit_ratio_below:.0%})",
                      value_title="cached input ÷ input tokens", category_title="tenant", color="tier",
                      color_title="tier", value_format=".0%", sort_desc=False))
    keyed_rows = noisy.drop_nulls("retries_per_logical_request")
    if keyed_rows.height:
        chart(charts.bars(keyed_rows.sort("retries_per_logical_request", descending=True).head(25), "tenant_id",
                          "retries_per_logical_request",
                          title=f"Retries per logical request per tenant (detector: above "
                                f"{t.retries_per_request_above:g})",
                          value_title="retries ÷ logical requests with a key", category_title="tenant",
                          color="tier", color_title="tier", value_format=".2f"))
    else:
        st.caption("No tenant sent a request with an Idempotency-Key in this window: no retry can be recognised.")

    states = pl.concat([states, _agent_loops(ctx, noisy, seconds, t)])
    if PROMPT_CACHE["reprefill_rate"] in ctx.signal_names():
        thrash = thrash_states(noisy, ctx.gauge(PROMPT_CACHE["reprefill_rate"], ("tenant", "model"), "avg",
                                                per_tenant=True), seconds, float(w.step_s), t)
        states = pl.concat([states, thrash])
        chart(charts.bars(thrash.drop_nulls("value").sort("value", descending=True).head(25), "tenant_id", "value",
                          title=f"Re-prefilled share of input per tenant (detector: above "
                                f"{t.reprefill_ratio_above:.0%} while sending ≥ {t.cache_min_input_tokens_per_s:g} "
                                "input tokens/s)",
                          value_title="re-prefilled ÷ input tokens", category_title="tenant", color="tier",
                          color_title="tier", value_format=".0%"))
    more = _signal_states(ctx, seconds, t)
    if more is not None and more.height:
        states = pl.concat([states, more])
    states = states.sort(["state", "detector", "tenant_id"])
    st.markdown("**Detectors** — the alerts' thresholds on this window's totals "
                f"({', '.join(f'{d}: `{a}`' for d, a in ALERTS.items())} in Prometheus, over "
                f"{t.window}, firing after {t.for_})")
    st.dataframe(states, hide_index=True, width="stretch", column_config={
        "tenant_id": "tenant", "value": st.column_config.NumberColumn("value", format="%.3f"),
        "rate_per_s": st.column_config.NumberColumn(
            "rate or level", format="%.3f",
            help="input tokens/s (hit ratio, re-prefilled share), retries/s (retries), agent model calls/s "
                 "(calls per agent run), the model's tokens/s "
                 "(prefill, decode shares), "
                 "requests waiting (queue share), the tenant's KV tokens held (KV share)")})
    st.dataframe(noisy, hide_index=True, width="stretch", column_config={
        "tenant_id": "tenant",
        "prompt_cache_hit_ratio": st.column_config.NumberColumn("hit ratio", format="%.3f"),
        "retries_per_logical_request": st.column_config.NumberColumn("retries / logical request", format="%.3f"),
        "model_calls_per_agent_run": st.column_config.NumberColumn("model calls / agent run", format="%.2f")})
    render_interference(ctx)


# --------------------------------------------------------------------------- interference (issue 14, item 3)

#: the quantities of an interference row, as the panel names them
_SHARES = (("prefill", "prefill_share"), ("decode", "decode_share"), ("KV", "kv_share"))
_LONG = {"bar": pl.String, "tenant_id": pl.String, "objective": pl.String, "quantity": pl.String,
         "neighbour": pl.String, "share": pl.Float64}


def interference_shares(rows: pl.DataFrame) -> pl.DataFrame:
    """The interference read's rows (:data:`~kvmeter.dashboards.schemas.INTERFERENCE`) as one row
    per (victim tenant, objective, quantity, neighbour) with its ``share`` (0–1), and ``bar``
    (``"<tenant> · <objective> · <quantity>"``, quantity ``prefill`` / ``decode`` tokens or ``KV``
    token-seconds) to draw a stacked bar per victim and quantity.
    Rows without a share (no attributed work) are left out; ``neighbour`` ``""`` (unattributed
    work) reads ``(unattributed)``."""
    out = []
    for r in rows.iter_rows(named=True):
        for quantity, column in _SHARES:
            if r[column] is None or r["neighbour"] is None:
                continue
            out.append({"bar": f"{r['tenant_id']} · {r['objective'].upper()} · {quantity}", "tenant_id": r["tenant_id"],
                        "objective": r["objective"], "quantity": quantity,
                        "neighbour": r["neighbour"] or "(unattributed)", "share": r[column]})
    return pl.DataFrame(out, schema=_LONG)


def render_interference(ctx: PageContext) -> None:
    """Who filled the engine steps that tenants' SLO-missing requests waited through
    (:mod:`kvmeter.ledger.interference`): per victim tenant and objective, each tenant's share of
    the scheduled prefill and decode tokens and of the KV held; a tenant key sees the others as
    ``tenant-1``, ``tenant-2``... ranked by share."""
    st.subheader("Interference: whose work filled the steps of missed requests")
    rows = ctx.read("interference", schemas.INTERFERENCE)
    if rows.height == 0:
        st.caption("No request missed its tier's TTFT or ITL objective in this window (or the engine's "
                   "per-step records are not in the ledger).")
        return
    long = interference_shares(rows)
    if long.height:
        chart(charts.bars(long, "bar", "share", title="Share of the steps between arrival and first token (TTFT) "
                          "or between first and last token (ITL), by tenant whose work it was",
                          value_title="share of the steps' prefill tokens, decode tokens or KV token-seconds",
                          category_title="missed requests of · objective · quantity", color="neighbour",
                          color_title="tenant", value_format=".0%", sort_desc=False))
    st.caption("Recomputable from the ledger's engine_steps rows: each share is the tenant's sum over the steps "
               "of every missed request's window ÷ the sum over all tenants; a tenant's own row includes the "
               "missed requests' own prefill.")
    st.dataframe(rows, hide_index=True, width="stretch", column_config={
        "tenant_id": "missed requests of", "neighbour": "work of",
        **{c: st.column_config.NumberColumn(c.replace("_", " "), format="%.3f")
           for c in ("prefill_share", "decode_share", "kv_share", "kv_token_seconds")}})

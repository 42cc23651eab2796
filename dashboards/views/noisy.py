"""Noisy neighbours: per tenant, the shapes of issue 14 the ledger can show — prompt-cache hit ratio
and retries per logical request — and the state of each shape's detector over the window.

The detectors are the Prometheus alerts' (``KvmeterTenantPromptCacheHitLow``,
``KvmeterTenantRetriesHigh``): the same thresholds and predicates
(:class:`kvmeter.exporters.prometheus.rules.noisy.NoisyThresholds`), applied here to the ledger's
totals over the page's window instead of Prometheus' rate window."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvmeter.exporters.prometheus.rules.noisy import THRESHOLDS, NoisyThresholds

from .. import charts, schemas
from ..ui import PageContext
from .common import chart, empty, pct

TITLE = "Noisy neighbours"
CAPTION = ("Each shape of noisy neighbour per tenant, from every attempt's engine work in the ledger (not the "
           "bill): how much of its input the prefix cache served, and how often it retries a logical request.")

#: detector names as the page shows them, and the alert each one mirrors
CACHE, RETRIES = "prompt-cache hit ratio", "retries per logical request"
ALERTS = {CACHE: "KvmeterTenantPromptCacheHitLow", RETRIES: "KvmeterTenantRetriesHigh"}

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

    st.markdown("**Detectors** — the alerts' thresholds on this window's totals "
                f"({', '.join(f'{d}: `{a}`' for d, a in ALERTS.items())} in Prometheus, over "
                f"{t.window}, firing after {t.for_})")
    st.dataframe(states, hide_index=True, width="stretch", column_config={
        "tenant_id": "tenant", "value": st.column_config.NumberColumn("value", format="%.3f"),
        "rate_per_s": st.column_config.NumberColumn("input tokens/s or retries/s", format="%.3f")})
    st.dataframe(noisy, hide_index=True, width="stretch", column_config={
        "tenant_id": "tenant",
        "prompt_cache_hit_ratio": st.column_config.NumberColumn("hit ratio", format="%.3f"),
        "retries_per_logical_request": st.column_config.NumberColumn("retries / logical request", format="%.3f")})
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

"""Agent runs: the run, not the request, as the unit — the most expensive runs (model calls, tokens,
tool calls by risk class, refusals, approvals, cost), the runs stopped as loops, and the approvals
waiting for a person. Reads the ledger's run rollup (``agent_runs``, refreshed with the hourly
rollups) and its approval and stop records."""

from __future__ import annotations

from decimal import Decimal

import polars as pl
import streamlit as st

from kvmeter.money import format_money

from .. import charts, schemas
from ..ui import PageContext
from .common import chart, secs, si

TITLE = "Agent runs"
CAPTION = ("One user request can become dozens of model and tool calls. Runs are budgeted, their tools checked "
           "against the key's policy, high-risk calls held for approval, and loops stopped.")

#: Runs drawn in the cost chart (the table holds all of them).
TOP_RUNS = 15


def money(text: str | None) -> str:
    """An exact decimal string for display (``—`` when unpriced): at least cents, no float."""
    if text is None:
        return "—"
    return format_money(Decimal(text), 2, grouping=True)


def with_labels(runs: pl.DataFrame) -> pl.DataFrame:
    """Add ``run`` (``tenant / run id``, shortened) and ``cost_value`` (the exact subtotal as a
    float, for drawing only)."""
    return runs.with_columns(
        (pl.col("tenant_id") + " / " + pl.col("agent_run_id").str.slice(0, 40)).alias("run"),
        pl.col("subtotal").cast(pl.Float64, strict=False).fill_null(0.0).alias("cost_value"))


def render(ctx: PageContext) -> None:
    runs = with_labels(ctx.read("agent_runs", schemas.AGENT_RUNS))
    stops = ctx.read("agent_run_stops", schemas.AGENT_RUN_STOPS)
    pending = ctx.read("approvals_pending", schemas.APPROVALS_PENDING)
    top = runs.sort("cost_value", descending=True).head(1)
    c = st.columns(5)
    c[0].metric("Agent runs", f"{runs.height:,}", help="Runs with a model call, tool call, approval or stop in "
                "the window (the 1,000 most expensive).")
    c[1].metric("Loops stopped", f"{stops.height:,}", help="Runs the gateway stopped: the same tool call "
                "repeated, an A → B → A cycle, or the same prompt with no progress.")
    c[2].metric("Approvals pending", f"{pending.height:,}", help="High-risk tool calls waiting for an approver "
                "(as the ledger has them at the window's end).")
    c[3].metric("Most expensive run", money(top.get_column("subtotal")[0]) if top.height else "—",
                help=f"Exact cost at list price ({runs.get_column('currency')[0] if runs.height else 'USD'}); "
                     "the invoice rounds once per line.")
    c[4].metric("Tool calls refused", f"{int(runs.get_column('refused_tool_calls').sum() or 0):,}",
                help="Blocked or not allowed by the tool policy, rejected, over budget, or in a stopped run.")

    if runs.height == 0:
        st.info("No agent runs in this window: model calls carry a run id in `X-Agent-Run-Id`, tool calls are "
                "reported to `POST /v1/agent_runs/{id}/tool_calls`.")
    else:
        left, right = st.columns(2)
        with left:
            chart(charts.bars(runs.sort("cost_value", descending=True).head(TOP_RUNS), "run", "cost_value",
                              title=f"Most expensive runs (top {min(TOP_RUNS, runs.height)})",
                              value_title=f"cost ({runs.get_column('currency')[0]}, list price)",
                              category_title="run", color="tier",
                              color_title="tier", value_format="~g"))
        with right:
            by_class = pl.DataFrame({
                "risk_class": ["read_only", "side_effect", "high_risk"],
                "calls": [int(runs.get_column(f"{k}_calls").sum() or 0) for k in ("read_only", "side_effect",
                                                                                    "high_risk")]})
            chart(charts.bars(by_class, "risk_class", "calls", title="Tool calls permitted by risk class",
                              value_title="tool calls", category_title="risk class", value_format="d"))
        table = runs.sort("cost_value", descending=True).select(
            "tenant_id", "agent_run_id", "tier", "model_calls", "input_tokens", "output_tokens", "tool_calls",
            "tools", "refusals", "approvals_requested", "stop_reason", "duration_s", "subtotal")
        st.dataframe(table.with_columns(pl.col("subtotal").map_elements(money, return_dtype=pl.String)),
                     hide_index=True, width="stretch",
                     column_config={"tenant_id": "tenant", "agent_run_id": "run",
                                    "model_calls": "model calls (attempts)",
                                    "input_tokens": "billed input tokens", "output_tokens": "billed output tokens",
                                    "tool_calls": "tool calls", "approvals_requested": "approvals",
                                    "stop_reason": "stopped", "subtotal": "cost",
                                    "duration_s": st.column_config.NumberColumn("duration (s)", format="%.1f")})
        st.caption(f"{si(int(runs.get_column('model_calls').sum() or 0))} model calls (attempts: a retried call "
                   "counts each; its tokens and cost are billed once) and "
                   f"{si(int(runs.get_column('tool_calls').sum() or 0))} permitted tool calls in these runs.")

    st.subheader("Loops stopped")
    if stops.height:
        reasons = stops.group_by("reason").agg(pl.len().alias("runs"))
        chart(charts.bars(reasons, "reason", "runs", title="Runs stopped by reason", value_title="runs",
                          category_title="reason", value_format="d"))
        st.dataframe(stops.select("ts", "tenant_id", "agent_run_id", "reason", "detail"), hide_index=True,
                     width="stretch", column_config={"ts": "stopped at (UTC)", "tenant_id": "tenant",
                                                     "agent_run_id": "run"})
    else:
        st.caption("No run was stopped as a loop in this window.")

    st.subheader("Approvals pending")
    if pending.height:
        st.dataframe(pending.with_columns(pl.col("waiting_s").map_elements(secs, return_dtype=pl.String)).select(
            "approval_id", "tenant_id", "agent_run_id", "api_key_id", "tool", "waiting_s", "expires_ts"),
            hide_index=True, width="stretch",
            column_config={"tenant_id": "tenant", "agent_run_id": "run", "api_key_id": "key", "waiting_s": "waiting",
                           "expires_ts": "expires (UTC)"})
        st.caption("Decide them with `POST /v1/approvals/{id}/approve` or `/reject` (an admin key or an approver "
                   "of the scope).")
    else:
        st.caption("No approval is waiting.")

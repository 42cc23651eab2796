"""Polars schemas of the window reads (columns as documented on
:class:`~kvmeter.ledger.window_queries.WindowQueries`, the ledger's window reads).

A frame built with :func:`kvmeter.dashboards.frames.frame` has these columns and dtypes even when
the read returned no rows, so a quiet window draws empty charts instead of failing.
"""

from __future__ import annotations

import polars as pl

TS = pl.Datetime("us", "UTC")
I, F, S = pl.Int64, pl.Float64, pl.String  # noqa: E741 — one-letter column types keep the tables below one line each

TENANTS = {"tenant_id": S, "tier": S}
TRAFFIC = {"ts": TS, "requests": I, "ok_requests": I, "aborted_requests": I, "error_requests": I,
           "input_tokens": I, "cached_input_tokens": I, "output_tokens": I, "kv_token_seconds": F,
           "queue_seconds": F, "queue_p50_s": F, "queue_p95_s": F, "ttft_p95_s": F, "max_input_tokens": I}
TRAFFIC_BY_TENANT = {"ts": TS, "tenant_id": S, "tier": S, "requests": I, "input_tokens": I,
                     "output_tokens": I, "kv_token_seconds": F, "queue_seconds": F, "backlogged": I}
TENANT_TOTALS = {"tenant_id": S, "tier": S, "requests": I, "aborted_requests": I, "error_requests": I,
                 "input_tokens": I, "cached_input_tokens": I, "output_tokens": I, "kv_token_seconds": F,
                 "preemptions": I, "queue_seconds": F, "queued_requests": I, "queue_p95_s": F, "ttft_p95_s": F,
                 "mean_input_tokens": F, "max_input_tokens": I, "max_output_tokens": I}
LATENCY_BY_TIER = {"tier": S, "requests": I,
                   **{f"{m}_{p}_s": F for m in ("ttft", "itl") for p in ("p50", "p90", "p95", "p99")},
                   "e2e_p50_s": F, "e2e_p95_s": F, "queue_mean_s": F, "prefill_mean_s": F, "decode_mean_s": F,
                   "queue_p95_s": F}
LATENCY_TIMESERIES = {"ts": TS, "tier": S, "requests": I, "ttft_p50_s": F, "ttft_p95_s": F, "itl_p50_s": F,
                      "itl_p95_s": F, "queue_p95_s": F}
GOODPUT = {"ts": TS, "tier": S, "requests": I, "good_requests": I, "slo_missed_requests": I, "input_tokens": I,
           "output_tokens": I, "good_input_tokens": I, "good_output_tokens": I, "aborted_tokens": I,
           "error_tokens": I}
ATTEMPTS_TIMESERIES = {"ts": TS, "status": S, "reason": S, "attempts": I}
ATTEMPTS_BY_TENANT = {"tenant_id": S, "tier": S, "status": S, "reason": S, "attempts": I, "status_code": I}
REJECTIONS_BY_LIMIT = {"level": S, "dimension": S, "reason": S, "attempts": I}
RESERVATION_BY_TENANT = {"tenant_id": S, "tier": S, "requests": I, "reserved_input_tokens": I,
                         "reserved_output_tokens": I, "input_tokens": I, "output_tokens": I,
                         "over_reserved_requests": I, "under_reserved_requests": I}
RESERVATION_TIMESERIES = {"ts": TS, "reserved_tokens": I, "actual_tokens": I}
OUTPUT_BUDGET_USE = {"bin": I, "requests": I}
#: :meth:`kvmeter.ledger.noisy_queries.NoisyQueries.noisy_neighbours`
NOISY_NEIGHBOURS = {"tenant_id": S, "tier": S, "input_tokens": I, "cached_input_tokens": I,
                    "prompt_cache_hit_ratio": F, "logical_requests": I, "keyed_logical_requests": I, "attempts": I,
                    "retries": I, "retries_per_logical_request": F, "agent_model_calls": I, "agent_runs": I,
                    "model_calls_per_agent_run": F}
#: :meth:`kvmeter.ledger.noisy_queries.NoisyQueries.agent_calls_per_run`
AGENT_CALLS_PER_RUN = {"ts": TS, "tenant_id": S, "tier": S, "model_calls": I, "agent_runs": I,
                       "model_calls_per_agent_run": F}
#: :meth:`kvmeter.ledger.interference.InterferenceQueries.interference`
INTERFERENCE = {"tenant_id": S, "tier": S, "objective": S, "missed_requests": I, "attributed_requests": I,
                "rank": I, "neighbour": S, "is_self": pl.Boolean, "steps": I, "prefill_tokens": I,
                "decode_tokens": I, "kv_token_seconds": F, "prefill_share": F, "decode_share": F, "kv_share": F}
AGENT_RUNS = {"tenant_id": S, "agent_run_id": S, "api_key_id": S, "tier": S, "first_ts": TS, "last_ts": TS,
              "duration_s": F, "model_calls": I, "refused_model_calls": I, "input_tokens": I, "output_tokens": I,
              "tool_calls": I, "read_only_calls": I, "side_effect_calls": I, "high_risk_calls": I, "tools": S,
              "refused_tool_calls": I, "replayed_tool_calls": I, "refusals": I, "approvals_requested": I,
              "approvals_approved": I, "approvals_rejected": I, "loop_stops": I, "stop_reason": S, "subtotal": S,
              "cost": S, "currency": S}
AGENT_RUN_STOPS = {"ts": TS, "tenant_id": S, "agent_run_id": S, "api_key_id": S, "tier": S, "reason": S,
                   "detail": S, "tool": S}
APPROVALS_PENDING = {"approval_id": S, "tenant_id": S, "agent_run_id": S, "api_key_id": S, "tool": S,
                     "requested_ts": TS, "expires_ts": TS, "waiting_s": F}

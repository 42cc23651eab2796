"""The ledger's noisy-neighbour reads: per tenant over a window, the shapes of issue 14 that the
usage rows can show — prompt-cache hit ratio, retries per logical request and model calls per
agent run.

Beside :class:`~kvmeter.ledger.window_queries.WindowQueries` (same runner, same rules: usage read
deduplicated with ``FINAL``, every value a bound parameter, rows JSON-friendly with ``None`` for
missing, never NaN; usage belongs to the window containing its ``finish_ts``).

This is **engine work, not billing**: every usage row counts — one row per attempt that reached the
engine (migration 0006: the attempts of one logical request share ``(tenant_id, event_id)``),
superseded and undelivered attempts included — never the billed view
(:func:`~kvmeter.ledger.queries.classified_usage_sql`), which keeps one bill per logical request.

Definitions (the Prometheus rules use the same ratios: ``rules/noisy.py``):

* prompt-cache hit ratio = Σ cached input tokens ÷ Σ input tokens (cached input is a part of the
  input: ``kvmeter.tokens.TokenCounts``);
* logical requests = distinct event ids; keyed logical requests = those sent with an
  ``Idempotency-Key`` (only these can be retried: without a key every request is a new logical
  request, ``kvmeter.events.event_id_for``);
* retries = attempts − logical requests (each attempt after a logical request's first that did
  engine work; a replay from the idempotency store did none and has no usage row); retries per
  logical request = retries ÷ keyed logical requests;
* agent model calls = usage rows carrying an agent run id (every attempt of a run that reached the
  engine: the count :mod:`~kvmeter.ledger.agent_runs` calls a run's ``model_calls``); agent runs =
  distinct run ids among them; model calls per agent run = agent model calls ÷ agent runs. Every
  run with a call in the span counts once, however long ago it began. (The Prometheus detector,
  ``KvmeterTenantAgentCallsPerRunHigh``, divides by the runs its process first saw in the window, at
  least one — :mod:`kvmeter.exporters.prometheus.agents` —, because a counter cannot hold distinct
  ids; the ledger has them, so its ratio is exact per span. The two agree when runs begin and end
  inside the window.)

A logical request whose attempts straddle the window's start or end counts there with the attempts
that finished inside it.
"""

from __future__ import annotations

from typing import Any, Sequence

from .window_queries import _END, _START, Buckets, WindowQueries, _bucket, _tenant_filter

__all__ = ["NoisyQueries"]


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole > 0 else None


class NoisyQueries(WindowQueries):
    """Per-tenant noisy-neighbour reads: :class:`~kvmeter.ledger.window_queries.WindowQueries`'
    client, parameters, row cleaning and errors, plus :meth:`noisy_neighbours` and
    :meth:`agent_calls_per_run`."""

    def noisy_neighbours(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per tenant with usage in ``[window.start, window.end)`` (``window.step_s`` unused), sorted
        by tenant.

        Returns:
            ``tenant_id``, ``tier`` (any one of the tenant's rows), ``input_tokens``,
            ``cached_input_tokens`` (⊆ input), ``prompt_cache_hit_ratio`` (0–1, ``None`` without
            input), ``logical_requests``, ``keyed_logical_requests``, ``attempts`` (usage rows),
            ``retries`` (attempts − logical requests), ``retries_per_logical_request`` (retries ÷
            keyed logical requests, ``None`` without one), ``agent_model_calls`` (usage rows with an
            agent run id), ``agent_runs`` (distinct run ids among them),
            ``model_calls_per_agent_run`` (≥ 1, ``None`` without an agent run).
        """
        rows = self._query(f"""
            SELECT tenant_id, any(tier) AS tier,
                sum(input_tokens) AS input_tokens,
                sum(cached_input_tokens) AS cached_input_tokens,
                uniqExact(event_id) AS logical_requests,
                uniqExactIf(event_id, idempotency_key != '') AS keyed_logical_requests,
                count() AS attempts,
                countIf(agent_run_id != '') AS agent_model_calls,
                uniqExactIf(agent_run_id, agent_run_id != '') AS agent_runs
            FROM usage_events FINAL
            WHERE finish_ts >= {_START} AND finish_ts < {_END}{_tenant_filter(tenants)}
            GROUP BY tenant_id ORDER BY tenant_id""", self._params(window, tenants))
        for r in rows:
            r["prompt_cache_hit_ratio"] = _ratio(r["cached_input_tokens"], r["input_tokens"])
            r["retries"] = r["attempts"] - r["logical_requests"]
            r["retries_per_logical_request"] = _ratio(r["retries"], r["keyed_logical_requests"])
            r["model_calls_per_agent_run"] = _ratio(r["agent_model_calls"], r["agent_runs"])
        return rows

    def agent_calls_per_run(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per bucket of ``window.step_s`` seconds (by ``finish_ts``) and tenant with agent model
        calls in it, sorted by bucket and tenant: the history of the agent-loop shape (module
        docstring; a run with calls in several buckets counts once in each).

        Returns:
            ``ts`` (bucket start, UTC), ``tenant_id``, ``tier`` (any one of its rows in the bucket),
            ``model_calls`` (usage rows with an agent run id), ``agent_runs`` (distinct run ids),
            ``model_calls_per_agent_run`` (model calls ÷ agent runs, ≥ 1).
        """
        rows = self._query(f"""
            SELECT {_bucket('finish_ts')} AS bucket, tenant_id, any(tier) AS tier,
                count() AS model_calls, uniqExact(agent_run_id) AS agent_runs
            FROM usage_events FINAL
            WHERE finish_ts >= {_START} AND finish_ts < {_END}{_tenant_filter(tenants)} AND agent_run_id != ''
            GROUP BY bucket, tenant_id ORDER BY bucket, tenant_id""", self._params(window, tenants))
        for r in rows:
            r["model_calls_per_agent_run"] = _ratio(r["model_calls"], r["agent_runs"])
        return rows

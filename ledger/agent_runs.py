"""Agent runs as first-class data: the per-run rollup in ClickHouse and the reads over it.

**The rollup** (``agent_runs``, migration 0004; tokens named input/output since 0005) holds one
row per (tenant, run id): model calls, tokens per model, tool calls (permits) by tool and by risk
class, refused and replayed tool calls, approvals by event, the loop stop. Like ``usage_hourly``
it is derived data, recomputed — never incremented — from the deduplicated tables (``FINAL``) for
every run with rows ingested since the last computation (minus
:data:`~kvmeter.ledger.rollups.ROLLUP_MARGIN_S`); the ledger's writer refreshes it with the hourly
rollups. Money is not stored: a run's ``cost`` is priced when it is read, with the reader's price
list, by the one price function (:meth:`~kvmeter.ledger.prices.PriceList.cost`, per model):
``subtotal`` exact, ``cost`` rounded once per run.

**Attempts and the bill.** A usage row is one attempt's engine work (migration 0006), so a model
call retried after an aborted attempt, or run twice after a restart (``superseded``), has several
rows. The model-call counts count attempts — the run's load; the quota's run budget counts model
calls per attempt too: ``model_calls`` every attempt of the run that reached the engine (its usage
rows, billed or not), ``ok_model_calls`` those that finished ``ok`` (a superseded second success
included), ``refused_model_calls`` its refused HTTP attempts (``rejected`` or ``invalid`` attempt
records). Its tokens per model, and so its cost, are billed tokens only: the rows of classes
:data:`~kvmeter.ledger.queries.BILLED_CLASSES`, read through the one classification
(:func:`~kvmeter.ledger.queries.classified_usage_sql`), so a retried call is paid for once, as on
the invoice.

**The reads** (:class:`AgentRunQueries`), each over a time range (``start``, ``end``: a
:class:`~kvmeter.ledger.period.Period` or a dashboard window) and a tenant filter (``None`` = all;
who may ask for which tenant is decided by the caller — the read API and the dashboards' scope):

* :meth:`~AgentRunQueries.runs` — runs active in the range (first call before ``end``, last at or
  after ``start``), most expensive first (or by tokens, by last activity);
* :meth:`~AgentRunQueries.pending_approvals` — approvals requested, not decided, not expired;
* :meth:`~AgentRunQueries.run_stops` — runs stopped as loops in the range.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Callable, Protocol, Sequence

from clickhouse_connect.driver.client import Client

from kvmeter.money import format_money, money_places
from kvmeter.tokens import TOKEN_FIELDS, TokenCounts

from .connection import ClientHolder, QueryRunner
from .prices import PriceList
from .queries import BILLED_SQL, classified_usage_sql

__all__ = ["refresh_run_rollups", "AgentRunQueries", "RUN_ORDERS", "MAX_RUNS"]

#: How :meth:`AgentRunQueries.runs` may sort.
RUN_ORDERS = ("cost", "tokens", "last_ts")
#: Most runs one read returns; runs priced per read (the most tokens first, then sorted by cost).
MAX_RUNS = 1_000
_SCAN = 20_000
_MARGIN_S = 120

_DIRTY = """
SELECT tenant_id, agent_run_id FROM (
    SELECT tenant_id, agent_run_id FROM usage_events WHERE agent_run_id != '' AND ingested_at >= {since}
    UNION ALL SELECT tenant_id, agent_run_id FROM attempts WHERE agent_run_id != '' AND ingested_at >= {since}
    UNION ALL SELECT tenant_id, agent_run_id FROM tool_calls WHERE ingested_at >= {since}
    UNION ALL SELECT tenant_id, agent_run_id FROM approval_events WHERE ingested_at >= {since}
    UNION ALL SELECT tenant_id, agent_run_id FROM agent_run_stops WHERE ingested_at >= {since}
) GROUP BY tenant_id, agent_run_id"""

#: The usage rows of the dirty runs (every attempt; their classes decided over all rows of each
#: logical request, :func:`~kvmeter.ledger.queries.classified_usage_sql`).
_RUN_USAGE = classified_usage_sql(
    "agent_run_id != '' AND (tenant_id, agent_run_id) IN (SELECT tenant_id, agent_run_id FROM dirty)")

_RECOMPUTE = """
INSERT INTO agent_runs
WITH dirty AS ({dirty})
SELECT
    d.tenant_id AS tenant_id, d.agent_run_id AS agent_run_id,
    if(u.u_key != '', u.u_ws, if(t.t_key != '', t.t_ws, if(p.p_key != '', p.p_ws, s.s_ws))) AS workspace_id,
    if(u.u_key != '', u.u_proj, if(t.t_key != '', t.t_proj, if(p.p_key != '', p.p_proj, s.s_proj))) AS project_id,
    if(u.u_key != '', u.u_key, if(t.t_key != '', t.t_key, if(p.p_key != '', p.p_key, s.s_key))) AS api_key_id,
    if(u.u_key != '', u.u_tier, if(t.t_key != '', t.t_tier, if(p.p_key != '', p.p_tier, s.s_tier))) AS tier,
    arrayMin(arrayFilter(x -> x > toDateTime64(0, 6, 'UTC'),
                         [u.u_first, a.a_first, t.t_first, p.p_first, s.s_first, toDateTime64('2299-01-01', 6, 'UTC')]))
        AS first_ts,
    arrayMax([u.u_last, a.a_last, t.t_last, p.p_last, s.s_first]) AS last_ts,
    u.model_calls AS model_calls, u.ok_model_calls AS ok_model_calls, a.refused AS refused_model_calls,
    u.input_m AS input_tokens_by_model, u.cached_m AS cached_input_tokens_by_model,
    u.output_m AS output_tokens_by_model, u.reasoning_m AS reasoning_tokens_by_model,
    t.permits AS tool_calls, t.by_tool AS tool_calls_by_tool, t.by_risk AS tool_calls_by_risk_class,
    t.refused AS refused_tool_calls, t.replayed AS replayed_tool_calls,
    p.requested AS approvals_requested, p.approved AS approvals_approved, p.rejected AS approvals_rejected,
    p.consumed AS approvals_consumed, p.last_expires AS last_approval_expires_ts,
    s.stops AS loop_stops, s.reason AS stop_reason, s.detail AS stop_detail,
    now64(3) AS computed_at
FROM (SELECT tenant_id, agent_run_id FROM dirty) AS d
LEFT JOIN (
    SELECT tenant_id, agent_run_id, any(workspace_id) AS u_ws, any(project_id) AS u_proj,
           any(api_key_id) AS u_key, argMax(tier, finish_ts) AS u_tier, min(arrival_ts) AS u_first,
           max(finish_ts) AS u_last, count() AS model_calls, countIf(outcome = 'ok') AS ok_model_calls,
           sumMapIf(map(model, toUInt64(input_tokens)), billed) AS input_m,
           sumMapIf(map(model, toUInt64(cached_input_tokens)), billed) AS cached_m,
           sumMapIf(map(model, toUInt64(output_tokens)), billed) AS output_m,
           sumMapIf(map(model, toUInt64(reasoning_tokens)), billed) AS reasoning_m
    FROM (SELECT *, """ + BILLED_SQL + """ AS billed FROM """ + _RUN_USAGE + """)
    GROUP BY tenant_id, agent_run_id) AS u ON u.tenant_id = d.tenant_id AND u.agent_run_id = d.agent_run_id
LEFT JOIN (
    SELECT tenant_id, agent_run_id, min(ts) AS a_first, max(ts) AS a_last,
           countIf(status IN ('rejected', 'invalid')) AS refused
    FROM attempts FINAL
    WHERE agent_run_id != '' AND (tenant_id, agent_run_id) IN (SELECT tenant_id, agent_run_id FROM dirty)
    GROUP BY tenant_id, agent_run_id) AS a ON a.tenant_id = d.tenant_id AND a.agent_run_id = d.agent_run_id
LEFT JOIN (
    SELECT tenant_id, agent_run_id, any(workspace_id) AS t_ws, any(project_id) AS t_proj,
           any(api_key_id) AS t_key, any(tier) AS t_tier, min(ts) AS t_first, max(ts) AS t_last,
           countIf(decision = 'allowed' AND source = 'reported') AS permits,
           sumMapIf(map(toString(tool), toUInt64(1)), decision = 'allowed' AND source = 'reported') AS by_tool,
           sumMapIf(map(toString(risk_class), toUInt64(1)), decision = 'allowed' AND source = 'reported') AS by_risk,
           countIf(decision NOT IN ('allowed', 'replayed', 'pending_approval')) AS refused,
           countIf(decision = 'replayed') AS replayed
    FROM tool_calls FINAL
    WHERE (tenant_id, agent_run_id) IN (SELECT tenant_id, agent_run_id FROM dirty)
    GROUP BY tenant_id, agent_run_id) AS t ON t.tenant_id = d.tenant_id AND t.agent_run_id = d.agent_run_id
LEFT JOIN (
    SELECT tenant_id, agent_run_id, any(workspace_id) AS p_ws, any(project_id) AS p_proj,
           any(api_key_id) AS p_key, any(tier) AS p_tier, min(ts) AS p_first, max(ts) AS p_last,
           countIf(event = 'requested') AS requested, countIf(event = 'approved') AS approved,
           countIf(event = 'rejected') AS rejected, countIf(event = 'consumed') AS consumed,
           max(expires_ts) AS last_expires
    FROM approval_events FINAL
    WHERE (tenant_id, agent_run_id) IN (SELECT tenant_id, agent_run_id FROM dirty)
    GROUP BY tenant_id, agent_run_id) AS p ON p.tenant_id = d.tenant_id AND p.agent_run_id = d.agent_run_id
LEFT JOIN (
    SELECT tenant_id, agent_run_id, any(workspace_id) AS s_ws, any(project_id) AS s_proj,
           any(api_key_id) AS s_key, any(tier) AS s_tier, min(ts) AS s_first, count() AS stops,
           any(reason) AS reason, any(detail) AS detail
    FROM agent_run_stops FINAL
    WHERE (tenant_id, agent_run_id) IN (SELECT tenant_id, agent_run_id FROM dirty)
    GROUP BY tenant_id, agent_run_id) AS s ON s.tenant_id = d.tenant_id AND s.agent_run_id = d.agent_run_id
"""

_SINCE = "{since:DateTime64(3, 'UTC')}"
_START = "{start:DateTime64(6, 'UTC')}"
_END = "{end:DateTime64(6, 'UTC')}"


def refresh_run_rollups(client: Client, *, full: bool = False) -> int:
    """Recompute ``agent_runs`` for every run with rows ingested since the last computation.

    Args:
        client: a client on the ledger database (schema migrated).
        full: recompute every run.
    Returns:
        The number of runs recomputed.
    Raises:
        clickhouse-connect errors (the writer thread logs and retries them next interval).
    """
    since = datetime(1970, 1, 1, tzinfo=timezone.utc)
    if not full:
        last = client.query("SELECT max(computed_at) FROM agent_runs").result_rows[0][0]
        if last is not None and last.year > 1970:
            last = last.replace(tzinfo=timezone.utc) if last.tzinfo is None else last
            since = last - timedelta(seconds=_MARGIN_S)
    dirty = _DIRTY.replace("{since}", _SINCE)
    count = client.query(f"SELECT count() FROM ({dirty})", parameters={"since": since}).result_rows[0][0]
    if count:
        client.command(_RECOMPUTE.replace("{dirty}", dirty), parameters={"since": since})
    return int(count)


class TimeRange(Protocol):
    """A half-open UTC interval ``[start, end)`` (a ``Period`` or a dashboard ``Window``)."""

    @property
    def start(self) -> datetime: ...
    @property
    def end(self) -> datetime: ...


def _utc(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    return value


def _tenants(tenants: Sequence[str] | None) -> list[str] | None:
    if tenants is None:
        return None
    out = list(tenants)
    if any(not isinstance(t, str) or not t for t in out):
        raise ValueError("tenant ids must be non-empty strings")
    return out


def _money(value: Decimal | None, places: int) -> str | None:
    return None if value is None else format_money(value, places)


class AgentRunQueries:
    """Reads of agent runs on the ledger's ClickHouse database (module docstring).

    Args:
        client: a :class:`ClientHolder` or a zero-argument function returning a client.
        prices: the price list runs are priced with.
    Raises (every read):
        LedgerUnavailable: ClickHouse cannot be reached.
        LedgerError: ClickHouse refused the query.
        ValueError: a bad argument (order, limit, empty tenant id).
    """

    def __init__(self, client: ClientHolder | Callable[[], Client], prices: PriceList) -> None:
        self._runner = QueryRunner(client)
        self.prices = prices

    def _rows(self, sql: str, params: dict[str, Any], settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        rows = self._runner.rows(sql, params, settings=settings)
        return [{k: _utc(v) for k, v in row.items()} for row in rows]

    def _base_params(self, span: TimeRange, tenants: Sequence[str] | None) -> tuple[str, dict[str, Any]]:
        params: dict[str, Any] = {"start": span.start, "end": span.end}
        checked = _tenants(tenants)
        where = ""
        if checked is not None:
            where = " AND tenant_id IN {tenants:Array(String)}"
            params["tenants"] = checked
        return where, params

    def subtotal(self, row: dict[str, Any]) -> Decimal | None:
        """A rollup row's exact cost: Σ over its models of the one price function
        (:meth:`PriceList.cost <kvmeter.ledger.prices.PriceList.cost>` of the model's token sums);
        ``None`` when one of its models has no price. Round it once with :meth:`PriceList.round`
        (the row's ``cost``)."""
        total = Decimal(0)
        inputs = row.get("input_tokens_by_model") or {}
        cached = row.get("cached_input_tokens_by_model") or {}
        outputs = row.get("output_tokens_by_model") or {}
        reasoning = row.get("reasoning_tokens_by_model") or {}
        for model in set(inputs) | set(outputs):
            tokens = TokenCounts(input_tokens=int(inputs.get(model, 0)), cached_input_tokens=int(cached.get(model, 0)),
                                 output_tokens=int(outputs.get(model, 0)),
                                 reasoning_tokens=int(reasoning.get(model, 0)))
            sub = self.prices.cost_if_priced(model, row.get("tier", ""), tokens)
            if sub is None:
                return None
            total += sub
        return total

    def _shape(self, row: dict[str, Any]) -> dict[str, Any]:
        subtotal = self.subtotal(row)
        cost = self.prices.round(subtotal) if subtotal is not None else None
        out = {k: v for k, v in row.items() if not k.endswith("_by_model")}
        out["models"] = sorted(set(row.get("input_tokens_by_model") or {})
                               | set(row.get("output_tokens_by_model") or {}))
        for kind in TOKEN_FIELDS:
            out[kind] = int(sum((row.get(f"{kind}_by_model") or {}).values()))
        out["tool_calls_by_tool"] = {k: int(v) for k, v in (row.get("tool_calls_by_tool") or {}).items()}
        out["tool_calls_by_risk_class"] = {k: int(v) for k, v in (row.get("tool_calls_by_risk_class") or {}).items()}
        first, last = row.get("first_ts"), row.get("last_ts")
        out["duration_s"] = (last - first).total_seconds() if first and last and last >= first else 0.0
        out["refusals"] = int(row.get("refused_tool_calls", 0)) + int(row.get("refused_model_calls", 0))
        places = money_places(self.prices)
        out["subtotal"] = _money(subtotal, places)
        out["cost"] = _money(cost, places)
        out["priced"] = cost is not None
        out["currency"] = self.prices.currency
        return out

    def runs(self, span: TimeRange, tenants: Sequence[str] | None = None, *, agent_run_id: str | None = None,
             order: str = "cost", limit: int = 100) -> list[dict[str, Any]]:
        """The runs active in ``span``, sorted by ``order`` (descending; ``cost`` puts unpriced runs
        last), at most ``limit`` (1..:data:`MAX_RUNS`).

        Returns:
            One dict per run: the rollup's columns (``tenant_id``, ``agent_run_id``, attribution,
            ``first_ts``, ``last_ts``, ``duration_s``, ``model_calls``, ``ok_model_calls``,
            ``refused_model_calls`` (attempts, billed or not: module docstring), ``input_tokens``,
            ``cached_input_tokens``, ``output_tokens``, ``reasoning_tokens`` (billed tokens:
            :data:`~kvmeter.ledger.queries.BILLED_CLASSES`), ``models`` (those of its billed
            rows), ``tool_calls``, ``tool_calls_by_tool``, ``tool_calls_by_risk_class``,
            ``refused_tool_calls``, ``replayed_tool_calls``, ``refusals``, ``approvals_requested``
            / ``_approved`` / ``_rejected`` / ``_consumed``, ``loop_stops``, ``stop_reason``,
            ``stop_detail``) plus
            ``cost`` (exact decimal string, or None when unpriced), ``priced`` and ``currency``.
        """
        if order not in RUN_ORDERS:
            raise ValueError(f"order must be one of {RUN_ORDERS}, got {order!r}")
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_RUNS:
            raise ValueError(f"limit must be an integer in 1..{MAX_RUNS}")
        where, params = self._base_params(span, tenants)
        if agent_run_id is not None:
            where += " AND agent_run_id = {run:String}"
            params["run"] = agent_run_id
        sort = "last_ts" if order == "last_ts" else "arraySum(mapValues(input_tokens_by_model)) + " \
                                                     "arraySum(mapValues(output_tokens_by_model))"
        rows = self._rows(
            "SELECT * FROM agent_runs FINAL WHERE first_ts < " + _END + " AND last_ts >= " + _START + where
            + f" ORDER BY {sort} DESC, tenant_id, agent_run_id LIMIT {_SCAN if order == 'cost' else limit}",
            params)
        shaped = [self._shape(r) for r in rows]
        if order == "cost":
            shaped.sort(key=lambda r: (r["subtotal"] is None, -Decimal(r["subtotal"] or 0), r["tenant_id"],
                                       r["agent_run_id"]))
        return shaped[:limit]

    def pending_approvals(self, now: datetime, tenants: Sequence[str] | None = None,
                          limit: int = 100) -> list[dict[str, Any]]:
        """Approvals requested and not yet decided whose expiry is after ``now`` (as the ledger has
        them: drained once a minute or on flush), the soonest to expire first.

        Returns:
            ``approval_id``, ``tenant_id``, ``agent_run_id``, ``api_key_id``, ``tool``,
            ``risk_class``, ``arguments_sha256``, ``policy_version``, ``requested_ts``,
            ``expires_ts``, ``waiting_s`` (since the request, at ``now``).
        """
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_RUNS:
            raise ValueError(f"limit must be an integer in 1..{MAX_RUNS}")
        params: dict[str, Any] = {"now": now}
        checked = _tenants(tenants)
        where = ""
        if checked is not None:
            where = " AND tenant_id IN {tenants:Array(String)}"
            params["tenants"] = checked
        rows = self._rows(
            "SELECT approval_id, tenant_id, agent_run_id, api_key_id, tool, risk_class, arguments_sha256, "
            "policy_version, requested AS requested_ts, expires AS expires_ts FROM ("
            "SELECT approval_id, tenant_id, any(agent_run_id) AS agent_run_id, any(api_key_id) AS api_key_id, "
            "any(tool) AS tool, any(risk_class) AS risk_class, any(arguments_sha256) AS arguments_sha256, "
            "any(policy_version) AS policy_version, minIf(ts, event = 'requested') AS requested, "
            "max(expires_ts) AS expires, countIf(event = 'requested') AS asked, "
            "countIf(event IN ('approved', 'rejected')) AS decided "
            "FROM approval_events FINAL WHERE expires_ts > {now:DateTime64(6, 'UTC')}" + where +
            " GROUP BY tenant_id, approval_id) WHERE asked > 0 AND decided = 0 "
            f"ORDER BY expires, approval_id LIMIT {limit}", params, settings={})
        for r in rows:
            r["waiting_s"] = max(0.0, (_utc(now) - r["requested_ts"]).total_seconds())
        return rows

    def run_stops(self, span: TimeRange, tenants: Sequence[str] | None = None,
                  limit: int = 100) -> list[dict[str, Any]]:
        """Runs stopped as loops in ``span``, newest first: ``tenant_id``, ``agent_run_id``,
        ``api_key_id``, ``tier``, ``reason``, ``detail``, ``tool``, ``ts``."""
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_RUNS:
            raise ValueError(f"limit must be an integer in 1..{MAX_RUNS}")
        where, params = self._base_params(span, tenants)
        return self._rows(
            "SELECT tenant_id, agent_run_id, api_key_id, tier, reason, detail, tool, ts FROM agent_run_stops FINAL "
            "WHERE ts >= " + _START + " AND ts < " + _END + where + f" ORDER BY ts DESC LIMIT {limit}", params)

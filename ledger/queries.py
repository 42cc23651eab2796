"""Read functions over the ledger — one set, used directly on ClickHouse and behind the read API.

Every query reads deduplicated data (``FINAL``), takes its values as bound parameters
(``{name:Type}`` server-side binding: user text is never spliced into SQL) and its identifiers
(group-by columns) only from a fixed allow-list.

:class:`UsageReader` is the protocol both :class:`LedgerQueries` (ClickHouse) and
:class:`~kvmeter.ledger.http_client.LedgerHttpClient` (the serve process's read API) implement,
so the billing CLI and the dashboards do not care which one they hold.

Why this module is longer than ~600 lines: :class:`LedgerQueries` is the one read surface that
billing, reconciliation, the read API and the dashboards share. Its reads share the bill
classification (:func:`classified_usage_sql`), the period parameters and the allow-listed
group-by columns; most of its length is SQL text, one statement per read.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Callable, Protocol, Sequence

from clickhouse_connect.driver.client import Client

from kvmeter.billing_calendar import whole_hour_offsets
from kvmeter.tokens import TokenCounts

from .connection import ClientHolder, QueryRunner
from .period import Period
from .prices import PriceList
from .records import USAGE_COLUMNS

#: The usage totals every per-group usage query selects, in this order (``usage_hourly``'s columns
#: after its keys rely on it): requests by outcome and engine-true tokens by type. One definition,
#: so billing, the hourly rollup and the dashboards count a request and its tokens the same way.
USAGE_TOTALS_SQL = """count() AS requests,
    countIf(outcome = 'aborted') AS aborted_requests,
    countIf(outcome = 'error') AS error_requests,
    sum(input_tokens) AS input_tokens,
    sum(cached_input_tokens) AS cached_input_tokens,
    sum(output_tokens) AS output_tokens"""

#: :data:`USAGE_TOTALS_SQL` plus the other billable quantities (reasoning tokens, KV token-seconds).
BILLABLE_TOTALS_SQL = USAGE_TOTALS_SQL + """,
    sum(reasoning_tokens) AS reasoning_tokens,
    sum(kv_token_seconds) AS kv_token_seconds"""

#: The attempt totals of an invoice line: every HTTP attempt, and those refused, replayed or invalid.
ATTEMPT_TOTALS_SQL = """count() AS attempts,
    countIf(status = 'rejected') AS rejected_attempts,
    countIf(status = 'replayed') AS replayed_attempts,
    countIf(status IN ('invalid', 'error')) AS invalid_attempts"""

__all__ = ["UsageReader", "LedgerQueries", "GROUP_BY_FIELDS", "INVOICE_KEYS", "RECONCILE_SLACK_S", "BILL_CLASSES",
           "BILLED_CLASSES", "BILLED_SQL", "classified_usage_sql"]

#: The bill class of a usage row (one row per attempt, migration 0006), decided per logical
#: request (``tenant_id``, ``event_id``) over all its rows (docs/ARCHITECTURE.md, "Metering rules"):
#:
#: * ``usage`` — the logical request's bill: its successful attempt (the first ``ok`` row by
#:   finish time), or a row that names no undelivered cause (written before schema 3, or by a
#:   caller that gives none: billed as it always was);
#: * ``undelivered_billed`` / ``undelivered_absorbed`` — an attempt that did not complete, of a
#:   logical request with no successful attempt: billed or absorbed as its tier decided for its
#:   cause (``undelivered_billing``); of a logical request with a successful attempt: absorbed
#:   (the bill is the successful attempt's, so a retry can never add to or erase it);
#: * ``superseded`` — a second successful attempt of a logical request (the same key and body run
#:   again after the idempotency store forgot it): delivered, not billed again.
BILL_CLASSES = ("usage", "undelivered_billed", "undelivered_absorbed", "superseded")
#: The classes that are billed to the tenant.
BILLED_CLASSES = ("usage", "undelivered_billed")
#: The SQL condition, over a row of :func:`classified_usage_sql`, that it is billed (its class is
#: one of :data:`BILLED_CLASSES`): what every read of money or billed tokens filters on.
BILLED_SQL = "bill_class IN (" + ", ".join(f"'{c}'" for c in BILLED_CLASSES) + ")"

#: The columns of a classified usage row (:func:`classified_usage_sql`), besides ``bill_class``:
#: every column a usage row is written with.
_CLASSIFIED_COLUMNS = USAGE_COLUMNS


def classified_usage_sql(where: str) -> str:
    """A subquery of the usage rows of ``usage_events FINAL`` that match ``where`` (SQL over the
    table's columns, bound parameters allowed), each with its ``bill_class`` (:data:`BILL_CLASSES`).

    The one statement of which attempt bills a logical request: a row's class depends on every row
    of its logical request, in or out of ``where`` (a success recorded in another period still
    decides it).

    The logical request's rows are found by ``event_id``, then the tenant is matched inside the
    group: the successful attempts of one ``event_id`` are gathered as an array of
    ``(finish_ts, request_id, tenant_id)`` and a row takes the first of its own tenant. Only ids
    with more than one row are joined (most logical requests are one attempt, and a lone row's
    class is its own: ``usage`` if ``ok``, else its cause's). Joining, grouping and pre-filtering
    on the one UUID column instead of the ``(tenant_id, event_id)`` pair, and joining only the
    retried ids, made the hourly rollup's recompute about 3× faster over 1 M rows (it runs on
    every writer round: bench/ledger/RESULTS.md, "Drain after migration 0006"), and two tenants
    whose rows carry the same ``event_id`` (ids a caller chose, not :func:`kvmeter.events.event_id_for`'s)
    still never decide each other's bill.
    """
    cols = ", ".join(f"u.{c} AS {c}" for c in _CLASSIFIED_COLUMNS)
    names = ", ".join(_CLASSIFIED_COLUMNS)
    return f"""(
        SELECT {names},
            multiIf(ok_request = '' AND outcome = 'ok', 'usage',
                    ok_request = '', if(undelivered_cause = '', 'usage',
                                        if(undelivered_billing = 'billed', 'undelivered_billed',
                                           'undelivered_absorbed')),
                    request_id = ok_request, 'usage',
                    outcome = 'ok', 'superseded',
                    'undelivered_absorbed') AS bill_class
        FROM (
            SELECT {cols},
                tupleElement(arrayFirst(x -> tupleElement(x, 3) = u.tenant_id, arraySort(b.oks)), 2) AS ok_request
            FROM (SELECT * FROM usage_events FINAL WHERE {where}) AS u
            LEFT JOIN (
                SELECT event_id, groupArrayIf((finish_ts, request_id, tenant_id), outcome = 'ok') AS oks
                FROM usage_events FINAL
                WHERE event_id IN (SELECT event_id FROM usage_events WHERE {where})
                GROUP BY event_id
                HAVING count() > 1
            ) AS b ON u.event_id = b.event_id
        )
    )"""


#: Allowed ``group_by`` names → SQL expression over usage_events.
GROUP_BY_FIELDS: dict[str, str] = {
    "tenant_id": "tenant_id", "workspace_id": "workspace_id", "project_id": "project_id",
    "api_key_id": "api_key_id", "model": "model", "tier": "tier", "endpoint": "endpoint", "outcome": "outcome",
    "agent_run_id": "agent_run_id", "hour": "toStartOfHour(finish_ts, {tz:String})",
    "day": "toStartOfDay(finish_ts, {tz:String})",
}
#: The attribution of one invoice line.
INVOICE_KEYS = ("tenant_id", "workspace_id", "project_id", "api_key_id", "model", "tier")
#: Engine and gateway records this close outside the period are read too, so a request that
#: finished at 23:59:59.9 is matched with its engine record stamped 00:00:00.1.
RECONCILE_SLACK_S = 600

_PERIOD = "{start:DateTime64(6, 'UTC')}"
_PERIOD_END = "{end:DateTime64(6, 'UTC')}"


class UsageReader(Protocol):
    """What billing, reconciliation and the dashboards read (see :class:`LedgerQueries`)."""

    def usage_summary(self, period: Period, tenant_id: str | None = None,
                      group_by: Sequence[str] = ("tenant_id",)) -> list[dict[str, Any]]: ...

    def invoice_usage(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]: ...

    def invoice_attempts(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]: ...

    def adjustments(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]: ...

    def reconcile_views(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]: ...

    def usage_timeseries(self, period: Period, tenant_id: str | None = None,
                         step: str = "hour") -> list[dict[str, Any]]: ...


def _tenant_clause(tenant_id: str | None, column: str = "tenant_id") -> str:
    return f" AND {column} = {{tenant:String}}" if tenant_id is not None else ""


def _params(period: Period, tenant_id: str | None, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"start": period.start, "end": period.end, "tz": period.timezone, **extra}
    if tenant_id is not None:
        if not isinstance(tenant_id, str) or not tenant_id:
            raise ValueError("tenant_id must be a non-empty string or None")
        params["tenant"] = tenant_id
    return params


def _nan_to_none(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


class LedgerQueries:
    """Parameterised read queries on the ledger's ClickHouse database.

    Args:
        client: a :class:`ClientHolder` or a zero-argument function returning a connected client
            whose database is the ledger's (schema migrated).
        prices: the price list used for :meth:`usage_summary`'s cost column.
    Raises (every method):
        LedgerUnavailable: ClickHouse cannot be reached.
        LedgerError: ClickHouse refused the query.
        ValueError: a bad argument (unknown group-by field or step, empty tenant id).
    """

    def __init__(self, client: ClientHolder | Callable[[], Client], prices: PriceList) -> None:
        self._runner = QueryRunner(client)
        self._get = self._runner.get_client
        self._query = self._runner.rows
        self.prices = prices

    # ------------------------------------------------------------------ usage

    def usage_summary(self, period: Period, tenant_id: str | None = None,
                      group_by: Sequence[str] = ("tenant_id",)) -> list[dict[str, Any]]:
        """Billed usage per group in a period: the rows of classes :data:`BILLED_CLASSES` (a
        logical request's successful attempt, or its undelivered work its tier bills).

        Args:
            period: the half-open UTC interval (events by ``finish_ts``); ``hour`` and ``day``
                groups are local hours and days of its zone (``Period.timezone``, ClickHouse's
                ``toStartOfDay(ts, zone)``), returned as aware UTC datetimes of their first instant.
            tenant_id: restrict to one tenant, or ``None`` for all.
            group_by: names from :data:`GROUP_BY_FIELDS` (at least one).
        Returns:
            One dict per group, ordered by the group keys: the group keys, then ``requests``,
            ``aborted_requests``, ``error_requests``, ``input_tokens``, ``cached_input_tokens``
            (⊆ input), ``output_tokens``, ``reasoning_tokens`` (⊆ output),
            ``kv_token_seconds`` (float), ``ttft_p50_s``, ``ttft_p95_s``, ``itl_p50_s``,
            ``itl_p95_s`` (exact percentiles with linear interpolation, over requests that have
            the value; ITL is each request's mean ITL; ``None`` when no request has it),
            ``attempts`` (gateway attempts of the group, when every group key exists on attempts,
            else ``None``), ``cost`` (exact unrounded Decimal at the price list; ``None`` if any
            model in the group is unpriced), ``currency``.
        """
        group = list(dict.fromkeys(group_by))
        if not group:
            raise ValueError("group_by needs at least one field")
        unknown = [g for g in group if g not in GROUP_BY_FIELDS]
        if unknown:
            raise ValueError(f"unknown group_by field(s) {unknown}; allowed: {sorted(GROUP_BY_FIELDS)}")
        select_keys = ", ".join(f"{GROUP_BY_FIELDS[g]} AS {g}" for g in group)
        group_sql = ", ".join(group)
        params = _params(period, tenant_id)
        usage = classified_usage_sql(f"finish_ts >= {_PERIOD} AND finish_ts < {_PERIOD_END}{_tenant_clause(tenant_id)}")
        where = BILLED_SQL
        # The cost's token counts come from the same statement as the totals, per (model, tier)
        # (sumMap over tuple keys): two statements could see different drained rows, and a summary
        # read mid-drain showed 16 requests' tokens beside 17 requests' cost.
        # (sumMap leaves out keys whose sum is 0, so ``rows`` — never 0 — names every model and tier)
        kinds = ("rows", "input_tokens", "cached_input_tokens", "output_tokens", "reasoning_tokens")
        by_price = ",\n                ".join(
            f"sumMap([(c.model, c.tier)], [toUInt64({'1' if k == 'rows' else 'c.' + k})]) AS _priced_{k}"
            for k in kinds)
        metrics = self._query(f"""
            SELECT {select_keys},
                {BILLABLE_TOTALS_SQL},
                {by_price},
                if(count(ttft_s) = 0, nan, quantileExactInclusive(0.5)(ttft_s)) AS ttft_p50_s,
                if(count(ttft_s) = 0, nan, quantileExactInclusive(0.95)(ttft_s)) AS ttft_p95_s,
                if(count(itl_mean_s) = 0, nan, quantileExactInclusive(0.5)(itl_mean_s)) AS itl_p50_s,
                if(count(itl_mean_s) = 0, nan, quantileExactInclusive(0.95)(itl_mean_s)) AS itl_p95_s
            FROM {usage} AS c
            WHERE {where}
            GROUP BY {group_sql}
            ORDER BY {group_sql}""", params)
        attempts: dict[tuple, int] | None = None
        if all(g in _ATTEMPT_GROUPS for g in group):
            attempt_keys = ", ".join(f"{_ATTEMPT_GROUPS[g]} AS {g}" for g in group)
            rows = self._query(f"""
                SELECT {attempt_keys}, count() AS attempts FROM attempts FINAL
                WHERE ts >= {_PERIOD} AND ts < {_PERIOD_END}{_tenant_clause(tenant_id)}
                GROUP BY {group_sql}""", params)
            attempts = {tuple(r[g] for g in group): int(r["attempts"]) for r in rows}
        out = []
        for row in metrics:
            key = tuple(row[g] for g in group)  # before the hour/day conversion: attempts' keys are raw
            cost = self._priced_cost(row, kinds)
            for g in ("hour", "day"):
                if g in row:
                    row[g] = _utc(row[g])
            for name in ("ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s"):
                row[name] = _nan_to_none(row[name])
            row["attempts"] = attempts.get(key, 0) if attempts is not None else None
            row["cost"] = cost
            row["currency"] = self.prices.currency
            out.append(row)
        return out

    def _priced_cost(self, row: dict[str, Any], kinds: Sequence[str]) -> Decimal | None:
        """The cost of one summary row from its ``_priced_<kind>`` sumMap columns (removed from
        ``row``): the sum over its (model, tier) pairs of the price list's cost, exact Decimal;
        ``None`` when any of its models is unpriced."""
        per_price: dict[tuple[str, str], dict[str, int]] = {}
        for k in kinds:
            price_keys, values = row.pop(f"_priced_{k}")
            for (model, tier), value in zip(price_keys, values, strict=True):
                per_price.setdefault((model, tier), {})[k] = int(value)
        total: Decimal | None = Decimal(0)
        for (model, tier), counts in per_price.items():
            line = self.prices.cost_if_priced(model, tier, TokenCounts.from_row(counts))
            total = None if (line is None or total is None) else total + line
        return total

    def invoice_usage(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """Usage per invoice line key (:data:`INVOICE_KEYS`), line type and undelivered cause in
        a period.

        Returns:
            One dict per line: the keys, ``line_type`` (``usage``, ``undelivered_billed`` or
            ``undelivered_absorbed``: the bill class of its rows, :data:`BILL_CLASSES`; superseded
            successes are not invoiced), ``undelivered_cause`` (``""`` on usage lines),
            ``requests`` (usage rows: logical requests on a usage line, attempts on an undelivered
            one), ``aborted_requests``, ``error_requests``, ``input_tokens``,
            ``cached_input_tokens``, ``output_tokens``, ``reasoning_tokens`` (ints) and
            ``kv_token_seconds`` (float). Deduplicated (FINAL).
        """
        keys = ", ".join(INVOICE_KEYS)
        usage = classified_usage_sql(f"finish_ts >= {_PERIOD} AND finish_ts < {_PERIOD_END}{_tenant_clause(tenant_id)}")
        return self._query(f"""
            SELECT {keys}, bill_class AS line_type, undelivered_cause,
                {BILLABLE_TOTALS_SQL}
            FROM {usage}
            WHERE bill_class != 'superseded'
            GROUP BY {keys}, line_type, undelivered_cause
            ORDER BY {keys}, line_type, undelivered_cause""", _params(period, tenant_id))

    def invoice_attempts(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """HTTP attempts per invoice line key in a period (by attempt ``ts``).

        Returns:
            One dict per line key: the keys, ``attempts``, ``rejected_attempts`` (quota or
            scheduler refusals), ``replayed_attempts`` (idempotent replays), ``invalid_attempts``
            (refused before admission as invalid requests, or failed before any engine work:
            statuses ``invalid`` and ``error``) (ints). The rest of ``attempts`` were admitted.
        """
        return self._per_line_key(ATTEMPT_TOTALS_SQL, "attempts", "ts", period, tenant_id)

    def _per_line_key(self, totals_sql: str, table: str, ts_column: str, period: Period,
                      tenant_id: str | None) -> list[dict[str, Any]]:
        """``totals_sql`` over ``table FINAL`` per invoice line key, rows of the period by
        ``ts_column``, ordered by the keys."""
        keys = ", ".join(INVOICE_KEYS)
        return self._query(f"""
            SELECT {keys},
                {totals_sql}
            FROM {table} FINAL
            WHERE {ts_column} >= {_PERIOD} AND {ts_column} < {_PERIOD_END}{_tenant_clause(tenant_id)}
            GROUP BY {keys}
            ORDER BY {keys}""", _params(period, tenant_id))

    def adjustments(self, period: Period, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """Signed adjustments effective in the period.

        Returns:
            One dict per adjustment: ``adjustment_id`` (str), ``tenant_id``,
            ``workspace_id``, ``project_id``, ``api_key_id``, ``ts`` (UTC datetime),
            ``amount`` (exact Decimal), ``currency``, ``reason``, ``reference``, ``created_by``.
        """
        rows = self._query(f"""
            SELECT toString(adjustment_id) AS adjustment_id, tenant_id, workspace_id, project_id,
                   api_key_id, ts, amount, currency, reason, reference, created_by
            FROM adjustments FINAL
            WHERE ts >= {_PERIOD} AND ts < {_PERIOD_END}{_tenant_clause(tenant_id)}
            ORDER BY tenant_id, ts, adjustment_id""", _params(period, tenant_id))
        for row in rows:
            row["amount"] = Decimal(row["amount"]).normalize() if row["amount"] is not None else Decimal(0)
            row["ts"] = _utc(row["ts"])
        return rows

    def usage_timeseries(self, period: Period, tenant_id: str | None = None,
                         step: str = "hour") -> list[dict[str, Any]]:
        """Per-tenant billed usage per local hour or day of the period's zone (``Period.timezone``):
        the rows of classes :data:`BILLED_CLASSES`, as :meth:`usage_summary` counts them, so a
        logical request retried after an aborted attempt, or run twice (superseded), counts once.

        Read from the hourly rollups (FINAL; billed rows only, :mod:`kvmeter.ledger.rollups`) when
        the zone's offsets in the period are whole hours (a local hour or day is then a union of
        UTC hours); otherwise (``Asia/Kathmandu``, +05:45) from ``usage_events`` FINAL through
        :func:`classified_usage_sql`. Buckets are ClickHouse's ``toStartOfHour/Day(ts, zone)``; a
        local day is 23, 24 or 25 hours long.

        Returns:
            Dicts with ``ts`` (bucket start, aware UTC datetime), ``tenant_id``, ``requests``
            (billed rows: logical requests, plus attempts billed as undelivered work),
            ``aborted_requests``, ``input_tokens``, ``cached_input_tokens``, ``output_tokens``
            (ints), ``kv_token_seconds`` (float).
        """
        if step not in ("hour", "day"):
            raise ValueError(f"step must be 'hour' or 'day', got {step!r}")
        fn = "toStartOfHour" if step == "hour" else "toStartOfDay"
        if whole_hour_offsets(period.start, period.end, period.timezone):
            column = "hour"
            source = "usage_hourly FINAL"
            where = f"hour >= {_PERIOD} AND hour < {_PERIOD_END}{_tenant_clause(tenant_id)}"
            totals = """sum(requests) AS requests, sum(aborted_requests) AS aborted_requests,
                sum(input_tokens) AS input_tokens, sum(cached_input_tokens) AS cached_input_tokens,
                sum(output_tokens) AS output_tokens, sum(kv_token_seconds) AS kv_token_seconds"""
        else:
            column = "finish_ts"
            source = classified_usage_sql(f"finish_ts >= {_PERIOD} AND finish_ts < {_PERIOD_END}"
                                          f"{_tenant_clause(tenant_id)}")
            where = BILLED_SQL
            totals = """count() AS requests, countIf(outcome = 'aborted') AS aborted_requests,
                sum(input_tokens) AS input_tokens, sum(cached_input_tokens) AS cached_input_tokens,
                sum(output_tokens) AS output_tokens, sum(kv_token_seconds) AS kv_token_seconds"""
        rows = self._query(f"""
            SELECT toTimeZone({fn}({column}, {{tz:String}}), 'UTC') AS ts, tenant_id,
                {totals}
            FROM {source}
            WHERE {where}
            GROUP BY ts, tenant_id
            ORDER BY ts, tenant_id""", _params(period, tenant_id))
        for row in rows:
            row["ts"] = _utc(row["ts"])
        return rows

    # ------------------------------------------------------------------ reconciliation

    def reconcile_views(self, period: Period, tenant_id: str | None = None, *,
                        detailed: bool = False) -> list[dict[str, Any]]:
        """The three views — engine (engine_requests), gateway (attempts), ledger (usage_events
        FINAL) — compared per tenant.

        Two passes. The fast pass scans each table once and compares, per tenant, the ledger's
        engine-counted requests with the engine's records and the admitted attempts with the
        ledger's requests, as sets: same count and same checksum (a wrapping sum of
        ``cityHash64(request_id, prompt, output)``, so any missing, extra or changed request
        shows). A tenant whose sets agree needs nothing more. Only the other tenants go through
        the per-request pass, which joins the three views on ``request_key`` and classifies each
        request. ``detailed=True`` sends every tenant through it.

        In the per-request pass a request belongs to the period by its ledger ``finish_ts``, else
        its engine ``wall_ts``, else its attempt ``ts``; records up to :data:`RECONCILE_SLACK_S`
        outside the period are read so boundary requests match. Engine records are attributed
        to a tenant by the ledger when it stores them (from the request's admitted attempt);
        records it could not attribute come back under ``tenant_id == ""``.

        Returns:
            One dict per tenant with ints (see :func:`kvmeter.ledger.reconcile.reconcile` for
            the meaning of each): ``ledger_requests``, ``ledger_rows``, ``ledger_input_tokens``,
            ``ledger_output_tokens``, ``reserved_tokens``, ``actual_tokens``,
            ``engine_requests``, ``engine_input_tokens``, ``engine_output_tokens``,
            ``gateway_admitted``, ``matched_requests``, ``mismatched_requests``,
            ``matched_token_drift``, ``aborted_requests``, ``aborted_tokens``,
            ``frontend_only_requests``, ``frontend_only_tokens``, ``ledger_only_requests``,
            ``ledger_only_tokens``, ``engine_unbilled_requests``, ``engine_unbilled_tokens``,
            ``superseded_requests``, ``superseded_tokens``, ``duplicate_billed_requests``,
            ``duplicate_billed_tokens``, ``missing_finishes``, ``missing_finish_reserved_tokens``,
            ``stored_rows`` (ledger rows before deduplication), and the gateway's ``attempts``,
            ``rejected_attempts``, ``replayed_attempts``; the engine tokens of the period's engine
            records by the bill class of their attempt's usage row (:data:`BILL_CLASSES`):
            ``delivered_engine_tokens`` (class ``usage``), ``undelivered_billed_engine_tokens``,
            ``undelivered_absorbed_engine_tokens``, ``superseded_engine_tokens``; plus ``checked``
            = ``sets`` or ``per_request`` (which pass produced the row).
        """
        params = _params(period, tenant_id)
        t_filter = _tenant_clause(tenant_id)
        ledger = {r["tenant_id"]: r for r in self._query(f"""
            SELECT tenant_id,
                count() AS ledger_requests,
                sum(input_tokens) AS ledger_input_tokens,
                sum(output_tokens) AS ledger_output_tokens,
                sum(toUInt64(reserved_input_tokens) + reserved_output_tokens) AS reserved_tokens,
                sum(toUInt64(input_tokens) + output_tokens) AS actual_tokens,
                countIf(outcome = 'aborted') AS aborted_requests,
                sumIf(toUInt64(input_tokens) + output_tokens, outcome = 'aborted') AS aborted_tokens,
                countIf(outcome != 'aborted' AND token_source != 'engine_hooks') AS frontend_only_requests,
                sumIf(toUInt64(input_tokens) + output_tokens,
                      outcome != 'aborted' AND token_source != 'engine_hooks') AS frontend_only_tokens,
                countIf(outcome != 'aborted' AND token_source = 'engine_hooks') AS hooks_requests,
                sumWithOverflowIf(cityHash64(request_id, input_tokens, output_tokens),
                                  outcome != 'aborted' AND token_source = 'engine_hooks') AS hooks_sum,
                sumWithOverflow(request_key) AS request_sum
            FROM usage_events FINAL
            WHERE finish_ts >= {_PERIOD} AND finish_ts < {_PERIOD_END}{t_filter}
            GROUP BY tenant_id""", params)}
        engine = {r["tenant_id"]: r for r in self._query(f"""
            SELECT tenant_id, count() AS engine_requests, sum(input_tokens) AS engine_input_tokens,
                sum(output_tokens) AS engine_output_tokens,
                sumWithOverflow(cityHash64(request_id, input_tokens, output_tokens)) AS engine_sum
            FROM engine_requests FINAL
            WHERE wall_ts >= {_PERIOD} AND wall_ts < {_PERIOD_END}{t_filter}
            GROUP BY tenant_id""", params)}
        gateway = {r["tenant_id"]: r for r in self._query(f"""
            SELECT tenant_id, count() AS attempts, countIf(status = 'rejected') AS rejected_attempts,
                countIf(status = 'replayed') AS replayed_attempts, countIf(status = 'admitted') AS gateway_admitted,
                sumWithOverflowIf(request_key, status = 'admitted') AS admitted_sum
            FROM attempts FINAL
            WHERE ts >= {_PERIOD} AND ts < {_PERIOD_END}{t_filter}
            GROUP BY tenant_id""", params)}
        stored = {r["tenant_id"]: int(r["stored_rows"]) for r in self._query(f"""
            SELECT tenant_id, count() AS stored_rows FROM usage_events
            WHERE finish_ts >= {_PERIOD} AND finish_ts < {_PERIOD_END}{t_filter}
            GROUP BY tenant_id""", params)}

        tenants = sorted(set(ledger) | set(engine) | set(gateway))
        consistent: dict[str, dict[str, Any]] = {}
        for tenant in tenants:
            led, e, g = ledger.get(tenant), engine.get(tenant), gateway.get(tenant)
            if detailed or tenant == "" or led is None:
                continue
            e_count, e_sum = (int(e["engine_requests"]), int(e["engine_sum"])) if e else (0, 0)
            g_count, g_sum = (int(g["gateway_admitted"]), int(g["admitted_sum"])) if g else (0, 0)
            if (int(led["hooks_requests"]), int(led["hooks_sum"])) == (e_count, e_sum) and \
                    (int(led["ledger_requests"]), int(led["request_sum"])) == (g_count, g_sum):
                row = _empty_view(tenant)
                row.update({k: int(led[k]) for k in ("ledger_requests", "ledger_input_tokens",
                                                     "ledger_output_tokens", "reserved_tokens", "actual_tokens",
                                                     "aborted_requests", "aborted_tokens", "frontend_only_requests",
                                                     "frontend_only_tokens")})
                row["ledger_rows"] = row["ledger_requests"]
                row["matched_requests"] = e_count
                if e:
                    row.update({k: int(e[k]) for k in ("engine_requests", "engine_input_tokens",
                                                       "engine_output_tokens")})
                row["gateway_admitted"] = g_count
                row["checked"] = "sets"
                consistent[tenant] = row
        rest = [t for t in tenants if t not in consistent]
        detail = {r["tenant_id"]: r for r in self._per_request(period, rest)} if rest else {}
        out = []
        for tenant in sorted(set(consistent) | set(detail) | set(gateway) | set(stored)):
            row = consistent.get(tenant) or detail.get(tenant) or {**_empty_view(tenant), "checked": "per_request"}
            g = gateway.get(tenant)
            for f in ("attempts", "rejected_attempts", "replayed_attempts"):
                row[f] = int(g[f]) if g else 0
            row["stored_rows"] = stored.get(tenant, 0)
            out.append({k: (int(v) if isinstance(v, (int, bool)) else v) for k, v in row.items()})
        by_class = self._engine_tokens_by_class(period, tenant_id)
        for row in out:
            for cls, column in _ENGINE_CLASS_COLUMNS.items():
                row[column] = by_class.get((row["tenant_id"], cls), 0)
        return out

    def _engine_tokens_by_class(self, period: Period, tenant_id: str | None) -> dict[tuple[str, str], int]:
        """(tenant, bill class) → input + output tokens of the period's engine records (by
        ``wall_ts``), each under the class of its attempt's usage row (rows up to
        :data:`RECONCILE_SLACK_S` outside the period are read so boundary requests match); an
        engine record with no usage row is not counted here (reconciliation reports it as
        engine-unbilled or superseded)."""
        slack = timedelta(seconds=RECONCILE_SLACK_S)
        params = _params(period, tenant_id, wstart=period.start - slack, wend=period.end + slack)
        window = ("finish_ts >= {wstart:DateTime64(6, 'UTC')} AND finish_ts < {wend:DateTime64(6, 'UTC')}"
                  + _tenant_clause(tenant_id))
        rows = self._query(f"""
            SELECT l.tenant_id AS tenant_id, l.bill_class AS bill_class,
                sum(toUInt64(e.input_tokens) + e.output_tokens) AS tokens
            FROM (
                SELECT request_id, input_tokens, output_tokens FROM engine_requests FINAL
                WHERE wall_ts >= {_PERIOD} AND wall_ts < {_PERIOD_END}{_tenant_clause(tenant_id)}
            ) AS e
            INNER JOIN (
                SELECT request_id, any(tenant_id) AS tenant_id, any(bill_class) AS bill_class
                FROM {classified_usage_sql(window)}
                GROUP BY request_id
            ) AS l ON e.request_id = l.request_id
            GROUP BY tenant_id, bill_class""", params)
        return {(r["tenant_id"], r["bill_class"]): int(r["tokens"]) for r in rows}

    def _per_request(self, period: Period, tenants: list[str]) -> list[dict[str, Any]]:
        """The per-request pass of :meth:`reconcile_views` for ``tenants`` ("" = engine records
        the ledger could not attribute)."""
        slack = timedelta(seconds=RECONCILE_SLACK_S)
        params = _params(period, None, wstart=period.start - slack, wend=period.end + slack, tenants=tenants)
        w_start, w_end = "{wstart:DateTime64(6, 'UTC')}", "{wend:DateTime64(6, 'UTC')}"
        in_set = " AND tenant_id IN {tenants:Array(String)}"
        rows = self._query(f"""
            SELECT
                tenant AS tenant_id,
                countIf(l_rows > 0) AS ledger_requests,
                sum(l_rows) AS ledger_rows,
                sum(l_input) AS ledger_input_tokens,
                sum(l_output) AS ledger_output_tokens,
                sumIf(l_reserved, l_rows > 0) AS reserved_tokens,
                sumIf(l_input + l_output, l_rows > 0) AS actual_tokens,
                countIf(in_engine) AS engine_requests,
                sumIf(e_input, in_engine) AS engine_input_tokens,
                sumIf(e_output, in_engine) AS engine_output_tokens,
                countIf(in_gateway) AS gateway_admitted,
                countIf(l_rows = 1 AND in_engine) AS matched_requests,
                countIf(l_rows = 1 AND in_engine AND (l_input != e_input OR l_output != e_output))
                    AS mismatched_requests,
                sumIf(abs(toInt64(l_input) - e_input) + abs(toInt64(l_output) - e_output), l_rows = 1 AND in_engine)
                    AS matched_token_drift,
                countIf(l_rows > 0 AND NOT in_engine AND l_aborted) AS aborted_requests,
                sumIf(l_input + l_output, l_rows > 0 AND NOT in_engine AND l_aborted) AS aborted_tokens,
                countIf(l_rows > 0 AND NOT in_engine AND NOT l_aborted AND NOT l_hooks) AS frontend_only_requests,
                sumIf(l_input + l_output, l_rows > 0 AND NOT in_engine AND NOT l_aborted AND NOT l_hooks)
                    AS frontend_only_tokens,
                countIf(l_rows > 0 AND NOT in_engine AND NOT l_aborted AND l_hooks) AS ledger_only_requests,
                sumIf(l_input + l_output, l_rows > 0 AND NOT in_engine AND NOT l_aborted AND l_hooks)
                    AS ledger_only_tokens,
                countIf(l_rows = 0 AND in_engine AND NOT superseded) AS engine_unbilled_requests,
                sumIf(e_input + e_output, l_rows = 0 AND in_engine AND NOT superseded) AS engine_unbilled_tokens,
                countIf(l_rows = 0 AND in_engine AND superseded) AS superseded_requests,
                sumIf(e_input + e_output, l_rows = 0 AND in_engine AND superseded) AS superseded_tokens,
                countIf(l_rows > 1) AS duplicate_billed_requests,
                sumIf(l_input + l_output - intDivOrZero(l_input + l_output, l_rows), l_rows > 1)
                    AS duplicate_billed_tokens,
                countIf(in_gateway AND l_rows = 0 AND NOT in_engine AND NOT superseded) AS missing_finishes,
                sumIf(a_reserved, in_gateway AND l_rows = 0 AND NOT in_engine AND NOT superseded)
                    AS missing_finish_reserved_tokens
            FROM (
                SELECT
                    request_key,
                    argMax(tenant_id, tenant_id != '') AS tenant,
                    countIf(src = 1) AS l_rows,
                    countIf(src = 2) > 0 AS in_engine,
                    countIf(src = 3 AND flag) > 0 AS in_gateway,
                    sumIf(p, src = 1) AS l_input,
                    sumIf(c, src = 1) AS l_output,
                    sumIf(r, src = 1) AS l_reserved,
                    maxIf(r, src = 3 AND flag) AS a_reserved,
                    maxIf(p, src = 2) AS e_input,
                    maxIf(c, src = 2) AS e_output,
                    maxIf(flag, src = 1) AS l_aborted,
                    minIf(hooks, src = 1) AS l_hooks,
                    maxIf(retried, src = 3) AS superseded,
                    if(l_rows > 0, minIf(ts, src = 1), if(in_engine, minIf(ts, src = 2), min(ts))) AS anchor
                FROM (
                    SELECT 1 AS src, request_key, tenant_id, input_tokens AS p, output_tokens AS c,
                           toUInt64(reserved_input_tokens) + reserved_output_tokens AS r,
                           outcome = 'aborted' AS flag, token_source = 'engine_hooks' AS hooks,
                           0 AS retried, finish_ts AS ts
                    FROM usage_events FINAL
                    WHERE finish_ts >= {w_start} AND finish_ts < {w_end}{in_set}
                    UNION ALL
                    SELECT 2, request_key, tenant_id, input_tokens, output_tokens, 0, 0, 0, 0, wall_ts
                    FROM engine_requests
                    WHERE wall_ts >= {w_start} AND wall_ts < {w_end}{in_set}
                    UNION ALL
                    SELECT 3, request_key, tenant_id, 0, 0,
                           toUInt64(reserved_input_tokens) + reserved_output_tokens, status = 'admitted', 0,
                           event_key IN (SELECT event_key FROM usage_events
                                         WHERE finish_ts >= {w_start} AND finish_ts < {w_end}{in_set}),
                           ts
                    FROM attempts
                    WHERE ts >= {w_start} AND ts < {w_end}{in_set}
                )
                GROUP BY request_key
                HAVING anchor >= {_PERIOD} AND anchor < {_PERIOD_END}
            )
            GROUP BY tenant
            ORDER BY tenant""", params)
        for row in rows:
            row["checked"] = "per_request"
        return rows


#: group-by names that exist on the attempts table (same meaning).
_ATTEMPT_GROUPS: dict[str, str] = {
    "tenant_id": "tenant_id", "workspace_id": "workspace_id", "project_id": "project_id",
    "api_key_id": "api_key_id", "model": "model", "tier": "tier", "endpoint": "endpoint",
    "agent_run_id": "agent_run_id", "hour": "toStartOfHour(ts, {tz:String})", "day": "toStartOfDay(ts, {tz:String})",
}

_VIEW_INT_FIELDS = (
    "ledger_requests", "ledger_rows", "ledger_input_tokens", "ledger_output_tokens", "reserved_tokens",
    "actual_tokens", "engine_requests", "engine_input_tokens", "engine_output_tokens", "gateway_admitted",
    "matched_requests", "mismatched_requests", "matched_token_drift", "aborted_requests", "aborted_tokens",
    "frontend_only_requests", "frontend_only_tokens", "ledger_only_requests", "ledger_only_tokens",
    "engine_unbilled_requests", "engine_unbilled_tokens", "superseded_requests", "superseded_tokens",
    "duplicate_billed_requests", "duplicate_billed_tokens", "missing_finishes", "missing_finish_reserved_tokens",
)


#: Bill class → the reconcile view's column of engine tokens under it.
_ENGINE_CLASS_COLUMNS = {"usage": "delivered_engine_tokens", "undelivered_billed": "undelivered_billed_engine_tokens",
                         "undelivered_absorbed": "undelivered_absorbed_engine_tokens",
                         "superseded": "superseded_engine_tokens"}


def _empty_view(tenant_id: str) -> dict[str, Any]:
    row: dict[str, Any] = {"tenant_id": tenant_id}
    row.update(dict.fromkeys(_VIEW_INT_FIELDS, 0))
    return row


def _utc(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    return value

"""The ledger's reads over a time window cut into buckets — what the dashboards draw.

:class:`~kvmeter.ledger.queries.LedgerQueries` answers billing questions per period; these
answer operational ones per bucket (traffic, latency, goodput, gateway decisions, reservations,
signal history). Both run on :class:`~kvmeter.ledger.connection.QueryRunner`: one query layer,
used directly on ClickHouse (``kvmeter dashboard --ledger-dsn``) and behind the serve process's
dashboard routes (:mod:`kvmeter.dashboards.routes`), so both modes return exactly these rows.

Rules, as for every ledger read: usage and attempts are read deduplicated (``FINAL``); every value
is a bound parameter (``{name:Type}``), label keys included; identifiers come only from fixed
text. Tenant filtering is a parameter here; *who may ask for which tenant* is decided by the
caller (:class:`~kvmeter.dashboards.source.ScopedSource`).

**Attempts, not the bill.** A usage row is one attempt's engine work (migration 0006): a request
aborted and retried has a row per attempt, one run again after a restart forgot its key two ``ok``
rows. These reads are engine load — work done, attempts nobody was billed for included — so they
count every attempt: their ``requests`` are attempts that reached the engine, their tokens the
engine's tokens of those attempts. None of them is money or billed usage; those read only the
billed rows (:data:`~kvmeter.ledger.queries.BILLED_CLASSES`, through
:func:`~kvmeter.ledger.queries.classified_usage_sql`): the invoice, ``usage_summary`` and
``usage_timeseries`` of :class:`~kvmeter.ledger.queries.LedgerQueries`, and an agent run's tokens
and cost (:mod:`kvmeter.ledger.agent_runs`).

Every method returns ``list[dict]`` with JSON-friendly values (ints, floats, strings, UTC-aware
datetimes; ``None`` for missing — never NaN), so the rows travel over HTTP unchanged.
Time buckets are ``toStartOfInterval(ts, step)``: aligned to multiples of the step since the epoch.
Usage events are bucketed by ``finish_ts`` (the ledger's period rule), attempts by ``ts``.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Callable, Protocol, Sequence

from clickhouse_connect.driver.client import Client

from .connection import ClientHolder, QueryRunner
from .queries import USAGE_TOTALS_SQL

__all__ = ["WindowQueries", "Buckets", "TierSlo", "BACKLOG_QUEUE_S", "SIGNAL_AGGS", "MAX_LABEL_KEYS",
           "OUTPUT_USE_BINS"]

#: A tenant counts as *backlogged* in a bucket when one of its requests waited at least this long
#: in the queue there (seconds): the ledger's proxy for the scheduler's "backlogged" set.
BACKLOG_QUEUE_S = 0.05
#: Aggregations of gauge samples inside a bucket.
SIGNAL_AGGS: dict[str, str] = {"avg": "avg(value)", "max": "max(value)", "min": "min(value)",
                               "last": "argMax(value, ts)"}
#: Most label keys a signal read may group by.
MAX_LABEL_KEYS = 4
#: Bins of the output-budget use histogram: output / reserved output tokens, in tenths.
OUTPUT_USE_BINS = 10

#: A tier's latency promises for :meth:`WindowQueries.goodput`: ``(tier, ttft_slo_s, itl_slo_s)``,
#: seconds, ``None`` where the tier makes no such promise.
TierSlo = tuple[str, float | None, float | None]

#: Per-query settings: a column name inside an aggregate means the column, not a same-named
#: alias (``sum(input_tokens) AS input_tokens`` beside ``max(input_tokens)``).
_SETTINGS = {"prefer_column_name_to_alias": 1}
#: Result columns of the signal reads (a label key may not use these names).
_RESERVED_COLUMNS = frozenset({"ts", "value", "samples"})

_START = "{start:DateTime64(6, 'UTC')}"
_END = "{end:DateTime64(6, 'UTC')}"


class Buckets(Protocol):
    """The window a read covers: ``[start, end)`` (timezone-aware UTC datetimes) in buckets of
    ``step_s`` seconds (:class:`kvmeter.dashboards.window.Window` is one)."""

    @property
    def start(self) -> datetime: ...
    @property
    def end(self) -> datetime: ...
    @property
    def step_s(self) -> int: ...


def _bucket(column: str) -> str:
    """The bucket start of ``column``. Queries alias it ``bucket`` (returned as ``ts``): an alias
    named like a column (``ts`` of attempts and signals) would, with
    ``prefer_column_name_to_alias``, make ``GROUP BY ts`` group by the raw timestamp."""
    return f"toStartOfInterval({column}, toIntervalSecond({{step:UInt32}}))"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    return value


def _tenant_filter(tenants: Sequence[str] | None, column: str = "tenant_id") -> str:
    return f" AND {column} IN {{tenants:Array(String)}}" if tenants is not None else ""


def _check_tenants(tenants: Sequence[str] | None) -> list[str] | None:
    if tenants is None:
        return None
    out = list(tenants)
    if any(not isinstance(t, str) or not t for t in out):
        raise ValueError("tenants must be non-empty strings")
    return out


class WindowQueries:
    """Bucketed reads on the ledger's ClickHouse database.

    Args:
        client: a :class:`~kvmeter.ledger.connection.ClientHolder` or a zero-argument function
            returning a connected clickhouse-connect client whose database is the ledger's.
    Raises (every read):
        LedgerUnavailable: ClickHouse cannot be reached.
        LedgerError: ClickHouse refused the query.
        ValueError: a bad argument (unknown aggregation, too many label keys, empty tenant id).
    """

    def __init__(self, client: ClientHolder | Callable[[], Client]) -> None:
        self._runner = QueryRunner(client)

    # ------------------------------------------------------------------ plumbing

    def _query(self, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        rows = self._runner.rows(sql, params, settings=_SETTINGS)
        return [{("ts" if k == "bucket" else k): _clean(v) for k, v in row.items()} for row in rows]  # (see _bucket)

    @staticmethod
    def _params(window: Buckets, tenants: Sequence[str] | None, **extra: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"start": window.start, "end": window.end, "step": window.step_s, **extra}
        checked = _check_tenants(tenants)
        if checked is not None:
            params["tenants"] = checked
        return params

    def _usage_where(self, tenants: Sequence[str] | None) -> str:
        return f"finish_ts >= {_START} AND finish_ts < {_END}{_tenant_filter(tenants)}"

    # ------------------------------------------------------------------ who is there

    def tenants(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Tenants with usage or attempts in the window: ``tenant_id``, ``tier`` (one row per
        pair), sorted."""
        params = self._params(window, tenants)
        return self._query(f"""
            SELECT tenant_id, tier FROM (
                SELECT DISTINCT tenant_id, tier FROM usage_events
                WHERE {self._usage_where(tenants)}
                UNION DISTINCT
                SELECT DISTINCT tenant_id, tier FROM attempts
                WHERE ts >= {_START} AND ts < {_END}{_tenant_filter(tenants)}
            ) ORDER BY tenant_id, tier""", params)

    # ------------------------------------------------------------------ traffic (usage events)

    def traffic(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Whole-platform (or the tenants') traffic per bucket: engine load, every attempt
        (module docstring).

        Returns:
            Per bucket ``ts`` (UTC start): ``requests``, ``ok_requests``, ``aborted_requests``,
            ``error_requests`` (attempts that *finished* in the bucket); ``input_tokens``,
            ``cached_input_tokens`` (⊆ input), ``output_tokens``; ``kv_token_seconds``
            (∫ KV tokens held dt of those requests — ÷ step = mean active KV tokens, exact when
            requests are shorter than a bucket); ``queue_seconds`` (Σ queue wait — ÷ step =
            mean queue depth, Little's law); ``queue_p50_s``, ``queue_p95_s``, ``ttft_p95_s``
            (exact percentiles, ``None`` when no request has the value); ``max_input_tokens``.
        """
        return self._query(f"""
            SELECT {_bucket('finish_ts')} AS bucket,
                {USAGE_TOTALS_SQL},
                countIf(outcome = 'ok') AS ok_requests,
                sum(kv_token_seconds) AS kv_token_seconds,
                sum(ifNull(queue_s, 0)) AS queue_seconds,
                quantileExactInclusive(0.5)(queue_s) AS queue_p50_s,
                quantileExactInclusive(0.95)(queue_s) AS queue_p95_s,
                quantileExactInclusive(0.95)(ttft_s) AS ttft_p95_s,
                max(input_tokens) AS max_input_tokens
            FROM usage_events FINAL
            WHERE {self._usage_where(tenants)}
            GROUP BY bucket ORDER BY bucket""", self._params(window, tenants))

    def traffic_by_tenant(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per bucket and tenant (engine load, every attempt: module docstring): ``ts``,
        ``tenant_id``, ``tier``, ``requests`` (attempts), ``input_tokens``, ``output_tokens``,
        ``kv_token_seconds``, ``queue_seconds`` (as in :meth:`traffic`), and ``backlogged`` (1 if
        an attempt of the tenant waited ≥ :data:`BACKLOG_QUEUE_S` in the queue in that bucket,
        else 0)."""
        return self._query(f"""
            SELECT {_bucket('finish_ts')} AS bucket, tenant_id, any(tier) AS tier,
                count() AS requests,
                sum(input_tokens) AS input_tokens,
                sum(output_tokens) AS output_tokens,
                sum(kv_token_seconds) AS kv_token_seconds,
                sum(ifNull(queue_s, 0)) AS queue_seconds,
                toUInt8(countIf(ifNull(queue_s, 0) >= {{backlog:Float64}}) > 0) AS backlogged
            FROM usage_events FINAL
            WHERE {self._usage_where(tenants)}
            GROUP BY bucket, tenant_id ORDER BY bucket, tenant_id""",
            self._params(window, tenants, backlog=BACKLOG_QUEUE_S))

    def tenant_totals(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per tenant over the window (engine load, every attempt: module docstring):
        ``tenant_id``, ``tier``, ``requests`` (attempts), ``aborted_requests``,
        ``error_requests``, ``input_tokens``, ``cached_input_tokens``, ``output_tokens``,
        ``kv_token_seconds``, ``preemptions``, ``queue_seconds``, ``queued_requests`` (waited ≥
        :data:`BACKLOG_QUEUE_S` in the queue), ``queue_p95_s``, ``ttft_p95_s``,
        ``mean_input_tokens``, ``max_input_tokens``, ``max_output_tokens``."""
        return self._query(f"""
            SELECT tenant_id, any(tier) AS tier,
                {USAGE_TOTALS_SQL},
                sum(kv_token_seconds) AS kv_token_seconds,
                sum(preemptions) AS preemptions,
                sum(ifNull(queue_s, 0)) AS queue_seconds,
                countIf(ifNull(queue_s, 0) >= {{backlog:Float64}}) AS queued_requests,
                quantileExactInclusive(0.95)(queue_s) AS queue_p95_s,
                quantileExactInclusive(0.95)(ttft_s) AS ttft_p95_s,
                avg(input_tokens) AS mean_input_tokens,
                max(input_tokens) AS max_input_tokens,
                max(output_tokens) AS max_output_tokens
            FROM usage_events FINAL
            WHERE {self._usage_where(tenants)}
            GROUP BY tenant_id ORDER BY tenant_id""", self._params(window, tenants, backlog=BACKLOG_QUEUE_S))

    # ------------------------------------------------------------------ latency

    def latency_by_tier(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per tier over the window (exact percentiles over attempts that have the value — every
        attempt, module docstring; ITL is each attempt's mean ITL; ``None`` when none has it).

        Returns:
            ``tier``, ``requests``, ``ttft_p50_s``, ``ttft_p90_s``, ``ttft_p95_s``,
            ``ttft_p99_s``, ``itl_p50_s``, ``itl_p90_s``, ``itl_p95_s``, ``itl_p99_s``,
            ``e2e_p50_s``, ``e2e_p95_s``, ``queue_mean_s``, ``prefill_mean_s``,
            ``decode_mean_s``, ``queue_p95_s``.
        """
        return self._query(f"""
            SELECT tier, count() AS requests,
                quantileExactInclusive(0.5)(ttft_s) AS ttft_p50_s,
                quantileExactInclusive(0.9)(ttft_s) AS ttft_p90_s,
                quantileExactInclusive(0.95)(ttft_s) AS ttft_p95_s,
                quantileExactInclusive(0.99)(ttft_s) AS ttft_p99_s,
                quantileExactInclusive(0.5)(itl_mean_s) AS itl_p50_s,
                quantileExactInclusive(0.9)(itl_mean_s) AS itl_p90_s,
                quantileExactInclusive(0.95)(itl_mean_s) AS itl_p95_s,
                quantileExactInclusive(0.99)(itl_mean_s) AS itl_p99_s,
                quantileExactInclusive(0.5)(e2e_s) AS e2e_p50_s,
                quantileExactInclusive(0.95)(e2e_s) AS e2e_p95_s,
                avg(queue_s) AS queue_mean_s,
                avg(prefill_s) AS prefill_mean_s,
                avg(decode_s) AS decode_mean_s,
                quantileExactInclusive(0.95)(queue_s) AS queue_p95_s
            FROM usage_events FINAL
            WHERE {self._usage_where(tenants)}
            GROUP BY tier ORDER BY tier""", self._params(window, tenants))

    def latency_timeseries(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per bucket and tier, over every attempt (module docstring): ``ts``, ``tier``,
        ``requests`` (attempts), ``ttft_p50_s``, ``ttft_p95_s``, ``itl_p50_s``, ``itl_p95_s``,
        ``queue_p95_s`` (exact, ``None`` when absent)."""
        return self._query(f"""
            SELECT bucket, tier, requests, ttft[1] AS ttft_p50_s, ttft[2] AS ttft_p95_s, itl[1] AS itl_p50_s,
                itl[2] AS itl_p95_s, queue_p95_s
            FROM (
                SELECT {_bucket('finish_ts')} AS bucket, tier, count() AS requests,
                    quantilesExactInclusive(0.5, 0.95)(ttft_s) AS ttft,
                    quantilesExactInclusive(0.5, 0.95)(itl_mean_s) AS itl,
                    quantileExactInclusive(0.95)(queue_s) AS queue_p95_s
                FROM usage_events FINAL
                WHERE {self._usage_where(tenants)}
                GROUP BY bucket, tier
            ) ORDER BY bucket, tier""", self._params(window, tenants))

    # ------------------------------------------------------------------ goodput

    def goodput(self, window: Buckets, tenants: Sequence[str] | None = None,
                slos: Sequence[TierSlo] = ()) -> list[dict[str, Any]]:
        """Throughput vs goodput per bucket and tier, per attempt (engine work, module docstring:
        an aborted attempt's tokens are throughput, not goodput, even when its retry was billed).

        A request is *good* under the gateway's rule (:mod:`kvmeter.serving.gateway.metering`):
        it finished ``ok`` and, when its tier has an SLO, it has a TTFT, the TTFT is within the
        tier's ``ttft_slo_s`` (if set) and its mean ITL within ``itl_slo_s`` (if set and the
        request has one). A tier without SLOs counts every ``ok`` request as good.

        Args:
            slos: the tiers' promises, ``(tier, ttft_slo_s, itl_slo_s)`` (seconds; ``None`` = no
                such SLO); a tier not listed has none.
        Returns:
            ``ts``, ``tier``, ``requests``, ``good_requests``, ``slo_missed_requests`` (ok but
            outside the SLO), ``input_tokens``, ``output_tokens`` (every request that ended:
            throughput), ``good_input_tokens``, ``good_output_tokens`` (goodput),
            ``aborted_tokens``, ``error_tokens`` (input + output of aborted / failed requests).
        """
        names = [name for name, _, _ in slos]
        ttft = [t if t is not None else math.inf for _, t, _ in slos]
        itl = [i if i is not None else math.inf for _, _, i in slos]
        return self._query(f"""
            SELECT bucket, tier,
                count() AS requests,
                countIf(good) AS good_requests,
                countIf(outcome = 'ok' AND NOT good) AS slo_missed_requests,
                sum(input_tokens) AS input_tokens,
                sum(output_tokens) AS output_tokens,
                sumIf(input_tokens, good) AS good_input_tokens,
                sumIf(output_tokens, good) AS good_output_tokens,
                sumIf(toUInt64(input_tokens) + output_tokens, outcome = 'aborted') AS aborted_tokens,
                sumIf(toUInt64(input_tokens) + output_tokens, outcome = 'error') AS error_tokens
            FROM (
                SELECT {_bucket('finish_ts')} AS bucket, tier, outcome, input_tokens, output_tokens,
                    transform(tier, {{slo_tiers:Array(String)}}, {{slo_ttft:Array(Float64)}}, inf) AS ttft_slo,
                    transform(tier, {{slo_tiers:Array(String)}}, {{slo_itl:Array(Float64)}}, inf) AS itl_slo,
                    outcome = 'ok' AND (
                        (ttft_slo = inf AND itl_slo = inf)
                        OR (ttft_s IS NOT NULL AND ifNull(ttft_s, inf) <= ttft_slo
                            AND ifNull(itl_mean_s, 0) <= itl_slo)) AS good
                FROM usage_events FINAL
                WHERE {self._usage_where(tenants)}
            )
            GROUP BY bucket, tier ORDER BY bucket, tier""",
            self._params(window, tenants, slo_tiers=names, slo_ttft=ttft, slo_itl=itl))

    # ------------------------------------------------------------------ attempts: rejections

    def attempts_timeseries(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Gateway attempts per bucket by decision: ``ts``, ``status`` (``admitted``,
        ``rejected``, ``replayed``, ``invalid``, ``error``), ``reason`` (``admitted`` or the
        rejection code: ``rate_limited``, ``queue_full``, ``context_length_exceeded``...),
        ``attempts``."""
        return self._query(f"""
            SELECT {_bucket('ts')} AS bucket, status, reason, count() AS attempts
            FROM attempts FINAL
            WHERE ts >= {_START} AND ts < {_END}{_tenant_filter(tenants)}
            GROUP BY bucket, status, reason ORDER BY bucket, status, reason""", self._params(window, tenants))

    def attempts_by_tenant(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Gateway attempts per tenant by decision: ``tenant_id``, ``tier``, ``status``,
        ``reason``, ``attempts``, ``status_code`` (the most frequent HTTP status)."""
        return self._query(f"""
            SELECT tenant_id, any(tier) AS tier, status, reason, count() AS attempts,
                topK(1)(status_code)[1] AS status_code
            FROM attempts FINAL
            WHERE ts >= {_START} AND ts < {_END}{_tenant_filter(tenants)}
            GROUP BY tenant_id, status, reason ORDER BY tenant_id, status, reason""", self._params(window, tenants))

    def rejections_by_limit(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Refused attempts by the limit that bound: ``level`` (``org``, ``workspace``,
        ``project``, ``api_key``, ``agent_run``, ``global``), ``dimension``
        (``requests_per_minute``, ``input_tokens_per_minute``, ``concurrent_requests``...),
        ``reason``, ``attempts``.

        Needs ``level`` and ``dimension`` columns on the ledger's ``attempts`` table (the quota's
        :class:`~kvmeter.serving.quota.base.QuotaRejected` carries both); on a ledger without
        them this returns ``[]`` — the reason alone is in :meth:`attempts_by_tenant`.
        """
        present = self._query("""
            SELECT count() AS n FROM system.columns
            WHERE database = currentDatabase() AND table = 'attempts' AND name IN ('level', 'dimension')""", {})
        if not present or present[0]["n"] < 2:
            return []
        return self._query(f"""
            SELECT level, dimension, reason, count() AS attempts
            FROM attempts FINAL
            WHERE ts >= {_START} AND ts < {_END}{_tenant_filter(tenants)} AND status = 'rejected'
            GROUP BY level, dimension, reason ORDER BY attempts DESC, level, dimension, reason""",
            self._params(window, tenants))

    # ------------------------------------------------------------------ reservation drift

    def reservation_by_tenant(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Reservation vs actual per tenant, per attempt (each attempt reserved at its own
        admission; module docstring): ``tenant_id``, ``tier``, ``requests`` (attempts),
        ``reserved_input_tokens``, ``reserved_output_tokens``, ``input_tokens``,
        ``output_tokens``, ``over_reserved_requests`` (reserved > used),
        ``under_reserved_requests`` (used > reserved)."""
        return self._query(f"""
            SELECT tenant_id, any(tier) AS tier, count() AS requests,
                sum(reserved_input_tokens) AS reserved_input_tokens,
                sum(reserved_output_tokens) AS reserved_output_tokens,
                sum(input_tokens) AS input_tokens,
                sum(output_tokens) AS output_tokens,
                countIf(toUInt64(reserved_input_tokens) + reserved_output_tokens
                        > toUInt64(input_tokens) + output_tokens) AS over_reserved_requests,
                countIf(toUInt64(reserved_input_tokens) + reserved_output_tokens
                        < toUInt64(input_tokens) + output_tokens) AS under_reserved_requests
            FROM usage_events FINAL
            WHERE {self._usage_where(tenants)}
            GROUP BY tenant_id ORDER BY tenant_id""", self._params(window, tenants))

    def reservation_timeseries(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per bucket, over every attempt (module docstring): ``ts``, ``reserved_tokens`` (input
        + output reserved at admission), ``actual_tokens`` (engine-true input + output)."""
        return self._query(f"""
            SELECT {_bucket('finish_ts')} AS bucket,
                sum(toUInt64(reserved_input_tokens) + reserved_output_tokens) AS reserved_tokens,
                sum(toUInt64(input_tokens) + output_tokens) AS actual_tokens
            FROM usage_events FINAL
            WHERE {self._usage_where(tenants)}
            GROUP BY bucket ORDER BY bucket""", self._params(window, tenants))

    def output_budget_use(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """How much of the reserved output (``max_tokens``) requests used: ``bin`` (0 … 10, the
        tenth of ``output / reserved output``; 10 = all of it or more), ``requests`` (attempts,
        every one: module docstring). Attempts that reserved no output are left out."""
        return self._query(f"""
            SELECT least(toUInt32(floor({OUTPUT_USE_BINS} * output_tokens / reserved_output_tokens)),
                         {OUTPUT_USE_BINS}) AS bin,
                count() AS requests
            FROM usage_events FINAL
            WHERE {self._usage_where(tenants)} AND reserved_output_tokens > 0
            GROUP BY bin ORDER BY bin""", self._params(window, tenants))

    # ------------------------------------------------------------------ signals

    def signal_catalog(self, window: Buckets, tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Signal names with samples in the window: ``name``, ``samples``, ``last_ts``.
        With ``tenants``, only series labelled with one of them (``labels['tenant']``)."""
        return self._query(f"""
            SELECT name, count() AS samples, max(ts) AS last_ts
            FROM signals
            WHERE ts >= {_START} AND ts < {_END}{_tenant_filter(tenants, "labels['tenant']")}
            GROUP BY name ORDER BY name""", self._params(window, tenants))

    @staticmethod
    def _label_keys(by: Sequence[str]) -> list[str]:
        keys = list(by)
        if len(keys) > MAX_LABEL_KEYS:
            raise ValueError(f"at most {MAX_LABEL_KEYS} label keys, got {len(keys)}")
        if any(not isinstance(k, str) or not k or len(k) > 100 for k in keys):
            raise ValueError("label keys must be non-empty strings of ≤ 100 characters")
        clash = set(keys) & _RESERVED_COLUMNS
        if clash:
            raise ValueError(f"label keys {sorted(clash)} clash with result columns")
        return keys

    def signal_gauge(self, window: Buckets, name: str, by: Sequence[str] = (), agg: str = "avg",
                     tenants: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """One gauge per bucket, grouped by label values.

        Args:
            name: the signal name (``kvmeter_engine_kv_watermark_ratio``...).
            by: label keys to group by (≤ :data:`MAX_LABEL_KEYS`); each becomes a column named
                after the key (a missing label reads ``""``).
            agg: ``avg``, ``max``, ``min`` or ``last`` (the newest sample) within the bucket,
                over all series of a group.
            tenants: only series whose ``tenant`` label is one of these.
        Returns:
            ``ts``, the ``by`` keys, ``value`` (float), ``samples``.
        """
        expr = SIGNAL_AGGS.get(agg)
        if expr is None:
            raise ValueError(f"agg must be one of {sorted(SIGNAL_AGGS)}, got {agg!r}")
        keys = self._label_keys(by)
        select = "".join(f", labels[{{k{i}:String}}] AS l{i}" for i in range(len(keys)))
        group = "".join(f", l{i}" for i in range(len(keys)))
        params = self._params(window, tenants, name=name, **{f"k{i}": k for i, k in enumerate(keys)})
        rows = self._query(f"""
            SELECT {_bucket('ts')} AS bucket{select}, {expr} AS value, count() AS samples
            FROM signals
            WHERE name = {{name:String}} AND ts >= {_START} AND ts < {_END}
                {_tenant_filter(tenants, "labels['tenant']")}
            GROUP BY bucket{group} ORDER BY bucket{group}""", params)
        return [_rename_labels(r, keys) for r in rows]


def _rename_labels(row: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"ts": row["ts"]}
    for i, key in enumerate(keys):
        out[key] = row[f"l{i}"]
    for k, v in row.items():
        if k != "ts" and not (k.startswith("l") and k[1:].isdigit()):
            out[k] = v
    return out

"""Hourly per-tenant rollups, recomputed from deduplicated usage events.

A rollup is derived data: it is recomputed for every hour that received events since the last
computation (``ingested_at`` newer than ``max(computed_at)`` minus a safety margin), always from
``usage_events FINAL``, so a duplicate can never inflate it, and only its billed rows (bill classes
``usage`` and ``undelivered_billed``, :func:`~kvmeter.ledger.queries.classified_usage_sql`), so it
counts what the usage summary counts. ``usage_hourly`` is a ReplacingMergeTree on ``computed_at``:
readers use FINAL and see the newest computation.

Known limit: an hour is recomputed when it receives events; a retry's success recorded in a later
hour reclassifies the earlier attempts (they become absorbed) without recomputing their hour, and a
group that becomes empty keeps its stale row until the hour is recomputed with other data. Billing
never reads rollups (it reads usage_events FINAL through the same classification).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

from clickhouse_connect.driver.client import Client

from .agent_runs import refresh_run_rollups
from .queries import BILLABLE_TOTALS_SQL, BILLED_SQL, classified_usage_sql

__all__ = ["refresh_rollups", "ROLLUP_MARGIN_S"]

log = logging.getLogger(__name__)

#: Hours whose events were ingested up to this long before the last computation are redone
#: too (inserts in flight while the previous computation ran).
ROLLUP_MARGIN_S = 120

_DIRTY_HOURS = """
SELECT DISTINCT toStartOfHour(finish_ts) AS hour
FROM usage_events
WHERE ingested_at >= {since:DateTime64(3, 'UTC')}
ORDER BY hour
"""

_LAST_COMPUTED = "SELECT max(computed_at) FROM usage_hourly"

_RECOMPUTE = """
INSERT INTO usage_hourly
SELECT
    toStartOfHour(finish_ts) AS hour,
    tenant_id, workspace_id, project_id, api_key_id, model, tier,
    """ + BILLABLE_TOTALS_SQL + """,
    if(count(ttft_s) = 0, nan, quantileExactInclusive(0.5)(ttft_s)) AS ttft_p50_s,
    if(count(ttft_s) = 0, nan, quantileExactInclusive(0.95)(ttft_s)) AS ttft_p95_s,
    now64(3) AS computed_at
FROM """ + classified_usage_sql("toStartOfHour(finish_ts) IN {hours:Array(DateTime('UTC'))}") + """
WHERE """ + BILLED_SQL + """
GROUP BY hour, tenant_id, workspace_id, project_id, api_key_id, model, tier
"""


def refresh_rollups(client: Client, *, full: bool = False) -> int:
    """Recompute ``usage_hourly`` for every hour that received events since the last run, then the
    agent-run rollup (:func:`~kvmeter.ledger.agent_runs.refresh_run_rollups`).

    Args:
        client: a client on the ledger database.
        full: recompute every hour that has events (e.g. after a restore).
    Returns:
        The number of hours recomputed.
    Raises:
        clickhouse-connect errors (the caller, the writer thread, logs and retries them).
    """
    if full:
        since = datetime(1970, 1, 1, tzinfo=timezone.utc)
    else:
        last = client.query(_LAST_COMPUTED).result_rows[0][0]
        if last is None or last.year <= 1970:
            since = datetime(1970, 1, 1, tzinfo=timezone.utc)
        else:
            if last.tzinfo is None:
                last = last.replace(tzinfo=timezone.utc)
            since = last - timedelta(seconds=ROLLUP_MARGIN_S)
    hours = [row[0] for row in client.query(_DIRTY_HOURS, parameters={"since": since}).result_rows]
    done = 0
    for i in range(0, len(hours), 500):
        chunk = [h.replace(tzinfo=timezone.utc) if h.tzinfo is None else h for h in hours[i:i + 500]]
        client.command(_RECOMPUTE, parameters={"hours": chunk})
        done += len(chunk)
    if done:
        log.debug("ledger rollups: recomputed %d hour(s)", done)
    runs = refresh_run_rollups(client, full=full)  # the agent-run rollup (ledger/agent_runs.py)
    if runs:
        log.debug("ledger rollups: recomputed %d agent run(s)", runs)
    return done
